"""Where the Hopper backward's two ways to dQ pay: the deterministic dQ pass against dQ added
in the dK/dV pass by bulk reductions (``dq_atomic``), per kernel, next to the mma.sync
backward for head dim 64 on 2-D/3-D (``fused._hopper_bwd_pays`` keeps those on mma.sync).

Per workload (``bench/workloads.py`` ids): the Hopper forward for out and lse, then each
backward timed by CUDA events (median of 10 after 2 warm-ups, whole call) and split into its
kernels by the profiler's launch events (``timing.kernel_split``). What decides
``wgmma_backward.atomic_pays``. JSON to $OUT/hopper_bwd_dq.json.

    python bench/probes/hopper_bwd_dq.py [--only ID,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROBES = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(PROBES)
sys.path[:0] = [os.path.dirname(BENCH), BENCH, PROBES]   # natten_cupy, bench/, probes/

import workloads as wl  # noqa: E402
from timing import kernel_split  # noqa: E402
from timing import event_ms  # noqa: E402

RUNS = (("SA", "float16"), ("W1", "float16"), ("M4", "bfloat16"), ("M7", "bfloat16"),
        ("2D-D64", "bfloat16"), ("1D-D64-small", "float16"), ("SA128", "float16"),
        ("M6", "bfloat16"), ("M5", "bfloat16"), ("3D-D128", "bfloat16"))


def backward_inputs(wid, tname):
    """(workload, problem, q, k, v, d_out, out, lse) of a probe workload: seeded random
    inputs of dtype ``tname`` (torch's name) as CuPy arrays, out and lse from the Hopper
    forward."""
    import cupy
    import torch
    from natten_cupy import _args
    from natten_cupy.backends.fused import wgmma_forward
    w = wl.probe_workload(wid)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (cupy.from_dlpack(torch.randn(*w.shape, device="cuda",
                                                   dtype=getattr(torch, tname), generator=g))
                      for _ in range(4))
    prob = _args.check_fused(w.rank, q, k, v, w.kernel, w.stride, w.dilation, w.causal, None,
                             "fused")
    out, lse = cupy.empty(q.shape, q.dtype), cupy.empty(q.shape[:-1], cupy.float32)
    wgmma_forward.forward(prob, q, k, v, out, lse)
    return w, prob, q, k, v, d_out, out, lse


def run(wid, tname):
    import cupy
    from natten_cupy.backends.fused import mma_backward
    from natten_cupy.backends.fused import wgmma_backward as H
    w, prob, q, k, v, d_out, out, lse = backward_inputs(wid, tname)
    grads = [cupy.empty(q.shape, q.dtype) for _ in range(3)]
    ways = [("deterministic", lambda: H.backward(prob, q, k, v, out, lse, d_out, *grads,
                                                 dq_atomic=False)),
            ("dq_atomic", lambda: H.backward(prob, q, k, v, out, lse, d_out, *grads,
                                             dq_atomic=True))]
    if w.dim == 64 and w.rank > 1:
        ways.append(("mma.sync", lambda: mma_backward.backward(prob, q, k, v, out, lse, d_out,
                                                               *grads)))
    rows = []
    for name, fn in ways:
        split = kernel_split(fn)
        rows.append(dict(id=wid, dtype=tname, way=name, ms=round(event_ms(fn, warmup=2, reps=10), 4),
                         kernels_ms=split))
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="workload ids, comma-separated")
    args = ap.parse_args(argv)
    import cupy
    import torch
    only = {x for x in args.only.split(",") if x}
    res = dict(device=torch.cuda.get_device_name(), commit=os.environ.get("NATTEN_CUPY_COMMIT", ""),
               rows=[])
    for wid, tname in RUNS:
        if only and wid not in only:
            continue
        res["rows"] += run(wid, tname)
        torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "hopper_bwd_dq.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
