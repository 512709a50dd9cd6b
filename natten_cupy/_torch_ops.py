"""The PyTorch layer's machinery: custom ops, eager autograd functions, lse gradients.

* custom ops ``torch.ops.natten_cupy.*`` (``torch.library.Library`` definitions with Python
  kernels; cheaper per call than ``torch.library.custom_op``, see the section below):
  validate, select a backend, let torch allocate every output, and fill it through
  ``natten_cupy.ops.run_*`` on zero-copy NumPy (CPU) or CuPy (CUDA) views, launched on
  torch's current stream (or through a warm call's plan, ``natten_cupy._fast``). Each op has
  a fake (shape-only) kernel for ``torch.compile`` and an Autograd kernel: the forward ops'
  saves its tensors through ``ctx.save_for_backward`` (so saved-tensor hooks such as
  ``torch.autograd.graph.save_on_cpu`` apply), the backward ops' refuses double backward.
  ``natten_cupy.torch`` calls them under ``torch.compile`` and on CPU tensors;
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

from . import _args, _fast, _operands, ops
from ._arrays import check_one_device, check_one_gpu, module_for, on_device, torch_stream
from ._dtypes import BFLOAT16, accumulator_dtype, canonical_dtype


# ---- torch tensors as NumPy / CuPy arrays -----------------------------------------------

def _check_tensors(named):
    """The checks the array API makes in ``_arrays.place``, for torch: types, devices (not
    requires grad, which ``place`` refuses: the ops run below autograd)."""
    present = [(n, x) for n, x in named if x is not None]
    for n, x in present:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(x).__name__}")
        if x.device.type not in ("cpu", "cuda"):
            raise TypeError(f"{n} lives on device {x.device}; only CPU and CUDA tensors are "
                            "supported")
    check_one_device({n: ("gpu" if x.is_cuda else "cpu") for n, x in present})
    check_one_gpu([x.device.index for _, x in present if x.is_cuda])


def _on_torch_stream(device):
    """Launch context: the tensor's GPU and torch's current stream there (nothing on CPU)."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    cupy = module_for(True)
    return on_device(cupy, device.index, torch_stream(cupy, device))


def _view(t):
    """A zero-copy, writable NumPy/CuPy view of tensor ``t`` (None stays None).

    Call inside ``_on_torch_stream`` so that CuPy imports the tensor on torch's stream.
    Not ``_arrays._as_numpy`` / ``_as_cupy``: those import the array API's inputs, of any
    framework, and may copy (a negative view is resolved, a JAX array read through its
    buffer), harmless for an input; these views are also the outputs torch allocated, written
    in place, so nothing here may copy. Tensors may require grad (the ops run below autograd,
    hence ``detach``); torch's dispatcher has resolved negative views before the ops run.
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

def _select_forward(q, k, v, options):
    """The ``Selection`` of a fused forward; raises what the array API raises."""
    rank, kernel_size, stride, dilation, is_causal, scale, backend, tf32, det, tile = options
    problem = _args.check_fused(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale,
                                backend, tf32, det, tile)
    _check_tensors([("q", q), ("k", k), ("v", v)])
    return ops.select_backend("fused_forward", problem, module_for(q.is_cuda), backend)


def _select_backward(tensors, options):
    rank, kernel_size, stride, dilation, is_causal, scale, backend, tf32, det, tile = options
    d_out, q, k, v, out, lse = tensors
    problem = _args.check_fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride,
                                         dilation, is_causal, scale, backend, tf32, det, tile)
    _check_tensors([("d_out", d_out), ("q", q), ("k", k), ("v", v), ("out", out),
                    ("lse", lse)])
    return ops.select_backend("fused_backward", problem, module_for(q.is_cuda), backend)


def _like(x):
    return (tuple(x.shape), canonical_dtype(x.dtype))


def _forward_entry(q, k, v, options):
    """The fast-path entry of a fused forward on CUDA tensors (validated on its signature's
    first call), or None where the general path runs it."""
    return _fast.torch_entry(
        "fused_forward", options[0], (q, k, v), options,
        lambda: _select_forward(q, k, v, options),
        lambda p: [(tuple(q.shape[:-1]) + (v.shape[-1],), p.dtype),   # v's head dim
                   (tuple(q.shape[:-1]), accumulator_dtype(p.dtype))])


def _backward_entry(tensors, options):
    q, k, v = tensors[1:4]
    return _fast.torch_entry("fused_backward", options[0], tensors, options,
                             lambda: _select_backward(tensors, options),
                             lambda p: [_like(q), _like(k), _like(v)])


def _unfused_entry(op, tensors, options):
    """Fast-path entry of an unfused op on CUDA tensors (``options``: rank, kernel_size,
    dilation, is_causal, backend, allow_tf32), or None."""
    rank, ks, dl, ca, backend, tf32 = options

    def select():
        named = list(zip(_UNFUSED_NAMES[op], tensors))
        problem = _UNFUSED_CHECKS[op](rank, *tensors, ks, dl, ca, backend, tf32)
        _check_tensors(named)
        return ops.select_backend(op, problem, module_for(tensors[0].is_cuda), backend)

    return _fast.torch_entry(op, rank, tensors, options, select,
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
    "av": lambda p, attn, v: [(tuple(attn.shape[:-1]) + (v.shape[-1],), p.dtype)],
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
    return _forward_op(q, k, v, _op_options(options))


def _fused_backward_no_grad(tensors, options):
    e = _backward_entry(tensors, options)
    if e is not None:
        dq, dk, dv = _fast.run_torch_call(e, tensors)
        return dq, dk, dv
    return _fused_backward(*tensors, *_op_options(options))


def _op_options(options):
    """The ops' option arguments (kernel_size, stride, dilation, is_causal, scale, backend,
    allow_tf32, deterministic, tile as text) from (rank, kernel_size, stride, dilation,
    is_causal, scale, backend, allow_tf32, deterministic, tile)."""
    rank, ks, st, dl, ca, scale, backend, tf32, det, tile = options
    ks, st, dl, ca = per_axis(rank, ks, dl, ca, st)
    return (ks, st, dl, ca, None if scale is None else float(scale), backend, bool(tf32),
            bool(det), tile_text(tile))


def tile_text(tile):
    """A tile option as the ops' schema carries it (no union types there): "" for None,
    "autotune", or the box as "8,16"."""
    if tile is None:
        return ""
    return tile if isinstance(tile, str) else ",".join(str(int(t)) for t in tile)


def _tile_value(text):
    """The inverse of ``tile_text``; anything else is passed on for validation to name."""
    if not text:
        return None
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        return text


def _forward_op(q, k, v, opts, lse_grad=False):
    """The forward op on the 9 option arguments of ``_op_options`` (lse_grad sits between
    deterministic and tile in its schema)."""
    return _fused_forward(q, k, v, *opts[:8], lse_grad, opts[8])


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




# ---- fused NA with a relative positional bias and/or additional tokens ---------------------
#
# Ops of their own (the plain fused ops' schemas stay as they are): rpb [H, 2k-1, ...] and
# the additional tokens [B, T, H_x, D] (keys, values; given together) are optional inputs of
# both, and the backward returns their gradients too (an empty tensor for one not given). Eager
# calls go through warm-call entries where one plan runs them (``FusedExtNA``, below); the ops
# validate every call (``_select_ext``).

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


def records(*tensors):
    """Whether autograd records a call on ``tensors`` (grad mode on and one of them, None
    for an absent one, requires grad): else an eager call skips its Function."""
    return _grad_enabled() and _any_requires_grad(*[t for t in tensors if t is not None])


# The eager Functions' apply (``_applier``), for natten_cupy.torch.
fused_na_apply = _applier(FusedNA)
qk_apply = _applier(QK)
av_apply = _applier(AV)
fused_ext_apply = _applier(FusedExtNA)
