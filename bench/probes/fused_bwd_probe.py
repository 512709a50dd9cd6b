"""Device probe of the fused backward: correctness on small configs, then workload timings.

Run on the GPU machine: ``python3 bench/probes/fused_bwd_probe.py [--checks ID:dtype[:layout],...]
[--workloads ID:dtype,...]``, or ``... --time LABEL [--no-fwd]`` for the W2/W3 fp16 timings
alone (``--no-fwd`` leaving the forward out, e.g. while the forward kernel is being edited in
the tree); ``--list`` prints the cases and workloads a run would take, without a GPU.
Correctness is checked against the tests' dense float64 oracle (``tests/oracle.py``, written
from the window rules with plain loops), on fresh random inputs with NaN-poisoned gradients,
on ``bench/workloads.py``'s ``CHECK_WORKLOADS`` in a layout: ``canonical`` [B, *spatial, H, D],
``heads_first`` (stored [B, H, *spatial, D] and viewed back) or ``strided_last`` (a last axis
that is not contiguous). Timed workloads are ``bench/workloads.py``'s (``probe_workload``
ids); timings are ``bench/timing.py``'s CUDA-event medians after warm-up; the last lines are a
short table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy

import cupy

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH, os.path.join(ROOT, "tests")]   # natten_cupy, bench/, the oracle

import oracle  # noqa: E402
import workloads as wl  # noqa: E402
from natten_cupy import _args  # noqa: E402
from natten_cupy._dtypes import FLOAT16, FLOAT32, canonical_dtype  # noqa: E402
from natten_cupy.backends.fused import mma_backward  # noqa: E402
from timing import event_ms, launch_times, sync  # noqa: E402


# The correctness cases in the order they run, ``CHECK_WORKLOADS`` id : dtype of
# ``workloads.DTYPES`` [: layout]. float32 runs as TF32 (the mma.sync backward's float32).
CHECKS = ("chk1-odd:fp16", "chk1-sdc:bf16", "chk1-large:fp16", "chk2-mixed:fp16:heads_first",
          "chk2-d128:bf16", "chk2-k9:fp16", "chk2-full:fp16", "chk2-sdc:bf16",
          "chk3-sdc:fp16:heads_first", "chk3-k355:bf16", "chk2-d64:fp16:strided_last",
          "chk2-k9:tf32", "chk1-dc:tf32:heads_first", "chk3-sdc-d128:tf32",
          "chk2-sdc-d200:tf32")
# The timed workloads: the table's, and ``--time``'s.
TIMED = ("W2:fp16", "W2:bf16", "W3:fp16", "W3b:fp16", "W2b:fp16", "W1:fp16", "W2:tf32")
TIMED_ONLY = ("W2:fp16", "W3:fp16")
# Tile variants: (rank, the mma_backward.TILES entry tried, the case it must pass, the
# workload it is then timed on).
VARIANTS = ((3, ((2, 4, 8), (1, 4, 4)), "chk3-tile:fp16", "W3:fp16"),
            (2, ((16, 4, 1), (4, 4, 1)), "chk2-tile:fp16", "W2:fp16"),
            (2, ((4, 16, 1), (4, 4, 1)), "chk2-tile:fp16", "W2:fp16"))
LAYOUTS = ("canonical", "heads_first", "strided_last")


def parse(text, layouts=False):
    """[(workload, dtype key, layout)] of ``ID:dtype[:layout],...`` (ids of
    ``workloads.probe_workload``; a layout only where ``layouts``); ValueError naming the
    entries that are not."""
    picked, bad = [], []
    allowed = LAYOUTS if layouts else LAYOUTS[:1]
    for item in filter(None, (x.strip() for x in text.split(","))):
        wid, _, rest = item.partition(":")
        dtype, _, layout = rest.partition(":")
        layout = layout or LAYOUTS[0]
        try:
            w = wl.probe_workload(wid)
        except KeyError:
            w = None
        if w is None or dtype not in wl.DTYPES or layout not in allowed:
            bad.append(item)
        else:
            picked.append((w, dtype, layout))
    if bad:
        form = "ID:dtype[:layout]" if layouts else "ID:dtype"
        raise ValueError(f"bad entries {bad} ({form}, ID of bench/workloads.py's WORKLOADS, "
                         f"PROBE_WORKLOADS or CHECK_WORKLOADS; dtypes {', '.join(wl.DTYPES)}"
                         + (f"; layouts {', '.join(LAYOUTS)})" if layouts else ")"))
    return picked


def _label(w, dtype, layout=LAYOUTS[0]):
    return f"{w.id}:{dtype}" + ("" if layout == LAYOUTS[0] else f":{layout}")


# 16-bit tensors live on the device as uint16 storage (the kernels only see pointers), so
# bfloat16 needs no CuPy support; NaN_BITS is a quiet NaN in both float16 and bfloat16.
# float32 runs as TF32 ("tf32"); exact float32 ("fp32") is exact_fp32's, refused here.
NAN_BITS = 0x7FC0


def make_problem(w, dtype):
    """The NAProblem of workload ``w`` in ``dtype`` (a ``workloads.DTYPES`` key)."""
    spec = wl.dtype_spec(dtype)
    return _args.NAProblem(
        rank=w.rank, batch=w.batch, spatial=w.spatial, heads=w.heads, head_dim=w.dim,
        kernel_size=w.kernel, stride=w.stride, dilation=w.dilation, is_causal=w.causal,
        scale=w.dim ** -0.5, dtype=canonical_dtype(spec["name"]), allow_tf32=spec["tf32"])


def to_dev(x, dtype, layout):
    """Device copy of x [B, *sp, H, D] in ``layout`` (``LAYOUTS``): heads_first is stored
    [B, H, *sp, D] and viewed back."""
    x = x.astype(dtype)
    bits = x if numpy.dtype(dtype) == FLOAT32 else x.view(numpy.uint16)
    if layout == "canonical":
        return cupy.asarray(bits)
    if layout == "strided_last":  # last dim not contiguous: the launcher copies
        return cupy.asarray(numpy.stack([bits, bits], axis=-1))[..., 0]
    nd = x.ndim
    perm = (0, nd - 2) + tuple(range(1, nd - 2)) + (nd - 1,)
    inv = numpy.argsort(perm)
    stored = cupy.ascontiguousarray(cupy.asarray(bits).transpose(perm))
    return stored.transpose(tuple(int(i) for i in inv))


def from_dev(x, dtype):
    return cupy.asnumpy(x).view(dtype).astype(numpy.float64)


def all_finite(x, dtype):
    if x.dtype == cupy.float32:
        return bool(cupy.isfinite(x).all())
    expo = 0x7C00 if numpy.dtype(dtype) == FLOAT16 else 0x7F80
    return bool(((x & expo) != expo).all())


def poisoned(shape, storage):
    if storage == cupy.float32:
        return cupy.full(shape, cupy.nan, dtype=cupy.float32)
    return cupy.full(shape, NAN_BITS, dtype=cupy.uint16)


def run_backward(problem, q, k, v, o, lse, d_o):
    grads = [poisoned(q.shape, q.dtype) for _ in range(3)]
    mma_backward.backward(problem, q, k, v, o, lse, d_o, *grads)
    return grads


def check(w, dtype, layout, rng):
    """Max |err| / max |ref| of dq, dk, dv against the float64 oracle on workload ``w``, and
    whether a second run repeats the first bitwise."""
    problem = make_problem(w, dtype)
    dt = problem.dtype
    q, k, v, d_o = (rng.standard_normal(w.shape).astype(dt).astype(numpy.float64)
                    for _ in range(4))
    window = (w.kernel, w.stride, w.dilation, w.causal, problem.scale)
    out, lse = oracle.fused_forward(q, k, v, *window)
    dq, dk, dv = oracle.fused_backward(d_o, q, k, v, *window)
    qd, kd, vd, dod = (to_dev(x, dt, layout) for x in (q, k, v, d_o))
    od = to_dev(out, dt, layout)
    lsed = cupy.asarray(lse.astype(numpy.float32))
    assert mma_backward.refuse(problem) is None, mma_backward.refuse(problem)
    got = run_backward(problem, qd, kd, vd, od, lsed, dod)
    again = run_backward(problem, qd, kd, vd, od, lsed, dod)
    same = all(bool((a == b).all()) for a, b in zip(got, again))
    errs = []
    for g, ref in zip(got, (dq, dk, dv)):
        g = from_dev(g, dt).reshape(ref.shape)
        if not numpy.isfinite(g).all():
            errs.append(float("nan"))
            continue
        errs.append(float(numpy.abs(g - ref).max() / max(numpy.abs(ref).max(), 1e-30)))
    return errs, same


def bench(w, dtype, reps=10, fwd=True):
    """Time the backward (and the forward helper's kernel) on workload ``w`` in ``dtype``
    (a ``workloads.DTYPES`` key; "tf32" is float32 I/O)."""
    name, shape, ks = f"{w.id} {dtype}", w.shape, w.kernel
    problem = make_problem(w, dtype)
    dt = problem.dtype
    rs = cupy.random.default_rng(0)

    def rand16():
        x = rs.standard_normal(shape, dtype=cupy.float32)
        if numpy.dtype(dt) == FLOAT32:
            return x
        if numpy.dtype(dt) == FLOAT16:
            return x.astype(cupy.float16).view(cupy.uint16)
        return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)

    q, k, v, o, d_o = (rand16() for _ in range(5))
    lse = (rs.standard_normal(shape[:-1], dtype=cupy.float32) * 0.1
           + math.log(math.prod(ks))).astype(cupy.float32)
    fwd_ms = float("nan")
    try:  # the forward helper's kernel, when present: real out/lse, and its time
        from natten_cupy.backends.fused import mma_forward
        if fwd and mma_forward.refuse(problem) is None:
            view = (lambda x: x) if numpy.dtype(dt) == FLOAT32 else (lambda x: x.view(dt))
            qv, kv, vv, ov = (view(x) for x in (q, k, v, o))
            fwd_ms = event_ms(lambda: mma_forward.forward(problem, qv, kv, vv, ov, lse),
                              warmup=1, reps=3)
    except Exception as e:
        first = str(e).strip().splitlines()[:1] or [""]  # one line: tables stay readable
        print(f"  ({name}: forward not timed: {type(e).__name__}: {first[0][:200]})")
    grads = [cupy.empty_like(q) for _ in range(3)]
    t0 = time.perf_counter()
    mma_backward.backward(problem, q, k, v, o, lse, d_o, *grads)
    sync()
    first = time.perf_counter() - t0
    ms = event_ms(lambda: mma_backward.backward(problem, q, k, v, o, lse, d_o, *grads),
                  warmup=2, reps=reps)
    split = dict(launch_times(lambda: mma_backward.backward(problem, q, k, v, o, lse, d_o,
                                                            *grads)))
    flops = 2.5 * problem.flops_forward()
    finite = all(all_finite(g, dt) for g in grads)
    return name, ms, flops / ms / 1e9, first, split, finite, fwd_ms


def time_only(label, timed, reps=20, fwd=True):
    """``--time LABEL``: the timings only (W2/W3 fp16 unless ``--workloads``), one table row
    per workload, tagged LABEL (run once per source tree through PYTHONPATH to compare
    versions in one device call)."""
    for w, dtype, _ in timed:
        name, ms, tf, _, split, finite, fwd_ms = bench(w, dtype, reps=reps, fwd=fwd)
        parts = " / ".join(f"{split.get(n, 0):.3f}" for n in
                           ("na_bwd_delta", "na_bwd_fused_kv", "na_bwd_fused_q"))
        print(f"| {label} | {name} | {ms:.3f} | {tf:.1f} | {parts} | {fwd_ms:.3f} | "
              f"{fwd_ms + ms:.3f} | {finite} |", flush=True)
    return 0


def show(checks, timed, variants):
    """``--list``: the cases, workloads and tile variants a run would take."""
    print("checks:")
    for w, dtype, layout in checks:
        print(f"  {_label(w, dtype, layout):<34} {w.describe()}, B={w.batch}, stride "
              f"{w.stride}, dilation {w.dilation}, causal {w.causal}")
    print("timed:")
    for w, dtype, _ in timed:
        print(f"  {_label(w, dtype):<34} {w.describe()}, B={w.batch}")
    print("tile variants:")
    for rank, tiles, case, spec in variants:
        print(f"  rank {rank} tile {tiles}: checked on {_label(*case[:2])}, timed on "
              f"{_label(*spec[:2])}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checks", metavar="ID:dtype[:layout],...", default=",".join(CHECKS),
                    help="the correctness cases (CHECK_WORKLOADS ids or any probe workload; "
                         f"layouts {', '.join(LAYOUTS)}; default: the {len(CHECKS)} cases "
                         "--list shows)")
    ap.add_argument("--workloads", metavar="ID:dtype,...", default=None,
                    help=f"the timed workloads (default {','.join(TIMED)}; with --time "
                         f"{','.join(TIMED_ONLY)})")
    ap.add_argument("--time", metavar="LABEL",
                    help="only the timings (W2/W3 fp16 unless --workloads), one table row each "
                         "tagged LABEL")
    ap.add_argument("--no-fwd", action="store_true", help="with --time: leave the forward out")
    ap.add_argument("--list", action="store_true",
                    help="print the cases, workloads and tile variants of the run (no GPU)")
    args = ap.parse_args(argv)
    try:
        checks = parse(args.checks, layouts=True)
        timed = parse(args.workloads or ",".join(TIMED_ONLY if args.time is not None else TIMED))
        variants = [(rank, tiles, parse(case, layouts=True)[0], parse(spec)[0])
                    for rank, tiles, case, spec in VARIANTS]
    except ValueError as e:
        ap.error(str(e))
    if args.list:   # --time runs the timings alone
        return show(*((checks, timed, variants) if args.time is None else ([], timed, [])))
    if args.time is not None:
        return time_only(args.time, timed, fwd=not args.no_fwd)
    rng = numpy.random.default_rng(int(time.time()))
    ok = True
    print("correctness (max |err| / max |ref|, float64 dense reference):", flush=True)
    worst = {}
    for w, dtype, layout in checks:
        try:
            errs, same = check(w, dtype, layout, rng)
        except Exception as e:  # report and go on: one device call must say everything
            print(f"  {_label(w, dtype, layout)}: FAILED {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        key = wl.dtype_spec(dtype)["name"]
        lim = 4e-2 if key == "bfloat16" else 1e-2
        good = all(e <= lim for e in errs) and same
        ok &= good
        worst[key] = max(worst.get(key, 0), *errs)
        shown = "" if layout == LAYOUTS[0] else f" {layout}"
        print(f"  {'ok ' if good else 'BAD'} {w.id} rank{w.rank} {w.spatial} k{w.kernel} "
              f"s{w.stride} d{w.dilation} c{w.causal} D{w.dim} {key}{shown}: dq {errs[0]:.2e} "
              f"dk {errs[1]:.2e} dv {errs[2]:.2e} bitwise-repeat {same}", flush=True)
    rows = []
    for w, dtype, _ in timed:
        try:
            rows.append(bench(w, dtype))
        except Exception as e:
            print(f"  {w.id} {dtype}: FAILED {type(e).__name__}: {e}", flush=True)
    print("\n| workload | bwd ms | TFLOP/s | delta / kv / q ms | fwd ms (other helper) | finite |")
    print("|---|---|---|---|---|---|")
    for name, ms, tf, first, split, finite, fwd_ms in rows:
        parts = " / ".join(f"{split.get(n, 0):.3f}" for n in
                           ("na_bwd_delta", "na_bwd_fused_kv", "na_bwd_fused_q"))
        print(f"| {name} | {ms:.3f} | {tf:.1f} | {parts} | {fwd_ms:.3f} | {finite} |")
    print("max rel err per dtype:", {k: f"{v:.2e}" for k, v in worst.items()})
    print("\ntile variants (checked on one small config, then timed):")
    for rank, tiles, case, spec in variants:
        saved = mma_backward.TILES[rank]
        mma_backward.TILES[rank] = tiles
        try:
            errs, same = check(*case, rng)
            name, ms, tf, _, split, finite, _ = bench(*spec[:2])
            print(f"  {name} tile {tiles}: {ms:.3f} ms {tf:.1f} TFLOP/s kv/q "
                  f"{split.get('na_bwd_fused_kv', 0):.3f}/{split.get('na_bwd_fused_q', 0):.3f} "
                  f"check errs {max(errs):.2e} repeat {same}")
        except Exception as e:
            print(f"  {spec[0].id} {spec[1]} tile {tiles}: FAILED {type(e).__name__}: {e}")
        finally:
            mma_backward.TILES[rank] = saved
    print("ALL CORRECT" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
