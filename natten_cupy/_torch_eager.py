"""Eager autograd functions (``FusedNA``, ``QK``, ``AV``) over warm-call entries.

The same arithmetic as the custom ops (``_torch_library``) without the custom-op dispatch, for
eager calls on CUDA tensors: each Function's forward runs a warm call (``natten_cupy._fast``)
that ``natten_cupy.torch`` found, its backward a warm call where one serves, else the ops.
Also what ``natten_cupy.torch`` applies them with (``_applier``, ``records``).
"""

from __future__ import annotations

import torch

from . import _fast
from ._torch_common import (_backward_entry, _forward_entry, _op_options, _softmax_scale,
                            _unfused_entry, fused_grads, per_axis)
from ._torch_library import (_any_requires_grad, _av_backward, _forward_op, _fused_backward,
                             _grad_enabled, _qk_backward)


class QK(torch.autograd.Function):
    """Eager unfused logits on CUDA tensors through the fast path."""

    @staticmethod
    def forward(ctx, q, k, rpb, entry, options):
        (attn,) = _fast.run_torch_call(entry, (q, k, rpb))
        ctx.save_for_backward(q, k)
        ctx.with_rpb = rpb is not None
        ctx.options = options
        return attn

    @staticmethod
    def backward(ctx, d_attn):
        q, k = ctx.saved_tensors
        e = None if ctx.with_rpb else _unfused_entry("qk_backward", (d_attn, q, k), ctx.options)
        if e is not None:
            dq, dk = _fast.run_torch_call(e, (d_attn, q, k))
            return dq, dk, None, None, None
        rank, ks, dl, ca, backend, tf32 = ctx.options
        ks, _, dl, ca = per_axis(rank, ks, dl, ca)
        dq, dk, d_rpb = _qk_backward(d_attn, q, k, ctx.with_rpb, ks, dl, ca, backend,
                                     bool(tf32))
        return dq, dk, d_rpb if ctx.with_rpb else None, None, None


class AV(torch.autograd.Function):
    """Eager unfused weighted values on CUDA tensors through the fast path."""

    @staticmethod
    def forward(ctx, attn, v, entry, options):
        (out,) = _fast.run_torch_call(entry, (attn, v))
        ctx.save_for_backward(attn, v)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, d_out):
        attn, v = ctx.saved_tensors
        e = _unfused_entry("av_backward", (d_out, attn, v), ctx.options)
        if e is not None:
            d_attn, dv = _fast.run_torch_call(e, (d_out, attn, v))
        else:
            rank, ks, dl, ca, backend, tf32 = ctx.options
            ks, _, dl, ca = per_axis(rank, ks, dl, ca)
            d_attn, dv = _av_backward(d_out, attn, v, ks, dl, ca, backend, bool(tf32))
        return d_attn, dv, None, None


def _fused_no_grad(q, k, v, options):
    """(out, lse) of a fused forward outside autograd, ``options`` as ``FusedNA`` takes them:
    a warm call where one serves, else the custom op."""
    e = _forward_entry(q, k, v, options)
    if e is not None:
        out, lse = _fast.run_torch_call(e, (q, k, v))
        return out, lse
    return _forward_op(q, k, v, _op_options(options))


def _fused_backward_no_grad(tensors, options):
    e = _backward_entry(tensors, options)
    if e is not None:
        dq, dk, dv = _fast.run_torch_call(e, tensors)
        return dq, dk, dv
    return _fused_backward(*tensors, *_op_options(options))


class FusedNA(torch.autograd.Function):
    """Eager fused NA on CUDA tensors: the fast path's forward and backward, no custom-op
    dispatch (``natten_cupy.torch`` takes the custom op under torch.compile, where graphs
    need it). Returns (out, lse); gradients flow from both (lse: see ``lse_grad_terms``).
    Where no saved-tensor hook is pushed, the backward finds its warm entry from the
    forward's (``_fast.torch_after``: d_out's signature and the saved tensors' pointers)."""

    @staticmethod
    def forward(ctx, q, k, v, entry, options):
        kept = []
        out, lse = _fast.run_torch_call(entry, (q, k, v), None, kept)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.served = (entry, kept) if _saved_hooks() is None else None
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        saved = ctx.saved_tensors
        opts = ctx.options
        if d_lse is None and d_out is not None:   # the common case: out's gradient alone
            tensors = (d_out, *saved)
            e = ptrs = None
            if ctx.served is not None:
                e, ptrs = _fast.torch_after(*ctx.served, d_out, saved,
                                            lambda: _backward_entry(tensors, opts))
            if e is not None:
                return (*_fast.run_torch_call(e, tensors, ptrs), None, None)
            dq, dk, dv = _fused_backward_no_grad(tensors, opts)
        else:
            q, k, v, out, lse = saved
            dq, dk, dv = fused_grads(
                q, k, v, out, lse, d_out, d_lse,
                lambda q, k, v: _fused_no_grad(q, k, v, opts),
                lambda *t: _fused_backward_no_grad(t, opts), _softmax_scale(q, opts[5]))
        return dq, dk, dv, None, None


def _applier(cls):
    """``cls.apply`` without the Python-level wrapper some torch versions put around it
    (2.11: ``Function.apply`` binds setup-context defaults and checks for functorch
    transforms and dead functorch wrappers before the C ``apply``). These Functions have no
    setup context and take only tensors the fast path has read (a functorch wrapper has no
    data pointer, so it never gets here); the transforms are checked per call, and the
    wrapper runs while one is active. Where ``apply`` is the C one, it is that."""
    if not isinstance(torch.autograd.Function.__dict__.get("apply"), classmethod):
        return cls.apply
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
    wrapped = cls.apply
    transforms = torch._C._are_functorch_transforms_active

    def apply(*args):
        return wrapped(*args) if transforms() else c_apply(*args)
    return apply


def _saved_hooks_reader():
    """A function giving the top saved-tensor hooks (None: tensors are saved as they are),
    from torch's private reader (its argument: ignore whether dynamo is tracing); where this
    torch lacks it or it takes other arguments, one that always answers "hooked"."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        top(True)
    except Exception:  # (None is not callable either)
        return lambda: ()
    return lambda: top(True)


_saved_hooks = _saved_hooks_reader()


def records(*tensors):
    """Whether autograd records a call on ``tensors`` (grad mode on and one of them, None
    for an absent one, requires grad): else an eager call skips its Function."""
    return _grad_enabled() and _any_requires_grad(*[t for t in tensors if t is not None])


# The eager Functions' apply (``_applier``), for natten_cupy.torch.
fused_na_apply = _applier(FusedNA)
qk_apply = _applier(QK)
av_apply = _applier(AV)
