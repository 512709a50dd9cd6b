"""The fused backward against an unfused chain from the saved log-sum-exp, on small windows.

    python bench/probes/unfused_bwd.py [--workloads 1D-D128-15:fp16,R1-51:fp16] [--out F]

A question for the dispatch, not a backend: on windows of a few dozen keys the fused
backward moves q, k, v, out, dO several times (its passes re-read overlapping tiles) while
the scores themselves are small (K per query), so the chain

    P = exp(scale * qk(q, k) - lse);  delta = rowsum(dO * out)
    d_attn, dv = av_backward(dO, P, v);  dS = scale * P * (d_attn - delta)
    dq, dk = qk_backward(dS, q, k)

on the tiled backend (``backend="tiled"``; the elementwise steps in CuPy) may move fewer
bytes. Per workload (``bench/workloads.py``, stride 1, any rank): the warm array-API fused
backward and the chain, each timed back to back (``event_ms`` with five calls between the
events, so that host work hides under the GPU's), their gradients compared (largest
difference over the largest fused gradient), and the bytes of the (B, N, H, K) score
arrays the chain writes and reads.
"""

import argparse
import json
import math
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import cupy  # noqa: E402

from natten_cupy import ops  # noqa: E402
from natten_cupy.profile_cli import random_array  # noqa: E402
from timing import event_ms  # noqa: E402
from workloads import dtype_spec, probe_workload  # noqa: E402

DEFAULT = "1D-D128-15:fp16,1D-D128-47c:bf16,R1-51:fp16,1D-D64-31:fp16,G11:bf16,M1:fp16,M3:fp16"


def run(wid, dtype, reps):
    w = probe_workload(wid)
    name = dtype_spec(dtype)["name"]
    q, k, v, do = (random_array(cupy, w.shape, name, i) for i in range(4))
    kw = dict(dilation=w.dilation, is_causal=w.causal)
    scale = w.shape[-1] ** -0.5
    out, lse = ops.fused_forward(w.rank, q, k, v, w.kernel, return_lse=True, scale=scale, **kw)

    def fused():
        return ops.fused_backward(w.rank, do, q, k, v, out, lse, w.kernel, scale=scale, **kw)

    def chain():
        attn = ops.qk(w.rank, q, k, w.kernel, backend="tiled", **kw)
        p = cupy.exp(attn.astype(cupy.float32) * scale - lse[..., None]).astype(q.dtype)
        delta = (do.astype(cupy.float32) * out.astype(cupy.float32)).sum(-1)
        d_attn, dv = ops.av_backward(w.rank, do, p, v, w.kernel, backend="tiled", **kw)
        ds = ((d_attn.astype(cupy.float32) - delta[..., None]) * p * scale).astype(q.dtype)
        dq, dk = ops.qk_backward(w.rank, ds, q, k, w.kernel, backend="tiled", **kw)
        return dq, dk, dv

    ref, got = fused(), chain()
    err = {n: float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max()
                    / max(float(cupy.abs(a.astype(cupy.float32)).max()), 1e-30))
           for n, a, b in zip(("dq", "dk", "dv"), ref, got)}
    row = dict(workload=wid, dtype=dtype, shape=list(w.shape), kernel=list(w.kernel),
               causal=list(w.causal), rel_err=err,
               score_bytes=math.prod(w.shape[:-1]) * math.prod(w.kernel) * q.dtype.itemsize,
               tensor_bytes=math.prod(w.shape) * q.dtype.itemsize)
    row["fused_ms"] = round(event_ms(fused, reps=reps, inner=5), 4)
    row["chain_ms"] = round(event_ms(chain, reps=reps, inner=5), 4)
    row["fused/chain"] = round(row["fused_ms"] / row["chain_ms"], 3)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for item in args.workloads.split(","):
        wid, dt = item.split(":")
        try:
            row = run(wid, dt, args.reps)
        except Exception as e:  # a workload the chain cannot run (e.g. stride)
            row = dict(workload=wid, dtype=dt, error=f"{type(e).__name__}: {e}"[:300])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from timing import save_rows
        save_rows(args.out, rows)


if __name__ == "__main__":
    main()
