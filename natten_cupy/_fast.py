"""Warm calls: one dictionary lookup from a call's signature to what its first call worked out.

A call's signature is its op, rank, option values (with their types, so that a later call
with a bad-typed option is validated anew) and, per array, its framework, shape, strides,
dtype, device and whether its first element is 16-byte aligned. The first call with a
signature validates (``_args``), selects the backend, and asks it for a ``Plan``
(``_launch``): the kernels with their grids and packed arguments, and the workspaces they
need. Later calls with the same signature only allocate their outputs and workspaces in the
caller's framework (CuPy or PyTorch), read the data pointers and the caller's current stream,
and launch: no validation, no DLPack, no stream objects, no CuPy arrays for torch tensors, so
a warm call costs microseconds and can be captured in a CUDA graph of either framework.

Calls the fast path does not serve return None and take the general path of ``ops``: NumPy
and JAX arrays, mixed frameworks, backends without plans (reference, naive, tiled), an active
profiler, ``tile="autotune"`` before its winner is known, or ``NATTEN_CUPY_FAST_PATH=0``.
Inputs whose rows cannot be read as they are (misaligned, or a strided head dim) are copied
in the caller's framework first, so the plan is that of contiguous inputs.
"""

from __future__ import annotations

import os
import sys

from . import _args
from ._dtypes import accumulator_dtype, canonical_dtype
from ._launch import Plan, _recorders, profiling, run_plan
from ._operands import Layout, rows_ready

__all__ = ["enabled", "fused_forward", "fused_backward", "qk", "av", "qk_backward",
           "av_backward", "torch_entry", "run_torch_call", "clear", "entries"]

enabled = os.environ.get("NATTEN_CUPY_FAST_PATH", "1") != "0"

MAX_ENTRIES = 4096
_entries = {}
_SLOW = object()   # an entry for signatures the fast path does not serve


def clear():
    """Forget every cached call (tests; a changed autotune winner)."""
    _entries.clear()


def entries():
    """Number of cached call signatures."""
    return len(_entries)


# ---- signatures -------------------------------------------------------------------------

_families = {}


def _family(x):
    """'cupy', 'torch' (CUDA or CPU tensors) or '' for one array (by type, memoized)."""
    t = type(x)
    fam = _families.get(t)
    if fam is None:
        mod = t.__module__.split(".", 1)[0]
        fam = ""
        if mod == "cupy" and "cupy" in sys.modules and issubclass(t, sys.modules["cupy"].ndarray):
            fam = "cupy"
        elif "torch" in sys.modules and issubclass(t, sys.modules["torch"].Tensor):
            fam = "torch"
        _families[t] = fam
    return fam


def _cupy_sig(x):
    return (x.shape, x.strides, x.dtype, x.data.ptr & 15, x.data.device_id)


def _torch_sig(x):   # (torch_entry writes the same tuple out inline)
    return (x.shape, x.stride(), x.dtype, x.data_ptr() & 15, x.get_device(), x.requires_grad,
            x.is_neg())


_SIGNATURE = {"cupy": _cupy_sig, "torch": _torch_sig}


def _opt(v):
    """An option value with its type (``True`` and ``1`` validate differently)."""
    t = type(v)
    if t is tuple or t is list:
        return (t, tuple(v), tuple(map(type, v)))
    return (t, v)


def _options_key(options):
    """Option values and their types: scalars as they are (with a tuple of their types);
    tuples and lists with the type of every entry."""
    types = tuple(map(type, options))
    if tuple in types or list in types:
        return tuple(map(_opt, options))
    return (options, types)


def _signature(tag, rank, arrays, options):
    """(family, key) of a call, or (None, None) if the fast path cannot key it: arrays of
    another framework than CuPy or torch, of mixed frameworks, or unhashable options."""
    fams = _families
    fam = fams.get(type(arrays[0])) or _family(arrays[0])
    if not fam:
        return None, None
    for x in arrays:
        if x is not None and (fams.get(type(x)) or _family(x)) != fam:
            return None, None
    sig = _SIGNATURE[fam]
    try:
        key = (tag, rank, fam, *[None if x is None else sig(x) for x in arrays],
               _options_key(options))
        hash(key)
    except Exception:  # an unhashable option, or an array the fast path cannot read
        return None, None
    return fam, key


def _remember(key, entry):
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[key] = entry
    return entry


# ---- entries ----------------------------------------------------------------------------

class Entry:
    """What a warm call needs: the plan, the arrays to copy first, outputs and workspaces."""

    __slots__ = ("problem", "plan", "device", "copies", "outputs", "workspaces", "torch_out")

    def __init__(self, problem, plan, device, copies, outputs, workspaces):
        self.problem = problem
        self.plan = plan
        self.device = device
        self.copies = copies          # input indices that need contiguous copies
        self.outputs = outputs        # (shape, numpy dtype) per output
        self.workspaces = workspaces  # (shape, numpy dtype) per workspace
        self.torch_out = None         # (shape, torch dtype) per output, for torch callers


def _layout(fam, x):
    if fam == "cupy":
        return Layout(tuple(x.shape), tuple(x.strides), x.dtype, x.data.ptr % 16 == 0)
    dtype = canonical_dtype(x.dtype)
    return Layout(tuple(x.shape), tuple(s * dtype.itemsize for s in x.stride()), dtype,
                  x.data_ptr() % 16 == 0)


def _device(fam, x):
    return x.data.device_id if fam == "cupy" else x.device.index


def _build(op, problem, backend, fam, inputs, outputs):
    """The Entry of a validated call, or _SLOW (None: not yet, see autotune). ``inputs``:
    the op's input arrays in plan order (None for an absent optional one); ``outputs``:
    (shape, numpy dtype) each."""
    planner = getattr(backend, "plan", None)
    present = [x for x in inputs if x is not None]
    if planner is None or profiling():
        return _SLOW
    if fam == "torch" and (present[0].device.type != "cuda"
                           or any(x.is_neg() or x.is_conj() for x in present)):
        return _SLOW   # CPU tensors run on the reference backend; lazy negation needs a copy
    if problem.tile == "autotune":
        from .backends import fused
        problem = fused.tuned(op, problem)
        if problem is None:  # the general path times the candidates first
            return None
    import cupy
    device = _device(fam, present[0])
    layouts = [None if x is None else _layout(fam, x) for x in inputs]
    copies = tuple(i for i in backend.ROW_INPUTS[op] if not rows_ready(layouts[i]))
    layouts = [Layout.contiguous(lay.shape, lay.dtype) if i in copies else lay
               for i, lay in enumerate(layouts)]
    layouts += [Layout.contiguous(s, d) for s, d in outputs]
    if problem.is_empty:   # zero batch or heads: outputs, no launch (SPEC 5)
        return Entry(problem, Plan(()), device, (), tuple(outputs), ())
    with cupy.cuda.Device(device):
        plan = planner(op, problem, layouts)
        if plan is None:
            return _SLOW
        plan.prepare()
    return Entry(problem, plan, device, copies, tuple(outputs), plan.workspaces)


def _run_cupy(e, inputs):
    import cupy
    if e.copies:
        inputs = list(inputs)
        for i in e.copies:
            inputs[i] = inputs[i].copy(order="C")
    new = cupy.ndarray
    outs = [new(s, d) for s, d in e.outputs]
    ws = [new(s, d) for s, d in e.workspaces]
    ptrs = [0 if x is None else x.data.ptr for x in inputs]
    ptrs += [x.data.ptr for x in outs]
    ptrs += [x.data.ptr for x in ws]
    run_plan(e.plan, ptrs, cupy.cuda.get_current_stream().ptr)
    return outs


def _torch_dtypes(specs):
    import torch
    by_name = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
               "bfloat16": torch.bfloat16}
    return tuple((s, by_name[d.name]) for s, d in specs)


def run_torch(e, inputs):
    """Run entry ``e`` on CUDA torch tensors (outputs allocated by torch, torch's current
    stream of their device); returns the outputs."""
    import torch
    dev = inputs[0].device
    if e.copies:
        inputs = list(inputs)
        for i in e.copies:
            inputs[i] = inputs[i].clone(memory_format=torch.contiguous_format)
    if e.torch_out is None:
        e.torch_out = (_torch_dtypes(e.outputs), _torch_dtypes(e.workspaces))
    out_specs, ws_specs = e.torch_out
    empty = torch.empty
    outs = [empty(s, dtype=d, device=dev) for s, d in out_specs]
    # one pass over operands, outputs and workspaces (the workspaces live until return)
    ws = [empty(s, dtype=d, device=dev) for s, d in ws_specs] if ws_specs else ()
    ptrs = [0 if x is None else x.data_ptr() for x in (*inputs, *outs, *ws)]
    run_plan(e.plan, ptrs, torch._C._cuda_getCurrentRawStream(e.device))
    return outs


_ONE_GPU = []


def _current_device_differs(device):
    """Whether ``device`` is not CUDA's current device (never, on a machine with one GPU)."""
    import cupy
    if not _ONE_GPU:
        _ONE_GPU.append(cupy.cuda.runtime.getDeviceCount() == 1)
    return not _ONE_GPU[0] and cupy.cuda.runtime.getDevice() != device


def _run(fam, e, inputs):
    if _current_device_differs(e.device):
        import cupy
        with cupy.cuda.Device(e.device):
            return _run(fam, e, inputs)
    return _run_cupy(e, inputs) if fam == "cupy" else run_torch(e, inputs)


# ---- array-level calls ------------------------------------------------------------------

def _select(op, problem, named, backend):
    from . import ops
    from ._arrays import array_module
    return ops.select_backend(op, problem, array_module(named), backend)


def _call(op, rank, names, arrays, options, backend, check, outputs_of):
    """One array-level call through the fast path: the outputs (a list), or None where the
    general path must run it. ``check()`` validates (raising what the general path raises)
    and returns the problem; ``outputs_of(problem)``: the outputs' (shape, dtype)."""
    if not enabled:
        return None
    fam, key = _signature(op, rank, arrays, options)
    if key is None:
        return None
    e = _entries.get(key)
    if e is None:
        problem = check()
        be = _select(op, problem, list(zip(names, arrays)), backend)
        e = _build(op, problem, be, fam, arrays, outputs_of(problem))
        if e is None:
            return None
        _remember(key, e)
    if e is _SLOW or profiling():
        return None
    return _run(fam, e, arrays)


def _same(x, dt=None):
    return (tuple(x.shape), canonical_dtype(x.dtype) if dt is None else dt)


def fused_forward(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale, backend,
                  return_lse, allow_tf32, deterministic, tile):
    """``ops.fused_forward`` for a signature the fast path serves, else None."""
    options = (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
               deterministic, tile)
    res = _call("fused_forward", rank, ("q", "k", "v"), (q, k, v), options, backend,
                lambda: _args.check_fused(rank, q, k, v, kernel_size, stride, dilation,
                                          is_causal, scale, backend, allow_tf32,
                                          deterministic, tile),
                lambda p: [(tuple(q.shape[:-1]) + (v.shape[-1],), p.dtype),
                           (tuple(q.shape[:-1]), accumulator_dtype(q.dtype))])
    if res is None:
        return None
    return tuple(res) if return_lse else res[0]


def fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride, dilation, is_causal,
                   scale, backend, allow_tf32, deterministic, tile):
    """``ops.fused_backward`` for a signature the fast path serves, else None."""
    options = (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
               deterministic, tile)
    res = _call("fused_backward", rank, ("d_out", "q", "k", "v", "out", "lse"),
                (d_out, q, k, v, out, lse), options, backend,
                lambda: _args.check_fused_backward(rank, d_out, q, k, v, out, lse, kernel_size,
                                                   stride, dilation, is_causal, scale, backend,
                                                   allow_tf32, deterministic, tile),
                lambda p: [_same(q), _same(k), _same(v)])
    return None if res is None else tuple(res)


def qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend, allow_tf32):
    """``ops.qk`` for a signature the fast path serves, else None."""
    res = _call("qk", rank, ("q", "k", "rpb"), (q, k, rpb),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend,
                lambda: _args.check_qk(rank, q, k, kernel_size, dilation, is_causal, rpb,
                                       backend, allow_tf32),
                lambda p: [(tuple(q.shape[:-1]) + (p.num_neighbors,), p.dtype)])
    return None if res is None else res[0]


def av(rank, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32):
    """``ops.av`` for a signature the fast path serves, else None."""
    res = _call("av", rank, ("attn", "v"), (attn, v),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend,
                lambda: _args.check_av(rank, attn, v, kernel_size, dilation, is_causal,
                                       backend, allow_tf32),
                lambda p: [(tuple(attn.shape[:-1]) + (v.shape[-1],), p.dtype)])
    return None if res is None else res[0]


def qk_backward(rank, d_attn, q, k, kernel_size, dilation, is_causal, backend, allow_tf32):
    """``ops.qk_backward`` without rpb for a signature the fast path serves, else None."""
    res = _call("qk_backward", rank, ("d_attn", "q", "k"), (d_attn, q, k),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend,
                lambda: _args.check_qk_backward(rank, d_attn, q, k, kernel_size, dilation,
                                                is_causal, None, backend, allow_tf32),
                lambda p: [_same(q), _same(k)])
    return None if res is None else tuple(res)


def av_backward(rank, d_out, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32):
    """``ops.av_backward`` for a signature the fast path serves, else None."""
    res = _call("av_backward", rank, ("d_out", "attn", "v"), (d_out, attn, v),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend,
                lambda: _args.check_av_backward(rank, d_out, attn, v, kernel_size, dilation,
                                                is_causal, backend, allow_tf32),
                lambda p: [_same(attn), _same(v)])
    return None if res is None else tuple(res)


# ---- the torch layer --------------------------------------------------------------------

def torch_entry(op, rank, tensors, options, problem_of, outputs_of):
    """The Entry for a torch-layer call on CUDA tensors (``problem_of()`` validates and
    returns (problem, backend) on the first call of a signature; ``outputs_of(problem)``
    gives the outputs' (shape, numpy dtype)), or None."""
    if not enabled or _recorders:   # (``profiling()``, without the call)
        return None
    try:   # (``_torch_sig`` of each tensor, written out: one Python call fewer a tensor)
        key = (op, rank, *[None if x is None else
                           (x.shape, x.stride(), x.dtype, x.data_ptr() & 15, x.get_device(),
                            x.requires_grad, x.is_neg()) for x in tensors],
               _options_key(options))
        e = _entries.get(key)
    except Exception:
        return None
    if e is None:
        problem, be = problem_of()
        e = _build(op, problem, be, "torch", tensors, outputs_of(problem))
        if e is None:
            return None
        _remember(key, e)
    return None if e is _SLOW else e


def run_torch_call(e, tensors):
    """``run_torch`` on the entry's device."""
    if _ONE_GPU and _ONE_GPU[0]:   # one GPU: it is the current device (no query)
        return run_torch(e, tensors)
    return _run("torch", e, tensors)
