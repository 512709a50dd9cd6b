"""Argument normalization and validation (SPEC section 5).

Every public call passes through here first: per-axis options become tuples, array shapes
and dtypes are checked against each other, and the result is a small frozen ``NAProblem``
that the backends, the tile selection and the kernel cache key on. Nothing here touches a
GPU, so every error is raised before any device work.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy

from ._dtypes import DTYPE_NAMES, canonical_dtype

__all__ = ["NAProblem", "normalize_axes", "check_fused", "check_fused_backward",
           "check_qk", "check_av", "check_qk_backward", "check_av_backward",
           "BACKEND_NAMES"]

BACKEND_NAMES = ("auto", "reference", "naive", "tiled", "fused")


@dataclasses.dataclass(frozen=True)
class NAProblem:
    """Shape and options of one neighborhood-attention call (hashable, no arrays)."""

    rank: int
    batch: int
    spatial: tuple      # extents (L_0, ..., L_{n-1})
    heads: int
    head_dim: int
    kernel_size: tuple
    stride: tuple
    dilation: tuple
    is_causal: tuple
    scale: float
    dtype: numpy.dtype
    allow_tf32: bool = False
    deterministic: bool = False
    tile: tuple | str | None = None   # a CTA query box, "autotune", or None (default)
    # Heads of k and v (grouped-query / multi-query attention): query head h reads kv head
    # h // heads_per_kv. None (the default) means as many as the queries.
    kv_heads: int | None = None
    # Head dim of v, out and their gradients (fused ops); None (the default) means head_dim.
    # The unfused ops see only one head dim each (qk: q/k's, av: v's), in head_dim.
    v_dim: int | None = None
    # Whether the fused ops add a relative positional bias rpb [H, 2k-1, ...] to the scores
    # (and the backward returns its gradient).
    has_rpb: bool = False
    # Additional tokens of the fused ops (additional_keys / additional_values [B, T, H_x, D]):
    # every query also attends to these T tokens; query head h reads extra head
    # h // heads_per_extra. 0 and 0: none.
    extra_tokens: int = 0
    extra_heads: int = 0

    def __post_init__(self):
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.v_dim is None:
            object.__setattr__(self, "v_dim", self.head_dim)

    @property
    def heads_per_kv(self):
        """Query heads that share one kv head (1 without GQA; 1 for an empty problem)."""
        return self.heads // self.kv_heads if self.kv_heads else 1

    @property
    def has_extra(self):
        return self.extra_tokens > 0 and self.extra_heads > 0

    @property
    def heads_per_extra(self):
        """Query heads that share one extra head (1 without additional tokens)."""
        return self.heads // self.extra_heads if self.extra_heads else 1

    def without_extra(self):
        """The same problem over the neighborhoods alone."""
        return dataclasses.replace(self, extra_tokens=0, extra_heads=0)

    @property
    def is_gqa(self):
        return self.kv_heads != self.heads

    @property
    def num_neighbors(self):
        """K = prod(kernel_size): slots per query in the unfused attention weights."""
        return math.prod(self.kernel_size)

    @property
    def num_tokens(self):
        return math.prod(self.spatial)

    @property
    def is_empty(self):
        return self.batch == 0 or self.heads == 0

    @property
    def dtype_name(self):
        return DTYPE_NAMES[self.dtype]

    def flops_forward(self):
        """Useful FLOPs of the fused forward (``profiler.flops``: 4 * B * N * H * K * D)."""
        from .profiler import flops
        return flops(self.batch, self.num_tokens, self.heads, self.num_neighbors, self.head_dim)


def _shape_text(shape):
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _layout_text(rank, last="D"):
    axes = ("X", "Y", "Z")[:rank] if rank > 1 else ("L",)
    return "[B, " + ", ".join(axes) + ", H, " + last + "]"


def normalize_axes(name, value, rank, kind):
    """Turn an int (or bool) or a per-axis sequence into a tuple of ``rank`` entries.

    ``kind`` is ``int`` or ``bool``. Raises TypeError for a wrong type and ValueError for a
    wrong number of axes, naming ``name`` and echoing ``value``.
    """
    if kind is bool:
        def ok(x):
            return isinstance(x, (bool, numpy.bool_))
        what = "a bool"
    else:
        def ok(x):
            return isinstance(x, numbers.Integral) and not isinstance(x, (bool, numpy.bool_))
        what = "an int"
    if ok(value):
        return (kind(value),) * rank
    if isinstance(value, (tuple, list)):
        if len(value) != rank:
            raise ValueError(
                f"{name} must have {rank} entr{'y' if rank == 1 else 'ies'} for a {rank}-D call, "
                f"got {value!r}")
        if not all(ok(x) for x in value):
            raise TypeError(f"{name} must be {what} or a tuple of them, got {value!r}")
        return tuple(kind(x) for x in value)
    raise TypeError(f"{name} must be {what} or a tuple of {rank}, got {value!r}")


def not_an_array(name, x):
    """The TypeError for argument ``name`` that is no usable array."""
    return TypeError(f"{name} must be an array (NumPy, CuPy, or a DLPack tensor), "
                     f"got {type(x).__name__}")


def _check_array(name, x):
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise not_an_array(name, x)


def _check_dtype(name, x):
    try:
        return canonical_dtype(x.dtype)
    except TypeError:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: float64, float32, float16, "
                        "bfloat16") from None


def _check_rank(name, x, rank, last="D"):
    if x.ndim != rank + 3:
        raise ValueError(f"{name} must have {rank + 3} dimensions {_layout_text(rank, last)} "
                         f"for a {rank}-D call, got shape {_shape_text(x.shape)}")


def _check_same(name, x, ref_name, ref, shape=None):
    want = tuple(ref.shape) if shape is None else tuple(shape)
    if tuple(x.shape) != want:
        raise ValueError(f"{name} shape {_shape_text(x.shape)} does not match {ref_name} "
                         f"shape {_shape_text(want)}")
    if canonical_dtype(x.dtype) != canonical_dtype(ref.dtype):
        raise ValueError(f"{name} dtype {x.dtype} does not match {ref_name} dtype {ref.dtype}")


def _geometry(rank, shape, kernel_size, stride, dilation, is_causal):
    spatial = tuple(int(s) for s in shape[1:1 + rank])
    heads, head_dim = int(shape[1 + rank]), int(shape[2 + rank])
    if any(s == 0 for s in spatial):
        raise ValueError(f"spatial extents must be positive, got {_shape_text(spatial)}")
    ks = normalize_axes("kernel_size", kernel_size, rank, int)
    st = normalize_axes("stride", stride, rank, int)
    dl = normalize_axes("dilation", dilation, rank, int)
    ca = normalize_axes("is_causal", is_causal, rank, bool)
    if any(k < 2 for k in ks):
        raise ValueError(f"kernel_size must be >= 2 on every axis, got {kernel_size!r}")
    if any(s < 1 or s > k for s, k in zip(st, ks)):
        raise ValueError(f"stride must satisfy 1 <= stride <= kernel_size on every axis, "
                         f"got stride={stride!r} with kernel_size={ks!r}")
    if any(d < 1 for d in dl):
        raise ValueError(f"dilation must be >= 1 on every axis, got {dilation!r}")
    for a, (k, d, L) in enumerate(zip(ks, dl, spatial)):
        if k * d > L:
            raise ValueError(f"kernel_size * dilation must not exceed the extent on every axis: "
                             f"axis {a} has kernel_size {k} * dilation {d} = {k * d} > "
                             f"extent {L}")
    return spatial, heads, head_dim, ks, st, dl, ca


def _check_scale(scale, head_dim):
    if scale is None:
        return head_dim ** -0.5   # head_dim > 0: _make rejects 0 first
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def _check_options(backend, tile):
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {', '.join(BACKEND_NAMES)}, "
                        f"got {backend!r}")
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {backend!r}")
    return None if tile is None else check_tile(tile)


def check_tile(tile):
    """A tile option (not None): "autotune", or a box as a tuple of ints."""
    if isinstance(tile, str) and tile == "autotune":
        return tile
    if not (isinstance(tile, (tuple, list)) and tile
            and all(isinstance(t, numbers.Integral) and t > 0 for t in tile)):
        raise ValueError(f"tile must be a tuple of positive ints or 'autotune', got {tile!r}")
    return tuple(int(t) for t in tile)


def _make(rank, ref, kernel_size, stride, dilation, is_causal, scale, allow_tf32=False,
          deterministic=False, tile=None, kv_heads=None, v_dim=None):
    spatial, heads, head_dim, ks, st, dl, ca = _geometry(
        rank, ref.shape, kernel_size, stride, dilation, is_causal)
    if head_dim == 0:
        raise ValueError(f"head dim must be positive, got shape {_shape_text(ref.shape)}")
    if v_dim == 0:
        raise ValueError("head dim must be positive, got v with head dim 0")
    return NAProblem(
        rank=rank, batch=int(ref.shape[0]), spatial=spatial, heads=heads, head_dim=head_dim,
        kernel_size=ks, stride=st, dilation=dl, is_causal=ca,
        scale=_check_scale(scale, head_dim), dtype=canonical_dtype(ref.dtype),
        allow_tf32=bool(allow_tf32), deterministic=bool(deterministic), tile=tile,
        kv_heads=heads if kv_heads is None else int(kv_heads),
        v_dim=head_dim if v_dim is None else int(v_dim))


def _check_types(named):
    """Every (name, array) pair is an array of a supported dtype (TypeErrors first)."""
    for name, x in named:
        _check_array(name, x)
    for name, x in named:
        _check_dtype(name, x)


def _check_inputs(rank, named, kv=(), free_dim=()):
    """Type, rank, dtype and shape agreement of the (name, array) pairs; the first one leads.
    ``kv``: key/value-side pairs, checked by ``_check_kv`` against the leader (``free_dim``:
    those whose head dim may differ). Returns H_kv (the leader's heads when ``kv`` is
    empty)."""
    _check_types(list(named) + list(kv))
    (ref_name, ref), rest = named[0], named[1:]
    _check_rank(ref_name, ref, rank)
    for name, x in rest:
        _check_same(name, x, ref_name, ref)
    return (_check_kv(rank, ref_name, ref, kv, free_dim) if kv
            else int(ref.shape[1 + rank]))


def _check_kv(rank, ref_name, ref, named, free_dim=()):
    """Key/value-side arrays (k, v, or v alone) against the query-side ``ref``: same dtype,
    batch, extents and head dim (but those named in ``free_dim``: v of the fused ops), one
    head count H_kv among them that divides ref's H (grouped-query attention; H_kv = H is
    plain multi-head). Returns H_kv."""
    kv_heads, first = None, None
    for name, x in named:
        _check_rank(name, x, rank)
        h = int(x.shape[1 + rank])
        d = int(x.shape[-1]) if name in free_dim else ref.shape[-1]
        if tuple(x.shape) != tuple(ref.shape[:1 + rank]) + (h, d):
            raise ValueError(
                f"{name} shape {_shape_text(x.shape)} does not match {ref_name} shape "
                f"{_shape_text(ref.shape)}: it must be {_layout_text(rank, 'D')} with "
                f"{ref_name}'s batch, extents"
                + ("" if name in free_dim else " and head dim") + " (H may be fewer heads, H_kv)")
        if canonical_dtype(x.dtype) != canonical_dtype(ref.dtype):
            raise ValueError(f"{name} dtype {x.dtype} does not match {ref_name} dtype "
                             f"{ref.dtype}")
        if kv_heads is None:
            kv_heads, first = h, name
        elif h != kv_heads:
            raise ValueError(f"{name} has {h} heads but {first} has {kv_heads}: keys and "
                             "values need the same number of heads H_kv")
    heads = int(ref.shape[1 + rank])
    if heads == 0 and kv_heads:   # zero heads is an empty call only when both sides are
        raise ValueError(f"{first} has H_kv = {kv_heads} heads but {ref_name} has none: with "
                         "zero query heads, keys and values need zero heads too")
    if (kv_heads == 0 and heads != 0) or (kv_heads and heads % kv_heads):
        raise ValueError(f"{first} has H_kv = {kv_heads} heads, which does not divide "
                         f"{ref_name}'s H = {heads} heads (grouped-query attention needs "
                         "H % H_kv == 0)")
    return kv_heads


class _Shaped:
    """Shape and dtype of an array that the call does not pass (av's output)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _with_rpb(problem, rpb):
    """``problem`` with its relative positional bias checked and recorded (or as it is)."""
    if rpb is None:
        return problem
    _check_rpb(rpb, problem)
    if any(s != 1 for s in problem.stride):
        raise ValueError(f"rpb needs stride 1 on every axis, got stride {problem.stride} (a "
                         "strided window's offsets do not fit the [H, 2k-1, ...] table)")
    return dataclasses.replace(problem, has_rpb=True)


def _with_extra(problem, q, v, keys, values):
    """``problem`` with its additional tokens checked and recorded: ``[B, T, H_x, D]`` arrays
    (values: v's head dim) in q's dtype, H_x dividing q's heads, given together."""
    if keys is None and values is None:
        return problem
    if keys is None or values is None:
        raise ValueError("additional_keys and additional_values must be given together, got "
                         f"{type(keys).__name__} and {type(values).__name__}")
    _check_types([("additional_keys", keys), ("additional_values", values)])
    B, H = problem.batch, problem.heads
    for name, x, d in (("additional_keys", keys, problem.head_dim),
                       ("additional_values", values, problem.v_dim)):
        shape = tuple(int(n) for n in x.shape)
        if len(shape) != 4 or shape[0] != B or shape[3] != d:
            raise ValueError(f"{name} shape {_shape_text(x.shape)} must be [B, T, H_x, D] "
                             f"with q's batch {B} and head dim {d}")
        if canonical_dtype(x.dtype) != problem.dtype:
            raise ValueError(f"{name} dtype {x.dtype} does not match q dtype {q.dtype}")
    T, hx = int(keys.shape[1]), int(keys.shape[2])
    if tuple(values.shape[1:3]) != (T, hx):
        raise ValueError(f"additional_keys {_shape_text(keys.shape)} and additional_values "
                         f"{_shape_text(values.shape)} must agree on T and H_x")
    if (hx == 0) != (H == 0) or (hx and H % hx):
        raise ValueError(f"additional_keys has H_x = {hx} heads, which does not divide q's "
                         f"H = {H} heads")
    return dataclasses.replace(problem, extra_tokens=T, extra_heads=hx)


def check_fused(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale, backend,
                allow_tf32=False, deterministic=False, tile=None, rpb=None,
                additional_keys=None, additional_values=None):
    """Validate a fused forward call; returns its NAProblem."""
    tile = _check_options(backend, tile)
    kv = _check_inputs(rank, [("q", q)], kv=[("k", k), ("v", v)], free_dim=("v",))
    problem = _with_rpb(_make(rank, q, kernel_size, stride, dilation, is_causal, scale,
                              allow_tf32, deterministic, tile, kv, int(v.shape[-1])), rpb)
    return _with_extra(problem, q, v, additional_keys, additional_values)


def check_fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride, dilation,
                         is_causal, scale, backend, allow_tf32=False, deterministic=False,
                         tile=None, rpb=None, additional_keys=None, additional_values=None):
    """Validate a fused backward call; returns its NAProblem."""
    tile = _check_options(backend, tile)
    kv = _check_inputs(rank, [("q", q)], kv=[("k", k), ("v", v)], free_dim=("v",))
    # out and d_out: q's batch, extents and heads, v's head dim Dv.
    _check_types([("out", out), ("d_out", d_out)])
    o_like = _Shaped(tuple(q.shape[:-1]) + (v.shape[-1],), q.dtype)
    for name, x in (("out", out), ("d_out", d_out)):
        _check_rank(name, x, rank)
        _check_same(name, x, "q" if v.shape[-1] == q.shape[-1] else "the expected", o_like)
    _check_array("lse", lse)
    want = tuple(q.shape[:-1])
    if tuple(lse.shape) != want:
        raise ValueError(f"lse shape {_shape_text(lse.shape)} must be q's shape without the "
                         f"head dim, {_shape_text(want)}")
    lse_dtype = _check_dtype("lse", lse)
    want_dtype = numpy.dtype(numpy.float64 if canonical_dtype(q.dtype) == numpy.float64
                             else numpy.float32)
    if lse_dtype != want_dtype:
        raise ValueError(f"lse dtype must be {want_dtype} for {q.dtype} inputs, got {lse.dtype}")
    problem = _with_rpb(_make(rank, q, kernel_size, stride, dilation, is_causal, scale,
                              allow_tf32, deterministic, tile, kv, int(v.shape[-1])), rpb)
    return _with_extra(problem, q, v, additional_keys, additional_values)


def _check_attn(name, attn, rank, q_like, num_neighbors):
    _check_array(name, attn)
    _check_dtype(name, attn)
    _check_rank(name, attn, rank, last="K")
    want = tuple(q_like.shape[:-1]) + (num_neighbors,)
    _check_same(name, attn, "the expected", q_like, shape=want)


def _check_rpb(rpb, problem, name="rpb"):
    _check_array(name, rpb)
    _check_dtype(name, rpb)
    want = (problem.heads,) + tuple(2 * k - 1 for k in problem.kernel_size)
    if tuple(rpb.shape) != want:
        raise ValueError(f"{name} shape {_shape_text(rpb.shape)} must be [H, 2k-1, ...] = "
                         f"{_shape_text(want)}")
    if canonical_dtype(rpb.dtype) != problem.dtype:
        raise ValueError(f"{name} dtype {rpb.dtype} does not match q dtype {problem.dtype}")


def check_qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend, allow_tf32=False):
    tile = _check_options(backend, None)
    kv = _check_inputs(rank, [("q", q)], kv=[("k", k)])
    p = _make(rank, q, kernel_size, 1, dilation, is_causal, 1.0, allow_tf32, False, tile, kv)
    if rpb is not None:
        _check_rpb(rpb, p)
    return p


def check_av(rank, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32=False):
    _check_options(backend, None)
    _check_types([("attn", attn), ("v", v)])
    _check_rank("attn", attn, rank, last="K")
    _check_rank("v", v, rank)
    if tuple(attn.shape[:1 + rank]) != tuple(v.shape[:1 + rank]):
        raise ValueError(f"attn shape {_shape_text(attn.shape)} does not match v shape "
                         f"{_shape_text(v.shape)} in batch and extents")
    # The output: attn's batch, extents and heads, v's head dim.
    out = _Shaped(tuple(attn.shape[:-1]) + (v.shape[-1],), attn.dtype)
    kv = _check_kv(rank, "attn", out, [("v", v)])
    p = _make(rank, out, kernel_size, 1, dilation, is_causal, 1.0, allow_tf32, kv_heads=kv)
    _check_attn("attn", attn, rank, out, p.num_neighbors)
    return p


def check_qk_backward(rank, d_attn, q, k, kernel_size, dilation, is_causal, rpb, backend,
                      allow_tf32=False):
    _check_options(backend, None)
    kv = _check_inputs(rank, [("q", q)], kv=[("k", k)])
    p = _make(rank, q, kernel_size, 1, dilation, is_causal, 1.0, allow_tf32, kv_heads=kv)
    _check_attn("d_attn", d_attn, rank, q, p.num_neighbors)
    if rpb is not None:
        _check_rpb(rpb, p)
    return p


def check_av_backward(rank, d_out, attn, v, kernel_size, dilation, is_causal, backend,
                      allow_tf32=False):
    _check_options(backend, None)
    kv = _check_inputs(rank, [("d_out", d_out)], kv=[("v", v)])
    p = _make(rank, d_out, kernel_size, 1, dilation, is_causal, 1.0, allow_tf32, kv_heads=kv)
    _check_attn("attn", attn, rank, d_out, p.num_neighbors)
    return p
