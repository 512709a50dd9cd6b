"""Warm calls: one dictionary lookup from a call's signature to what its first call worked out.

A call's signature is its op, rank, framework, option values (with their types, so that a
later call with a bad-typed option is validated anew) and, per array, its type, shape,
strides, dtype, device and whether its first element is 16-byte aligned. The first call with
a signature validates (``_args``), selects the backend (``_selection.select_backend``, a
``Selection``) and asks the selection for its ``Plan`` (``_launch``): the kernels with their
grids and packed arguments, and the workspaces they need. Later calls with the same
signature only allocate their outputs and workspaces in the caller's framework (CuPy or
PyTorch), read the data pointers and the caller's current stream, and launch: no
validation, no DLPack, no stream objects, no CuPy arrays for torch tensors, so a warm call
costs microseconds and can be captured in a CUDA graph of either framework.

Calls the fast path does not serve return None and take the general path of ``ops``: NumPy
and JAX arrays, mixed frameworks, backends without plans (reference, naive), an active
profiler, ``tile="autotune"`` before its winner is known, a bias together with additional
tokens or tokens the kernels do not take themselves (merged in array math), or
``NATTEN_CUPY_FAST_PATH=0``.
Inputs whose rows cannot be read as they are (misaligned, or a strided head dim) are copied
in the caller's framework first, so the plan is that of contiguous inputs.
"""

from __future__ import annotations

import os
import sys

from . import _args
from ._arrays import array_module
from ._dtypes import accumulator_dtype, canonical_dtype
from ._launch import Plan, _recorders, profiling
from ._operands import Layout, layout_of, rows_ready
from ._selection import select_backend

__all__ = ["enabled", "fused_forward", "fused_backward", "fused_forward_ext",
           "fused_backward_ext", "ext_order", "ext_outputs", "ext_shape", "qk", "av",
           "qk_backward", "av_backward", "torch_entry", "torch_after", "run_torch_call", "clear",
           "entries"]

enabled = os.environ.get("NATTEN_CUPY_FAST_PATH", "1") != "0"
# CuPy warm calls allocate their outputs and small workspaces as one block (``_Block``);
# False: one allocation each (bench/overhead.py times both).
share_allocation = True

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


# Each array's type is part of its signature, so a warm call needs no framework check: the
# first call of a signature finds mixed frameworks and caches _SLOW for it.

def _cupy_sigs(arrays):
    return [None if x is None else
            (type(x), x.shape, x.strides, x.dtype, x.data.ptr & 15, x.data.device_id)
            for x in arrays]


def _torch_sigs(arrays):   # (torch_entry writes the same tuple out, without the type)
    return [None if x is None else
            (type(x), x.shape, x.stride(), x.dtype, x.data_ptr() & 15, x.get_device(),
             x.requires_grad, x.is_neg())
            for x in arrays]


_SIGNATURES = {"cupy": _cupy_sigs, "torch": _torch_sigs}


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
    """(family, key) of a call, or (None, None) if the fast path cannot key it: the first
    array of another framework than CuPy or torch, or an array its framework's signature
    cannot read. The key may be unhashable (an unhashable option): the lookup finds that."""
    fam = _families.get(type(arrays[0])) or _family(arrays[0])
    sigs = _SIGNATURES.get(fam)
    if sigs is None:
        return None, None
    try:
        return fam, (tag, rank, fam, *sigs(arrays), _options_key(options))
    except Exception:  # an array the fast path cannot read (another framework's)
        return None, None


def _remember(key, entry):
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[key] = entry
    return entry


# ---- entries ----------------------------------------------------------------------------

class Entry:
    """What a warm call needs: the plan's launches, the arrays to copy first, outputs and
    workspaces; and the selection the plan came from (its backend and problem)."""

    __slots__ = ("selection", "plan", "calls", "device", "copies", "outputs", "workspaces",
                 "workspace_bytes", "block", "torch_out", "torch_device", "order", "after")

    def __init__(self, selection, plan, device, copies, outputs, workspaces, order=None):
        self.selection = selection
        self.plan = plan
        self.calls = tuple(c for c in plan.calls if not c.empty)   # launched in this order
        self.device = device
        self.copies = copies          # input indices that need contiguous copies
        self.outputs = outputs        # (shape, numpy dtype) per output
        self.workspaces = workspaces  # (shape, numpy dtype) per workspace
        self.workspace_bytes = tuple(_nbytes(s, d) for s, d in workspaces)
        self.block = _Block(tuple(_nbytes(s, d) for s, d in outputs), self.workspace_bytes)
        self.torch_out = None         # (shape, torch dtype) per output and per workspace
        self.torch_device = None      # their torch.device
        # The plan's operands as indices into (inputs, outputs, workspaces), where they are
        # not in that order (the ops with a bias or additional tokens); None: as they are.
        self.order = order
        # Entries of later calls on this call's tensors, by the signature of the one tensor
        # they add (``torch_after``: the torch layer's backward after its forward).
        self.after = {}


class _Block:
    """Where a CuPy warm call's outputs and small workspaces lie in one pool allocation (one
    allocation instead of one per array; the arrays keep it alive together). Workspaces
    join only while they add at most 1/16 to the outputs' bytes (a large one, such as a
    float32 dQ accumulator, is allocated apart and freed after the call). Pieces start
    256-byte aligned. ``bytes`` 0: fewer than three pieces, allocated as usual (measured on
    an H100 host, ``bench/results/overhead_block_ab.json``: a backward's three gradients and
    delta 36 us in one block against 43; a forward's out and lse 25 against 24)."""

    __slots__ = ("bytes", "outputs", "workspaces", "apart")
    ALIGN = 256

    def __init__(self, output_bytes, workspace_bytes):
        joined = 16 * sum(workspace_bytes) <= sum(output_bytes)
        sizes = output_bytes + (workspace_bytes if joined else ())
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += -(-n // self.ALIGN) * self.ALIGN
        n_out = len(output_bytes)
        self.bytes = at if len(sizes) > 2 and at else 0
        self.outputs = tuple(offsets[:n_out])
        self.workspaces = tuple(offsets[n_out:])
        self.apart = () if joined else workspace_bytes


def _nbytes(shape, dtype):
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _layout(fam, x):
    if fam == "cupy":
        return layout_of(x)
    dtype = canonical_dtype(x.dtype)
    return Layout(tuple(x.shape), tuple(s * dtype.itemsize for s in x.stride()), dtype,
                  x.data_ptr() % 16 == 0)


def _device(fam, x):
    return x.data.device_id if fam == "cupy" else x.device.index


def _build(sel, fam, inputs, outputs, order=None, rows=None, hidden=0):
    """The Entry of a validated call whose backend is selected (``sel``, a ``Selection``),
    or _SLOW (None: not yet, see autotune). ``inputs``: the op's input arrays (None for an
    absent optional one); ``outputs``: (shape, numpy dtype) each, the last ``hidden`` of
    them written by the kernels but not returned (memory like a workspace's, no array made:
    the forward's lse where the caller does not ask for it). The plan takes the inputs
    then the outputs, or with ``order`` the operands at those indices of (inputs, outputs)
    (see ``ext_order``); ``rows``: the inputs read by 16-byte rows (default: the selection's
    ``row_inputs``)."""
    present = [x for x in inputs if x is not None]
    if not sel.has_plans or profiling():
        return _SLOW
    if fam == "torch" and (present[0].device.type != "cuda"
                           or any(x.is_neg() or x.is_conj() for x in present)):
        return _SLOW   # CPU tensors run on the reference backend; lazy negation needs a copy
    sel = sel.tuned()
    if sel is None:  # tile="autotune": the general path times the candidates first
        return None
    _bind(fam)
    device = _device(fam, present[0])
    layouts = [None if x is None else _layout(fam, x) for x in inputs]
    rows = sel.row_inputs if rows is None else rows
    copies = tuple(i for i in rows if not rows_ready(layouts[i]))
    layouts = [Layout.contiguous(lay.shape, lay.dtype) if i in copies else lay
               for i, lay in enumerate(layouts)]
    layouts += [Layout.contiguous(s, d) for s, d in outputs]
    shown = len(outputs) - hidden
    if sel.problem.is_empty:   # zero batch or heads: outputs, no launch (SPEC 5)
        if order is not None:
            return _SLOW   # (a bias's gradient is zeroed there: the general path does it)
        e = Entry(sel, Plan(()), device, (), tuple(outputs[:shown]), ())
    else:
        import cupy
        if order is not None:
            layouts = [layouts[i] for i in order]
        with cupy.cuda.Device(device):
            plan = sel.plan(layouts)
            if plan is None:
                return _SLOW
            plan.prepare()
        if order is not None:   # then the workspaces, after the inputs and outputs
            n = len(inputs) + len(outputs)
            order = tuple(order) + tuple(range(n, n + len(plan.workspaces)))
        e = Entry(sel, plan, device, copies, tuple(outputs[:shown]),
                  tuple(outputs[shown:]) + tuple(plan.workspaces), order)
    if fam == "torch":
        e.torch_out = _torch_specs(e.outputs + e.workspaces)
        e.torch_device = present[0].device
    return e


# ---- running an entry -------------------------------------------------------------------
#
# The framework calls a warm call makes are bound once, by the first build (CuPy and torch
# are imported lazily): outputs are made without going through cupy.ndarray's Python-level
# constructor where this CuPy allows it, in one pool allocation with the small workspaces
# (``_Block``); workspaces need no array object (the pool hands their memory out again only
# on the same stream).

_one_gpu = None          # whether the machine has one GPU (then it is the current device)
_new_cupy_array = None   # (shape, numpy dtype[, memptr]) -> C-contiguous cupy.ndarray
_cupy_alloc = None       # nbytes -> cupy MemoryPointer from the current allocator
_cupy_stream = None      # device id -> its current CuPy stream
_torch_tensor = None
_torch_empty = None
_torch_stream = None     # device index -> raw handle of torch's current stream


def _bind(fam):
    global _one_gpu, _new_cupy_array, _cupy_alloc, _cupy_stream
    global _torch_tensor, _torch_empty, _torch_stream
    import cupy
    if _one_gpu is None:
        _one_gpu = cupy.cuda.runtime.getDeviceCount() == 1
    if fam == "cupy" and _new_cupy_array is None:
        _cupy_alloc = cupy.cuda.memory.alloc
        _cupy_stream = cupy.cuda.get_current_stream
        _new_cupy_array = _array_maker(cupy)
    if fam == "torch" and _torch_empty is None:
        import torch
        _torch_tensor = torch.Tensor
        _torch_empty = torch.empty
        _torch_stream = torch._C._cuda_getCurrentRawStream


def _array_maker(cupy):
    """``cupy.ndarray(shape, dtype[, memptr])`` without its Python-level ``__new__`` and
    ``__init__``: for ndarray itself (not a subclass) they only call ``_init``, after the
    extension type's own ``__new__``. Plain ``cupy.ndarray`` where this CuPy lacks either."""
    ndarray = cupy.ndarray
    base = getattr(getattr(cupy, "_core", None), "core", None)
    base = getattr(base, "_ndarray_base", None)
    if base is None or not isinstance(ndarray, type) or not issubclass(ndarray, base) \
            or not hasattr(ndarray, "_init"):
        return lambda shape, dtype, memptr=None: ndarray(shape, dtype, memptr=memptr)
    new = base.__new__

    def new_array(shape, dtype, memptr=None):
        a = new(ndarray)
        a._init(shape, dtype, memptr)
        return a
    return new_array


def _run_cupy(e, inputs):
    if e.copies:
        inputs = list(inputs)
        for i in e.copies:
            inputs[i] = inputs[i].copy(order="C")
    new, block = _new_cupy_array, e.block
    if block.bytes and share_allocation:   # outputs (and small workspaces) in one allocation
        mem = _cupy_alloc(block.bytes)
        outs = [new(s, d, mem + at) for (s, d), at in zip(e.outputs, block.outputs)]
        joined, apart = [mem.ptr + at for at in block.workspaces], block.apart
    else:
        outs = [new(s, d) for s, d in e.outputs]
        joined, apart = [], e.workspace_bytes
    ws = [_cupy_alloc(n) for n in apart]   # (alive until the kernels are queued)
    ptrs = [0 if x is None else x.data.ptr for x in (*inputs, *outs)]
    ptrs += joined
    ptrs += [m.ptr for m in ws]
    if e.order is not None:
        ptrs = [ptrs[i] for i in e.order]
    stream = _cupy_stream(e.device).ptr
    for c in e.calls:
        c(ptrs, stream)
    return outs


def _torch_specs(specs):
    import torch
    by_name = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
               "bfloat16": torch.bfloat16}
    return tuple((s, by_name[d.name]) for s, d in specs)


def run_torch(e, inputs, ptrs=None, kept=None):
    """Run entry ``e`` on CUDA torch tensors (outputs allocated by torch, torch's current
    stream of their device); returns the outputs. ``ptrs``: the inputs' data pointers where
    the caller has read them; ``kept``: a list that receives the data pointers of the inputs
    and outputs (``torch_after`` checks them)."""
    if e.copies:
        import torch
        inputs = list(inputs)
        for i in e.copies:
            inputs[i] = inputs[i].clone(memory_format=torch.contiguous_format)
        ptrs = None
    # outputs then workspaces, in one pass (the workspaces live until return); new_empty
    # parses less than torch.empty, but a subclass's may return the subclass
    first = inputs[0]
    if type(first) is _torch_tensor:
        made = [first.new_empty(s, dtype=d) for s, d in e.torch_out]
    else:
        empty, dev = _torch_empty, e.torch_device
        made = [empty(s, dtype=d, device=dev) for s, d in e.torch_out]
    if ptrs is None:
        ptrs = [0 if x is None else x.data_ptr() for x in (*inputs, *made)]
    else:
        ptrs = [*ptrs, *[x.data_ptr() for x in made]]
    if kept is not None:
        kept += ptrs[:len(inputs) + len(e.outputs)]
    if e.order is not None:
        ptrs = [ptrs[i] for i in e.order]
    stream = _torch_stream(e.device)
    for c in e.calls:
        c(ptrs, stream)
    n = len(e.outputs)
    return made[:n] if len(made) > n else made


_RUN = {"cupy": _run_cupy, "torch": run_torch}


def _run(fam, e, inputs, *more):
    """Run ``e`` on its device (made current for the call where another one is)."""
    if not _one_gpu:
        import cupy
        if cupy.cuda.runtime.getDevice() != e.device:
            with cupy.cuda.Device(e.device):
                return _RUN[fam](e, inputs, *more)
    return _RUN[fam](e, inputs, *more)


# ---- array-level calls ------------------------------------------------------------------

def _call(op, rank, names, arrays, options, backend, first, tag=None, hidden=0):
    """One array-level call through the fast path: the outputs (a list), or None where the
    general path must run it. ``first(rank, arrays, options)``, on a signature's first
    call, validates (raising what the general path raises) and returns the problem and the
    outputs' (shape, numpy dtype), or with the plan's operand order and row inputs too
    (``ext_order``). ``tag``: the signature's op name where it is not ``op``; ``hidden``:
    how many of the last outputs are not returned (``_build``)."""
    if not enabled:
        return None
    fam, key = _signature(tag or op, rank, arrays, options)
    if key is None:
        return None
    try:
        e = _entries.get(key)
    except TypeError:   # an unhashable option
        return None
    if e is None:
        e = _first_call(op, rank, fam, names, arrays, options, backend, first, hidden)
        if e is None:
            return None
        _remember(key, e)
    if e is _SLOW or _recorders:   # (``profiling()``, without the call)
        return None
    if _one_gpu:   # the current device is the entry's
        return _RUN[fam](e, arrays)
    return _run(fam, e, arrays)


def _first_call(op, rank, fam, names, arrays, options, backend, first, hidden=0):
    """The Entry for a signature's first call (_SLOW for mixed frameworks), or None."""
    if any(x is not None and _family(x) != fam for x in arrays):
        return _SLOW
    got = first(rank, arrays, options)
    if got is None:
        return _SLOW
    problem, outputs, *shape = got
    sel = select_backend(op, problem, array_module(list(zip(names, arrays))), backend)
    return _build(sel, fam, arrays, outputs, *shape, hidden=hidden)


def _same(x, dt=None):
    return (tuple(x.shape), canonical_dtype(x.dtype) if dt is None else dt)


def _first_fused_forward(rank, arrays, options):
    q, k, v = arrays
    problem = _args.check_fused(rank, q, k, v, *options)
    return problem, [(tuple(q.shape[:-1]) + (v.shape[-1],), problem.dtype),
                     (tuple(q.shape[:-1]), accumulator_dtype(q.dtype))]


def _first_fused_backward(rank, arrays, options):
    problem = _args.check_fused_backward(rank, *arrays, *options)
    q, k, v = arrays[1:4]
    return problem, [_same(q), _same(k), _same(v)]


def _first_qk(rank, arrays, options):
    q, k, rpb = arrays
    kernel_size, dilation, is_causal, backend, allow_tf32 = options
    problem = _args.check_qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend,
                             allow_tf32)
    return problem, [(tuple(q.shape[:-1]) + (problem.num_neighbors,), problem.dtype)]


def _first_av(rank, arrays, options):
    attn, v = arrays
    problem = _args.check_av(rank, attn, v, *options)
    return problem, [(tuple(attn.shape[:-1]) + (v.shape[-1],), problem.dtype)]


def _first_qk_backward(rank, arrays, options):
    d_attn, q, k = arrays
    kernel_size, dilation, is_causal, backend, allow_tf32 = options
    problem = _args.check_qk_backward(rank, d_attn, q, k, kernel_size, dilation, is_causal,
                                      None, backend, allow_tf32)
    return problem, [_same(q), _same(k)]


def _first_av_backward(rank, arrays, options):
    d_out, attn, v = arrays
    problem = _args.check_av_backward(rank, d_out, attn, v, *options)
    return problem, [_same(attn), _same(v)]


# The fused ops with a relative positional bias and/or additional tokens take their inputs
# as (q, k, v, rpb, keys, values) forward and (d_out, q, k, v, out, lse, rpb, keys, values)
# backward, None for one not given, and give (out, lse) and (dq, dk, dv[, d_rpb][, d_keys,
# d_values]); the plans take the operands in another order (``ext_order``).

def ext_order(op, has_rpb, has_extra):
    """(order, rows) of a fused op with a bias and/or additional tokens: the plan's operands
    as indices into (inputs, outputs) (``backends.fused.plan``: forward q, k, v, out, lse
    [, rpb] [, keys, values: then rpb's place is kept]; backward d_out, q, k, v, out, lse,
    dq, dk, dv [, rpb, d_rpb] [, keys, values, d_keys, d_values]), and the inputs read by
    16-byte rows. An absent rpb's place is taken by its input (None: a null pointer)."""
    if op == "fused_forward":   # inputs 0-5, outputs out 6, lse 7
        order = (0, 1, 2, 6, 7)
        if has_extra:
            order += (3, 4, 5)
        elif has_rpb:
            order += (3,)
        return order, (0, 1, 2, 4, 5) if has_extra else (0, 1, 2)
    # inputs 0-8, outputs dq 9, dk 10, dv 11, then d_rpb, then d_keys, d_values
    order = (0, 1, 2, 3, 4, 5, 9, 10, 11)
    grad = 12
    if has_rpb:
        order += (6, grad)
        grad += 1
    elif has_extra:
        order += (6, 6)
    if has_extra:
        order += (7, 8, grad, grad + 1)
    return order, (0, 1, 2, 3, 4, 7, 8) if has_extra else (0, 1, 2, 3, 4)


def ext_outputs(op, problem, inputs):
    """The outputs' (shape, numpy dtype) of a fused op with a bias and/or tokens."""
    if op == "fused_forward":
        q, v = inputs[0], inputs[2]
        return [(tuple(q.shape[:-1]) + (v.shape[-1],), problem.dtype),
                (tuple(q.shape[:-1]), accumulator_dtype(problem.dtype))]
    q, k, v, _, _, rpb, keys, values = inputs[1:]
    grads = [_same(q), _same(k), _same(v)]
    if rpb is not None:
        grads.append(_same(rpb))
    if keys is not None:
        grads += [_same(keys, problem.dtype), _same(values, problem.dtype)]
    return grads


def ext_shape(op, problem, inputs):
    """(outputs, order, rows) of a validated ext call (``ext_outputs``, ``ext_order``), or
    None where one plan does not run it: where the general path zeroes gradients (no query
    tokens; additional tokens of length 0 or no heads)."""
    rpb, keys = inputs[-3], inputs[-2]
    if problem.num_tokens == 0 or (keys is not None and not problem.has_extra):
        return None
    order, rows = ext_order(op, rpb is not None, problem.has_extra)
    return ext_outputs(op, problem, inputs), order, rows


def _first_ext(op):
    """The first-call function of a fused op with a bias and/or tokens (returning None where
    ``ext_shape`` does)."""
    def first(rank, arrays, options):
        if op == "fused_forward":
            problem = _args.check_fused(rank, *arrays[:3], *options, *arrays[3:])
        else:
            problem = _args.check_fused_backward(rank, *arrays[:6], *options, *arrays[6:])
        shape = ext_shape(op, problem, arrays)
        return None if shape is None else (problem, *shape)
    return first


_EXT_NAMES = {"fused_forward": ("q", "k", "v", "rpb", "additional_keys", "additional_values"),
              "fused_backward": ("d_out", "q", "k", "v", "out", "lse", "rpb",
                                 "additional_keys", "additional_values")}
_FIRST_EXT = {op: _first_ext(op) for op in _EXT_NAMES}


def fused_forward(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale, backend,
                  return_lse, allow_tf32, deterministic, tile):
    """``ops.fused_forward`` for a signature the fast path serves, else None."""
    # Without return_lse the kernels' lse is a workspace (no array made for it): its own
    # signatures (tag), so each kind of call finds its entry by one lookup.
    res = _call("fused_forward", rank, ("q", "k", "v"), (q, k, v),
                (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
                 deterministic, tile), backend, _first_fused_forward,
                None if return_lse else "fused_forward_out", 0 if return_lse else 1)
    if res is None:
        return None
    return tuple(res) if return_lse else res[0]


def fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride, dilation, is_causal,
                   scale, backend, allow_tf32, deterministic, tile):
    """``ops.fused_backward`` for a signature the fast path serves, else None."""
    res = _call("fused_backward", rank, ("d_out", "q", "k", "v", "out", "lse"),
                (d_out, q, k, v, out, lse),
                (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
                 deterministic, tile), backend, _first_fused_backward)
    return None if res is None else tuple(res)


def fused_forward_ext(rank, q, k, v, rpb, keys, values, kernel_size, stride, dilation,
                      is_causal, scale, backend, return_lse, allow_tf32, deterministic, tile):
    """``ops.fused_forward`` with a bias and/or additional tokens, for a signature the fast
    path serves, else None."""
    res = _call("fused_forward", rank, _EXT_NAMES["fused_forward"], (q, k, v, rpb, keys, values),
                (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
                 deterministic, tile), backend, _FIRST_EXT["fused_forward"], "fused_forward_ext")
    if res is None:
        return None
    return tuple(res) if return_lse else res[0]


def fused_backward_ext(rank, d_out, q, k, v, out, lse, rpb, keys, values, kernel_size, stride,
                       dilation, is_causal, scale, backend, allow_tf32, deterministic, tile):
    """``ops.fused_backward`` with a bias and/or additional tokens, for a signature the fast
    path serves, else None: (dq, dk, dv[, d_rpb][, d_keys, d_values])."""
    res = _call("fused_backward", rank, _EXT_NAMES["fused_backward"],
                (d_out, q, k, v, out, lse, rpb, keys, values),
                (kernel_size, stride, dilation, is_causal, scale, backend, allow_tf32,
                 deterministic, tile), backend, _FIRST_EXT["fused_backward"],
                "fused_backward_ext")
    return None if res is None else tuple(res)


def qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend, allow_tf32):
    """``ops.qk`` for a signature the fast path serves, else None."""
    res = _call("qk", rank, ("q", "k", "rpb"), (q, k, rpb),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend, _first_qk)
    return None if res is None else res[0]


def av(rank, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32):
    """``ops.av`` for a signature the fast path serves, else None."""
    res = _call("av", rank, ("attn", "v"), (attn, v),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend, _first_av)
    return None if res is None else res[0]


def qk_backward(rank, d_attn, q, k, kernel_size, dilation, is_causal, backend, allow_tf32):
    """``ops.qk_backward`` without rpb for a signature the fast path serves, else None."""
    res = _call("qk_backward", rank, ("d_attn", "q", "k"), (d_attn, q, k),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend,
                _first_qk_backward)
    return None if res is None else tuple(res)


def av_backward(rank, d_out, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32):
    """``ops.av_backward`` for a signature the fast path serves, else None."""
    res = _call("av_backward", rank, ("d_out", "attn", "v"), (d_out, attn, v),
                (kernel_size, dilation, is_causal, backend, allow_tf32), backend,
                _first_av_backward)
    return None if res is None else tuple(res)


# ---- the torch layer --------------------------------------------------------------------

def torch_entry(op, rank, tensors, options, select, outputs_of, tag=None):
    """The Entry for a torch-layer call on CUDA tensors (``select()`` validates and returns
    the ``Selection`` on the first call of a signature; ``outputs_of(problem)`` gives the
    outputs' (shape, numpy dtype), or those with the plan's operand order and row inputs
    (``ext_order``), or None where the fast path does not serve it), or None.
    ``tag``: the signature's op name where it is not ``op``."""
    if not enabled or _recorders:   # (``profiling()``, without the call)
        return None
    try:   # (``_torch_sigs``' tuples, written out: one Python call fewer)
        key = (tag or op, rank, *[None if x is None else
                           (x.shape, x.stride(), x.dtype, x.data_ptr() & 15, x.get_device(),
                            x.requires_grad, x.is_neg()) for x in tensors],
               _options_key(options))
        e = _entries.get(key)
    except Exception:
        return None
    if e is None:
        sel = select()
        shape = outputs_of(sel.problem)
        if shape is None:
            e = _SLOW
        else:
            if isinstance(shape, list):
                shape = (shape,)
            e = _build(sel, "torch", tensors, *shape)
            if e is None:
                return None
        _remember(key, e)
    return None if e is _SLOW else e


def torch_after(first, kept, x, saved, make):
    """(entry, data pointers) for a call on CUDA tensors ``(x, *saved)`` where ``saved`` are
    tensors a call served by entry ``first`` took or made and ``kept`` their data pointers
    then (``run_torch``'s ``kept``), or (None, None) where the fast path does not serve it.

    While ``saved`` still lie at those pointers (a saved-tensor hook may have moved them)
    their layouts are those ``first``'s signature fixed, so the entry is found by ``x``'s
    signature alone among ``first.after``; else ``make()`` (a full-signature lookup such as
    ``torch_entry``) gives it and it is remembered there. The pointers: x's, then saved's."""
    if not enabled or _recorders:
        return None, None
    ptrs = [t.data_ptr() for t in saved]
    if ptrs != kept:
        return None, None
    try:
        p = x.data_ptr()
        key = (x.shape, x.stride(), x.dtype, p & 15, x.get_device(), x.requires_grad,
               x.is_neg())
        e = first.after.get(key)
    except Exception:
        return None, None
    if e is None:
        e = make()
        if e is None:
            return None, None
        if len(first.after) >= 64:
            first.after.clear()
        first.after[key] = e
    return e, [p, *ptrs]


def run_torch_call(e, tensors, ptrs=None, kept=None):
    """``run_torch`` on the entry's device."""
    if _one_gpu:   # one GPU: it is the current device (no query)
        return run_torch(e, tensors, ptrs, kept)
    return _run("torch", e, tensors, ptrs, kept)
