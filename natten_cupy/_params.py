"""The kernels' launch-argument struct, ``NAParams`` of ``cuda_src/natten/common.cuh``.

One NumPy structured scalar, passed by value to every kernel: CuPy hands a ``numpy.void``
of an aligned structured dtype to the kernel as the struct of the same layout. Field order
and types here must match the C++ struct exactly.

The softmax scale travels twice: rounded to float32 (``scale``, what the float32, float16
and bfloat16 kernels compute with) and as the caller's float64 (``scale_f64``, what the
float64 kernels compute with, so that float64 results do not carry float32's rounding).

Grouped-query attention: k, v, dk, dv have ``kv_heads`` heads; query head h reads kv head
``h / heads_per_kv``. ``v_dim``: the head dim of v, out and their gradients in the fused ops
(``head_dim``, that of q and k, unless the caller's values have their own).

Additional tokens (the fused ops' ``additional_keys`` / ``additional_values``, attended by
every query): ``extra_tokens`` of them in ``extra_heads`` heads, query head h reading extra
head ``h / heads_per_extra``; their arrays xk, xv (and gradients dxk, dxv) are ``[B, T, H_x,
D]``, with strides laid out as (batch, token, 0, 0, head, last). These fields come last, so
that the fields before them keep their offsets.
"""

from __future__ import annotations

import numpy

__all__ = ["PARAMS_DTYPE", "TENSOR_FIELDS", "EXTRA_FIELDS", "make_params", "element_strides"]

_I64 = numpy.int64
TENSOR_FIELDS = ("q", "k", "v", "o", "d_o", "dq", "dk", "dv",
                 "lse", "delta", "attn", "d_attn", "rpb", "d_rpb")
EXTRA_FIELDS = ("xk", "xv", "dxk", "dxv")

PARAMS_DTYPE = numpy.dtype(
    [(name, _I64, (3,)) for name in ("extent", "kernel", "stride", "dilation", "causal")]
    + [(name, _I64) for name in ("batch", "heads", "head_dim", "num_neighbors", "kv_heads",
                                 "heads_per_kv", "v_dim")]
    + [(name, _I64, (6,)) for name in TENSOR_FIELDS]
    + [("scale", numpy.float32), ("pad_", numpy.float32), ("scale_f64", numpy.float64)]
    + [(name, _I64) for name in ("extra_tokens", "extra_heads", "heads_per_extra")]
    + [(name, _I64, (6,)) for name in EXTRA_FIELDS],
    align=True)


def element_strides(x):
    """Strides of an array in elements (CuPy/NumPy report bytes)."""
    item = x.dtype.itemsize
    return tuple(int(s) // item for s in x.strides)


def _canonical6(x, rank, kind):
    """Strides over (batch, axis0, axis1, axis2, head, last) with inert axes at 0.

    ``kind`` is "full" for [B, *spatial, H, last] arrays, "lse" for [B, *spatial, H], and
    "rpb" for [H, r_0, ..., r_{n-1}] (laid out as (head, r0, r1, r2, 0, 0)), and "extra"
    for [B, T, H_x, last] (laid out as (batch, token, 0, 0, head, last)).
    """
    st = element_strides(x)
    out = [0] * 6
    if kind == "extra":
        out[0], out[1], out[4], out[5] = st
        return out
    out[0] = st[0]
    for a in range(rank):
        out[1 + a] = st[1 + a]
    if kind == "rpb":
        return out
    out[4] = st[1 + rank]
    if kind == "full":
        out[5] = st[2 + rank]
    return out


_KIND = {"lse": "lse", "delta": "lse", "rpb": "rpb", "d_rpb": "rpb",
         **{name: "extra" for name in EXTRA_FIELDS}}


def make_params(problem, **tensors):
    """Pack a problem and the strides of the named tensors into one NAParams scalar.

    Keyword names are those of TENSOR_FIELDS; a tensor given as None keeps zero strides.
    """
    p = numpy.zeros((), dtype=PARAMS_DTYPE)
    n = problem.rank
    pad = 3 - n
    p["extent"] = list(problem.spatial) + [1] * pad
    p["kernel"] = list(problem.kernel_size) + [1] * pad
    p["stride"] = list(problem.stride) + [1] * pad
    p["dilation"] = list(problem.dilation) + [1] * pad
    p["causal"] = [int(c) for c in problem.is_causal] + [0] * pad
    p["batch"] = problem.batch
    p["heads"] = problem.heads
    p["head_dim"] = problem.head_dim
    p["num_neighbors"] = problem.num_neighbors
    p["kv_heads"] = problem.kv_heads
    p["heads_per_kv"] = problem.heads_per_kv
    p["v_dim"] = problem.v_dim
    p["scale"] = numpy.float32(problem.scale)
    p["scale_f64"] = numpy.float64(problem.scale)
    p["extra_tokens"] = problem.extra_tokens
    p["extra_heads"] = problem.extra_heads
    p["heads_per_extra"] = problem.heads_per_extra
    for name, x in tensors.items():
        if name not in TENSOR_FIELDS and name not in EXTRA_FIELDS:
            raise KeyError(f"unknown tensor field {name!r}")
        if x is not None:
            p[name] = _canonical6(x, n, _KIND.get(name, "full"))
    return p[()]
