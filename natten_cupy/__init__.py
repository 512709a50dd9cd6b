"""natten_cupy: neighborhood attention as CUDA kernels compiled at run time by CuPy.

Array-level calls (no autograd) take q, k, v as ``[B, *spatial, H, D]`` NumPy arrays (CPU,
reference backend), CuPy arrays, or any CUDA tensor that speaks DLPack (PyTorch, JAX), and
return the caller's array type. See SPEC-level docs in the README; ``natten_cupy.torch``
adds autograd.
"""

from __future__ import annotations

import functools
import inspect

from . import ops as _ops

__version__ = "0.1.0"

_FUSED_OPTIONS = """
    kernel_size, stride, dilation: int or per-axis tuple; is_causal: bool or
    per-axis tuple; ``scale`` defaults to ``D ** -0.5``. ``backend``: auto, reference, naive,
    fused. ``allow_tf32`` lets float32 inputs use TF32 tensor cores. ``tile``: the fused
    forward's CTA query box (a tuple) or ``"autotune"``. ``deterministic`` is accepted; every
    fused-op kernel is deterministic already (no atomics).
    """

_UNFUSED_OPTIONS = """
    kernel_size, dilation: int or per-axis tuple; is_causal: bool or per-axis
    tuple; stride is 1. ``backend``: auto, reference, naive, tiled. ``allow_tf32`` lets
    float32 inputs use TF32 tensor cores (tiled).
    """

_FUSED_DOC = """{n}-D fused neighborhood attention (no attention matrix in memory).

    q, k, v: ``[B, {axes}, H, D]``. Returns ``out`` (same shape and dtype as q) and, with
    ``return_lse=True``, also ``lse`` ``[B, {axes}, H]`` (float32; float64 for float64
    inputs).
    """ + _FUSED_OPTIONS

_FUSED_BWD_DOC = """Backward of na{n}d: returns (dq, dk, dv) from d_out, q, k, v, out, lse.

    Pass the forward's options again.
    """ + _FUSED_OPTIONS

_QK_DOC = """{n}-D unfused attention logits: ``[B, {axes}, H, K]``, K = prod(kernel_size).

    Slot t (row-major over kernel offsets) holds ``scale``-free ``<q_i, k_j> + rpb`` for the
    t-th key of the window; slots outside a causal window hold -inf. ``rpb``:
    ``[H, 2k_0-1, ...]`` relative positional bias.
    """ + _UNFUSED_OPTIONS

_AV_DOC = """{n}-D unfused attention-weighted values: ``out_i = sum_t attn[i, t] v_{{j(i, t)}}``.

    Slots outside a causal window are ignored.
    """ + _UNFUSED_OPTIONS

_QKB_DOC = """Backward of na{n}d_qk: (dq, dk), or (dq, dk, d_rpb) when ``rpb`` is given.
    """ + _UNFUSED_OPTIONS

_AVB_DOC = """Backward of na{n}d_av: (d_attn, dv).
    """ + _UNFUSED_OPTIONS

_AXES = {1: "L", 2: "X, Y", 3: "X, Y, Z"}


def _for_rank(fn, rank, name, doc):
    """``fn`` with its leading ``rank`` argument fixed, named and documented for that rank
    (its signature is ``fn``'s without ``rank``). Also used by ``natten_cupy.torch``."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(rank, *args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = doc.format(n=rank, axes=_AXES[rank])
    sig = inspect.signature(fn)
    call.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    del call.__wrapped__
    return call


__all__ = []
for _n in (1, 2, 3):
    for _suffix, _fn, _doc in (("", _ops.fused_forward, _FUSED_DOC),
                               ("_backward", _ops.fused_backward, _FUSED_BWD_DOC),
                               ("_qk", _ops.qk, _QK_DOC),
                               ("_av", _ops.av, _AV_DOC),
                               ("_qk_backward", _ops.qk_backward, _QKB_DOC),
                               ("_av_backward", _ops.av_backward, _AVB_DOC)):
        _name = f"na{_n}d{_suffix}"
        globals()[_name] = _for_rank(_fn, _n, _name, _doc)
        __all__.append(_name)
del _n, _suffix, _fn, _doc, _name


from ._softmax import softmax, softmax_backward  # noqa: E402
from ._merge import merge_attentions  # noqa: E402

__all__ += ["softmax", "softmax_backward", "merge_attentions"]


def profile(*args, **kwargs):
    """Record every kernel natten_cupy launches inside the block (see natten_cupy.profile)."""
    from .profiler import Profiler
    return Profiler(*args, **kwargs)


__all__.append("profile")
