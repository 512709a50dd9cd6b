"""Softmax over the neighbor axis of unfused attention weights, and its backward.

The step between ``na*d_qk`` and ``na*d_av``: ``softmax(attn, scale)`` turns the logits
``[..., K]`` into probabilities (``-inf`` slots, the empty places of causal windows, become 0),
``softmax_backward(probs, d_probs, scale)`` gives the logits' gradient. On CUDA arrays each is
one kernel (``cuda_src/na_softmax.cu``) reading the weights once or twice and writing them once,
accumulating in float32 (float64 for float64); on NumPy arrays the same math runs on the CPU.
A generic array-library softmax takes about eight passes over float32 copies of the weights,
which on the unfused chain of a 1024 x 1024 image cost more than the NA kernels themselves.
"""

from __future__ import annotations

import numpy

from ._args import _check_array, _check_dtype, _check_same, _check_scale, _shape_text
from ._arrays import Inputs
from ._compile import get_kernel
from ._dtypes import accumulator_dtype, c_type, DTYPE_NAMES
from ._launch import launch
from ._operands import is_aligned

__all__ = ["softmax", "softmax_backward", "instantiations"]

SOURCE = "na_softmax.cu"
BLOCK = 256
MAX_CTAS = 16384
# softmax::SoftmaxArgs of na_softmax.cu, field for field (every softmax kernel's launch
# arguments besides its pointers).
SOFTMAX_ARGS = numpy.dtype([("rows", numpy.int64), ("scale", numpy.float64),
                            ("slots", numpy.int32), ("lanes", numpy.int32)], align=True)


def _check_weights(name, x):
    _check_array(name, x)
    _check_dtype(name, x)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last (neighbor) axis, got shape "
                         f"{_shape_text(x.shape)}")


def softmax(attn, scale=1.0):
    """Softmax of ``scale * attn`` over the last axis (the K neighbors of ``na*d_qk``);
    ``scale=None`` means 1.

    ``-inf`` entries (empty causal slots) get probability 0. Returns a new array of attn's
    type, dtype and shape; attn is not modified. float32 accumulation (float64 for float64).
    """
    _check_weights("attn", attn)
    scale = _check_scale(scale, 1)   # None: 1
    ins = Inputs.gather([("attn", attn)])
    with ins.on_device():
        (x,) = ins.arrays
        out = _forward(ins.xp, x, scale)
    return ins.give_back(out)


def softmax_backward(probs, d_probs, scale=1.0):
    """Gradient of ``softmax(attn, scale)`` with respect to attn, from its result ``probs``
    and the gradient ``d_probs``: ``scale * probs * (d_probs - sum(probs * d_probs))`` over
    the last axis. Returns a new array; the inputs are not modified."""
    _check_weights("probs", probs)
    _check_weights("d_probs", d_probs)
    _check_same("d_probs", d_probs, "probs", probs)
    scale = _check_scale(scale, 1)
    ins = Inputs.gather([("probs", probs), ("d_probs", d_probs)])
    with ins.on_device():
        p, dp = ins.arrays
        out = _backward(ins.xp, p, dp, scale)
    return ins.give_back(out)


# ---- CPU (NumPy) ---------------------------------------------------------------------------

def reference_forward(xp, x, scale):
    """Softmax in the accumulator dtype with array ops (NumPy or CuPy), cast back."""
    acc = accumulator_dtype(x.dtype)
    a = x.astype(acc) * acc.type(scale)
    m = a.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)        # an all -inf row gives zeros, not NaN
    e = xp.exp(a - m)
    s = e.sum(axis=-1, keepdims=True)
    return (e / xp.where(s > 0, s, 1)).astype(x.dtype)


def reference_backward(xp, p, dp, scale):
    acc = accumulator_dtype(p.dtype)
    pa, da = p.astype(acc), dp.astype(acc)
    dot = (pa * da).sum(axis=-1, keepdims=True)
    return (acc.type(scale) * pa * (da - dot)).astype(p.dtype)


# ---- GPU ---------------------------------------------------------------------------------

REGISTER_SLOTS = (4, 8)   # slots per lane of a row held in registers (V); 0: streamed
# float64 rows of 8 slots a lane spill (double exp's slow path): they stream instead.
FLOAT64_SLOTS = (4,)


# Lanes per row: about one per this many slots, by direction (NOTES-tiled.md, "Constants").
SLOTS_PER_LANE = {"forward": 8, "backward": 4}


def lanes_per_row(k, direction="forward"):
    """Lanes that share one row: a power of two, about one per SLOTS_PER_LANE[direction]
    slots, at most a warp."""
    g = 1
    while g < 32 and SLOTS_PER_LANE[direction] * g < k:
        g *= 2
    return g


def _slot_choices(c_t):
    return FLOAT64_SLOTS if c_t == "double" else REGISTER_SLOTS


def slots_per_lane(k, c_t="float", direction="forward"):
    """V of the kernels: the register-held row size a row of k slots fits, or 0 (streamed)."""
    g = lanes_per_row(k, direction)
    return next((v for v in _slot_choices(c_t) if g * v >= k), 0)


def _softmax_args(rows, k, lanes, scale):
    """The SoftmaxArgs scalar of one launch."""
    a = numpy.zeros((), SOFTMAX_ARGS)[()]
    a["rows"], a["scale"], a["slots"], a["lanes"] = rows, scale, k, lanes
    return a


def _launch(direction, c_t, args, rows, k, scale):
    g = lanes_per_row(k, direction)
    v = slots_per_lane(k, c_t, direction)
    expr = f"natten::softmax::na_softmax_{direction}<{c_t}, {v}>"
    ctas = max(1, min(MAX_CTAS, -(-rows // (BLOCK // g))))
    launch(get_kernel(SOURCE, expr), (ctas,), (BLOCK,), (*args, _softmax_args(rows, k, g, scale)),
           name=expr, backend="softmax")


# Rows whose 32-row tiles (one array forward, two backward) take at most this many bytes of
# shared memory a warp run one lane a row (na_softmax_rows_*), when the arrays are 16-byte
# aligned; larger tiles cost CTAs per SM (NOTES-tiled.md, "Constants").
ROW_TILE_BYTES = 12288
ROW_WARPS = 4                # kRowWarps in na_softmax.cu


def use_row_kernels(k, itemsize, tiles, *arrays):
    """Whether rows of k slots run the one-lane-a-row kernels (``tiles``: 32-row tiles a warp
    stages, 1 forward, 2 backward)."""
    return (32 * k * itemsize * tiles <= ROW_TILE_BYTES
            and all(is_aligned(a) for a in arrays))


def _launch_rows(direction, c_t, args, rows, k, itemsize, scale):
    expr = f"natten::softmax::na_softmax_rows_{direction}<{c_t}>"
    chunks = -(-rows // 32)
    ctas = max(1, min(MAX_CTAS, -(-chunks // ROW_WARPS)))
    tiles = 1 if direction == "forward" else 2
    launch(get_kernel(SOURCE, expr), (ctas,), (32 * ROW_WARPS,),
           (*args, _softmax_args(rows, k, 1, scale)),
           shared_mem=ROW_WARPS * tiles * 32 * k * itemsize, name=expr, backend="softmax")


def _forward(xp, x, scale):
    if xp is numpy:
        return reference_forward(numpy, x, scale)
    x = xp.ascontiguousarray(x)
    out = xp.empty(x.shape, dtype=x.dtype)
    k = x.shape[-1]
    rows = x.size // k
    if rows and use_row_kernels(k, x.itemsize, 1, x, out):
        _launch_rows("forward", c_type(x.dtype), (x, out), rows, k, x.itemsize, scale)
    elif rows:
        _launch("forward", c_type(x.dtype), (x, out), rows, k, scale)
    return out


def _backward(xp, p, dp, scale):
    if xp is numpy:
        return reference_backward(numpy, p, dp, scale)
    p, dp = xp.ascontiguousarray(p), xp.ascontiguousarray(dp)
    out = xp.empty(p.shape, dtype=p.dtype)
    k = p.shape[-1]
    rows = p.size // k
    if rows and use_row_kernels(k, p.itemsize, 2, p, dp, out):
        _launch_rows("backward", c_type(p.dtype), (p, dp, out), rows, k, p.itemsize, scale)
    elif rows:
        _launch("backward", c_type(p.dtype), (p, dp, out), rows, k, scale)
    return out


def instantiations():
    """Every (source, name_expression) of the softmax kernels."""
    return ([(SOURCE, f"natten::softmax::na_softmax_{d}<{c_type(t)}, {v}>")
             for d in ("forward", "backward") for t in DTYPE_NAMES
             for v in _slot_choices(c_type(t)) + (0,)]
            + [(SOURCE, f"natten::softmax::na_softmax_rows_{d}<{c_type(t)}>")
               for d in ("forward", "backward") for t in DTYPE_NAMES])
