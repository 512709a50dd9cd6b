"""Backends: each module runs the six operations on NumPy or CuPy arrays.

A backend module provides

* ``NAME`` and ``DTYPES`` (the canonical dtypes it accepts);
* ``refuse(op, problem) -> str | None``: why it cannot run ``op`` on ``problem`` (None if
  it can); ``op`` is one of OPS;
* ``fused_forward(problem, q, k, v, out, lse)``,
  ``fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv)``,
  ``qk(problem, q, k, rpb, attn)``, ``av(problem, attn, v, out)``,
  ``qk_backward(problem, d_attn, q, k, dq, dk, d_rpb)`` (d_rpb, when not None, is zeroed
  float32/float64 and accumulated into), ``av_backward(problem, d_out, attn, v, d_attn, dv)``:
  outputs are preallocated and every element must be written;
* ``instantiations() -> list[(source, name_expression)]``: every kernel it may compile
  (GPU backends), for the GPU-free compile test.

A backend whose launches are planned (tiled, fused) also provides ``plan(op, problem,
layouts) -> Plan | None`` (the ``_launch.Plan`` for the operands' layouts, in the order of
its docstring; None where it plans nothing for them) and ``ROW_INPUTS[op]`` (the inputs its
kernels read by 16-byte rows); fused adds ``tuned(op, problem)`` (an autotuned problem with its
timed winner as tile) and ``runs_extra(op, problem)`` (whether its kernels take the additional
tokens). The fast path reaches ``plan``, ``ROW_INPUTS`` and ``tuned`` through the
``Selection`` that ``_selection.select_backend`` returns.
"""

from __future__ import annotations

import importlib

__all__ = ["OPS", "NAMES", "PREFERENCE", "get_backend"]

OPS = ("fused_forward", "fused_backward", "qk", "av", "qk_backward", "av_backward")
NAMES = ("reference", "naive", "tiled", "fused")

# Fastest first, by measurement (bench/results/); "auto" takes the first that accepts.
PREFERENCE = {
    "fused_forward": ("fused", "naive", "reference"),
    "fused_backward": ("fused", "naive", "reference"),
    "qk": ("tiled", "naive", "reference"),
    "av": ("tiled", "naive", "reference"),
    "qk_backward": ("tiled", "naive", "reference"),
    "av_backward": ("tiled", "naive", "reference"),
}

_cache = {}


def get_backend(name):
    """The backend module called ``name``, or None if this install lacks it."""
    if name not in _cache:
        try:
            _cache[name] = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            _cache[name] = None
    return _cache[name]
