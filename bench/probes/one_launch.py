"""The mma.sync backward's passes one by one against both in one launch (``na_bwd_fused_one``)
on small problems, side by side in one run.

    python bench/probes/one_launch.py [--out one_launch.json]

Per problem (float16/bfloat16, head dims 32-64, from the overhead problem up to sizes where
``mma_backward.one_launch`` stops taking it) and per mode (``ONE_LAUNCH`` False, then True):
a warm array-API backward on CuPy arrays, microseconds per call (``timing.wall_us``: calls
then one synchronize, median of runs; host-bound on the smallest), and the kernels alone
(the same call on torch tensors captured in a CUDA graph and replayed, ``timing.graph_ms``);
the gradients of both modes must agree (max |difference| / max |gradient|, printed).
"""

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import cupy  # noqa: E402
import numpy  # noqa: E402
import torch  # noqa: E402

import natten_cupy  # noqa: E402
from natten_cupy import _args, _fast  # noqa: E402
from natten_cupy.backends.fused import mma_backward as M  # noqa: E402
from timing import graph_ms, save_rows, wall_us  # noqa: E402

# (shape [B, *spatial, H, D], kernel, dtype)
PROBLEMS = [
    ((1, 8, 8, 1, 32), 3, "float16"),
    ((2, 14, 14, 4, 32), 7, "float16"),
    ((4, 28, 28, 4, 32), 7, "bfloat16"),
    ((2, 512, 4, 64), 63, "float16"),
    ((8, 28, 28, 4, 64), 7, "float16"),
    ((4, 32, 32, 8, 64), 7, "bfloat16"),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for shape, kernel, dtype in PROBLEMS:
        rank = len(shape) - 3
        na, back = {1: (natten_cupy.na1d, natten_cupy.na1d_backward),
                    2: (natten_cupy.na2d, natten_cupy.na2d_backward)}[rank]
        gen = numpy.random.default_rng(0)
        host = [gen.standard_normal(shape).astype(numpy.float32) for _ in range(4)]
        tt = [torch.tensor(h, device="cuda", dtype=getattr(torch, dtype)) for h in host]
        cp = [cupy.from_dlpack(t) for t in tt]      # the same memory (DLPack)
        out, lse = na(*cp[:3], kernel, return_lse=True)
        tout, tlse = torch.from_dlpack(out), torch.from_dlpack(lse)
        problem = _args.check_fused(rank, *cp[:3], kernel, 1, 1, False, None, "fused")
        t = M.configure(problem)
        row = dict(shape=list(shape), kernel=kernel, dtype=dtype,
                   one_launch_taken=bool(M.one_launch(t, M._limits())),
                   ctas=[t.q.launches[0][0][0] * t.q.launches[0][0][1],
                         t.kv.launches[0][0][0] * t.kv.launches[0][0][1]])
        grads = {}
        for mode in (False, True):
            M.ONE_LAUNCH = mode
            _fast.clear()
            name = "one" if mode else "two"
            call = lambda: back(cp[3], *cp[:3], out, lse, kernel)   # noqa: E731
            grads[name] = [torch.from_dlpack(g).float() for g in call()]
            row[f"{name}_wall_us"] = round(wall_us(call, calls=300), 2)
            row[f"{name}_kernels_us"] = round(
                graph_ms(lambda: back(tt[3], *tt[:3], tout, tlse, kernel)) * 1e3, 2)
        M.ONE_LAUNCH = False
        row["max_rel_diff"] = max(float((a - b).abs().max() / a.abs().max())
                                  for a, b in zip(grads["one"], grads["two"]))
        rows.append(row)
        print(f"{str(shape):24s} k{kernel:<3d} {dtype:9s} taken {row['one_launch_taken']!s:5s} "
              f"CTAs {row['ctas']}  wall {row['two_wall_us']:7.1f} -> {row['one_wall_us']:7.1f} us"
              f"  kernels {row['two_kernels_us']:7.1f} -> {row['one_kernels_us']:7.1f} us  "
              f"diff {row['max_rel_diff']:.1e}", flush=True)
    if args.out:
        save_rows(args.out, rows)


if __name__ == "__main__":
    main()
