"""The custom ops ``torch.ops.natten_cupy.*``: fused forward and backward, unfused qk and av.

``torch.library.Library`` definitions with Python kernels (cheaper per call than
``torch.library.custom_op``, see the section below): validate, select a backend, let torch
allocate every output, and fill it through ``natten_cupy.ops.run_*`` on zero-copy NumPy (CPU)
or CuPy (CUDA) views, launched on torch's current stream (or through a warm call's plan,
``natten_cupy._fast``). Each op has a fake (shape-only) kernel for ``torch.compile`` and an
Autograd kernel: the forward ops' saves its tensors through ``ctx.save_for_backward`` (so
saved-tensor hooks such as ``torch.autograd.graph.save_on_cpu`` apply), the backward ops'
refuses double backward. ``natten_cupy.torch`` calls them under ``torch.compile`` and on CPU
tensors. The ops with a bias and/or additional tokens are defined on the same library in
``_torch_ext``; the shared helpers are in ``_torch_common``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _args, _fast, ops
from ._arrays import module_for
from ._torch_common import (_accumulator, _backward_entry, _check_tensors, _forward_entry,
                            _on_torch_stream, _rpb_shape, _select_backward, _select_forward,
                            _softmax_scale, _tile_value, _view, fused_grads)


# ---- ops torch.ops.natten_cupy.* (per-axis options arrive as lists) ---------------------
#
# Registered one level below ``torch.library.custom_op`` (``bench/probes/torch_dispatch.py``
# measures both): a schema, one Python kernel for CPU and CUDA, a fake kernel, and for every
# op a hand-written Python kernel at the Autograd key. The forward ops' Autograd kernel
# applies an ``autograd.Function`` (``_FusedOp``, ``_QKOp``, ``_AVOp``) whose forward runs the
# device kernel directly below autograd; the backward ops' refuses double backward. This
# skips what custom_op adds to every call (its generated autograd wrapper: a metadata object,
# default filling and a keyset redispatch; the device kernel's dynamo-disable wrapper and
# output-aliasing check), in eager calls and in the graphs torch.compile runs alike.

_LIB = torch.library.Library("natten_cupy", "FRAGMENT")
_BELOW = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad

_OPTIONS3 = ("SymInt[] kernel_size, SymInt[] dilation, bool[] is_causal, str backend, "
             "bool allow_tf32")
_SCHEMAS = {
    "na_fused_forward": "(Tensor q, Tensor k, Tensor v, SymInt[] kernel_size, SymInt[] stride, "
                        "SymInt[] dilation, bool[] is_causal, float? scale, str backend, "
                        "bool allow_tf32, bool deterministic, bool lse_grad=False, "
                        "str tile=\"\") -> (Tensor, Tensor)",
    "na_fused_backward": "(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, "
                         "Tensor lse, SymInt[] kernel_size, SymInt[] stride, SymInt[] dilation, "
                         "bool[] is_causal, float? scale, str backend, bool allow_tf32, "
                         "bool deterministic, str tile=\"\") -> (Tensor, Tensor, Tensor)",
    "na_qk": f"(Tensor q, Tensor k, Tensor? rpb, {_OPTIONS3}) -> Tensor",
    "na_qk_backward": f"(Tensor d_attn, Tensor q, Tensor k, bool with_rpb, {_OPTIONS3}) "
                      "-> (Tensor, Tensor, Tensor)",
    "na_av": f"(Tensor attn, Tensor v, {_OPTIONS3}) -> Tensor",
    "na_av_backward": f"(Tensor d_out, Tensor attn, Tensor v, {_OPTIONS3}) -> (Tensor, Tensor)",
}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema, tags=(torch.Tag.pt2_compliant_tag,))
del _name, _schema


def _impl(name):
    """Register the decorated function as op ``name``'s kernel on CPU and CUDA tensors."""
    def register(fn):
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)
        return fn
    return register


def _fake(name):
    """Register the decorated function as op ``name``'s fake (shape-only) kernel."""
    return torch.library.register_fake(f"natten_cupy::{name}", lib=_LIB)


def _op(name):
    return getattr(torch.ops.natten_cupy, name).default


@_impl("na_fused_forward")
def _fused_forward_impl(q: Tensor, k: Tensor, v: Tensor, kernel_size: list[int],
                        stride: list[int], dilation: list[int], is_causal: list[bool],
                        scale: Optional[float], backend: str, allow_tf32: bool,
                        deterministic: bool, lse_grad: bool = False,
                        tile: str = "") -> tuple[Tensor, Tensor]:
    """(out, lse); with ``lse_grad`` the autograd formula takes lse's gradient too (else lse
    is not differentiable, so compiled graphs carry no lse gradient they do not need)."""
    options = (len(kernel_size), kernel_size, stride, dilation, is_causal, scale, backend,
               allow_tf32, deterministic, _tile_value(tile))
    e = _forward_entry(q, k, v, options)
    if e is not None:
        out, lse = _fast.run_torch_call(e, (q, k, v))
        return out, lse
    sel = _select_forward(q, k, v, options)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)  # Dv
    lse = torch.empty(q.shape[:-1], dtype=_accumulator(q.dtype), device=q.device)
    with _on_torch_stream(q.device):
        ops.run_fused_forward(sel.problem, sel.backend, *map(_view, (q, k, v, out, lse)))
    return out, lse


@_fake("na_fused_forward")
def _(q, k, v, kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
      deterministic, lse_grad=False, tile=""):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty(q.shape[:-1], dtype=_accumulator(q.dtype)))


@_impl("na_fused_backward")
def _fused_backward_impl(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, kernel_size: list[int], stride: list[int],
                         dilation: list[int], is_causal: list[bool], scale: Optional[float],
                         backend: str, allow_tf32: bool, deterministic: bool,
                         tile: str = "") -> tuple[Tensor, Tensor, Tensor]:
    options = (len(kernel_size), kernel_size, stride, dilation, is_causal, scale, backend,
               allow_tf32, deterministic, _tile_value(tile))
    tensors = (d_out, q, k, v, out, lse)
    e = _backward_entry(tensors, options)
    if e is not None:
        dq, dk, dv = _fast.run_torch_call(e, tensors)
        return dq, dk, dv
    sel = _select_backward(tensors, options)
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
    with _on_torch_stream(q.device):
        ops.run_fused_backward(sel.problem, sel.backend,
                               *map(_view, (d_out, q, k, v, out, lse, *grads)))
    return tuple(grads)


@_fake("na_fused_backward")
def _(d_out, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _refuse_double_backward(name):
    """The Autograd kernel of backward op ``name``: runs it, and where its inputs require
    grad (a gradient taken with ``create_graph=True``) gives its outputs a grad_fn that
    raises when differentiated."""
    op = _op(name)

    class Refused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            with _BELOW():
                return op(*args)

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(f"natten_cupy.{name} has no derivative: double backward (a "
                               "gradient of a gradient) through neighborhood attention is not "
                               "supported")

    def autograd_kernel(*args):
        if _grad_enabled() and _any_requires_grad(*args):
            return Refused.apply(*args)
        with _BELOW():
            return op(*args)

    _LIB.impl(name, autograd_kernel, "Autograd")


def _backward_ops_call(backward_fn, args):
    """Call a backward op from an autograd formula: below autograd in a plain backward, through
    its Autograd kernel (the double-backward refusal) when the graph of the gradient is kept."""
    if _grad_enabled():
        return backward_fn(*args)
    with _BELOW():
        return backward_fn(*args)


def _forward_op(q, k, v, opts, lse_grad=False):
    """The forward op on the 9 option arguments of ``_op_options`` (lse_grad sits between
    deterministic and tile in its schema)."""
    return _fused_forward(q, k, v, *opts[:8], lse_grad, opts[8])


class _FusedOp(torch.autograd.Function):
    """Autograd of ``na_fused_forward`` (its Autograd kernel applies it)."""

    @staticmethod
    def forward(ctx, q, k, v, options, lse_grad):
        with _BELOW():
            out, lse = _forward_op(q, k, v, options, lse_grad)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        opts = ctx.options
        if d_lse is None and d_out is not None:   # the common case: out's gradient alone
            dq, dk, dv = _backward_ops_call(_fused_backward, (d_out, q, k, v, out, lse, *opts))
        else:
            dq, dk, dv = fused_grads(
                q, k, v, out, lse, d_out, d_lse,
                lambda q, k, v: _backward_ops_call(_forward_op, (q, k, v, opts)),
                lambda *t: _backward_ops_call(_fused_backward, (*t, *opts)),
                _softmax_scale(q, opts[4]))
        return dq, dk, dv, None, None


def _fused_forward_autograd(q, k, v, kernel_size, stride, dilation, is_causal, scale, backend,
                            allow_tf32, deterministic, lse_grad=False, tile=""):
    options = (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
               deterministic, tile)
    if _grad_enabled() and _any_requires_grad(q, k, v):
        return _FusedOp.apply(q, k, v, options, lse_grad)
    with _BELOW():
        return _forward_op(q, k, v, options, lse_grad)


_fused_forward = _op("na_fused_forward")
_fused_backward = _op("na_fused_backward")
_LIB.impl("na_fused_forward", _fused_forward_autograd, "Autograd")
_refuse_double_backward("na_fused_backward")


@_impl("na_qk")
def _qk_impl(q: Tensor, k: Tensor, rpb: Optional[Tensor], kernel_size: list[int],
             dilation: list[int], is_causal: list[bool], backend: str,
             allow_tf32: bool) -> Tensor:
    problem = _args.check_qk(len(kernel_size), q, k, kernel_size, dilation, is_causal, rpb,
                             backend, allow_tf32)
    _check_tensors([("q", q), ("k", k), ("rpb", rpb)])
    sel = ops.select_backend("qk", problem, module_for(q.is_cuda), backend)
    attn = torch.empty(q.shape[:-1] + (problem.num_neighbors,), dtype=q.dtype, device=q.device)
    with _on_torch_stream(q.device):
        ops.run_qk(sel.problem, sel.backend, *map(_view, (q, k, rpb, attn)))
    return attn


@_fake("na_qk")
def _(q, k, rpb, kernel_size, *options):
    return q.new_empty(q.shape[:-1] + (math.prod(kernel_size),))


@_impl("na_qk_backward")
def _qk_backward_impl(d_attn: Tensor, q: Tensor, k: Tensor, with_rpb: bool,
                      kernel_size: list[int], dilation: list[int], is_causal: list[bool],
                      backend: str, allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, d_rpb); d_rpb is an empty tensor of shape (0,) unless ``with_rpb``."""
    problem = _args.check_qk_backward(len(kernel_size), d_attn, q, k, kernel_size, dilation,
                                      is_causal, None, backend, allow_tf32)
    _check_tensors([("d_attn", d_attn), ("q", q), ("k", k)])
    sel = ops.select_backend("qk_backward", problem, module_for(q.is_cuda), backend)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    d_rpb = None
    if with_rpb:  # accumulated in float32 (float64), zeroed by run_qk_backward
        d_rpb = torch.empty(_rpb_shape(problem.heads, problem.kernel_size),
                            dtype=_accumulator(q.dtype), device=q.device)
    with _on_torch_stream(q.device):
        ops.run_qk_backward(sel.problem, sel.backend, *map(_view, (d_attn, q, k, dq, dk, d_rpb)))
    if d_rpb is None:
        return dq, dk, q.new_empty((0,))
    return dq, dk, d_rpb.to(q.dtype)


@_fake("na_qk_backward")
def _(d_attn, q, k, with_rpb, kernel_size, *options):
    heads = q.shape[-2]
    d_rpb_shape = _rpb_shape(heads, kernel_size) if with_rpb else (0,)
    return q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty(d_rpb_shape)


class _QKOp(torch.autograd.Function):
    """Autograd of ``na_qk`` (its Autograd kernel applies it)."""

    @staticmethod
    def forward(ctx, q, k, rpb, options):
        with _BELOW():
            attn = _qk(q, k, rpb, *options)
        ctx.save_for_backward(q, k)
        ctx.with_rpb = rpb is not None
        ctx.options = options
        return attn

    @staticmethod
    def backward(ctx, d_attn):
        q, k = ctx.saved_tensors
        dq, dk, d_rpb = _backward_ops_call(_qk_backward,
                                           (d_attn, q, k, ctx.with_rpb, *ctx.options))
        return dq, dk, d_rpb if ctx.with_rpb else None, None


def _qk_autograd(q, k, rpb, kernel_size, dilation, is_causal, backend, allow_tf32):
    options = (kernel_size, dilation, is_causal, backend, allow_tf32)
    if _grad_enabled() and _any_requires_grad(q, k, rpb):
        return _QKOp.apply(q, k, rpb, options)
    with _BELOW():
        return _qk(q, k, rpb, *options)


_qk = _op("na_qk")
_qk_backward = _op("na_qk_backward")
_LIB.impl("na_qk", _qk_autograd, "Autograd")
_refuse_double_backward("na_qk_backward")


@_impl("na_av")
def _av_impl(attn: Tensor, v: Tensor, kernel_size: list[int], dilation: list[int],
             is_causal: list[bool], backend: str, allow_tf32: bool) -> Tensor:
    problem = _args.check_av(len(kernel_size), attn, v, kernel_size, dilation, is_causal,
                             backend, allow_tf32)
    _check_tensors([("attn", attn), ("v", v)])
    sel = ops.select_backend("av", problem, module_for(v.is_cuda), backend)
    # attn's heads (H), v's head dim: v may have fewer heads (H_kv, grouped-query attention)
    out = torch.empty(attn.shape[:-1] + v.shape[-1:], dtype=v.dtype, device=v.device)
    with _on_torch_stream(v.device):
        ops.run_av(sel.problem, sel.backend, *map(_view, (attn, v, out)))
    return out


@_fake("na_av")
def _(attn, v, *options):
    return v.new_empty(attn.shape[:-1] + v.shape[-1:])


@_impl("na_av_backward")
def _av_backward_impl(d_out: Tensor, attn: Tensor, v: Tensor, kernel_size: list[int],
                      dilation: list[int], is_causal: list[bool], backend: str,
                      allow_tf32: bool) -> tuple[Tensor, Tensor]:
    problem = _args.check_av_backward(len(kernel_size), d_out, attn, v, kernel_size, dilation,
                                      is_causal, backend, allow_tf32)
    _check_tensors([("d_out", d_out), ("attn", attn), ("v", v)])
    sel = ops.select_backend("av_backward", problem, module_for(v.is_cuda), backend)
    d_attn = torch.empty(attn.shape, dtype=attn.dtype, device=attn.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    with _on_torch_stream(v.device):
        ops.run_av_backward(sel.problem, sel.backend, *map(_view, (d_out, attn, v, d_attn, dv)))
    return d_attn, dv


@_fake("na_av_backward")
def _(d_out, attn, v, *options):
    return attn.new_empty(attn.shape), v.new_empty(v.shape)


class _AVOp(torch.autograd.Function):
    """Autograd of ``na_av`` (its Autograd kernel applies it)."""

    @staticmethod
    def forward(ctx, attn, v, options):
        with _BELOW():
            out = _av(attn, v, *options)
        ctx.save_for_backward(attn, v)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, d_out):
        attn, v = ctx.saved_tensors
        d_attn, dv = _backward_ops_call(_av_backward, (d_out, attn, v, *ctx.options))
        return d_attn, dv, None


def _av_autograd(attn, v, kernel_size, dilation, is_causal, backend, allow_tf32):
    options = (kernel_size, dilation, is_causal, backend, allow_tf32)
    if _grad_enabled() and _any_requires_grad(attn, v):
        return _AVOp.apply(attn, v, options)
    with _BELOW():
        return _av(attn, v, *options)


_av = _op("na_av")
_av_backward = _op("na_av_backward")
_LIB.impl("na_av", _av_autograd, "Autograd")
_refuse_double_backward("na_av_backward")
