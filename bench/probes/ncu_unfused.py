"""Drive Nsight Compute over the unfused chain's kernels (one call of each, after warm-up).

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats python bench/probes/ncu_unfused.py [W2] [fp16]

Only the calls between cudaProfilerStart/Stop are profiled: qk, softmax, av, av_backward,
softmax_backward, qk_backward on the tiled backend.
"""

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # the repository (natten_cupy), bench/

import cupy  # noqa: E402

import natten_cupy  # noqa: E402
from natten_cupy import ops  # noqa: E402
from natten_cupy.profile_cli import random_array  # noqa: E402
from timing import profiled_once  # noqa: E402
from workloads import WORKLOADS, dtype_spec  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", nargs="?", default="W2", choices=sorted(WORKLOADS))
    ap.add_argument("dtype", nargs="?", default="fp16", choices=("fp16", "bf16", "fp32", "tf32"))
    args = ap.parse_args(argv)
    w = WORKLOADS[args.workload]
    spec = dtype_spec(args.dtype)
    dtype, tf32 = spec["name"], spec["tf32"]
    q, k, v, do = (random_array(cupy, w.shape, dtype, i) for i in range(4))
    c = dict(dilation=w.dilation, is_causal=w.causal, allow_tf32=tf32, backend="tiled")
    scale = w.dim ** -0.5

    def chain():
        logits = ops.qk(w.rank, q, k, w.kernel, **c)
        attn = natten_cupy.softmax(logits, scale)
        ops.av(w.rank, attn, v, w.kernel, **c)
        d_attn, _ = ops.av_backward(w.rank, do, attn, v, w.kernel, **c)
        d_logits = natten_cupy.softmax_backward(attn, d_attn, scale)
        ops.qk_backward(w.rank, d_logits, q, k, w.kernel, **c)

    profiled_once(chain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
