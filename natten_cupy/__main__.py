"""``python -m natten_cupy demo``: run na2d on a realistic problem and check it.

On a machine with a GPU the demo runs CuPy float16 arrays through the fastest backend
(``auto``); without one it runs float32 NumPy arrays on the reference backend. Either way the
result is checked against the float64 reference and the backend and timings are printed.

``python -m natten_cupy demo --check`` runs every backend of this install once (each on the
arrays it takes: NumPy for the reference backend on a CPU, CuPy on a GPU) against the float64
reference and prints the versions, the GPU and a table of backends: what to paste into a bug
report.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy

from . import _env, na2d, ops
from ._args import check_fused
from ._device import gpu_unavailable_reason

# Default grid side: 96x96 keeps the CPU run about a second.
SIZE = {"gpu": 128, "cpu": 96}
KERNEL = 7
CHECK_SIZE = 24  # grid side of --check: small, every backend in a few seconds


def _relative_error(x, ref):
    x = numpy.asarray(x, dtype=numpy.float64)
    return float(numpy.linalg.norm(x - ref) / numpy.linalg.norm(ref))


def demo(size=None, heads=4, head_dim=32, kernel=KERNEL, seed=0):
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
    selected = ops.select_backend("fused_forward", problem, xp, "auto")

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
    print(f"  backend: {selected.name}")
    first_label = "first call (includes compiling)" if on_gpu else "first call"
    print(f"  {first_label}: {first * 1e3:.1f} ms; "
          f"median of the next: {numpy.median(times) * 1e3:.2f} ms")
    print(f"  relative error vs float64 reference: {err:.2e} (tolerance {tol:.0e})")
    ok = err <= tol and bool(numpy.isfinite(out_host.astype(numpy.float64)).all())
    print("  check: " + ("PASSED" if ok else "FAILED"))
    if not on_gpu:
        print("  (no GPU: `python -m natten_cupy demo --check` lists what this install can use)")
    return 0 if ok else 1


# ---- demo --check ---------------------------------------------------------------------------

def _check_one(name, mod, on_gpu, q64, k64, v64, ref, kernel):
    """(arrays, dtype, result text, passed or None when not run) of one backend."""
    gpu_backend = name != "reference"
    if gpu_backend and not on_gpu:
        return "cupy", "-", "not run: needs a CUDA GPU", None
    xp_name = "cupy" if on_gpu else "numpy"
    dtype = numpy.float16 if on_gpu else numpy.float32
    q_probe = numpy.empty(q64.shape, dtype)
    problem = check_fused(2, q_probe, q_probe, q_probe, kernel, 1, 1, False, None, name)
    fused_why = mod.refuse("fused_forward", problem)
    unfused_why = mod.refuse("qk", problem) or mod.refuse("av", problem)
    if fused_why and unfused_why:
        return xp_name, numpy.dtype(dtype).name, f"not run: {fused_why}", None
    if on_gpu:
        import cupy
        q, k, v = (cupy.asarray(x.astype(dtype)) for x in (q64, k64, v64))
    else:
        q, k, v = (x.astype(dtype) for x in (q64, k64, v64))
    from . import na2d_av, na2d_qk, softmax
    try:
        t0 = time.perf_counter()
        if fused_why is None:
            out, what = na2d(q, k, v, kernel, backend=name), "na2d"
        else:
            attn = na2d_qk(q, k, kernel, backend=name)
            out = na2d_av(softmax(attn, q.shape[-1] ** -0.5), v, kernel, backend=name)
            what = "na2d_qk/softmax/na2d_av"
        host = out.get() if on_gpu else out
        ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # reported in the table, not raised: the point is the report
        return xp_name, numpy.dtype(dtype).name, f"FAILED: {type(e).__name__}: {e}", False
    err = _relative_error(host, ref)
    tol = 1e-2 if dtype == numpy.float16 else 1e-5
    passed = err <= tol and bool(numpy.isfinite(numpy.asarray(host, numpy.float64)).all())
    verdict = "ok" if passed else "FAILED"
    return (xp_name, numpy.dtype(dtype).name,
            f"{verdict}: {what}, rel. error {err:.1e} (tol {tol:.0e}), "
            f"{ms:.0f} ms" + (" incl. compile" if on_gpu else ""), passed)


def _torch_check(ref64, q64, k64, v64, kernel, on_gpu):
    try:
        import torch
    except ImportError:
        return "not installed (pip install 'natten_cupy[torch]')", None
    try:
        from .torch import na2d as torch_na2d
        device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
        dtype = torch.float16 if device == "cuda" else torch.float32
        q, k, v = (torch.tensor(x, dtype=dtype, device=device, requires_grad=True)
                   for x in (q64, k64, v64))
        out = torch_na2d(q, k, v, kernel_size=kernel)
        out.float().sum().backward()
        err = _relative_error(out.detach().float().cpu().numpy(), ref64)
    except Exception as e:
        return f"FAILED: {type(e).__name__}: {e}", False
    tol = 1e-2 if dtype == torch.float16 else 1e-5
    passed = err <= tol
    return (f"{'ok' if passed else 'FAILED'}: natten_cupy.torch.na2d on {device} "
            f"{str(dtype).replace('torch.', '')} with backward, rel. error {err:.1e}", passed)


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])


def check(kernel=KERNEL, size=CHECK_SIZE, seed=0):
    """Print the environment and run every backend once; 0 when every backend that ran passed."""
    from .backends import NAMES, get_backend
    reason = gpu_unavailable_reason()
    on_gpu = reason is None
    print("natten_cupy environment and backend check (paste this into a bug report)\n")
    print(_table(("item", "value"), _env.environment()))
    rng = numpy.random.default_rng(seed)
    shape = (1, size, size, 2, 32)
    q64, k64, v64 = (rng.standard_normal(shape) for _ in range(3))
    ref = na2d(q64, k64, v64, kernel, backend="reference")
    rows, failed = [], 0
    for name in NAMES:
        mod = get_backend(name)
        if mod is None:
            rows.append((name, "-", "-", "not available in this install"))
            continue
        arrays, dtype, text, passed = _check_one(name, mod, on_gpu, q64, k64, v64, ref, kernel)
        failed += passed is False
        rows.append((name, arrays, dtype, text))
    torch_text, torch_passed = _torch_check(ref, q64, k64, v64, kernel, on_gpu)
    failed += torch_passed is False
    rows.append(("torch layer", "torch", "-", torch_text))
    print(f"\nBackends on na2d q/k/v {shape}, kernel {kernel}x{kernel}, against the float64 "
          "reference:\n")
    print(_table(("backend", "arrays", "dtype", "result"), rows))
    if not on_gpu:
        print(f"\nNo GPU: {reason}. The CUDA backends were not run; NumPy arrays use the "
              "reference backend.")
    print("\ncheck: " + ("PASSED" if not failed else f"FAILED ({failed} failed)"))
    return 1 if failed else 0


def make_parser():
    parser = argparse.ArgumentParser(
        prog="python -m natten_cupy",
        description="natten_cupy's command line: a demo and an install check.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "demo", help="run na2d on a realistic problem and check it against the reference",
        description="Run na2d once (GPU when there is one, NumPy otherwise), check it against "
                    "the float64 reference and print the backend and timings. With --check: "
                    "versions, GPU, and every backend run once (a bug-report table).")
    d.add_argument("--size", type=int, default=None,
                   help=f"grid side of the demo problem (default {SIZE['gpu']} GPU, "
                        f"{SIZE['cpu']} CPU; {CHECK_SIZE} with --check)")
    d.add_argument("--kernel", type=int, default=KERNEL, help="kernel size per axis (default %(default)s)")
    d.add_argument("--check", action="store_true",
                   help="print versions and the GPU, run every backend once against the "
                        "reference, print a table for bug reports")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    try:
        if args.command == "demo" and args.check:
            return check(kernel=args.kernel, size=args.size or CHECK_SIZE)
        if args.command == "demo":
            return demo(size=args.size, kernel=args.kernel)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if _env.is_no_gpu_error(e):
            print(f"error: {_env.no_gpu_message('the demo')}", file=sys.stderr)
            return 2
        raise
    return 2


if __name__ == "__main__":
    sys.exit(main())
