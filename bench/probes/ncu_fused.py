"""Drive Nsight Compute over one fused call (forward or backward, after a warm-up call).

    ncu --profile-from-start off --set full --import-source yes -o rep \
        python bench/probes/ncu_fused.py 2D-33 fp16 [--backward] [--rpb] [--tile wgmma]
        python bench/probes/ncu_fused.py 2D-33 fp16 --hopper-box small

Only the call between cudaProfilerStart/Stop is profiled (every kernel of it: the backward's
delta, dK/dV and dQ passes, and with ``--rpb`` the bias reduction). Workloads are
``bench/workloads.py``'s (the suite's, the model-shaped and the probes' ids).
"""

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # the repository (natten_cupy), bench/

import cupy  # noqa: E402

from natten_cupy import ops  # noqa: E402
from natten_cupy.profile_cli import random_array  # noqa: E402
from timing import profiled_once  # noqa: E402
from workloads import dtype_spec, probe_workload  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload")
    ap.add_argument("dtype", nargs="?", default="fp16", choices=("fp16", "bf16", "fp32", "tf32"))
    ap.add_argument("--backward", action="store_true", help="profile the backward call")
    ap.add_argument("--rpb", action="store_true", help="with a relative positional bias")
    ap.add_argument("--tile", default=None, help="tile option (wgmma, mma.sync, a box)")
    ap.add_argument("--hopper-dq", choices=("passes", "atomic"), default=None,
                    help="run the Hopper backward itself, dQ by its own pass or added in the "
                         "dK/dV pass (wgmma_backward's dq_atomic), whatever the dispatch picks")
    ap.add_argument("--hopper-box", choices=("default", "small"), default=None,
                    help="run the Hopper forward itself with its default query box or the "
                         "64-query box (wgmma_forward.SMALL_BOX), whatever the dispatch picks")
    args = ap.parse_args(argv)
    if args.hopper_box and (args.backward or args.hopper_dq or args.rpb):
        ap.error("--hopper-box profiles the forward without a bias")
    w = probe_workload(args.workload)
    spec = dtype_spec(args.dtype)
    dtype, tf32 = spec["name"], spec["tf32"]
    q, k, v, do = (random_array(cupy, w.shape, dtype, i) for i in range(4))
    rpb = None
    if args.rpb:
        rpb = random_array(cupy, (w.heads,) + tuple(2 * n - 1 for n in w.kernel), dtype, 9)
    tile = args.tile
    if tile and tile[0].isdigit():
        tile = tuple(int(t) for t in tile.split(","))
    c = dict(stride=w.stride, dilation=w.dilation, is_causal=w.causal, allow_tf32=tf32,
             backend="fused", tile=tile, rpb=rpb)
    out, lse = ops.fused_forward(w.rank, q, k, v, w.kernel, return_lse=True, **c)

    if args.hopper_dq or args.hopper_box:   # a Hopper part called directly
        from natten_cupy import _args
        from natten_cupy.backends.fused import wgmma_backward, wgmma_forward
        prob = _args.check_fused(w.rank, q, k, v, w.kernel, w.stride, w.dilation, w.causal,
                                 None, "fused")
    if args.hopper_dq:
        grads = [cupy.empty(q.shape, q.dtype) for _ in range(3)]
    if args.hopper_box:
        box = ({} if args.hopper_box == "default" else
               dict(tile=wgmma_forward.SMALL_BOX[wgmma_forward._bucket(w.dim)]))

    def call():
        if args.hopper_box:
            wgmma_forward.forward(prob, q, k, v, out, lse, **box)
        elif args.hopper_dq:
            wgmma_backward.backward(prob, q, k, v, out, lse, do, *grads,
                                    dq_atomic=args.hopper_dq == "atomic")
        elif args.backward:
            ops.fused_backward(w.rank, do, q, k, v, out, lse, w.kernel, **c)
        else:
            ops.fused_forward(w.rank, q, k, v, w.kernel, return_lse=True, **c)

    profiled_once(call)
    return 0


if __name__ == "__main__":
    sys.exit(main())
