"""Profile one neighborhood-attention problem kernel by kernel, from the command line:
``python -m natten_cupy.profile_cli`` (installed as the ``natten-cupy-profile`` command).

Builds random inputs for the problem the flags describe, warms up, then runs the forward (and
with ``--backprop`` the backward) once inside ``natten_cupy.profile()`` and prints each
kernel's time next to the time measured around the whole call, with useful TFLOP/s and the
fraction of the floor reached (see ``natten_cupy.profiler``). ``--dry-run`` needs no GPU: it
lists which backends can run the problem and why the others cannot.

The module is not named ``profile``: ``natten_cupy.profile`` is the context-manager function
of the package, and a submodule of that name would replace it once imported.
"""

from __future__ import annotations

import argparse
import sys
import types

import numpy

from . import _args, _env
from .backends import NAMES, PREFERENCE, get_backend
from ._softmax import softmax, softmax_backward
from .profiler import Profiler, flops, floor_ms

__all__ = ["main", "parse_args", "build_problem", "dry_run", "unfused_forward",
           "unfused_backward", "DTYPE_ALIASES"]

DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "float64": "float64", "double": "float64",
}

FUSED_OPS = ("fused_forward", "fused_backward")
UNFUSED_OPS = ("qk", "av", "qk_backward", "av_backward")


# ---- the problem -------------------------------------------------------------------------

class _Shape:
    """Stands in for an array in argument validation: shape, dtype and ndim only."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = tuple(shape), numpy.dtype(dtype), len(shape)


def _bool(text):
    t = str(text).strip().lower()
    if t in ("1", "true", "t", "yes", "y"):
        return True
    if t in ("0", "false", "f", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false/1/0), got {text!r}")


def _per_axis(name, values, rank, default):
    if values is None:
        return (default,) * rank
    if len(values) == 1:
        return tuple(values) * rank
    if len(values) != rank:
        raise SystemExit(f"error: {name} takes 1 or {rank} values for a {rank}-D input size, "
                         f"got {len(values)}")
    return tuple(values)


def make_parser():
    p = argparse.ArgumentParser(
        prog="natten-cupy-profile",
        description="Profile natten_cupy's kernels on one neighborhood-attention problem "
                    "(needs a CUDA GPU; --dry-run does not).",
        epilog="example: natten-cupy-profile -i 1024 1024 -k 9 -n 8 -d 32 --dtype fp16 "
               "--backprop\n")
    p.add_argument("-i", "--input-size", type=int, nargs="+", required=True, metavar="L",
                   help="spatial extents, 1 to 3 values (sets the rank: 1-D, 2-D or 3-D; "
                        "required)")
    p.add_argument("-b", "--batch-size", type=int, default=1,
                   help="batch size B (default %(default)s)")
    p.add_argument("-n", "--heads", type=int, default=1,
                   help="number of heads H (default %(default)s)")
    p.add_argument("-d", "--dim", type=int, default=64,
                   help="head dim D (default %(default)s)")
    p.add_argument("-k", "--kernel-size", type=int, nargs="+", required=True,
                   help="kernel size, one value or one per axis (required)")
    p.add_argument("-s", "--stride", type=int, nargs="+", default=None,
                   help="stride, one value or one per axis (default 1)")
    p.add_argument("--dilation", type=int, nargs="+", default=None,
                   help="dilation, one value or one per axis (default 1)")
    p.add_argument("-c", "--causal", type=_bool, nargs="*", default=None,
                   help="causal masking: alone means every axis, else one bool per axis "
                        "(e.g. -c true false; default not causal)")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_ALIASES),
                   metavar="DTYPE", help="element type: " + ", ".join(sorted(DTYPE_ALIASES))
                   + " (default %(default)s)")
    p.add_argument("--backprop", action="store_true",
                   help="also profile the backward (default: forward only)")
    p.add_argument("--backend", default="auto", choices=("auto",) + NAMES,
                   help="backend to run: " + ", ".join(("auto",) + NAMES)
                   + " (default %(default)s: the fastest that accepts the problem)")
    p.add_argument("--unfused", action="store_true",
                   help="run the unfused chain qk -> softmax -> av (and its backward) "
                        "instead of the fused op (default: the fused op)")
    p.add_argument("--tile", type=int, nargs="+", default=None,
                   help="tile config passed to the fused backends, the CTA query box per "
                        "axis (default: the backend's choice)")
    p.add_argument("--warmup-steps", type=int, default=10,
                   help="untimed runs before the profiled one, at least 1 (compiles the "
                        "kernels; default %(default)s)")
    p.add_argument("--allow-tf32", action="store_true",
                   help="let float32 inputs use TF32 tensor cores (default: exact float32)")
    p.add_argument("--dry-run", action="store_true",
                   help="only list the backends that can run the problem and why the "
                        "others cannot (no GPU needed)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random inputs (default %(default)s)")
    return p


def parse_args(argv=None):
    args = make_parser().parse_args(argv)
    rank = len(args.input_size)
    if not 1 <= rank <= 3:
        raise SystemExit(f"error: --input-size takes 1 to 3 extents, got {len(args.input_size)}")
    args.rank = rank
    args.kernel_size = _per_axis("--kernel-size", args.kernel_size, rank, None)
    args.stride = _per_axis("--stride", args.stride, rank, 1)
    args.dilation = _per_axis("--dilation", args.dilation, rank, 1)
    if args.causal is not None and len(args.causal) == 0:
        args.causal = [True]
    args.causal = _per_axis("--causal", args.causal, rank, False)
    args.dtype = DTYPE_ALIASES[args.dtype]
    args.tile = None if args.tile is None else tuple(args.tile)
    if args.unfused and any(s != 1 for s in args.stride):
        raise SystemExit("error: --unfused runs the unfused ops, which take stride 1 only")
    return args


def build_problem(args):
    """The NAProblem of the flags, validated like a real call (ValueError on bad values)."""
    from ._dtypes import DTYPE_NAMES
    dtype = {v: k for k, v in DTYPE_NAMES.items()}[args.dtype]
    shape = (args.batch_size, *args.input_size, args.heads, args.dim)
    q = _Shape(shape, dtype)
    return _args.check_fused(args.rank, q, q, q, args.kernel_size, args.stride, args.dilation,
                             args.causal, None, args.backend, args.allow_tf32, False, args.tile)


def ops_of(args):
    if args.unfused:
        return UNFUSED_OPS if args.backprop else ("qk", "av")
    return FUSED_OPS if args.backprop else ("fused_forward",)


def cost(problem, backward):
    """(useful FLOPs, floor ms) of the forward or the backward of ``problem``."""
    shape = (problem.batch, problem.num_tokens, problem.heads, problem.num_neighbors,
             problem.head_dim)
    return (flops(*shape, backward=backward),
            floor_ms(*shape, problem.dtype_name, backward=backward,
                     allow_tf32=problem.allow_tf32))


# ---- dry run -----------------------------------------------------------------------------

def backend_verdicts(problem, ops):
    """[(backend name, None or why it cannot run)] for every known backend."""
    out = []
    for name in NAMES:
        mod = get_backend(name)
        if mod is None:
            out.append((name, "not available in this install"))
            continue
        why = [f"{op}: {r}" for op in ops for r in [mod.refuse(op, problem)] if r is not None]
        out.append((name, "; ".join(why) or None))
    return out


def auto_choice(problem, ops):
    """Backend that 'auto' picks for each op on a GPU (None where no backend accepts)."""
    picks = {}
    for op in ops:
        picks[op] = None
        for name in PREFERENCE[op]:
            mod = get_backend(name)
            if mod is not None and mod.refuse(op, problem) is None:
                picks[op] = name
                break
    return picks


def _describe(problem, args):
    from rich.table import Table
    t = Table(title="problem", show_header=False)
    t.add_column("field")
    t.add_column("value")
    rows = [("shape [B, *spatial, H, D]",
             f"[{problem.batch}, {', '.join(map(str, problem.spatial))}, {problem.heads}, "
             f"{problem.head_dim}]"),
            ("kernel / stride / dilation", f"{problem.kernel_size} / {problem.stride} / "
                                            f"{problem.dilation}"),
            ("causal", str(problem.is_causal)),
            ("dtype", problem.dtype_name + (" (TF32 allowed)" if problem.allow_tf32 else "")),
            ("path", "unfused qk -> softmax -> av" if args.unfused else "fused")]
    for backward in ((False, True) if args.backprop else (False,)):
        f, fl = cost(problem, backward)
        tag = "backward" if backward else "forward"
        rows.append((f"{tag} useful GFLOP / floor ms", f"{f / 1e9:.4g} / {fl:.4g}"))
    for r in rows:
        t.add_row(*r)
    return t


def dry_run(problem, args, console):
    from rich.table import Table
    ops = ops_of(args)
    console.print(_describe(problem, args))
    t = Table(title="backends")
    t.add_column("backend")
    t.add_column("can run")
    t.add_column("why not")
    verdicts = backend_verdicts(problem, ops)
    for name, why in verdicts:
        t.add_row(name, "yes" if why is None else "no", why or "")
    console.print(t)
    picks = auto_choice(problem, ops)
    console.print("auto picks: " + ", ".join(f"{op} -> {b or 'none'}" for op, b in picks.items()))
    if args.backend != "auto":
        why = dict(verdicts)[args.backend]
        console.print(f"requested backend {args.backend!r}: "
                      + ("can run" if why is None else f"cannot run ({why})"))
    return 0


# ---- the unfused chain (also used by bench/suite.py) --------------------------------------

def unfused_forward(rank, q, k, v, kernel_size, *, dilation=1, is_causal=False, scale=None,
                    backend="auto", allow_tf32=False):
    """out, attn (probabilities) of the chain qk -> softmax -> av (natten_cupy's kernels)."""
    from . import ops
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = ops.qk(rank, q, k, kernel_size, dilation=dilation, is_causal=is_causal,
                    backend=backend, allow_tf32=allow_tf32)
    attn = softmax(logits, scale)
    out = ops.av(rank, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                 backend=backend, allow_tf32=allow_tf32)
    return out, attn


def unfused_backward(rank, d_out, q, k, v, attn, kernel_size, *, dilation=1, is_causal=False,
                     scale=None, backend="auto", allow_tf32=False):
    """dq, dk, dv of the unfused chain, from the probabilities ``attn`` of the forward."""
    from . import ops
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    d_attn, dv = ops.av_backward(rank, d_out, attn, v, kernel_size, dilation=dilation,
                                 is_causal=is_causal, backend=backend, allow_tf32=allow_tf32)
    d_logits = softmax_backward(attn, d_attn, scale)
    dq, dk = ops.qk_backward(rank, d_logits, q, k, kernel_size, dilation=dilation,
                             is_causal=is_causal, backend=backend, allow_tf32=allow_tf32)
    return dq, dk, dv


def random_array(xp, shape, dtype_name, rng_seed):
    """Standard-normal array of ``dtype_name`` (bfloat16 built from float32 bits if need be)."""
    from ._dtypes import BFLOAT16
    try:
        if xp is numpy:
            raise ImportError
        x = xp.random.RandomState(rng_seed).standard_normal(shape, dtype=numpy.float32)
    except ImportError:  # NumPy, or a CuPy install without cuRAND: draw on the host
        host = numpy.random.default_rng(rng_seed).standard_normal(shape, dtype=numpy.float32)
        x = host if xp is numpy else xp.asarray(host)
    if dtype_name != "bfloat16":
        return x.astype(dtype_name)
    try:
        return x.astype(BFLOAT16)
    except Exception:  # CuPy builds without bfloat16 arithmetic: round the float32 bits
        bits = x.view(numpy.uint32)
        rounded = (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16
        return rounded.astype(numpy.uint16).view(BFLOAT16)


# ---- the real run ------------------------------------------------------------------------

def _runner(args, problem):
    """(forward, backward) callables on fresh random CuPy inputs."""
    import cupy
    shape = (problem.batch, *problem.spatial, problem.heads, problem.head_dim)
    q, k, v, d_out = (random_array(cupy, shape, problem.dtype_name, args.seed + i)
                      for i in range(4))
    common = dict(dilation=problem.dilation, is_causal=problem.is_causal,
                  backend=args.backend, allow_tf32=problem.allow_tf32)
    state = {}
    from . import ops
    if args.unfused:
        def forward():
            state["out"], state["attn"] = unfused_forward(problem.rank, q, k, v,
                                                          problem.kernel_size, **common)

        def backward():
            return unfused_backward(problem.rank, d_out, q, k, v, state["attn"],
                                    problem.kernel_size, **common)
    else:
        common.update(stride=problem.stride, tile=problem.tile)

        def forward():
            state["out"], state["lse"] = ops.fused_forward(
                problem.rank, q, k, v, problem.kernel_size, return_lse=True, **common)

        def backward():
            return ops.fused_backward(problem.rank, d_out, q, k, v, state["out"],
                                      state["lse"], problem.kernel_size, **common)
    return forward, backward


def _profile_phase(fn):
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    with Profiler() as prof:
        start.record()
        fn()
        stop.record()
    stop.synchronize()
    return prof, cupy.cuda.get_elapsed_time(start, stop)


def profile_run(problem, args, console):
    import cupy
    forward, backward = _runner(args, problem)
    for _ in range(max(args.warmup_steps, 1)):  # one call at least: compile outside the timing
        forward()
        if args.backprop:
            backward()
    cupy.cuda.get_current_stream().synchronize()
    console.print(_describe(problem, args))
    phases = [("forward", forward, False)] + ([("backward", backward, True)]
                                              if args.backprop else [])
    total_kernels = total_measured = 0.0
    for tag, fn, is_bwd in phases:
        prof, measured = _profile_phase(fn)
        f, fl = cost(problem, is_bwd)
        console.print(prof.table(flops=f, floor_ms=fl, measured_ms=measured,
                                 title=f"{tag}: kernels ({args.backend} backend)"))
        total_kernels += prof.total_ms
        total_measured += measured
    gap = abs(total_measured - total_kernels) / total_measured if total_measured > 0 else 0.0
    console.print(f"kernels sum to {total_kernels:.4f} ms of {total_measured:.4f} ms measured "
                  f"({100 * gap:.1f}% apart)")
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        from rich.console import Console
    except ImportError:
        print("error: the profiler prints its tables with rich: pip install rich "
              "(or the package's [bench] extra)", file=sys.stderr)
        return 2
    console = Console()
    try:
        problem = build_problem(args)
    except (ValueError, TypeError) as e:
        console.print(f"[red]invalid problem:[/red] {e}")
        return 2
    if args.dry_run:
        return dry_run(problem, args, console)
    refused = [why for name, why in backend_verdicts(problem, ops_of(args))
               if name == args.backend and why]
    if refused:
        console.print(f"[red]backend {args.backend!r} cannot run this:[/red] {refused[0]}"
                      + ("" if args.unfused else " (the unfused ops need --unfused)"))
        return 2
    hint = "`--dry-run` lists the backends that can run the problem without one."
    try:
        # Asked before any CUDA call (a driverless machine can hang on some). A stand-in for
        # CuPy that is not a module (tests/unit/test_profiler.py runs the flow on NumPy) is
        # taken at its word.
        if isinstance(sys.modules.get("cupy", sys), types.ModuleType):
            _env.require_gpu("profiling (kernels are timed on the GPU, the reference "
                             "backend's too)", hint)
        return profile_run(problem, args, console)
    except Exception as e:
        if not _env.is_no_gpu_error(e):
            raise
        msg = str(e) if isinstance(e, _env.NoGPUError) else _env.no_gpu_message("profiling",
                                                                              hint=hint)
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
