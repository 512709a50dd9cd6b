"""Fused NA with a relative positional bias and/or additional tokens: custom ops, eager calls.

Ops of their own (the plain fused ops' schemas stay as they are), defined on the library of
``_torch_library``: rpb [H, 2k-1, ...] and the additional tokens [B, T, H_x, D] (keys,
values; given together) are optional inputs of both, and the backward returns their gradients
too (an empty tensor for one not given). Eager calls go through warm-call entries where one
plan runs them (``FusedExtNA``, below); the ops validate every call (``_select_ext``).
"""

from __future__ import annotations

from typing import Optional

import numpy
import torch
from torch import Tensor

from . import _args, _fast, _operands, ops
from ._arrays import module_for
from ._torch_common import (_accumulator, _check_tensors, _on_torch_stream, _op_options,
                            _tile_value, _view)
from ._torch_eager import _applier, records
from ._torch_library import (_BELOW, _LIB, _any_requires_grad, _backward_ops_call, _fake,
                             _grad_enabled, _impl, _op, _refuse_double_backward)


_LIB.define("na_fused_forward_ext(Tensor q, Tensor k, Tensor v, Tensor? rpb, "
            "Tensor? additional_keys, Tensor? additional_values, SymInt[] kernel_size, "
            "SymInt[] stride, SymInt[] dilation, bool[] is_causal, float? scale, str backend, "
            "bool allow_tf32, bool deterministic, bool lse_grad=False, str tile=\"\") "
            "-> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("na_fused_backward_ext(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, "
            "Tensor lse, Tensor? rpb, Tensor? additional_keys, Tensor? additional_values, "
            "SymInt[] kernel_size, SymInt[] stride, SymInt[] dilation, bool[] is_causal, "
            "float? scale, str backend, bool allow_tf32, bool deterministic, str tile=\"\") "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))


def _select_ext(op, tensors, rpb, keys, values, opts):
    """The ``Selection`` of a fused op with a bias and/or additional tokens from the ops'
    option arguments."""
    ks, st, dl, ca, scale, backend, tf32, det, tile = opts
    rank, tile = len(ks), _tile_value(tile)
    if op == "fused_forward":
        q, k, v = tensors
        problem = _args.check_fused(rank, q, k, v, ks, st, dl, ca, scale, backend, tf32, det,
                                    tile, rpb, keys, values)
        names = ("q", "k", "v")
    else:
        d_out, q, k, v, out, lse = tensors
        problem = _args.check_fused_backward(rank, d_out, q, k, v, out, lse, ks, st, dl, ca,
                                             scale, backend, tf32, det, tile, rpb, keys, values)
        names = ("d_out", "q", "k", "v", "out", "lse")
    _check_tensors(list(zip(names, tensors)) + [("rpb", rpb), ("additional_keys", keys),
                                                ("additional_values", values)])
    return ops.select_backend(op, problem, module_for(q.is_cuda), backend)


_TORCH_DTYPES = {numpy.dtype(numpy.float32): torch.float32,
                 numpy.dtype(numpy.float64): torch.float64}


def _torch_workspaces(device):
    """Workspaces in torch's allocator on ``device`` (capturable in a CUDA graph), as views."""
    def allocate(shape, dtype):
        t = torch.empty(tuple(shape), dtype=_TORCH_DTYPES[numpy.dtype(dtype)], device=device)
        return _view(t)
    return _operands.workspaces_from(allocate)


@_impl("na_fused_forward_ext")
def _fused_forward_ext_impl(q: Tensor, k: Tensor, v: Tensor, rpb: Optional[Tensor],
                            additional_keys: Optional[Tensor],
                            additional_values: Optional[Tensor], kernel_size: list[int],
                            stride: list[int], dilation: list[int], is_causal: list[bool],
                            scale: Optional[float], backend: str, allow_tf32: bool,
                            deterministic: bool, lse_grad: bool = False, tile: str = ""
                            ) -> tuple[Tensor, Tensor]:
    opts = (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
            deterministic, tile)
    sel = _select_ext("fused_forward", (q, k, v), rpb, additional_keys, additional_values,
                      opts)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=_accumulator(q.dtype), device=q.device)
    with _on_torch_stream(q.device), _torch_workspaces(q.device):
        qa, ka, va, oa, la, ra, xk, xv = map(_view, (q, k, v, out, lse, rpb, additional_keys,
                                                  additional_values))
        ops.run_fused_forward(sel.problem, sel.backend, qa, ka, va, oa, la, ra,
                              None if xk is None else (xk, xv))
    return out, lse


@_fake("na_fused_forward_ext")
def _(q, k, v, rpb, keys, values, kernel_size, *options):
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
            q.new_empty(q.shape[:-1], dtype=_accumulator(q.dtype)))


def _ext_grads_like(q, k, v, rpb, keys, values):
    """Empty gradients of the ext backward: rpb's and the tokens' a [0] tensor when absent."""
    like = lambda x: q.new_empty((0,)) if x is None else x.new_empty(x.shape)
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), like(rpb),
            like(keys), like(values)]


@_impl("na_fused_backward_ext")
def _fused_backward_ext_impl(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, rpb: Optional[Tensor],
                             additional_keys: Optional[Tensor],
                             additional_values: Optional[Tensor], kernel_size: list[int],
                             stride: list[int], dilation: list[int], is_causal: list[bool],
                             scale: Optional[float], backend: str, allow_tf32: bool,
                             deterministic: bool, tile: str = ""
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
            deterministic, tile)
    tensors = (d_out, q, k, v, out, lse)
    sel = _select_ext("fused_backward", tensors, rpb, additional_keys, additional_values,
                      opts)
    grads = _ext_grads_like(q, k, v, rpb, additional_keys, additional_values)
    with _on_torch_stream(q.device), _torch_workspaces(q.device):
        arrays = map(_view, (*tensors, *grads[:3]))
        ra, xk, xv = map(_view, (rpb, additional_keys, additional_values))
        g_rpb, g_xk, g_xv = map(_view, grads[3:])
        ops.run_fused_backward(sel.problem, sel.backend, *arrays, ra,
                               None if ra is None else g_rpb,
                               None if xk is None else (xk, xv),
                               None if xk is None else (g_xk, g_xv))
    return tuple(grads)


@_fake("na_fused_backward_ext")
def _(d_out, q, k, v, out, lse, rpb, keys, values, *options):
    return tuple(_ext_grads_like(q, k, v, rpb, keys, values))


_fused_forward_ext = _op("na_fused_forward_ext")
_fused_backward_ext = _op("na_fused_backward_ext")


def lse_grads_ext(q, k, v, out, lse, rpb, keys, values, d_lse, opts):
    """The gradients (dq, dk, dv, d_rpb, d_keys, d_values) that flow from ``d_lse``, from one
    backward call: with values 0 (so dP = 0) and (out, d_out) = (e_0, -d_lse e_0) per row (so
    delta = -d_lse), its dS_ij = P_ij d_lse_i, which is d lse_i / d score_ij times d_lse_i
    (over the additional tokens too)."""
    d_out = torch.zeros_like(out)
    one = torch.zeros_like(out)
    d_out[..., 0] = -d_lse.to(out.dtype)
    one[..., 0] = 1
    zero_values = None if values is None else torch.zeros_like(values)
    dq, dk, _, d_rpb, d_keys, _ = _backward_ops_call(
        _fused_backward_ext, (d_out, q, k, torch.zeros_like(v), one, lse, rpb, keys,
                              zero_values, *opts))
    return (dq, dk, torch.zeros_like(v), d_rpb, d_keys,
            None if values is None else torch.zeros_like(values))


def _ext_grads(saved, opts, d_out, d_lse, warm=None):
    """The gradients (dq, dk, dv, d_rpb, d_keys, d_values; None for an input not given) of
    the ext forward from those of out and lse; ``opts``: the ops' option arguments; ``warm``:
    a fast-path entry of the backward that serves out's gradient."""
    q, k, v, rpb, keys, values, out, lse = saved
    grads = None
    if d_out is not None:
        if warm is not None:
            got = iter(_fast.run_torch_call(warm, (d_out, q, k, v, out, lse, rpb, keys,
                                                   values)))
            grads = [next(got), next(got), next(got), None if rpb is None else next(got)]
            grads += [None, None] if keys is None else [next(got), next(got)]
        else:
            grads = _backward_ops_call(_fused_backward_ext, (d_out, q, k, v, out, lse, rpb,
                                                             keys, values, *opts))
    if d_lse is not None:
        more = lse_grads_ext(q, k, v, out, lse, rpb, keys, values, d_lse, opts)
        grads = more if grads is None else tuple(
            b if a is None else a if b is None else a + b for a, b in zip(grads, more))
    if grads is None:
        return (None,) * 6
    grads = list(grads)
    for i, x in ((3, rpb), (4, keys), (5, values)):   # inputs not given: no gradient
        if x is None:
            grads[i] = None
    return tuple(grads)


class _FusedExtOp(torch.autograd.Function):
    """Autograd of ``na_fused_forward_ext``: gradients for q, k, v, rpb and the additional
    tokens, from out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, rpb, keys, values, options, lse_grad):
        with _BELOW():
            out, lse = _fused_forward_ext(q, k, v, rpb, keys, values, *options[:8], lse_grad,
                                          options[8])
        ctx.save_for_backward(q, k, v, rpb, keys, values, out, lse)
        ctx.options = options
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        return (*_ext_grads(ctx.saved_tensors, ctx.options, d_out, d_lse), None, None)


# ---- warm eager calls of the ext ops ------------------------------------------------------

def _ext_entry(op, tensors, options):
    """The fast-path entry of an ext op on CUDA tensors (``tensors``: the ext op's inputs,
    None where not given; ``options``: (rank, kernel_size, stride, dilation, is_causal,
    scale, backend, allow_tf32, deterministic, tile) as the caller gave them), or None."""
    def select():
        return _select_ext(op, tensors[:-3], *tensors[-3:], _op_options(options))

    return _fast.torch_entry(op, options[0], tensors, options, select,
                             lambda problem: _fast.ext_shape(op, problem, tensors),
                             op + "_ext")


class FusedExtNA(torch.autograd.Function):
    """Eager fused NA with a bias and/or additional tokens on CUDA tensors through the fast
    path (``_FusedExtOp`` without the op's dispatch and per-call validation); returns (out,
    lse), gradients from both."""

    @staticmethod
    def forward(ctx, q, k, v, rpb, keys, values, entry, options):
        out, lse = _fast.run_torch_call(entry, (q, k, v, rpb, keys, values))
        ctx.save_for_backward(q, k, v, rpb, keys, values, out, lse)
        ctx.options = options
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        saved = ctx.saved_tensors
        warm = None
        if d_out is not None:
            q, k, v, rpb, keys, values, out, lse = saved
            warm = _ext_entry("fused_backward", (d_out, q, k, v, out, lse, rpb, keys, values),
                              ctx.options)
        # the ops' options only where an op runs (no warm entry, or lse's gradient)
        opts = None if warm is not None and d_lse is None else _op_options(ctx.options)
        return (*_ext_grads(saved, opts, d_out, d_lse, warm), None, None)


def fused_ext_eager(q, k, v, rpb, keys, values, options):
    """(out, lse) of an eager ext call through the fast path, or None where it does not
    serve the call (``options`` as ``_ext_entry`` takes them)."""
    e = _ext_entry("fused_forward", (q, k, v, rpb, keys, values), options)
    if e is None:
        return None
    if records(q, k, v, rpb, keys, values):
        return fused_ext_apply(q, k, v, rpb, keys, values, e, options)
    return tuple(_fast.run_torch_call(e, (q, k, v, rpb, keys, values)))


def _fused_forward_ext_autograd(q, k, v, rpb, keys, values, kernel_size, stride, dilation,
                                is_causal, scale, backend, allow_tf32, deterministic,
                                lse_grad=False, tile=""):
    options = (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
               deterministic, tile)
    if _grad_enabled() and _any_requires_grad(
            *[x for x in (q, k, v, rpb, keys, values) if x is not None]):
        return _FusedExtOp.apply(q, k, v, rpb, keys, values, options, lse_grad)
    with _BELOW():
        return _fused_forward_ext(q, k, v, rpb, keys, values, *options[:8], lse_grad, tile)


_LIB.impl("na_fused_forward_ext", _fused_forward_ext_autograd, "Autograd")
_refuse_double_backward("na_fused_backward_ext")


# The eager Function's apply (``_applier``), for natten_cupy.torch.
fused_ext_apply = _applier(FusedExtNA)
