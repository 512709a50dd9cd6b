"""PyTorch layer: autograd-enabled neighborhood attention and ``NeighborhoodAttention{1,2,3}D``.

* ``na1d/na2d/na3d(query, key, value, kernel_size, stride, dilation, is_causal, scale, ...)``
  (fused, NATTEN's calling convention: argument names, order and ``None`` defaults), with
  ``return_lse`` and ``additional_keys`` / ``additional_values``; gradients flow to every
  tensor input, from out and from lse. ``merge_attentions`` joins attentions over disjoint
  key sets through their lse;
* ``na{n}d_qk`` / ``na{n}d_av``: the unfused pieces (attention weights in memory, rpb);
* modules ``NeighborhoodAttention1D/2D/3D``: qkv projection, heads, NA, output projection,
  with NATTEN's constructor arguments; their state dicts load NATTEN modules' (``qkv``,
  ``proj``, ``rpb``).

Eager calls on CUDA tensors run warm calls through autograd functions
(``natten_cupy._torch_eager``; ``_torch_ext`` with a bias or additional tokens); under
``torch.compile`` the custom ops ``torch.ops.natten_cupy.*`` run (``natten_cupy._torch_library``,
``_torch_ext``; shared helpers: ``_torch_common``). Tensors are ``[B, *spatial, H, D]`` with any
strides; unfused weights ``[B, *spatial, H, K]``.
"""

from __future__ import annotations


import torch
from torch import nn

from . import _AXES, _args
from . import _fast
from ._torch_common import _check_tensors, _forward_entry, _unfused_entry, per_axis, tile_text
from ._torch_eager import av_apply, fused_na_apply, qk_apply, records
from ._torch_ext import _fused_forward_ext, fused_ext_eager
from ._torch_library import _av, _fused_forward, _qk

__all__ = ["na1d", "na2d", "na3d", "na1d_qk", "na2d_qk", "na3d_qk", "na1d_av", "na2d_av",
           "na3d_av", "merge_attentions", "NeighborhoodAttention", "NeighborhoodAttention1D",
           "NeighborhoodAttention2D", "NeighborhoodAttention3D"]

# NATTEN's backend names: its kernel choices, which natten_cupy makes itself.
NATTEN_BACKENDS = ("cutlass-fna", "hopper-fna", "blackwell-fna", "flex-fna")


def _validating():
    """Eager calls validate up front; under torch.compile the ops validate when they run."""
    return not torch.compiler.is_compiling()


def _backend(name):
    return "auto" if name is None or name in NATTEN_BACKENDS else name


# ---- merging attentions -------------------------------------------------------------------

def merge_attentions(outputs, lse_tensors):
    """(out, lse) of attention over the union of disjoint key sets, from the attention over
    each set: ``lse = log sum_x exp(lse_x)``, ``out = sum_x exp(lse_x - lse) out_x``.

    outputs: list of ``[B, *spatial, H, D]`` tensors (one dtype), lse_tensors: the matching
    ``[B, *spatial, H]`` (float32). Differentiable in every input (no in-place writes, so
    saved-tensor hooks such as ``save_on_cpu`` apply). lse comes back float32 (float64 for
    float64 outputs); out in the outputs' dtype.
    """
    outputs, lse_tensors = list(outputs), list(lse_tensors)
    if not outputs or len(outputs) != len(lse_tensors):
        raise ValueError(f"merge_attentions needs one lse per output and at least one of each, "
                         f"got {len(outputs)} outputs and {len(lse_tensors)} lse tensors")
    first = outputs[0]
    for i, (o, lse) in enumerate(zip(outputs, lse_tensors)):
        if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise TypeError(f"outputs[{i}] and lse_tensors[{i}] must be torch tensors, got "
                            f"{type(o).__name__} and {type(lse).__name__}")
        if tuple(o.shape) != tuple(first.shape) or o.dtype != first.dtype:
            raise ValueError(f"outputs[{i}] is {tuple(o.shape)} {o.dtype}; outputs[0] is "
                             f"{tuple(first.shape)} {first.dtype}")
        if tuple(lse.shape) != tuple(first.shape[:-1]):
            raise ValueError(f"lse_tensors[{i}] shape {tuple(lse.shape)} must be the outputs' "
                             f"shape without the head dim, {tuple(first.shape[:-1])}")
    acc = torch.float64 if first.dtype == torch.float64 else torch.float32
    lses = torch.stack([lse.to(acc) for lse in lse_tensors])
    lse = torch.logsumexp(lses, dim=0)
    # A row no set saw (every lse -inf) gets out 0, not NaN.
    weights = torch.exp(lses - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    out = sum(w.unsqueeze(-1) * o.to(acc) for w, o in zip(weights, outputs))
    return out.to(first.dtype), lse


# ---- public functions ---------------------------------------------------------------------

def _na(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
        deterministic, lse_grad=False, tile=None, rpb=None, keys=None, values=None):
    """(out, lse) with autograd through out, and through lse where ``lse_grad`` (eager calls
    always carry it: an unused lse costs nothing there); ``rpb``: a relative positional
    bias, ``keys``/``values``: additional tokens, with their gradients."""
    if rpb is not None or keys is not None or values is not None:
        if _validating():
            got = fused_ext_eager(q, k, v, rpb, keys, values,
                                  (rank, kernel_size, stride, dilation, is_causal, scale,
                                   backend, allow_tf32, deterministic, tile))
            if got is not None:
                return got
        ks, st, dl, ca = per_axis(rank, kernel_size, dilation, is_causal, stride)
        return _fused_forward_ext(q, k, v, rpb, keys, values, ks, st, dl, ca,
                                  None if scale is None else float(scale), backend,
                                  bool(allow_tf32), bool(deterministic), bool(lse_grad),
                                  tile_text(tile))
    if _validating():
        options = (rank, kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
                   deterministic, tile)
        e = _forward_entry(q, k, v, options)
        if e is not None:
            if records(q, k, v):
                return fused_na_apply(q, k, v, e, options)
            return _fast.run_torch_call(e, (q, k, v))
        _args.check_fused(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale,
                          backend, allow_tf32, deterministic, tile)
        _check_tensors([("q", q), ("k", k), ("v", v)])
    ks, st, dl, ca = per_axis(rank, kernel_size, dilation, is_causal, stride)
    return _fused_forward(q, k, v, ks, st, dl, ca, None if scale is None else float(scale),
                          backend, bool(allow_tf32), bool(deterministic), bool(lse_grad),
                          tile_text(tile))


def na(rank, query, key, value, kernel_size, stride=1, dilation=1, is_causal=False,
       scale=None, additional_keys=None, additional_values=None, attention_kwargs=None,
       backend=None, q_tile_shape=None, kv_tile_shape=None, backward_q_tile_shape=None,
       backward_kv_tile_shape=None, backward_kv_splits=None, backward_use_pt_reduction=False,
       run_persistent_kernel=True, kernel_schedule=None, torch_compile=False,
       return_lse=False, *, allow_tf32=False, deterministic=False, tile=None, rpb=None):
    """Fused neighborhood attention with autograd (``rank`` spatial axes)."""
    if tile is not None:   # checked here: the ops carry it as text
        tile = _args.check_tile(tile)
    stride = 1 if stride is None else stride
    dilation = 1 if dilation is None else dilation
    is_causal = False if is_causal is None else is_causal
    out, lse = _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                   _backend(backend), allow_tf32, deterministic, return_lse, tile, rpb,
                   additional_keys, additional_values)
    return (out, lse) if return_lse else out


def na_qk(rank, q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
          allow_tf32=False):
    """Unfused attention logits ``[B, *spatial, H, K]`` with autograd (q, k and rpb)."""
    if _validating():
        options = (rank, kernel_size, dilation, is_causal, backend, allow_tf32)
        e = _unfused_entry("qk", (q, k, rpb), options)
        if e is not None:
            if records(q, k, rpb):
                return qk_apply(q, k, rpb, e, options)
            return _fast.run_torch_call(e, (q, k, rpb))[0]
        _args.check_qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend, allow_tf32)
        _check_tensors([("q", q), ("k", k), ("rpb", rpb)])
    ks, _, dl, ca = per_axis(rank, kernel_size, dilation, is_causal)
    return _qk(q, k, rpb, ks, dl, ca, backend, bool(allow_tf32))


def na_av(rank, attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
          allow_tf32=False):
    """Unfused attention-weighted values ``[B, *spatial, H, D]`` with autograd (attn and v)."""
    if _validating():
        options = (rank, kernel_size, dilation, is_causal, backend, allow_tf32)
        e = _unfused_entry("av", (attn, v), options)
        if e is not None:
            if records(attn, v):
                return av_apply(attn, v, e, options)
            return _fast.run_torch_call(e, (attn, v))[0]
        _args.check_av(rank, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32)
        _check_tensors([("attn", attn), ("v", v)])
    ks, _, dl, ca = per_axis(rank, kernel_size, dilation, is_causal)
    return _av(attn, v, ks, dl, ca, backend, bool(allow_tf32))


_NA_DOC = """{n}-D fused neighborhood attention with autograd (NATTEN's calling convention).

    query, key, value: torch tensors ``[B, {axes}, H, D]`` (any strides, CPU or CUDA).
    kernel_size, stride, dilation: int or per-axis tuple; is_causal: bool or per-axis tuple
    (``None`` means the default: 1, 1, False); scale defaults to ``D ** -0.5``.
    additional_keys, additional_values: ``[B, T, H_x, D]`` tokens (H_x dividing H) that every query attends
    besides its neighborhood (one softmax over both). ``return_lse=True`` also returns lse
    ``[B, {axes}, H]`` (float32, natural log); gradients flow to every tensor from out and
    from lse. ``backend``: None or "auto" (NATTEN's backend names also mean auto), reference
    (CPU tensors run here), naive, fused. NATTEN's kernel-tuning arguments (attention_kwargs,
    q_tile_shape, kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape,
    backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel, kernel_schedule,
    torch_compile) are accepted and have no effect. Keyword-only: ``allow_tf32`` lets float32
    inputs use TF32 tensor cores; ``deterministic=True`` makes the backward bitwise
    reproducible (by default the Hopper backward may add dq by float32 reductions);
    ``tile``: the fused forward's CTA query box (a tuple) or "autotune" (the fastest kernel
    and tile for the problem, forward and backward, timed once and remembered), as in the
    array API; ``rpb``: a relative positional bias ``[H, 2k_0-1,
    ...]`` (stride 1) added to the scores, ``rpb[h, (j - i) / dilation + k - 1]`` per axis,
    which receives a gradient.
    """

_UNFUSED_OPTIONS = """
    kernel_size, dilation: int or per-axis tuple; is_causal: bool or per-axis tuple; stride
    is 1. ``backend``: auto, reference (CPU tensors run here), naive, tiled. ``allow_tf32``
    lets float32 inputs use TF32 tensor cores (tiled).
    """

_QK_DOC = """{n}-D unfused attention logits with autograd: ``[B, {axes}, H, K]``.

    K = prod(kernel_size), slots row-major over kernel offsets; no scale is applied; slots
    outside a causal window hold -inf. ``rpb`` ``[H, 2k_0-1, ...]`` (optional) is added and
    receives a gradient.
    """ + _UNFUSED_OPTIONS

_AV_DOC = """{n}-D unfused attention-weighted values with autograd.

    attn ``[B, {axes}, H, K]`` (e.g. the softmax of ``na{n}d_qk``), v ``[B, {axes}, H, D]``;
    returns ``[B, {axes}, H, D]``. Slots outside a causal window are ignored.
    """ + _UNFUSED_OPTIONS


def na1d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
         additional_keys=None, additional_values=None, attention_kwargs=None, backend=None,
         q_tile_shape=None, kv_tile_shape=None, backward_q_tile_shape=None,
         backward_kv_tile_shape=None, backward_kv_splits=None, backward_use_pt_reduction=False,
         run_persistent_kernel=True, kernel_schedule=None, torch_compile=False,
         return_lse=False, *, allow_tf32=False, deterministic=False, tile=None, rpb=None):
    return na(1, query, key, value, kernel_size, stride, dilation, is_causal, scale,
              additional_keys, additional_values, backend=backend, return_lse=return_lse,
              allow_tf32=allow_tf32, deterministic=deterministic, tile=tile, rpb=rpb)


def na2d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
         additional_keys=None, additional_values=None, attention_kwargs=None, backend=None,
         q_tile_shape=None, kv_tile_shape=None, backward_q_tile_shape=None,
         backward_kv_tile_shape=None, backward_kv_splits=None, backward_use_pt_reduction=False,
         run_persistent_kernel=True, kernel_schedule=None, torch_compile=False,
         return_lse=False, *, allow_tf32=False, deterministic=False, tile=None, rpb=None):
    return na(2, query, key, value, kernel_size, stride, dilation, is_causal, scale,
              additional_keys, additional_values, backend=backend, return_lse=return_lse,
              allow_tf32=allow_tf32, deterministic=deterministic, tile=tile, rpb=rpb)


def na3d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
         additional_keys=None, additional_values=None, attention_kwargs=None, backend=None,
         q_tile_shape=None, kv_tile_shape=None, backward_q_tile_shape=None,
         backward_kv_tile_shape=None, backward_kv_splits=None, backward_use_pt_reduction=False,
         run_persistent_kernel=True, kernel_schedule=None, torch_compile=False,
         return_lse=False, *, allow_tf32=False, deterministic=False, tile=None, rpb=None):
    return na(3, query, key, value, kernel_size, stride, dilation, is_causal, scale,
              additional_keys, additional_values, backend=backend, return_lse=return_lse,
              allow_tf32=allow_tf32, deterministic=deterministic, tile=tile, rpb=rpb)


def na1d_qk(q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
            allow_tf32=False):
    return na_qk(1, q, k, kernel_size, dilation=dilation, is_causal=is_causal, rpb=rpb,
                 backend=backend, allow_tf32=allow_tf32)


def na2d_qk(q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
            allow_tf32=False):
    return na_qk(2, q, k, kernel_size, dilation=dilation, is_causal=is_causal, rpb=rpb,
                 backend=backend, allow_tf32=allow_tf32)


def na3d_qk(q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
            allow_tf32=False):
    return na_qk(3, q, k, kernel_size, dilation=dilation, is_causal=is_causal, rpb=rpb,
                 backend=backend, allow_tf32=allow_tf32)


def na1d_av(attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
            allow_tf32=False):
    return na_av(1, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                 backend=backend, allow_tf32=allow_tf32)


def na2d_av(attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
            allow_tf32=False):
    return na_av(2, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                 backend=backend, allow_tf32=allow_tf32)


def na3d_av(attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
            allow_tf32=False):
    return na_av(3, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                 backend=backend, allow_tf32=allow_tf32)


for _n in (1, 2, 3):
    for _fn, _doc in ((f"na{_n}d", _NA_DOC), (f"na{_n}d_qk", _QK_DOC), (f"na{_n}d_av", _AV_DOC)):
        globals()[_fn].__doc__ = _doc.format(n=_n, axes=_AXES[_n])
del _n, _fn, _doc


# ---- modules ----------------------------------------------------------------------------

class NeighborhoodAttention(nn.Module):
    """Multi-head neighborhood attention over ``[B, *spatial, embed_dim]`` inputs.

    qkv linear projection, split into ``num_heads`` heads of ``embed_dim // num_heads``, NA,
    merge heads, output projection. Constructor arguments are NATTEN's (``embed_dim`` may
    also be given as ``dim``; ``qk_scale`` as ``scale``); ``rel_pos_bias=True`` adds a learned
    relative positional bias ``rpb`` [H, 2k_0-1, ...] (the fused op takes it, but in exact
    float32 on the GPU, where the unfused chain's tensor-core kernels are faster than the
    only fused kernel with a bias, the naive one), and ``attn_drop > 0`` drops attention
    weights in training, which runs the unfused chain (qk, softmax, av). Use the rank-specific
    subclasses ``NeighborhoodAttention1D/2D/3D``.
    """

    rank = None

    def __init__(self, embed_dim=None, num_heads=None, kernel_size=None, stride=1, dilation=1,
                 is_causal=False, qkv_bias=True, qk_scale=None, proj_drop=0.0, attn_drop=0.0,
                 rel_pos_bias=False, *, dim=None, proj_bias=True, scale=None, backend="auto"):
        super().__init__()
        if self.rank is None:
            raise TypeError("NeighborhoodAttention has no rank; use NeighborhoodAttention1D, "
                            "NeighborhoodAttention2D or NeighborhoodAttention3D")
        if (embed_dim is None) == (dim is None):
            raise TypeError("give the feature size once, as embed_dim or dim, got "
                            f"embed_dim={embed_dim!r} and dim={dim!r}")
        dim = embed_dim if dim is None else dim
        if num_heads is None or kernel_size is None:
            raise TypeError("num_heads and kernel_size are required")
        if qk_scale is not None and scale is not None:
            raise TypeError("give the softmax scale once, as qk_scale or scale")
        if num_heads < 1 or dim % num_heads:
            raise ValueError(f"dim must be a positive multiple of num_heads, got dim={dim} "
                             f"and num_heads={num_heads}")
        for name, p in (("proj_drop", proj_drop), ("attn_drop", attn_drop)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p!r}")
        stride = 1 if stride is None else stride
        dilation = 1 if dilation is None else dilation
        is_causal = False if is_causal is None else is_causal
        ks, st, dl, ca = per_axis(self.rank, kernel_size, dilation, is_causal, stride)
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.kernel_size, self.stride = tuple(ks), tuple(st)
        self.dilation, self.is_causal = tuple(dl), tuple(ca)
        self.scale = qk_scale if qk_scale is not None else scale
        self.backend = _backend(backend)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.attn_drop_p = float(attn_drop)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)
        if (rel_pos_bias or attn_drop > 0) and any(s != 1 for s in st):
            raise ValueError(f"rel_pos_bias and attn_drop take stride 1 (a bias table and the "
                             f"unfused chain), got stride={tuple(st)}")
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.zeros(num_heads, *(2 * k - 1 for k in ks)))
            nn.init.trunc_normal_(self.rpb, std=0.02, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)

    def _unfused(self, q, k, v):
        """qk (+ rpb) -> softmax (float32) -> dropout -> av: NA with weights in memory."""
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        rpb = None if self.rpb is None else self.rpb.to(q.dtype)
        logits = na_qk(self.rank, q * scale, k, self.kernel_size, dilation=self.dilation,
                       is_causal=self.is_causal, rpb=rpb, backend="auto")
        attn = self.attn_drop(torch.softmax(logits.float(), dim=-1)).to(v.dtype)
        return na_av(self.rank, attn, v, self.kernel_size, dilation=self.dilation,
                     is_causal=self.is_causal, backend="auto")

    def forward(self, x):
        if x.ndim != self.rank + 2 or x.shape[-1] != self.dim:
            axes = _AXES[self.rank]
            raise ValueError(f"x must be [B, {axes}, {self.dim}] for {type(self).__name__}, "
                             f"got shape {tuple(x.shape)}")
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))
        q, k, v = qkv.unbind(-3)
        exact_fp32_gpu = x.is_cuda and q.dtype == torch.float32
        if (self.training and self.attn_drop_p > 0) or (self.rpb is not None and exact_fp32_gpu):
            out = self._unfused(q, k, v)
        else:
            rpb = None if self.rpb is None else self.rpb.to(q.dtype)
            out, _ = _na(self.rank, q, k, v, self.kernel_size, self.stride, self.dilation,
                         self.is_causal, self.scale, self.backend, False, False, rpb=rpb)
        return self.proj_drop(self.proj(out.flatten(-2)))

    def extra_repr(self):
        return (f"embed_dim={self.dim}, num_heads={self.num_heads}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}, is_causal={self.is_causal}, "
                f"rel_pos_bias={self.rpb is not None}, backend={self.backend!r}")


class NeighborhoodAttention1D(NeighborhoodAttention):
    """Neighborhood attention over ``[B, L, embed_dim]``."""
    rank = 1


class NeighborhoodAttention2D(NeighborhoodAttention):
    """Neighborhood attention over ``[B, X, Y, embed_dim]``."""
    rank = 2


class NeighborhoodAttention3D(NeighborhoodAttention):
    """Neighborhood attention over ``[B, X, Y, Z, embed_dim]``."""
    rank = 3
