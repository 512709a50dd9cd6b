"""Device probe of the relative positional bias (rpb) in the fused kernels.

Per workload, side by side in one process on the same inputs:

* fused forward and backward without a bias (the default kernels, and the mma.sync ones:
  where the default is a Hopper kernel the two differ);
* fused forward and backward with a bias (``rpb=``, d_rpb from the backward, as the dispatch
  picks the kernels), the mma.sync forward with the bias, and the biased backward on each
  part by itself: mma.sync (reproducible d_rpb) and, where it takes the problem, the Hopper
  one as its default picks (``hopper``), with its dQ pass summing d_rpb by shared-memory
  atomics (``hopper_dq_pass``) and with dQ added in its dK/dV pass and d_rpb from the dS
  workspace (``hopper_ds``, where that fits), with their differences to mma.sync's;
* the default biased backward with the other reduction of the dQ CTAs' bias-gradient boxes
  (``mma_backward.RPB_TWO_LAUNCH`` flipped: ``bwd_rpb_two_launch`` or ``bwd_rpb_one_launch``);
* where that backward is mma.sync's, with the other count of copies of its dQ pass's warp
  boxes (``mma_backward.BIAS_BOX_COPIES`` 1 <-> 4: ``bwd_rpb_copies4`` or ``bwd_rpb_copies1``);
* the unfused chain with the same bias (qk with rpb, softmax, av; backward: av, softmax and
  qk backwards with d_rpb), the way the bias ran before the fused kernels took it.

Times are kernels alone: every launch of a call is bracketed by CUDA events through the
library's profiler hook (``timing.kernel_ms``, ``timing.kernel_split``) and summed, median over
``--reps`` calls after a warm-up; host time between launches does not count. Errors: the
fused biased out and d_rpb against the unfused chain's, both from the same inputs (max abs
difference relative to the largest value). Usage::

    python bench/probes/rpb_probe.py [--workloads M1:fp16,M4:bf16] [--reps 10] [--out f.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]

import workloads as wl  # noqa: E402
from timing import kernel_ms, kernel_split  # noqa: E402

DEFAULT = "M1:fp16,M2:fp16,M3:fp16,M4:bf16,M5:bf16,M7:bf16,W2:fp16,W3:fp16"


def _rel(a, b):
    import cupy
    a, b = a.astype(cupy.float64), b.astype(cupy.float64)
    return float(cupy.abs(a - b).max() / max(float(cupy.abs(b).max()), 1e-30))


def _rpb_reduction(two):
    """Sets mma_backward.RPB_TWO_LAUNCH and clears what cached the other setting."""
    from natten_cupy import _fast
    from natten_cupy.backends.fused import mma_backward, wgmma_backward
    mma_backward.RPB_TWO_LAUNCH = two
    mma_backward._configure.cache_clear()
    wgmma_backward._configure.cache_clear()
    _fast.clear()


def _box_copies(n):
    """Sets mma_backward.BIAS_BOX_COPIES (part of its decision cache's key) and clears the
    warm-call plans."""
    from natten_cupy import _fast
    from natten_cupy.backends.fused import mma_backward
    mma_backward.BIAS_BOX_COPIES = n
    _fast.clear()


def run_workload(wid, dtype, reps):
    import cupy
    import natten_cupy as nc
    from natten_cupy import _args
    from natten_cupy._dtypes import canonical_dtype
    from natten_cupy.backends import fused, get_backend
    from natten_cupy.backends.fused import mma_backward, mma_forward, wgmma_backward

    w = wl.probe_workload(wid) if wid in wl.PROBE_WORKLOADS else wl.model_workload(wid)
    spec = wl.dtype_spec(dtype)
    dt = canonical_dtype(spec["name"])
    rank, ks, dl, ca = w.rank, w.kernel, w.dilation, w.causal
    rs = cupy.random.default_rng(0)

    def rand(shape, scale=1.0):
        return (scale * rs.standard_normal(shape, dtype=cupy.float32)).astype(dt)

    q, k, v, d_out = (rand(w.shape) for _ in range(4))
    rpb = rand((w.heads,) + tuple(2 * x - 1 for x in ks), 0.5)
    kw = dict(dilation=dl, is_causal=ca)
    fwd = getattr(nc, f"na{rank}d")
    bwd = getattr(nc, f"na{rank}d_backward")
    row = dict(workload=wid, dtype=dtype, shape=list(w.shape), kernel=list(ks),
               dilation=list(dl), causal=list(ca))

    # Which kernels run (the backward with a bias is mma.sync's whatever the default).
    problem = _args.check_fused(rank, q, k, v, ks, 1, dl, ca, None, "auto")
    biased = dataclasses.replace(problem, has_rpb=True)
    be = get_backend("fused")
    row["default_forward"] = fused._parts_for("fused_forward", problem)
    row["default_backward"] = fused._parts_for("fused_backward", problem)
    row["forward_with_rpb"] = fused._parts_for("fused_forward", biased)
    row["backward_with_rpb"] = fused._parts_for("fused_backward", biased)
    row["refusal_with_rpb"] = {op: be.refuse(op, biased)
                               for op in ("fused_forward", "fused_backward")}

    out, lse = fwd(q, k, v, ks, **kw, return_lse=True)
    out_b, lse_b = fwd(q, k, v, ks, **kw, return_lse=True, rpb=rpb)
    grads = [cupy.empty_like(x) for x in (q, k, v)]

    o_m, l_m = cupy.empty_like(out), cupy.empty_like(lse)

    def mma_fwd():   # the mma.sync parts themselves, whatever the dispatch would pick
        mma_forward.forward(problem, q, k, v, o_m, l_m)

    def mma_fwd_rpb():
        mma_forward.forward(biased, q, k, v, o_m, l_m, rpb=rpb)

    def mma_bwd():
        mma_backward.backward(problem, q, k, v, out, lse, d_out, *grads)

    t = {}
    t["fwd"] = kernel_ms(lambda: fwd(q, k, v, ks, **kw, return_lse=True), reps)
    t["fwd_mma"] = kernel_ms(mma_fwd, reps)
    t["fwd_rpb"] = kernel_ms(lambda: fwd(q, k, v, ks, **kw, return_lse=True, rpb=rpb), reps)
    t["fwd_rpb_mma"] = kernel_ms(mma_fwd_rpb, reps)
    row["err_out_rpb_vs_mma"] = _rel(out_b, (mma_fwd_rpb(), o_m)[1])
    t["bwd"] = kernel_ms(lambda: bwd(d_out, q, k, v, out, lse, ks, **kw), reps)
    t["bwd_mma"] = kernel_ms(mma_bwd, reps)
    t["bwd_rpb"] = kernel_ms(lambda: bwd(d_out, q, k, v, out_b, lse_b, ks, **kw, rpb=rpb), reps)
    # The biased backward on each part by itself, on the same biased out and lse.
    # The Hopper part as its default picks (``hopper``), and with the dQ pass summing d_rpb
    # (``hopper_dq_pass``) and dQ added in the dK/dV pass with d_rpb from its dS workspace
    # (``hopper_ds``), each where it takes the problem.
    parts = {"mma": (mma_backward, {})}
    if wgmma_backward.refuse(biased) is None:
        parts["hopper"] = (wgmma_backward, {})
        parts["hopper_dq_pass"] = (wgmma_backward, {"dq_atomic": False})
        if wgmma_backward.ds_refusal(biased) is None:
            parts["hopper_ds"] = (wgmma_backward, {"dq_atomic": True})
    part_grads = {}
    for tag, (part, opts) in parts.items():
        g = [cupy.empty_like(x) for x in (q, k, v, rpb)]

        def run_part(part=part, g=g, opts=opts):
            part.backward(biased, q, k, v, out_b, lse_b, d_out, *g[:3], rpb=rpb, d_rpb=g[3],
                          **opts)
        t[f"bwd_rpb_{tag}"] = kernel_ms(run_part, reps)
        row[f"split_bwd_rpb_{tag}"] = kernel_split(run_part)
        part_grads[tag] = g
    for tag in ("hopper", "hopper_dq_pass", "hopper_ds"):
        if tag in part_grads:
            row[f"err_{tag}_vs_mma"] = {n: _rel(a, b) for n, a, b in zip(
                ("dq", "dk", "dv", "d_rpb"), part_grads[tag], part_grads["mma"])}
    if "hopper_ds" in parts:
        row["ds_head_runs"] = len(wgmma_backward.ds_head_groups(biased))
    row["split_bwd"] = kernel_split(lambda: bwd(d_out, q, k, v, out, lse, ks, **kw))
    row["split_bwd_rpb"] = kernel_split(lambda: bwd(d_out, q, k, v, out_b, lse_b, ks, **kw,
                                                    rpb=rpb))
    # The default biased backward with the other reduction of the dQ CTAs' bias-gradient
    # boxes (mma_backward.RPB_TWO_LAUNCH flipped; the decision caches and warm-call plans
    # cleared both ways), where the default has such boxes; its d_rpb against the default's.
    def biased_bwd():
        return bwd(d_out, q, k, v, out_b, lse_b, ks, **kw, rpb=rpb)

    d_rpb_default = biased_bwd()[3]

    def other_setting(tag):   # the default biased backward under a flipped setting
        t[f"bwd_rpb_{tag}"] = kernel_ms(biased_bwd, reps)
        row[f"split_bwd_rpb_{tag}"] = kernel_split(biased_bwd)
        row[f"err_d_rpb_{tag}_vs_default"] = _rel(biased_bwd()[3], d_rpb_default)

    two = not mma_backward.RPB_TWO_LAUNCH
    try:
        _rpb_reduction(two)
        other_setting("two_launch" if two else "one_launch")
    finally:
        _rpb_reduction(not two)
    # The default biased backward with the other count of copies of the mma.sync dQ pass's
    # warp boxes (mma_backward.BIAS_BOX_COPIES 1 <-> 4), where that pass runs it.
    if row["backward_with_rpb"] == "mma_backward":
        copies = mma_backward.BIAS_BOX_COPIES
        try:
            _box_copies(5 - copies)
            other_setting(f"copies{5 - copies}")
            row[f"wcopies_copies{5 - copies}"] = int(
                mma_backward.configure(biased).bias["wcopies"])
        finally:
            _box_copies(copies)
    dq, dk, dv, d_rpb = bwd(d_out, q, k, v, out_b, lse_b, ks, **kw, rpb=rpb)
    again = bwd(d_out, q, k, v, out_b, lse_b, ks, **kw, rpb=rpb)
    row["bitwise_repeat"] = all(bool((a.view(cupy.uint16 if a.itemsize == 2 else cupy.uint32)
                                      == b.view(cupy.uint16 if b.itemsize == 2 else cupy.uint32)
                                      ).all()) for a, b in zip((dq, dk, dv, d_rpb), again))

    # The unfused chain with the same bias (scale folded into q, as the modules do).
    scale = w.dim ** -0.5
    qk = getattr(nc, f"na{rank}d_qk")
    av = getattr(nc, f"na{rank}d_av")
    qkb = getattr(nc, f"na{rank}d_qk_backward")
    avb = getattr(nc, f"na{rank}d_av_backward")
    qs = (q.astype(cupy.float32) * scale).astype(dt)
    try:
        def chain_fwd():
            p = nc.softmax(qk(qs, k, ks, **kw, rpb=rpb))
            return p, av(p, v, ks, **kw)

        probs, out_u = chain_fwd()

        def chain_bwd():
            d_p, dv_u = avb(d_out, probs, v, ks, **kw)
            d_logits = nc.softmax_backward(probs, d_p)
            return qkb(d_logits, qs, k, ks, **kw, rpb=rpb), dv_u

        (_, _, d_rpb_u), _ = chain_bwd()
        t["chain_fwd"] = kernel_ms(chain_fwd, reps)
        t["chain_bwd"] = kernel_ms(chain_bwd, reps)
        row["err_out_vs_chain"] = _rel(out_b, out_u)
        row["err_d_rpb_vs_chain"] = _rel(d_rpb, d_rpb_u)
    except Exception as e:  # e.g. out of memory for the weights of a huge window
        row["chain_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    row["ms"] = {n: round(x, 4) for n, x in t.items()}
    flops = 4 * w.batch * w.tokens * w.heads * w.neighbors * w.dim
    row["tflops_fwd_rpb"] = round(flops / t["fwd_rpb"] / 1e9, 1)
    row["ratio"] = {
        "fwd_rpb/fwd_mma": round(t["fwd_rpb"] / t["fwd_mma"], 3),
        "fwd_rpb/fwd": round(t["fwd_rpb"] / t["fwd"], 3),
        "fwdbwd_rpb/fwdbwd_mma": round((t["fwd_rpb"] + t["bwd_rpb"])
                                       / (t["fwd_mma"] + t["bwd_mma"]), 3),
        "fwdbwd_rpb/fwdbwd": round((t["fwd_rpb"] + t["bwd_rpb"]) / (t["fwd"] + t["bwd"]), 3),
    }
    if "chain_fwd" in t:
        row["ratio"]["chain/fused_rpb fwd+bwd"] = round(
            (t["chain_fwd"] + t["chain_bwd"]) / (t["fwd_rpb"] + t["bwd_rpb"]), 2)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=DEFAULT,
                    help=f"comma-separated WID:dtype (default {DEFAULT})")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args(argv)
    specs = [s.split(":") for s in args.workloads.split(",") if s]
    for s in specs:
        if len(s) != 2 or s[1] not in wl.DTYPES:
            ap.error(f"bad workload spec {':'.join(s)!r} (want WID:dtype)")
    import cupy
    rows = []
    for wid, dtype in specs:
        t0 = time.perf_counter()
        try:
            row = run_workload(wid, dtype, args.reps)
        except Exception as e:
            row = dict(workload=wid, dtype=dtype, error=f"{type(e).__name__}: {e}"[:400])
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    print("\n  workload      fwd   fwd_mma fwd_rpb |  bwd   bwd_mma bwd_rpb  rpb_mma rpb_hop | "
          "chain f+b | rpb/mma f+b  rpb/default f+b  repeat")
    for r in rows:
        if "ms" not in r:
            print(f"  {r['workload']}:{r['dtype']}  {r.get('error', '')[:100]}")
            continue
        m = r["ms"]
        chain = m.get("chain_fwd", math.nan) + m.get("chain_bwd", math.nan)
        print(f"  {r['workload']:>5}:{r['dtype']:<5} {m['fwd']:7.3f} {m['fwd_mma']:7.3f} "
              f"{m['fwd_rpb']:7.3f} | {m['bwd']:7.3f} {m['bwd_mma']:7.3f} {m['bwd_rpb']:7.3f} "
              f"{m['bwd_rpb_mma']:7.3f} {m.get('bwd_rpb_hopper', math.nan):7.3f} | "
              f"{chain:8.3f} | {r['ratio']['fwdbwd_rpb/fwdbwd_mma']:6.3f} "
              f"{r['ratio']['fwdbwd_rpb/fwdbwd']:10.3f}  {r['bitwise_repeat']}")
    if args.out:
        import natten_cupy
        meta = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                    commit=os.environ.get("NATTEN_CUPY_COMMIT", ""),
                    version=getattr(natten_cupy, "__version__", ""))
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
