"""``python -m natten_cupy demo``: run na2d on a realistic problem and check it.

On a machine with a GPU the demo runs CuPy float16 arrays through the fastest backend
(``auto``); without one it runs float32 NumPy arrays on the reference backend. Either way the
result is checked against the float64 reference and the backend and timings are printed.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy

from . import na2d, ops
from ._args import check_fused
from ._device import gpu_unavailable_reason

# Default grid side: 96x96 keeps the CPU run about a second.
SIZE = {"gpu": 128, "cpu": 96}


def _relative_error(x, ref):
    x = numpy.asarray(x, dtype=numpy.float64)
    return float(numpy.linalg.norm(x - ref) / numpy.linalg.norm(ref))


def demo(size=None, heads=4, head_dim=32, kernel=7, seed=0):
    rng = numpy.random.default_rng(seed)
    reason = gpu_unavailable_reason()
    on_gpu = reason is None
    size = size or SIZE["gpu" if on_gpu else "cpu"]
    shape = (1, size, size, heads, head_dim)
    q64, k64, v64 = (rng.standard_normal(shape) for _ in range(3))
    if on_gpu:
        import cupy
        dtype = numpy.float16
        q, k, v = (cupy.asarray(x.astype(dtype)) for x in (q64, k64, v64))
        where = f"GPU ({cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()})"
    else:
        dtype = numpy.float32
        q, k, v = (x.astype(dtype) for x in (q64, k64, v64))
        where = f"CPU (NumPy; {reason})"
    problem = check_fused(2, q, k, v, kernel, 1, 1, False, None, "auto")
    xp = numpy if not on_gpu else __import__("cupy")
    backend = ops.select_backend("fused_forward", problem, xp, "auto")

    def run():
        out = na2d(q, k, v, kernel)
        if on_gpu:
            xp.cuda.get_current_stream().synchronize()
        return out

    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    times = []
    for _ in range(5 if on_gpu else 1):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    out_host = out.get() if on_gpu else out
    ref = na2d(q64, k64, v64, kernel, backend="reference")
    err = _relative_error(out_host, ref)
    tol = 1e-2 if dtype == numpy.float16 else 1e-5
    print(f"natten_cupy demo on {where}")
    print(f"  na2d: q/k/v {shape} {numpy.dtype(dtype).name}, kernel {kernel}x{kernel}")
    print(f"  backend: {backend.NAME}")
    first_label = "first call (includes compiling)" if on_gpu else "first call"
    print(f"  {first_label}: {first * 1e3:.1f} ms; "
          f"median of the next: {numpy.median(times) * 1e3:.2f} ms")
    print(f"  relative error vs float64 reference: {err:.2e} (tolerance {tol:.0e})")
    ok = err <= tol and bool(numpy.isfinite(out_host.astype(numpy.float64)).all())
    print("  check: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m natten_cupy")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run na2d on a realistic problem and check it")
    d.add_argument("--size", type=int, default=None, help=f"grid side (default {SIZE['gpu']} GPU, {SIZE['cpu']} CPU)")
    d.add_argument("--kernel", type=int, default=7)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(size=args.size, kernel=args.kernel)
    return 2


if __name__ == "__main__":
    sys.exit(main())
