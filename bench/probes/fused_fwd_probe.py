"""Device probe of the fused tensor-core forward: compile, check, time, in one call.

    python3 bench/probes/fused_fwd_probe.py warm         # compile every instantiation (parallel)
    python3 bench/probes/fused_fwd_probe.py check [i n]  # tests' cases, CHECKS (i-th of n parts)
    python3 bench/probes/fused_fwd_probe.py time         # the workloads, ms and TFLOP/s
    python3 bench/probes/fused_fwd_probe.py small        # two small cases (for compute-sanitizer)
    python3 bench/probes/fused_fwd_probe.py split        # W2 over window sizes: fixed vs per-iteration
    python3 bench/probes/fused_fwd_probe.py list         # the cases check and small run (no GPU)

``check`` runs the GPU tests' cases (``tests/gpu/test_gpu_fused_fwd.py``'s ``CASES`` through
its ``check_case``: the fused forward against the reference backend in float64), then the
probe's ``CHECKS``; ``small`` runs ``SMALL``: ids of ``bench/workloads.py``'s
``CHECK_WORKLOADS``.

Timings: ``bench/timing.py``'s CUDA events around each launch after two warm-up runs, median
of 15; inputs are fresh standard-normal arrays (never zeros). Workloads and the peers' figures
are ``bench/workloads.py``'s; FLOPs are its useful FLOPs, 4 B N H K D.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]   # natten_cupy, bench/

import workloads as wl  # noqa: E402
from timing import event_ms, event_times  # noqa: E402

# The probe's cases beside the GPU tests', ``CHECK_WORKLOADS`` id : dtype of
# ``workloads.DTYPES`` [: layout] (float32 runs as TF32, as in the tests): ``check`` runs
# CHECKS after the tests' cases, ``small`` runs SMALL.
CHECKS = ("chk2-layout:fp16:heads_first", "chk2-layout:fp16:strided_last")
SMALL = ("chk2-small:fp16", "chk1-k257:fp16")


def _peer_ms(wid, dname):
    """The fastest published forward of a peer (FlexAttention's best token order, or dense
    SDPA for self-attention); float32 runs as TF32 here, set against the fp32 figure."""
    return wl.best_published(wid, wl.dtype_key(dname))[0]


# (workload, dtype, tile: None for the default, a query box, or a TileConfig to try). Configs
# with lines=False time the flat walk (before the line walk) side by side.
def _runs():
    from natten_cupy.backends.fused.mma_forward import TileConfig as C
    flat2, flat3 = C((4, 4, 1), (2, 2, 1), 2, False), C((1, 4, 4), (2, 2, 1), 2, False)
    return [
        ("W2", "float16", flat2), ("W2", "float16", None), ("W2", "float16", (16, 8)),
        ("W2", "float16", C((2, 8, 1), (4, 1, 1), 2, False)),
        ("W2", "bfloat16", None), ("W2", "float32", flat2), ("W2", "float32", None),
        ("W3", "float16", flat3), ("W3", "float16", None), ("W3", "float16", (4, 4, 4)),
        ("W3b", "float16", flat3), ("W3b", "float16", None),
        ("W2b", "float16", None), ("W2b", "float16", C((4, 4, 1), (2, 2, 1), 2)),
        ("W1", "float16", None), ("W1", "float16", (128,)),
        ("SA", "float16", None), ("SA128", "float16", None),
    ]


def _warm_one(expr):
    from natten_cupy._compile import get_kernel
    t = time.perf_counter()
    try:
        get_kernel("fused/mma_forward.cu", expr)
        return expr, time.perf_counter() - t, None
    except Exception as e:  # report, keep going
        return expr, time.perf_counter() - t, f"{type(e).__name__}: {str(e)[:400]}"


def warm():
    import multiprocessing as mp
    from natten_cupy._dtypes import canonical_dtype
    from natten_cupy.backends.fused import mma_forward
    exprs = [e for _, e in mma_forward.instantiations()]
    for wid, dname, tile in _runs():
        if isinstance(tile, mma_forward.TileConfig):
            w = wl.WORKLOADS[wid]
            exprs.append(mma_forward._name(canonical_dtype(dname), w.rank, mma_forward._bucket(w.dim),
                                          tile))
    t = time.perf_counter()
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 4)) as pool:
        res = pool.map(_warm_one, exprs)
    bad = [r for r in res if r[2]]
    print(f"warm: {len(exprs)} kernels in {time.perf_counter() - t:.1f} s, "
          f"slowest {max(r[1] for r in res):.1f} s, {len(bad)} failed")
    for expr, _, err in bad[:3]:
        print("  FAILED", expr, err)


def _gpu_tests():
    """tests/gpu/test_gpu_fused_fwd.py (its cases and ``check_case``); imports without a GPU."""
    tests = os.path.join(ROOT, "tests")
    for path in (tests, os.path.join(tests, "gpu")):   # gpu_cases, then the GPU tests
        if path not in sys.path:
            sys.path.insert(0, path)
    import test_gpu_fused_fwd
    return test_gpu_fused_fwd


def case_of(item):
    """(label, case of ``test_gpu_fused_fwd.check_case``, layout) of ``ID:dtype[:layout]``."""
    from natten_cupy._dtypes import canonical_dtype
    wid, dtype, *layout = item.split(":")
    w = wl.CHECK_WORKLOADS[wid]
    case = (w.spatial, w.kernel, w.stride, w.dilation, w.causal, w.heads, w.dim,
            canonical_dtype(wl.dtype_spec(dtype)["name"]), None)
    return f"{item} ({w.describe()})", case, layout[0] if layout else "canonical"


def cases():
    """[(label, case, layout)] that ``check`` runs: the GPU tests' cases, then CHECKS."""
    t = _gpu_tests()
    out = []
    for case in t.CASES:
        out.append((f"{len(case[0])}d {case[0]} k{case[1]} s{case[2]} d{case[3]} c{case[4]} "
                    f"D{case[6]} {numpy.dtype(case[7]).name} {case[8] or ''} canonical", case,
                    "canonical"))
    return out + [case_of(item) for item in CHECKS]


def check(part=0, parts=1):
    import cupy as cp
    t = _gpu_tests()
    worst = {}
    for i, (name, case, layout) in enumerate(cases()):
        if i % parts != part:
            continue
        rng = numpy.random.default_rng(1000 + i)
        try:
            err, ref_err, lse_err = t.check_case(case, rng, layout)
            status = "ok"
        except AssertionError as e:
            err = ref_err = lse_err = float("nan")
            status = f"FAIL {str(e)[:120]}"
        except Exception as e:
            err = ref_err = lse_err = float("nan")
            status = f"ERROR {type(e).__name__}: {str(e)[:300]}"
        cp.cuda.runtime.deviceSynchronize()
        dn = numpy.dtype(case[7]).name
        if status == "ok":
            w = worst.setdefault(dn, [0.0, 0.0])
            w[0], w[1] = max(w[0], err), max(w[1], lse_err)
        print(f"{status:<4} out {err:.2e} (ref {ref_err:.2e}) lse {lse_err:.2e}  {name}")
    for dn, (e, le) in worst.items():
        print(f"max error {dn}: out {e:.2e}, lse {le:.2e}")


def _inputs(cp, shape, dtype):
    """Standard-normal inputs made on the GPU (bfloat16 by truncating float32 bits)."""
    out = []
    for _ in range(3):
        x = cp.random.standard_normal(shape, dtype=cp.float32)
        if dtype.itemsize == 2 and dtype != numpy.float16:
            x = (x.view(cp.uint32) >> 16).astype(cp.uint16).view(dtype)
        else:
            x = x.astype(dtype)
        out.append(x)
    return out


def _finite(cp, x):
    if x.dtype.itemsize == 2:  # exponent all ones = inf or NaN, for float16 and bfloat16
        bits = x.view(cp.uint16)
        mask = 0x7C00 if x.dtype == numpy.float16 else 0x7F80
        return not bool(((bits & mask) == mask).any())
    return bool(cp.isfinite(x).all())


def time_all():
    import cupy as cp
    from natten_cupy.backends.fused import mma_forward
    from natten_cupy import _args
    from natten_cupy.backends import get_backend
    from natten_cupy._dtypes import canonical_dtype
    fused = get_backend("fused")
    rows = []
    for wid, dname, tile in _runs():
        w = wl.WORKLOADS[wid]
        trial = tile if isinstance(tile, mma_forward.TileConfig) else None
        if trial is not None:  # an untabled config: time it as the default for this shape
            tile = None
            key = (w.rank, mma_forward._bucket(w.dim))
            saved, mma_forward.DEFAULT[key] = mma_forward.DEFAULT[key], trial
        mma_forward.configure.cache_clear()  # cached per problem, not per DEFAULT
        dtype = canonical_dtype("bfloat16" if dname == "bfloat16" else dname)
        q, k, v = _inputs(cp, w.shape, dtype)
        prob = _args.check_fused(w.rank, q, k, v, w.kernel, w.stride, w.dilation, w.causal, None,
                                 "fused", allow_tf32=dname == "float32", tile=tile)
        why = fused.refuse("fused_forward", prob)
        out = cp.empty_like(q)
        lse = cp.empty(q.shape[:-1], cp.float32)
        try:
            if why:
                raise ValueError(why)
            kname = mma_forward.configure(prob).name.split("<", 1)[1].rstrip(">").replace(" ", "")
            run = functools.partial(fused.fused_forward, prob, q, k, v, out, lse)
            times = event_times(run, 15, warmup=2)
            ms = statistics.median(times)
            spread = (max(times) - min(times)) / ms
            ok = _finite(cp, out) and _finite(cp, lse)
            rows.append((wid, dname, tile, ms,
                         f"spread {spread:.0%}{'' if ok else ' NONFINITE!'} {kname}",
                         prob.flops_forward()))
        except Exception as e:
            rows.append((wid, dname, tile, None, f"{type(e).__name__}: {str(e)[:200]}"))
        if trial is not None:
            mma_forward.DEFAULT[key] = saved
            name = f"{trial.patch[:2]}x{trial.warps[:2]}k{trial.kb}{'' if trial.lines else ' flat'}"
            rows[-1] = (rows[-1][0], rows[-1][1], name) + rows[-1][3:]
            mma_forward.configure.cache_clear()
        del q, k, v, out, lse
        cp.get_default_memory_pool().free_all_blocks()
    print(f"{'id':<6}{'dtype':<9}{'tile':<30}{'ms':>8}{'TFLOP/s':>9}{'peer ms':>9}{'x peer':>8}  note")
    for r in rows:
        wid, dname, tile, ms, note = r[:5]
        if ms is None:
            print(f"{wid:<6}{dname:<9}{str(tile or 'default'):<30}{'-':>8}  {note}")
            continue
        tflops = r[5] / ms / 1e9
        peer = _peer_ms(wid, dname)
        ratio = f"{peer / ms:.2f}" if peer else "-"
        print(f"{wid:<6}{dname:<9}{str(tile or 'default'):<30}{ms:8.3f}{tflops:9.1f}"
              f"{peer or 0:9.2f}{ratio:>8}  {note}")


def split():
    """W2's grid, heads and head dim over square windows 3..13: ms against key-loop iterations
    per warp, and the least-squares line ms = fixed + per_iteration * iterations (the fixed
    part: CTA prologue, halo load, epilogue; the slope: one 32-key iteration of every warp)."""
    import cupy as cp
    from natten_cupy import _args
    from natten_cupy.backends import get_backend
    from natten_cupy.backends.fused import mma_forward
    fused = get_backend("fused")
    C = mma_forward.TileConfig
    w = wl.WORKLOADS["W2"]
    q, k, v = _inputs(cp, w.shape, numpy.dtype(numpy.float16))
    out = cp.empty_like(q)
    lse = cp.empty(q.shape[:-1], cp.float32)
    key = (2, 32)
    saved = mma_forward.DEFAULT[key]
    for cfg in (C((2, 8, 1), (4, 1, 1), 2), C((4, 4, 1), (2, 2, 1), 2, False)):
        mma_forward.DEFAULT[key] = cfg
        mma_forward.configure.cache_clear()
        its, mss = [], []
        for ks in (3, 5, 7, 9, 11, 13):
            prob = _args.check_fused(2, q, k, v, ks, 1, 1, False, None, "fused")
            wn = [p + ks - 1 for p in cfg.patch[:2]]
            keys = wn[0] * -(-wn[1] // 8) * 8 if cfg.lines else wn[0] * wn[1]
            it = -(-keys // (16 * cfg.kb))
            ms = event_ms(lambda: fused.fused_forward(prob, q, k, v, out, lse), warmup=2)
            its.append(it)
            mss.append(ms)
            print(f"{str(cfg.patch[:2]) + (' lines' if cfg.lines else ' flat'):<16} k {ks:>2}  "
                  f"iterations/warp {it:>3}  {ms:7.3f} ms  {prob.flops_forward() / ms / 1e9:6.1f} TFLOP/s")
        slope, fixed = numpy.polyfit(its, mss, 1)
        print(f"  fit: {fixed:.3f} ms fixed + {slope:.3f} ms per iteration")
    mma_forward.DEFAULT[key] = saved
    mma_forward.configure.cache_clear()


def small():
    import cupy as cp
    cp.cuda.set_allocator(None)
    t = _gpu_tests()
    rng = numpy.random.default_rng(7)
    for item in SMALL:
        _, case, layout = case_of(item)
        print(t.check_case(case, rng, layout))


def list_cases():
    for name, _, _ in cases():
        print(f"check  {name}")
    for item in SMALL:
        print(f"small  {case_of(item)[0]}")


STEPS = {"warm": warm, "check": check, "time": time_all, "small": small, "split": split,
         "list": list_cases}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("step", choices=STEPS)
    ap.add_argument("part", type=int, nargs="?", default=0, help="check: this part (from 0) ...")
    ap.add_argument("parts", type=int, nargs="?", default=1, help="... of this many")
    args = ap.parse_args(argv)
    if args.step == "check":
        check(args.part, args.parts)
    else:
        STEPS[args.step]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
