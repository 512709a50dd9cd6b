"""natten_cupy: neighborhood attention as CUDA kernels compiled at run time by CuPy.

Array-level calls (no autograd) take q, k, v as ``[B, *spatial, H, D]`` NumPy arrays (CPU,
reference backend), CuPy arrays, or any CUDA tensor that speaks DLPack (PyTorch, JAX), and
return the caller's array type. See SPEC-level docs in the README; ``natten_cupy.torch``
adds autograd.
"""

from __future__ import annotations

from . import ops as _ops

__version__ = "0.1.0"

_FUSED_OPTIONS = """
    kernel_size, stride, dilation: int or per-axis tuple; is_causal: bool or
    per-axis tuple; ``scale`` defaults to ``D ** -0.5``. ``backend``: auto, reference, naive,
    fused. ``allow_tf32`` lets float32 inputs use TF32 tensor cores. ``tile``: the fused
    forward's CTA query box (a tuple) or ``"autotune"``. ``deterministic=True``: a backward
    that is bitwise reproducible run to run; by default the Hopper backward may add dq by
    float32 reductions in an order that varies (faster where it runs).
    """

_UNFUSED_OPTIONS = """
    kernel_size, dilation: int or per-axis tuple; is_causal: bool or per-axis
    tuple; stride is 1. ``backend``: auto, reference, naive, tiled. ``allow_tf32`` lets
    float32 inputs use TF32 tensor cores (tiled).
    """

_FUSED_DOC = """{n}-D fused neighborhood attention (no attention matrix in memory).

    q: ``[B, {axes}, H, D]``; k, v: ``[B, {axes}, H_kv, D]`` with H_kv dividing H
    (grouped-query attention: query head h reads kv head ``h // (H // H_kv)``; H_kv = H is
    plain multi-head, H_kv = 1 multi-query). Returns ``out`` (same shape and dtype as q) and,
    with ``return_lse=True``, also ``lse`` ``[B, {axes}, H]`` (float32; float64 for float64
    inputs). ``rpb`` (optional, stride 1): a relative positional bias ``[H, 2k_0-1, ...]`` in
    q's dtype, added to every score: query i and key j get ``rpb[h, (j_0 - i_0) / d_0 +
    k_0 - 1, ...]``. ``additional_keys``, ``additional_values`` (optional, together):
    ``[B, T, H_x, D]`` tokens that every query attends to besides its window (H_x dividing
    H: query head h reads extra head ``h // (H // H_x)``); out and lse are then over the
    window and the T tokens together.
    """ + _FUSED_OPTIONS

_FUSED_BWD_DOC = """Backward of na{n}d: returns (dq, dk, dv) from d_out, q, k, v, out, lse,
    and (dq, dk, dv, d_rpb) when ``rpb`` is given (d_rpb in rpb's dtype, reduced in a fixed
    order: the same bits every run); with ``additional_keys`` / ``additional_values`` their
    gradients follow, last (out and lse: the forward's, over the window and those tokens).

    Pass the forward's options again. dk, dv have k's and v's H_kv heads: each sums the
    gradients of its group of query heads.
    """ + _FUSED_OPTIONS

_QK_DOC = """{n}-D unfused attention logits: ``[B, {axes}, H, K]``, K = prod(kernel_size).

    Slot t (row-major over kernel offsets) holds ``scale``-free ``<q_i, k_j> + rpb`` for the
    t-th key of the window; slots outside a causal window hold -inf. ``rpb``:
    ``[H, 2k_0-1, ...]`` relative positional bias. k may have H_kv heads dividing q's H
    (grouped-query attention, as in na{n}d).
    """ + _UNFUSED_OPTIONS

_AV_DOC = """{n}-D unfused attention-weighted values: ``out_i = sum_t attn[i, t] v_{{j(i, t)}}``.

    Slots outside a causal window are ignored. attn: ``[B, {axes}, H, K]``; v may have H_kv
    heads dividing H (grouped-query attention); out is ``[B, {axes}, H, D]``.
    """ + _UNFUSED_OPTIONS

_QKB_DOC = """Backward of na{n}d_qk: (dq, dk), or (dq, dk, d_rpb) when ``rpb`` is given;
    dk has k's heads (summed over each kv head's query group).
    """ + _UNFUSED_OPTIONS

_AVB_DOC = """Backward of na{n}d_av: (d_attn, dv); dv has v's heads (summed over each
    kv head's query group).
    """ + _UNFUSED_OPTIONS

_AXES = {1: "L", 2: "X, Y", 3: "X, Y, Z"}


# ---- the public calls, one per rank (their docstrings are the templates above) ----------

def na1d(q, k, v, kernel_size, *, stride=1, dilation=1, is_causal=False, scale=None,
         backend="auto", return_lse=False, allow_tf32=False, deterministic=False, tile=None,
         rpb=None, additional_keys=None, additional_values=None):
    return _ops.fused_forward(1, q, k, v, kernel_size, stride=stride, dilation=dilation,
                              is_causal=is_causal, scale=scale, backend=backend,
                              return_lse=return_lse, allow_tf32=allow_tf32,
                              deterministic=deterministic, tile=tile, rpb=rpb,
                              additional_keys=additional_keys,
                              additional_values=additional_values)


def na1d_backward(d_out, q, k, v, out, lse, kernel_size, *, stride=1, dilation=1,
                  is_causal=False, scale=None, backend="auto", allow_tf32=False,
                  deterministic=False, tile=None, rpb=None, additional_keys=None,
                  additional_values=None):
    return _ops.fused_backward(1, d_out, q, k, v, out, lse, kernel_size, stride=stride,
                               dilation=dilation, is_causal=is_causal, scale=scale,
                               backend=backend, allow_tf32=allow_tf32,
                               deterministic=deterministic, tile=tile, rpb=rpb,
                               additional_keys=additional_keys,
                               additional_values=additional_values)


def na1d_qk(q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
            allow_tf32=False):
    return _ops.qk(1, q, k, kernel_size, dilation=dilation, is_causal=is_causal, rpb=rpb,
                   backend=backend, allow_tf32=allow_tf32)


def na1d_av(attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
            allow_tf32=False):
    return _ops.av(1, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                   backend=backend, allow_tf32=allow_tf32)


def na1d_qk_backward(d_attn, q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None,
                     backend="auto", allow_tf32=False):
    return _ops.qk_backward(1, d_attn, q, k, kernel_size, dilation=dilation,
                            is_causal=is_causal, rpb=rpb, backend=backend,
                            allow_tf32=allow_tf32)


def na1d_av_backward(d_out, attn, v, kernel_size, *, dilation=1, is_causal=False,
                     backend="auto", allow_tf32=False):
    return _ops.av_backward(1, d_out, attn, v, kernel_size, dilation=dilation,
                            is_causal=is_causal, backend=backend, allow_tf32=allow_tf32)


def na2d(q, k, v, kernel_size, *, stride=1, dilation=1, is_causal=False, scale=None,
         backend="auto", return_lse=False, allow_tf32=False, deterministic=False, tile=None,
         rpb=None, additional_keys=None, additional_values=None):
    return _ops.fused_forward(2, q, k, v, kernel_size, stride=stride, dilation=dilation,
                              is_causal=is_causal, scale=scale, backend=backend,
                              return_lse=return_lse, allow_tf32=allow_tf32,
                              deterministic=deterministic, tile=tile, rpb=rpb,
                              additional_keys=additional_keys,
                              additional_values=additional_values)


def na2d_backward(d_out, q, k, v, out, lse, kernel_size, *, stride=1, dilation=1,
                  is_causal=False, scale=None, backend="auto", allow_tf32=False,
                  deterministic=False, tile=None, rpb=None, additional_keys=None,
                  additional_values=None):
    return _ops.fused_backward(2, d_out, q, k, v, out, lse, kernel_size, stride=stride,
                               dilation=dilation, is_causal=is_causal, scale=scale,
                               backend=backend, allow_tf32=allow_tf32,
                               deterministic=deterministic, tile=tile, rpb=rpb,
                               additional_keys=additional_keys,
                               additional_values=additional_values)


def na2d_qk(q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
            allow_tf32=False):
    return _ops.qk(2, q, k, kernel_size, dilation=dilation, is_causal=is_causal, rpb=rpb,
                   backend=backend, allow_tf32=allow_tf32)


def na2d_av(attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
            allow_tf32=False):
    return _ops.av(2, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                   backend=backend, allow_tf32=allow_tf32)


def na2d_qk_backward(d_attn, q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None,
                     backend="auto", allow_tf32=False):
    return _ops.qk_backward(2, d_attn, q, k, kernel_size, dilation=dilation,
                            is_causal=is_causal, rpb=rpb, backend=backend,
                            allow_tf32=allow_tf32)


def na2d_av_backward(d_out, attn, v, kernel_size, *, dilation=1, is_causal=False,
                     backend="auto", allow_tf32=False):
    return _ops.av_backward(2, d_out, attn, v, kernel_size, dilation=dilation,
                            is_causal=is_causal, backend=backend, allow_tf32=allow_tf32)


def na3d(q, k, v, kernel_size, *, stride=1, dilation=1, is_causal=False, scale=None,
         backend="auto", return_lse=False, allow_tf32=False, deterministic=False, tile=None,
         rpb=None, additional_keys=None, additional_values=None):
    return _ops.fused_forward(3, q, k, v, kernel_size, stride=stride, dilation=dilation,
                              is_causal=is_causal, scale=scale, backend=backend,
                              return_lse=return_lse, allow_tf32=allow_tf32,
                              deterministic=deterministic, tile=tile, rpb=rpb,
                              additional_keys=additional_keys,
                              additional_values=additional_values)


def na3d_backward(d_out, q, k, v, out, lse, kernel_size, *, stride=1, dilation=1,
                  is_causal=False, scale=None, backend="auto", allow_tf32=False,
                  deterministic=False, tile=None, rpb=None, additional_keys=None,
                  additional_values=None):
    return _ops.fused_backward(3, d_out, q, k, v, out, lse, kernel_size, stride=stride,
                               dilation=dilation, is_causal=is_causal, scale=scale,
                               backend=backend, allow_tf32=allow_tf32,
                               deterministic=deterministic, tile=tile, rpb=rpb,
                               additional_keys=additional_keys,
                               additional_values=additional_values)


def na3d_qk(q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
            allow_tf32=False):
    return _ops.qk(3, q, k, kernel_size, dilation=dilation, is_causal=is_causal, rpb=rpb,
                   backend=backend, allow_tf32=allow_tf32)


def na3d_av(attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
            allow_tf32=False):
    return _ops.av(3, attn, v, kernel_size, dilation=dilation, is_causal=is_causal,
                   backend=backend, allow_tf32=allow_tf32)


def na3d_qk_backward(d_attn, q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None,
                     backend="auto", allow_tf32=False):
    return _ops.qk_backward(3, d_attn, q, k, kernel_size, dilation=dilation,
                            is_causal=is_causal, rpb=rpb, backend=backend,
                            allow_tf32=allow_tf32)


def na3d_av_backward(d_out, attn, v, kernel_size, *, dilation=1, is_causal=False,
                     backend="auto", allow_tf32=False):
    return _ops.av_backward(3, d_out, attn, v, kernel_size, dilation=dilation,
                            is_causal=is_causal, backend=backend, allow_tf32=allow_tf32)


_DOCS = {"": _FUSED_DOC, "_backward": _FUSED_BWD_DOC, "_qk": _QK_DOC, "_av": _AV_DOC,
         "_qk_backward": _QKB_DOC, "_av_backward": _AVB_DOC}
for _n in (1, 2, 3):
    for _suffix, _doc in _DOCS.items():
        globals()[f"na{_n}d{_suffix}"].__doc__ = _doc.format(n=_n, axes=_AXES[_n])
del _n, _suffix, _doc

__all__ = [f"na{n}d{suffix}" for n in (1, 2, 3) for suffix in _DOCS]


from ._softmax import softmax, softmax_backward  # noqa: E402
from ._merge import merge_attentions  # noqa: E402

__all__ += ["softmax", "softmax_backward", "merge_attentions"]


def profile(*args, **kwargs):
    """Record every kernel natten_cupy launches inside the block (see natten_cupy.profiler)."""
    from .profiler import Profiler
    return Profiler(*args, **kwargs)


__all__.append("profile")
