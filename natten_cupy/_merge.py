"""``merge_attentions`` for NumPy and CuPy arrays (the torch layer has its own, with autograd).

Attention over disjoint key sets, each given by its output and lse, is the attention over
their union: ``lse = log sum_x exp(lse_x)``, ``out = sum_x exp(lse_x - lse) out_x``.
"""

from __future__ import annotations

import numpy

from ._args import not_an_array
from ._arrays import array_module
from ._dtypes import accumulator_dtype, canonical_dtype

__all__ = ["merge_attentions"]


def merge_attentions(outputs, lse_tensors):
    """(out, lse) of attention over the union of disjoint key sets.

    outputs: list of ``[B, *spatial, H, D]`` arrays of one dtype; lse_tensors: the matching
    ``[B, *spatial, H]`` (natural log). NumPy or CuPy arrays; lse comes back float32
    (float64 for float64 outputs), out in the outputs' dtype. For torch tensors with
    gradients use ``natten_cupy.torch.merge_attentions``.
    """
    outputs, lse_tensors = list(outputs), list(lse_tensors)
    if not outputs or len(outputs) != len(lse_tensors):
        raise ValueError(f"merge_attentions needs one lse per output and at least one of each, "
                         f"got {len(outputs)} outputs and {len(lse_tensors)} lse tensors")
    named = [(f"outputs[{i}]", o) for i, o in enumerate(outputs)]
    named += [(f"lse_tensors[{i}]", x) for i, x in enumerate(lse_tensors)]
    for name, x in named:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise not_an_array(name, x)
    xp = array_module(named)
    if any(type(x).__module__.split(".")[0] not in ("numpy", "cupy") for _, x in named):
        raise TypeError("merge_attentions takes NumPy or CuPy arrays; use "
                        "natten_cupy.torch.merge_attentions for torch tensors")
    first = outputs[0]
    dtype = canonical_dtype(first.dtype)
    for i, (o, lse) in enumerate(zip(outputs, lse_tensors)):
        if tuple(o.shape) != tuple(first.shape) or canonical_dtype(o.dtype) != dtype:
            raise ValueError(f"outputs[{i}] is {tuple(o.shape)} {o.dtype}; outputs[0] is "
                             f"{tuple(first.shape)} {first.dtype}")
        if tuple(lse.shape) != tuple(first.shape[:-1]):
            raise ValueError(f"lse_tensors[{i}] shape {tuple(lse.shape)} must be the outputs' "
                             f"shape without the head dim, {tuple(first.shape[:-1])}")
    acc = accumulator_dtype(dtype)
    lses = xp.stack([xp.asarray(x, dtype=acc) for x in lse_tensors])
    top = lses.max(axis=0)
    top = xp.where(xp.isinf(top), xp.zeros_like(top), top)   # rows no set saw: out 0
    weights = xp.exp(lses - top)
    total = weights.sum(axis=0)
    with numpy.errstate(divide="ignore"):
        lse = xp.log(total) + top
    norm = xp.where(total > 0, total, xp.ones_like(total))
    out = sum((w / norm)[..., None] * o.astype(acc) for w, o in zip(weights, outputs))
    return out.astype(dtype), lse.astype(acc)
