"""Time the reference backend (NumPy, CPU) on BENCH.md's W2 in float32.

W2: B=1, a 1024 x 1024 grid, kernel 9 x 9, 8 heads, head dim 32. Prints forward and backward
wall and CPU time (the dev machine is shared: wall time depends on its load), the useful
GFLOP/s (forward 4*B*N*H*K*D, backward counted as 2.5x forward) and the
process's peak resident memory.

Measured on the 2-core, 24 GB CPU dev machine (NumPy 2.4, float32), 2026-11-30, with the
machine nearly idle (load average about 1-2):
    forward    28.9 s wall,  28.2 s CPU, 3.0 GFLOP/s, peak RSS 5.12 GiB (inputs 4.04 GiB)
    backward  156.1 s wall, 151.3 s CPU, 1.4 GFLOP/s, peak RSS 8.19 GiB
(peak RSS counts the inputs q, k, v, d_out; backward adds out, lse, dq, dk, dv.) Under load
(load average 5-10) the same run took 128 s / 513 s wall for 47 s / 207 s of CPU.

Shapes and FLOPs are bench/workloads.py's (W2, with the options below changing it):
    python bench/probes/reference_w2.py [--extent 1024] [--kernel 9] [--heads 8] [--dim 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time

import numpy

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # the repository (natten_cupy), bench/

import natten_cupy  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


def peak_rss_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB


def main():
    w2 = WORKLOADS["W2"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--extent", type=int, default=w2.spatial[0])
    ap.add_argument("--kernel", type=int, default=w2.kernel[0])
    ap.add_argument("--heads", type=int, default=w2.heads)
    ap.add_argument("--dim", type=int, default=w2.dim)
    args = ap.parse_args()

    L, k, H, D = args.extent, args.kernel, args.heads, args.dim
    w = dataclasses.replace(w2, spatial=(L, L), kernel=(k, k), heads=H, dim=D)
    rng = numpy.random.default_rng(0)
    q, kk, v, d_out = (rng.standard_normal(w.shape, dtype=numpy.float32) for _ in range(4))
    base = peak_rss_gib()

    print(f"W2 reference float32 {L}x{L} kernel {k}x{k} H={H} D={D}", flush=True)
    t0, c0 = time.perf_counter(), time.process_time()
    out, lse = natten_cupy.na2d(q, kk, v, k, backend="reference", return_lse=True)
    t_fwd, c_fwd = time.perf_counter() - t0, time.process_time() - c0
    print(f"forward : {t_fwd:8.1f} s wall, {c_fwd:8.1f} s CPU  "
          f"{w.flops() / t_fwd / 1e9:6.2f} GFLOP/s  peak RSS {peak_rss_gib():.2f} GiB "
          f"(inputs {base:.2f} GiB)", flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    dq, dk, dv = natten_cupy.na2d_backward(d_out, q, kk, v, out, lse, k, backend="reference")
    t_bwd, c_bwd = time.perf_counter() - t0, time.process_time() - c0
    print(f"backward: {t_bwd:8.1f} s wall, {c_bwd:8.1f} s CPU  "
          f"{w.flops(True) / t_bwd / 1e9:6.2f} GFLOP/s  peak RSS {peak_rss_gib():.2f} GiB")
    finite = all(bool(numpy.isfinite(x).all()) for x in (out, lse, dq, dk, dv))
    print(f"all outputs finite: {finite}")


if __name__ == "__main__":
    main()
