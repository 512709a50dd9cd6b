"""Device probe of the fused backward: correctness on small configs, then W2/W3 timings.

Run on the GPU machine: ``python3 bench/probes/fused_bwd_probe.py`` (or
``... --time LABEL [--no-fwd]`` for the W2/W3 fp16 timings alone, ``--no-fwd`` leaving the
forward out, e.g. while the forward kernel is being edited in the tree). Correctness is
checked against the tests' dense float64 oracle (``tests/oracle.py``, written from the
window rules with plain loops), on fresh random inputs with NaN-poisoned gradients.
Workloads are ``bench/workloads.py``'s; timings are ``bench/timing.py``'s CUDA-event medians
after warm-up; the last lines are a short table.
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
from natten_cupy._dtypes import BFLOAT16, FLOAT16, FLOAT32, canonical_dtype  # noqa: E402
from natten_cupy.backends.fused import mma_backward  # noqa: E402
from timing import event_ms, launch_times, sync  # noqa: E402


# (rank, spatial, kernel, stride, dilation, causal, heads, head_dim, dtype, permuted input)
CONFIGS = [
    (1, (37,), (5,), (1,), (1,), (False,), 2, 32, FLOAT16, False),
    (1, (50,), (8,), (3,), (2,), (True,), 1, 64, BFLOAT16, False),
    (1, (300,), (129,), (1,), (1,), (False,), 1, 256, FLOAT16, False),
    (2, (13, 11), (3, 4), (1, 2), (2, 1), (False, True), 2, 40, FLOAT16, True),
    (2, (20, 20), (7, 7), (1, 1), (1, 1), (False, False), 1, 128, BFLOAT16, False),
    (2, (24, 24), (9, 9), (1, 1), (1, 1), (False, False), 2, 32, FLOAT16, False),
    (2, (16, 16), (16, 16), (1, 1), (1, 1), (False, False), 1, 64, FLOAT16, False),
    (2, (21, 19), (5, 6), (5, 3), (2, 3), (True, True), 1, 72, BFLOAT16, False),
    (3, (5, 9, 7), (3, 3, 5), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 72, FLOAT16, True),
    (3, (6, 12, 12), (3, 5, 5), (1, 1, 1), (1, 1, 1), (False, False, False), 2, 32, BFLOAT16,
     False),
    (2, (17, 15), (5, 4), (2, 1), (1, 2), (True, False), 2, 64, FLOAT16, "strided_last"),
    (2, (24, 24), (9, 9), (1, 1), (1, 1), (False, False), 2, 32, FLOAT32, False),
    (1, (97,), (7,), (1,), (2,), (True,), 2, 64, FLOAT32, True),
    (3, (5, 9, 7), (3, 3, 5), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 128, FLOAT32, False),
    (2, (21, 19), (5, 6), (5, 3), (2, 3), (True, True), 1, 200, FLOAT32, False),
]


# 16-bit tensors live on the device as uint16 storage (the kernels only see pointers), so
# bfloat16 needs no CuPy support; NaN_BITS is a quiet NaN in both float16 and bfloat16.
# float32 runs as TF32.
NAN_BITS = 0x7FC0


def make_problem(rank, shape, ks, st, dl, ca, dtype, scale=None):
    return _args.NAProblem(
        rank=rank, batch=shape[0], spatial=tuple(shape[1:1 + rank]), heads=shape[1 + rank],
        head_dim=shape[2 + rank], kernel_size=tuple(ks), stride=tuple(st), dilation=tuple(dl),
        is_causal=tuple(ca), scale=shape[2 + rank] ** -0.5 if scale is None else scale,
        dtype=numpy.dtype(dtype), allow_tf32=numpy.dtype(dtype) == FLOAT32)


def to_dev(x, dtype, permuted):
    """Device copy of x [B, *sp, H, D]; permuted: stored [B, H, *sp, D] and viewed back."""
    x = x.astype(dtype)
    bits = x if numpy.dtype(dtype) == FLOAT32 else x.view(numpy.uint16)
    if not permuted:
        return cupy.asarray(bits)
    if permuted == "strided_last":  # last dim not contiguous: the launcher copies
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


def check(cfg, rng):
    rank, sp, ks, st, dl, ca, H, D, dt, perm = cfg
    B = 2
    shape = (B,) + sp + (H, D)
    q, k, v, d_o = (rng.standard_normal(shape).astype(dt).astype(numpy.float64)
                    for _ in range(4))
    scale = D ** -0.5
    out, lse = oracle.fused_forward(q, k, v, ks, st, dl, ca, scale)
    dq, dk, dv = oracle.fused_backward(d_o, q, k, v, ks, st, dl, ca, scale)
    qd, kd, vd, dod = (to_dev(x, dt, perm) for x in (q, k, v, d_o))
    od = to_dev(out, dt, perm)
    lsed = cupy.asarray(lse.astype(numpy.float32))
    problem = make_problem(rank, shape, ks, st, dl, ca, dt)
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


def bench(wid, dtype, reps=10, fwd=True):
    """Time the backward (and the forward helper's kernel) on workload ``wid`` in ``dtype``
    (a ``workloads.DTYPES`` key; "tf32" is float32 I/O)."""
    w = wl.WORKLOADS[wid]
    name, rank, shape, ks = f"{wid} {dtype}", w.rank, w.shape, w.kernel
    dt = canonical_dtype(wl.dtype_spec(dtype)["name"])
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
    problem = make_problem(rank, shape, ks, w.stride, w.dilation, w.causal, dt)
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


TIMED = (("W2", "fp16"), ("W3", "fp16"))


def time_only(label, reps=20, fwd=True):
    """``--time LABEL``: W2/W3 fp16 timings only, one table row per workload, tagged LABEL
    (run once per source tree through PYTHONPATH to compare versions in one device call)."""
    for spec in TIMED:
        name, ms, tf, _, split, finite, fwd_ms = bench(*spec, reps=reps, fwd=fwd)
        parts = " / ".join(f"{split.get(n, 0):.3f}" for n in
                           ("na_bwd_delta", "na_bwd_fused_kv", "na_bwd_fused_q"))
        print(f"| {label} | {name} | {ms:.3f} | {tf:.1f} | {parts} | {fwd_ms:.3f} | "
              f"{fwd_ms + ms:.3f} | {finite} |", flush=True)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time", metavar="LABEL",
                    help="only the W2/W3 fp16 timings, one table row each tagged LABEL")
    ap.add_argument("--no-fwd", action="store_true", help="with --time: leave the forward out")
    args = ap.parse_args(argv)
    if args.time is not None:
        return time_only(args.time, fwd=not args.no_fwd)
    rng = numpy.random.default_rng(int(time.time()))
    ok = True
    print("correctness (max |err| / max |ref|, float64 dense reference):", flush=True)
    worst = {}
    for cfg in CONFIGS:
        try:
            errs, same = check(cfg, rng)
        except Exception as e:  # report and go on: one device call must say everything
            print(f"  {cfg[:8]} {cfg[8].name}: FAILED {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        lim = 4e-2 if cfg[8] == BFLOAT16 else 1e-2
        good = all(e <= lim for e in errs) and same
        ok &= good
        key = cfg[8].name
        worst[key] = max(worst.get(key, 0), *errs)
        print(f"  {'ok ' if good else 'BAD'} rank{cfg[0]} {cfg[1]} k{cfg[2]} s{cfg[3]} d{cfg[4]} "
              f"c{cfg[5]} D{cfg[7]} {key}{' perm' if cfg[9] else ''}: dq {errs[0]:.2e} "
              f"dk {errs[1]:.2e} dv {errs[2]:.2e} bitwise-repeat {same}", flush=True)
    rows = []
    for spec in (("W2", "fp16"), ("W2", "bf16"), ("W3", "fp16"), ("W3b", "fp16"),
                 ("W2b", "fp16"), ("W1", "fp16"), ("W2", "tf32")):
        try:
            rows.append(bench(*spec))
        except Exception as e:
            print(f"  {' '.join(spec)}: FAILED {type(e).__name__}: {e}", flush=True)
    print("\n| workload | bwd ms | TFLOP/s | delta / kv / q ms | fwd ms (other helper) | finite |")
    print("|---|---|---|---|---|---|")
    for name, ms, tf, first, split, finite, fwd_ms in rows:
        parts = " / ".join(f"{split.get(n, 0):.3f}" for n in
                           ("na_bwd_delta", "na_bwd_fused_kv", "na_bwd_fused_q"))
        print(f"| {name} | {ms:.3f} | {tf:.1f} | {parts} | {fwd_ms:.3f} | {finite} |")
    print("max rel err per dtype:", {k: f"{v:.2e}" for k, v in worst.items()})
    print("\ntile variants (checked on one small config, then timed):")
    variants = (
        (3, ((2, 4, 8), (1, 4, 4)), ("W3", "fp16"),
         (3, (6, 13, 12), (3, 5, 5), (1, 2, 1), (1, 1, 2), (True, False, False), 1, 32, FLOAT16,
          False)),
        (2, ((16, 4, 1), (4, 4, 1)), ("W2", "fp16"),
         (2, (37, 21), (9, 5), (1, 2), (1, 2), (False, True), 1, 32, FLOAT16, False)),
        (2, ((4, 16, 1), (4, 4, 1)), ("W2", "fp16"),
         (2, (37, 21), (9, 5), (1, 2), (1, 2), (False, True), 1, 32, FLOAT16, False)))
    for rank, tiles, spec, cfg in variants:
        saved = mma_backward.TILES[rank]
        mma_backward.TILES[rank] = tiles
        try:
            errs, same = check(cfg, rng)
            name, ms, tf, _, split, finite, _ = bench(*spec)
            print(f"  {name} tile {tiles}: {ms:.3f} ms {tf:.1f} TFLOP/s kv/q "
                  f"{split.get('na_bwd_fused_kv', 0):.3f}/{split.get('na_bwd_fused_q', 0):.3f} "
                  f"check errs {max(errs):.2e} repeat {same}")
        except Exception as e:
            print(f"  {' '.join(spec)} tile {tiles}: FAILED {type(e).__name__}: {e}")
        finally:
            mma_backward.TILES[rank] = saved
    print("ALL CORRECT" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
