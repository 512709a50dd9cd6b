"""Fused backend: flash-style NA on tensor cores (no attention matrix in memory).

This module only dispatches; the kernels' launchers live in three parts:

* ``_fused_fwd``: forward on tensor cores (float16, bfloat16; float32 as TF32 when the
  caller allows it);
* ``_fused_bwd``: backward on tensor cores (same dtypes);
* ``_fused_fp32``: exact-float32 forward and backward (tiled FMA, no TF32).

Each part provides ``refuse(problem) -> str | None``, ``forward``/``backward`` (whichever it
implements) and ``instantiations()``.
"""

from __future__ import annotations

import importlib

from .._dtypes import FLOAT32, HALF_TYPES

NAME = "fused"
DTYPES = HALF_TYPES + (FLOAT32,)


def _part(name):
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.{name}":
            raise
        return None


def _parts_for(op, problem):
    exact_fp32 = problem.dtype == FLOAT32 and not problem.allow_tf32
    if exact_fp32:
        return "_fused_fp32"
    return "_fused_fwd" if op == "fused_forward" else "_fused_bwd"


def refuse(op, problem):
    if op not in ("fused_forward", "fused_backward"):
        return "the fused backend runs only the fused ops (use tiled or naive for qk/av)"
    if problem.dtype not in DTYPES:
        return f"dtype {problem.dtype_name} is not supported (float16, bfloat16, float32)"
    name = _parts_for(op, problem)
    part = _part(name)
    if part is None:
        return f"{name} is not built yet"
    return part.refuse(problem)


def fused_forward(problem, q, k, v, out, lse):
    _part(_parts_for("fused_forward", problem)).forward(problem, q, k, v, out, lse)


def fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv):
    _part(_parts_for("fused_backward", problem)).backward(
        problem, q, k, v, out, lse, d_out, dq, dk, dv)


def _unsupported(*_args, **_kwargs):
    raise NotImplementedError("the fused backend runs only the fused ops")


qk = av = qk_backward = av_backward = _unsupported


def instantiations():
    out = []
    for name in ("_fused_fwd", "_fused_bwd", "_fused_fp32"):
        part = _part(name)
        if part is not None:
            out += list(part.instantiations())
    return out
