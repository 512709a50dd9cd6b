"""The PyTorch layer's machinery: custom ops, eager autograd functions, lse gradients.

* custom ops ``torch.ops.natten_cupy.*`` (``torch.library.custom_op``): validate, select a
  backend, let torch allocate every output, and fill it through ``natten_cupy.ops.run_*`` on
  zero-copy NumPy (CPU) or CuPy (CUDA) views, launched on torch's current stream (or through a
  warm call's plan, ``natten_cupy._fast``). Each op has a fake (shape-only) implementation for
  ``torch.compile`` and, for the forward ops, an autograd formula that saves its tensors
  through ``ctx.save_for_backward`` (so saved-tensor hooks such as
  ``torch.autograd.graph.save_on_cpu`` apply). ``natten_cupy.torch`` calls them under
  ``torch.compile``;
* eager autograd functions (``FusedNA``, ``QK``, ``AV``) over warm-call entries: the same
  arithmetic without the custom-op dispatch, for eager calls on CUDA tensors;
* the gradient that flows from lse (for ``return_lse`` and ``merge_attentions``):
  d lse_i / d q_i = scale * sum_j P_ij k_j and d lse_i / d k_j = scale * P_ij q_i, computed
  with the forward (values k) and the backward (output gradient d_lse * q, whose dv is the
  dk term) of the same problem.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import numpy
import torch
from torch import Tensor

from . import _args, _fast, ops
from ._arrays import check_one_device
from ._dtypes import BFLOAT16, accumulator_dtype, canonical_dtype


# ---- torch tensors as NumPy / CuPy arrays -----------------------------------------------

def _check_tensors(named):
    """The checks the array API makes in ``Inputs.gather``, for torch: types, devices."""
    present = [(n, x) for n, x in named if x is not None]
    for n, x in present:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type not in ("cpu", "cuda"):
            raise TypeError(f"{n} lives on device {x.device}; only CPU and CUDA tensors are "
                            "supported")
    check_one_device({n: ("gpu" if x.is_cuda else "cpu") for n, x in present})
    devices = {x.device for _, x in present}
    if len(devices) > 1:
        raise ValueError("all arrays must be on the same GPU, got devices "
                         f"{sorted(d.index for d in devices)}")


def _xp(device):
    """The array module that runs on ``device``: numpy (CPU) or cupy (CUDA)."""
    if device.type == "cpu":
        return numpy
    import cupy
    return cupy


@contextlib.contextmanager
def _on_torch_stream(device):
    """Launch context: the tensor's GPU and torch's current stream there (nothing on CPU)."""
    if device.type == "cpu":
        yield
        return
    import cupy
    stream = cupy.cuda.Stream.from_external(torch.cuda.current_stream(device))
    with cupy.cuda.Device(device.index), stream:
        yield


def _view(t):
    """A zero-copy, writable NumPy/CuPy view of tensor ``t`` (None stays None).

    Call inside ``_on_torch_stream`` so that CuPy imports the tensor on torch's stream.
    """
    if t is None:
        return None
    t = t.detach()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: reinterpret the bits
            return t.view(torch.int16).numpy().view(BFLOAT16)
        return t.numpy()
    import cupy
    return cupy.from_dlpack(t)


def per_axis(rank, kernel_size, dilation, is_causal, stride=1):
    """Per-axis option lists (what the custom ops take), validated as the array API does."""
    return ([int(x) for x in _args.normalize_axes("kernel_size", kernel_size, rank, int)],
            [int(x) for x in _args.normalize_axes("stride", stride, rank, int)],
            [int(x) for x in _args.normalize_axes("dilation", dilation, rank, int)],
            [bool(x) for x in _args.normalize_axes("is_causal", is_causal, rank, bool)])


def _accumulator(dtype):
    """lse / d_rpb accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rpb_shape(heads, kernel_size):
    return (heads,) + tuple(2 * k - 1 for k in kernel_size)


# ---- validation, cached per call signature ----------------------------------------------

def _forward_problem(q, k, v, options):
    """(problem, backend) of a fused forward; raises what the array API raises."""
    rank, kernel_size, stride, dilation, is_causal, scale, backend, tf32, det = options
    problem = _args.check_fused(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale,
                                backend, tf32, det)
    _check_tensors([("q", q), ("k", k), ("v", v)])
    return problem, ops.select_backend("fused_forward", problem, _xp(q.device), backend)


def _backward_problem(tensors, options):
    rank, kernel_size, stride, dilation, is_causal, scale, backend, tf32, det = options
    d_out, q, k, v, out, lse = tensors
    problem = _args.check_fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride,
                                         dilation, is_causal, scale, backend, tf32, det)
    _check_tensors([("d_out", d_out), ("q", q), ("k", k), ("v", v), ("out", out),
                    ("lse", lse)])
    return problem, ops.select_backend("fused_backward", problem, _xp(q.device), backend)


def _like(x):
    return (tuple(x.shape), canonical_dtype(x.dtype))


def _forward_entry(q, k, v, options):
    """The fast-path entry of a fused forward on CUDA tensors (validated on its signature's
    first call), or None where the general path runs it."""
    return _fast.torch_entry(
        "fused_forward", options[0], (q, k, v), options,
        lambda: _forward_problem(q, k, v, options),
        lambda p: [_like(q), (tuple(q.shape[:-1]), accumulator_dtype(p.dtype))])


def _backward_entry(tensors, options):
    q, k, v = tensors[1:4]
    return _fast.torch_entry("fused_backward", options[0], tensors, options,
                             lambda: _backward_problem(tensors, options),
                             lambda p: [_like(q), _like(k), _like(v)])


def _unfused_entry(op, tensors, options):
    """Fast-path entry of an unfused op on CUDA tensors (``options``: rank, kernel_size,
    dilation, is_causal, backend, allow_tf32), or None."""
    rank, ks, dl, ca, backend, tf32 = options

    def problem_of():
        named = list(zip(_UNFUSED_NAMES[op], tensors))
        problem = _UNFUSED_CHECKS[op](rank, *tensors, ks, dl, ca, backend, tf32)
        _check_tensors(named)
        return problem, ops.select_backend(op, problem, _xp(tensors[0].device), backend)

    return _fast.torch_entry(op, rank, tensors, options, problem_of,
                             lambda p: _UNFUSED_OUTPUTS[op](p, *tensors))


_UNFUSED_NAMES = {"qk": ("q", "k", "rpb"), "av": ("attn", "v"),
                  "qk_backward": ("d_attn", "q", "k"), "av_backward": ("d_out", "attn", "v")}
_UNFUSED_CHECKS = {
    "qk": lambda r, q, k, rpb, ks, dl, ca, be, tf: _args.check_qk(r, q, k, ks, dl, ca, rpb,
                                                                  be, tf),
    "av": _args.check_av,
    "qk_backward": lambda r, da, q, k, ks, dl, ca, be, tf: _args.check_qk_backward(
        r, da, q, k, ks, dl, ca, None, be, tf),
    "av_backward": _args.check_av_backward}
_UNFUSED_OUTPUTS = {
    "qk": lambda p, q, k, rpb: [(tuple(q.shape[:-1]) + (p.num_neighbors,), p.dtype)],
    "av": lambda p, attn, v: [_like(v)],
    "qk_backward": lambda p, d_attn, q, k: [_like(q), _like(k)],
    "av_backward": lambda p, d_out, attn, v: [_like(attn), _like(v)]}


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
    return _fused_forward(q, k, v, *_op_options(options))


def _fused_backward_no_grad(tensors, options):
    e = _backward_entry(tensors, options)
    if e is not None:
        dq, dk, dv = _fast.run_torch_call(e, tensors)
        return dq, dk, dv
    return _fused_backward(*tensors, *_op_options(options))


def _op_options(options):
    """The custom ops' option arguments from (rank, kernel_size, stride, dilation, is_causal,
    scale, backend, allow_tf32, deterministic)."""
    rank, ks, st, dl, ca, scale, backend, tf32, det = options
    ks, st, dl, ca = per_axis(rank, ks, dl, ca, st)
    return ks, st, dl, ca, None if scale is None else float(scale), backend, bool(tf32), bool(det)


def _softmax_scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def lse_grad_terms(q, k, lse, d_lse, forward, backward, scale):
    """The parts of dq and dk that flow from the gradient ``d_lse`` of lse (float32):
    scale * d_lse_i * sum_j P_ij k_j (the forward with values k), and scale * sum_i P_ij
    d_lse_i q_i (the dv of the backward whose output gradient is d_lse * q; dv needs no
    output, so q stands in for it). ``forward(q, k, v)`` -> (out, lse) and
    ``backward(d_out, q, k, v, out, lse)`` -> (dq, dk, dv) run the problem outside autograd."""
    acc = _accumulator(q.dtype)
    d = d_lse.to(acc).unsqueeze(-1)
    pk, _ = forward(q, k, k)
    _, _, pq = backward((d * q.to(acc)).to(q.dtype), q, k, k, q, lse)
    return scale * d * pk.to(acc), scale * pq.to(acc)


def fused_grads(q, k, v, out, lse, d_out, d_lse, forward, backward, scale):
    """(dq, dk, dv) from the gradients of out and lse (either may be None)."""
    if d_out is not None:
        dq, dk, dv = backward(d_out, q, k, v, out, lse)
    else:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if d_lse is not None:
        tq, tk = lse_grad_terms(q, k, lse, d_lse, forward, backward, scale)
        dq, dk = (dq.to(tq.dtype) + tq).to(q.dtype), (dk.to(tk.dtype) + tk).to(k.dtype)
    return dq, dk, dv


class FusedNA(torch.autograd.Function):
    """Eager fused NA on CUDA tensors: the fast path's forward and backward, no custom-op
    dispatch (``natten_cupy.torch`` takes the custom op under torch.compile, where graphs
    need it). Returns (out, lse); gradients flow from both (lse: see ``lse_grad_terms``)."""

    @staticmethod
    def forward(ctx, q, k, v, entry, options):
        out, lse = _fast.run_torch_call(entry, (q, k, v))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        opts = ctx.options
        dq, dk, dv = fused_grads(
            q, k, v, out, lse, d_out, d_lse,
            lambda q, k, v: _fused_no_grad(q, k, v, opts),
            lambda *t: _fused_backward_no_grad(t, opts), _softmax_scale(q, opts[5]))
        return dq, dk, dv, None, None


# ---- custom ops (per-axis options arrive as lists) --------------------------------------

@torch.library.custom_op("natten_cupy::na_fused_forward", mutates_args=())
def _fused_forward(q: Tensor, k: Tensor, v: Tensor, kernel_size: list[int],
                   stride: list[int], dilation: list[int], is_causal: list[bool],
                   scale: Optional[float], backend: str, allow_tf32: bool,
                   deterministic: bool, lse_grad: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse); with ``lse_grad`` the autograd formula takes lse's gradient too (else lse
    is not differentiable, so compiled graphs carry no lse gradient they do not need)."""
    options = (len(kernel_size), kernel_size, stride, dilation, is_causal, scale, backend,
               allow_tf32, deterministic)
    e = _forward_entry(q, k, v, options)
    if e is not None:
        out, lse = _fast.run_torch_call(e, (q, k, v))
        return out, lse
    problem, be = _forward_problem(q, k, v, options)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=_accumulator(q.dtype), device=q.device)
    with _on_torch_stream(q.device):
        ops.run_fused_forward(problem, be, *map(_view, (q, k, v, out, lse)))
    return out, lse


@_fused_forward.register_fake
def _(q, k, v, kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
      deterministic, lse_grad=False):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=_accumulator(q.dtype))


@torch.library.custom_op("natten_cupy::na_fused_backward", mutates_args=())
def _fused_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    kernel_size: list[int], stride: list[int], dilation: list[int],
                    is_causal: list[bool], scale: Optional[float], backend: str,
                    allow_tf32: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    options = (len(kernel_size), kernel_size, stride, dilation, is_causal, scale, backend,
               allow_tf32, deterministic)
    tensors = (d_out, q, k, v, out, lse)
    e = _backward_entry(tensors, options)
    if e is not None:
        dq, dk, dv = _fast.run_torch_call(e, tensors)
        return dq, dk, dv
    problem, be = _backward_problem(tensors, options)
    grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
    with _on_torch_stream(q.device):
        ops.run_fused_backward(problem, be, *map(_view, (d_out, q, k, v, out, lse, *grads)))
    return tuple(grads)


@_fused_backward.register_fake
def _(d_out, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fused_setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = options[:8]   # lse_grad aside
    ctx.n_options = len(options)
    if not (len(options) > 8 and options[8]):
        ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _fused_grad(ctx, d_out, d_lse):
    q, k, v, out, lse = ctx.saved_tensors
    opts = ctx.options
    dq, dk, dv = fused_grads(q, k, v, out, lse, d_out, d_lse,
                             lambda q, k, v: _fused_forward(q, k, v, *opts),
                             lambda *t: _fused_backward(*t, *opts),
                             _softmax_scale(q, opts[4]))
    return (dq, dk, dv) + (None,) * ctx.n_options


_fused_forward.register_autograd(_fused_grad, setup_context=_fused_setup_context)


@torch.library.custom_op("natten_cupy::na_qk", mutates_args=())
def _qk(q: Tensor, k: Tensor, rpb: Optional[Tensor], kernel_size: list[int],
        dilation: list[int], is_causal: list[bool], backend: str, allow_tf32: bool) -> Tensor:
    problem = _args.check_qk(len(kernel_size), q, k, kernel_size, dilation, is_causal, rpb,
                             backend, allow_tf32)
    _check_tensors([("q", q), ("k", k), ("rpb", rpb)])
    be = ops.select_backend("qk", problem, _xp(q.device), backend)
    attn = torch.empty(q.shape[:-1] + (problem.num_neighbors,), dtype=q.dtype, device=q.device)
    with _on_torch_stream(q.device):
        ops.run_qk(problem, be, *map(_view, (q, k, rpb, attn)))
    return attn


@_qk.register_fake
def _(q, k, rpb, kernel_size, *options):
    return q.new_empty(q.shape[:-1] + (math.prod(kernel_size),))


@torch.library.custom_op("natten_cupy::na_qk_backward", mutates_args=())
def _qk_backward(d_attn: Tensor, q: Tensor, k: Tensor, with_rpb: bool,
                 kernel_size: list[int], dilation: list[int], is_causal: list[bool],
                 backend: str, allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, d_rpb); d_rpb is an empty tensor of shape (0,) unless ``with_rpb``."""
    problem = _args.check_qk_backward(len(kernel_size), d_attn, q, k, kernel_size, dilation,
                                      is_causal, None, backend, allow_tf32)
    _check_tensors([("d_attn", d_attn), ("q", q), ("k", k)])
    be = ops.select_backend("qk_backward", problem, _xp(q.device), backend)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    d_rpb = None
    if with_rpb:  # accumulated in float32 (float64), zeroed by run_qk_backward
        d_rpb = torch.empty(_rpb_shape(problem.heads, problem.kernel_size),
                            dtype=_accumulator(q.dtype), device=q.device)
    with _on_torch_stream(q.device):
        ops.run_qk_backward(problem, be, *map(_view, (d_attn, q, k, dq, dk, d_rpb)))
    if d_rpb is None:
        return dq, dk, q.new_empty((0,))
    return dq, dk, d_rpb.to(q.dtype)


@_qk_backward.register_fake
def _(d_attn, q, k, with_rpb, kernel_size, *options):
    heads = q.shape[-2]
    d_rpb_shape = _rpb_shape(heads, kernel_size) if with_rpb else (0,)
    return q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty(d_rpb_shape)


def _qk_setup_context(ctx, inputs, output):
    q, k, rpb, *options = inputs
    ctx.save_for_backward(q, k)
    ctx.with_rpb = rpb is not None
    ctx.options = options


def _qk_grad(ctx, d_attn):
    q, k = ctx.saved_tensors
    dq, dk, d_rpb = _qk_backward(d_attn, q, k, ctx.with_rpb, *ctx.options)
    return (dq, dk, d_rpb if ctx.with_rpb else None) + (None,) * len(ctx.options)


_qk.register_autograd(_qk_grad, setup_context=_qk_setup_context)


@torch.library.custom_op("natten_cupy::na_av", mutates_args=())
def _av(attn: Tensor, v: Tensor, kernel_size: list[int], dilation: list[int],
        is_causal: list[bool], backend: str, allow_tf32: bool) -> Tensor:
    problem = _args.check_av(len(kernel_size), attn, v, kernel_size, dilation, is_causal,
                             backend, allow_tf32)
    _check_tensors([("attn", attn), ("v", v)])
    be = ops.select_backend("av", problem, _xp(v.device), backend)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    with _on_torch_stream(v.device):
        ops.run_av(problem, be, *map(_view, (attn, v, out)))
    return out


@_av.register_fake
def _(attn, v, *options):
    return v.new_empty(v.shape)


@torch.library.custom_op("natten_cupy::na_av_backward", mutates_args=())
def _av_backward(d_out: Tensor, attn: Tensor, v: Tensor, kernel_size: list[int],
                 dilation: list[int], is_causal: list[bool], backend: str,
                 allow_tf32: bool) -> tuple[Tensor, Tensor]:
    problem = _args.check_av_backward(len(kernel_size), d_out, attn, v, kernel_size, dilation,
                                      is_causal, backend, allow_tf32)
    _check_tensors([("d_out", d_out), ("attn", attn), ("v", v)])
    be = ops.select_backend("av_backward", problem, _xp(v.device), backend)
    d_attn = torch.empty(attn.shape, dtype=attn.dtype, device=attn.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    with _on_torch_stream(v.device):
        ops.run_av_backward(problem, be, *map(_view, (d_out, attn, v, d_attn, dv)))
    return d_attn, dv


@_av_backward.register_fake
def _(d_out, attn, v, *options):
    return attn.new_empty(attn.shape), v.new_empty(v.shape)


def _av_setup_context(ctx, inputs, output):
    attn, v, *options = inputs
    ctx.save_for_backward(attn, v)
    ctx.options = options


def _av_grad(ctx, d_out):
    attn, v = ctx.saved_tensors
    d_attn, dv = _av_backward(d_out, attn, v, *ctx.options)
    return (d_attn, dv) + (None,) * len(ctx.options)


_av.register_autograd(_av_grad, setup_context=_av_setup_context)


