"""Device probe: where the biased dQ pass of the fused backward spends its time.

Times the dQ pass (``na_bwd_fused_q``) of the mma.sync backward per workload in variants that
leave one stage of the bias out, compiled from the same source with that stage's lines
removed in memory (the results are wrong for d_rpb, and for dq where the table lookup goes;
only the times matter):

* ``bias``: as shipped;
* ``-adds``: without the column adds of the dS tile into the warps' boxes;
* ``-adds-tile``: without those and the dS tile's stores;
* ``-adds-tile-lookup``: without those and the table lookups of the scores;
* ``plain``: the kernel without a bias.

Each variant's time minus the next one's is what that stage costs. Kernels alone: the
launches of a call bracketed by CUDA events (the library's profiler hook), median over
``--reps`` calls. Usage::

    python bench/probes/rpb_bwd_stages.py [--workloads M4:bf16,M1:fp16] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH, os.path.join(BENCH, "probes")]

import workloads as wl  # noqa: E402

DEFAULT = "M4:bf16,M7:bf16,M1:fp16,W2:fp16"

# (variant, [(text in fused/mma_backward.cu, replacement)]), each adding to the one before.
CUTS = {
    "-adds": [("if (col0 == 0) {   // lane: gathered row `lane` of the step, owner rows in order",
               "if (false) {")],
    "-adds-tile": [("if (BIAS && !OwnerIsKey) wtl[hh * 8 * kTileStride + nt * 8 + c] = dp[nt][e];",
                    "")],
    "-adds-tile-lookup": [("if (BIAS && on) x += btab[bt - own_t[hh]];", "")],
}


def _variant_source(name):
    from natten_cupy import _compile
    text = _compile._read("fused/mma_backward.cu")
    for variant, cuts in CUTS.items():
        for old, new in cuts:
            if text.count(old) != 1:
                raise RuntimeError(f"probe cut {old!r} not found once in fused/mma_backward.cu")
            text = text.replace(old, new)
        if variant == name:
            return text
    raise KeyError(name)


def _compiled(source_text, name):
    import cupy
    from natten_cupy import _compile
    opts = tuple(_compile.compile_options()) + tuple(f"-I{d}" for d in _compile.cuda_include_dirs())
    mod = cupy.RawModule(code=source_text, options=opts, name_expressions=[name])
    return mod.get_function(name)


def run_workload(wid, dtype, reps):
    import cupy
    import natten_cupy as nc
    from natten_cupy.backends.fused import mma_backward
    from natten_cupy._dtypes import canonical_dtype
    from timing import launch_times

    w = wl.probe_workload(wid) if wid in wl.PROBE_WORKLOADS else wl.model_workload(wid)
    dt = canonical_dtype(wl.dtype_spec(dtype)["name"])
    rs = cupy.random.default_rng(0)

    def rand(shape, scale=1.0):
        return (scale * rs.standard_normal(shape, dtype=cupy.float32)).astype(dt)

    q, k, v, d_out = (rand(w.shape) for _ in range(4))
    rpb = rand((w.heads,) + tuple(2 * x - 1 for x in w.kernel), 0.5)
    kw = dict(dilation=w.dilation, is_causal=w.causal, backend="fused", tile=None)
    fwd, bwd = getattr(nc, f"na{w.rank}d"), getattr(nc, f"na{w.rank}d_backward")
    out, lse = fwd(q, k, v, w.kernel, return_lse=True, rpb=rpb, **kw)

    def q_pass_ms(call):
        call()
        times = []
        for _ in range(reps):
            times.append(sum(ms for n, ms in launch_times(call) if n == "na_bwd_fused_q"))
        return statistics.median(times)

    real = mma_backward.get_kernel
    row = dict(workload=wid, dtype=dtype, shape=list(w.shape), kernel=list(w.kernel))
    row["bias"] = q_pass_ms(lambda: bwd(d_out, q, k, v, out, lse, w.kernel, rpb=rpb, **kw))
    for variant in CUTS:
        text = _variant_source(variant)
        cache = {}

        def patched(source, name, extra_options=()):
            if source == "fused/mma_backward.cu" and name.startswith("na_bwd_fused_q"):
                if name not in cache:
                    cache[name] = _compiled(text, name)
                return cache[name]
            return real(source, name, extra_options)
        mma_backward.get_kernel = patched
        try:
            row[variant] = q_pass_ms(lambda: bwd(d_out, q, k, v, out, lse, w.kernel, rpb=rpb,
                                                 **kw))
        finally:
            mma_backward.get_kernel = real
    from natten_cupy import _args
    plain = _args.check_fused(w.rank, q, k, v, w.kernel, 1, w.dilation, w.causal, None, "fused")
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    row["plain"] = q_pass_ms(lambda: mma_backward.backward(plain, q, k, v, out, lse, d_out,
                                                         *grads))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for item in args.workloads.split(","):
        wid, dtype = item.split(":")
        row = run_workload(wid, dtype, args.reps)
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
