"""The torch layer's shared core: tensors as arrays, options, cached validation, lse gradients.

The machinery under ``natten_cupy.torch`` is split over four modules:

* ``_torch_common`` (this one): what the others share, below;
* ``_torch_library``: the custom ops ``torch.ops.natten_cupy.*`` (fused forward and backward,
  the unfused qk / av) with their fake and Autograd kernels;
* ``_torch_eager``: the eager autograd functions (``FusedNA``, ``QK``, ``AV``) over
  warm-call entries;
* ``_torch_ext``: the fused ops with a relative positional bias and/or additional tokens
  (custom ops and their eager autograd function).

Here: torch tensors as zero-copy NumPy (CPU) or CuPy (CUDA) views, launched on torch's
current stream; the per-axis options and their conversion to the ops' arguments; the
validation and backend selection of a call, cached per call signature (the fast-path entries
of ``natten_cupy._fast``); and the gradient that flows from lse (for ``return_lse`` and
``merge_attentions``): d lse_i / d q_i = scale * sum_j P_ij k_j and d lse_i / d k_j =
scale * P_ij q_i, computed with the forward (values k) and the backward (output gradient
d_lse * q, whose dv is the dk term) of the same problem.
"""

from __future__ import annotations

import contextlib

import torch

from . import _args, _fast, ops
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


# ---- the ops' option arguments -----------------------------------------------------------

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


# ---- the gradient from lse --------------------------------------------------------------

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
