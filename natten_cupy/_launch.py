"""The one place kernels are launched, so the profiler sees every launch.

Two ways in:

* ``launch`` runs a compiled kernel on the current CuPy stream with CuPy arguments. While a
  profiler is active (``natten_cupy.profile()``), each launch is bracketed by CUDA events and
  reported to it with the kernel's name, backend, tile config and grid. Code that runs
  array-library operations on the GPU instead of its own kernels (the reference backend on
  CuPy) wraps them in ``region``, which the profiler records as one entry.
* A ``Plan`` is what a backend part returns for one call signature (shapes, strides,
  dtypes, options, device): its ``KernelCall``s hold the kernel's function handle, the
  grid, and the argument bytes with holes for the operands' device pointers; calling one
  (``run_plan`` calls a plan's in order) fills the holes and launches through the driver. A
  warm call of the fast path (``natten_cupy._fast``) does only that: no argument conversion,
  no CuPy arrays, no device queries, so it is cheap and capturable in any framework's CUDA
  graph. ``launch`` itself
  runs the same ``KernelCall`` when its arguments are CuPy arrays, so both ways share one
  argument packing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import operator
import struct
import threading

import numpy

from ._tma import TensorMap

__all__ = ["launch", "region", "add_recorder", "remove_recorder", "Operand", "KernelCall",
           "Plan", "run_plan", "profiling"]

_recorders = []


def profiling():
    """Whether a profiler is recording (the fast path then steps aside for ``launch``)."""
    return bool(_recorders)


def add_recorder(rec):
    _recorders.append(rec)


def remove_recorder(rec):
    _recorders.remove(rec)


# Shared memory a launch gets without opting in: static and dynamic together.
DEFAULT_SMEM = 48 * 1024


def allow_shared_memory(fn, dynamic):
    """Raise ``fn``'s (a cupy.RawKernel) dynamic shared-memory limit to ``dynamic`` bytes
    where its static shared memory and ``dynamic`` together pass DEFAULT_SMEM, past which a
    launch that has not opted in fails with an invalid argument (found by the random sweep:
    the exact-fp32 weighted sums stage 45.5 KiB and declare 5 KiB)."""
    if dynamic and dynamic + fn.shared_size_bytes > DEFAULT_SMEM:
        fn.max_dynamic_shared_size_bytes = int(dynamic)


def launch(fn, grid, block, args, *, shared_mem=0, name="", backend="", tile=None):
    """Launch ``fn`` (a cupy.RawKernel) with ``args`` on the current stream.

    Empty grids are skipped (zero-size launches are invalid in CUDA).
    """
    grid = tuple(int(g) for g in grid)
    block = tuple(int(b) for b in block)
    if any(g == 0 for g in grid):
        return
    allow_shared_memory(fn, int(shared_mem))
    if not _recorders:
        fn(grid, block, args, shared_mem=int(shared_mem))
        return
    _recorded(lambda: fn(grid, block, args, shared_mem=int(shared_mem)), name=name or fn.name,
              backend=backend, tile=tile, grid=grid, block=block)


def _recorded(run, **info):
    """Run ``run`` (GPU work on the current stream) between two events and report it to every
    recorder with ``info`` (name, backend, tile, grid, block)."""
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    run()
    stop.record()
    for rec in _recorders:
        rec.record(start=start, stop=stop, **info)


@contextlib.contextmanager
def region(name, backend):
    """Record the GPU work of the block (array-library kernels on the current stream) as one
    profiler entry; a no-op while no profiler is active."""
    if not _recorders:
        yield
        return
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    try:
        yield
    finally:
        stop.record()
        for rec in _recorders:
            rec.record(name=name, backend=backend, tile=None, grid=(), block=(),
                       start=start, stop=stop)


# ---- prepared launches ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Operand:
    """A kernel argument that is the device pointer of the call's ``index``-th array (the
    operands first, in the order the op names them, then the plan's workspaces), plus
    ``offset`` bytes where that pointer is not null (e.g. the first element of a batch chunk
    that a launch of its own covers)."""
    index: int
    offset: int = 0


def _arg_bytes(a):
    """(bytes, alignment) of one constant kernel argument: a NumPy scalar or struct, or a
    device array kept by the plan (its pointer)."""
    if isinstance(a, numpy.generic):
        return a.tobytes(), max(a.dtype.alignment, 1)
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    if ptr is not None:  # a CuPy array the plan owns (e.g. a window table)
        return struct.pack("<Q", ptr), 8
    raise TypeError(f"kernel argument {a!r} must be a NumPy scalar, a struct scalar, a device "
                    "array or an Operand (Python ints have no C type: use numpy.int32/int64)")


def _getter(indices):
    """A callable giving the tuple ``(seq[i] for i in indices)`` of a sequence (itemgetter
    returns a bare item for one index, hence the other cases)."""
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    if indices:
        (i,) = indices
        return lambda seq: (seq[i],)
    return lambda seq: ()


class KernelCall:
    """One launch, prepared: function handle, grid, block, shared memory, and the argument
    bytes in one buffer whose operand slots are filled per call.

    The buffer is laid out as [pointer table][operand slots][constants]: the driver reads
    the kernel's arguments through the table, so the operand slots (8 bytes each) are packed
    together and one ``struct`` call fills them. A tensor map (``natten_cupy._tma.TensorMap``)
    is a constant whose address field each launch sets to its operand's pointer. The buffer
    is reused under a lock (the driver copies the arguments at launch).
    """

    def __init__(self, fn, grid, block, args, *, shared_mem=0, name="", backend="", tile=None):
        self.fn = fn
        self.grid = tuple(int(g) for g in grid)
        self.block = tuple(int(b) for b in block)
        self.shared_mem = int(shared_mem)
        self.name, self.backend, self.tile = name or fn.name, backend, tile
        self.args = tuple(args)   # kept: also holds the plan's device arrays alive
        self.empty = any(g == 0 for g in self.grid)
        n = len(args)
        slots = [a.index for a in args if isinstance(a, Operand)]
        head = 8 * n
        offsets, consts, maps, pos = [], [], [], head + 8 * len(slots)
        slot_at = head
        for a in args:
            if isinstance(a, Operand):
                offsets.append(slot_at)
                slot_at += 8
                continue
            if isinstance(a, TensorMap):
                data, align = a.data, 64
                maps.append((a.index, len(offsets)))
            else:
                data, align = _arg_bytes(a)
            pos = -(-pos // max(align, 8)) * max(align, 8)
            offsets.append(pos)
            consts.append((pos, data))
            pos += len(data)
        # The layout starts at a 64-byte aligned address inside the buffer (tensor maps are).
        self._buf = ctypes.create_string_buffer(max(pos, 8) + 64)
        start = -ctypes.addressof(self._buf) % 64
        base = ctypes.addressof(self._buf) + start
        struct.pack_into(f"<{n}Q", self._buf, start, *(base + o for o in offsets))
        for at, data in consts:
            ctypes.memmove(base + at, data, len(data))
        self._slots = tuple(slots)
        self._gather = _getter(self._slots)
        offsets_of = tuple(a.offset for a in args if isinstance(a, Operand))
        if any(offsets_of):
            if maps:
                raise ValueError("tensor-map operands take no pointer offsets")
            whole = self._gather
            self._gather = lambda seq: tuple(p + o if p else 0
                                             for p, o in zip(whole(seq), offsets_of))
        self._pack = struct.Struct(f"<{len(slots)}Q").pack_into
        self._head = start + head
        self._map_at = tuple((i, base + offsets[k]) for i, k in maps)
        self._maps = ()   # (operand index, _tma.AddressSlot) once prepared
        self._params = base
        self._lock = threading.Lock()
        self._func = None
        self._launch = None
        self._fixed = None   # launchKernel's arguments before the stream, once prepared

    def prepare(self):
        """Load the function on the current device and raise its shared-memory limit
        (once per plan; plans are per device)."""
        if self._func is None:
            from cupy.cuda import driver
            allow_shared_memory(self.fn, self.shared_mem)
            self._func = self.fn.kernel.ptr
            self._launch = driver.launchKernel
            self._fixed = (self._func, *self.grid, *self.block, self.shared_mem)
            if self._map_at:
                from ._tma import AddressSlot
                self._maps = tuple((i, AddressSlot(at)) for i, at in self._map_at)
        return self

    def __call__(self, ptrs, stream):
        """Launch on ``stream`` (a raw CUDA stream handle) with the call's pointers."""
        if self.empty:
            return
        with self._lock:
            self._pack(self._buf, self._head, *self._gather(ptrs))
            for i, slot in self._maps:
                slot.set(ptrs[i])
            self._launch(*self._fixed, stream, self._params, 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything one call needs besides its arrays: the kernels in launch order and the
    workspaces (``(shape, numpy dtype)``, C-contiguous, any contents) they take after the
    operands. Plans are built per device (function handles and tables are)."""
    calls: tuple
    workspaces: tuple = ()

    def prepare(self):
        for c in self.calls:
            c.prepare()
        return self


def run_plan(plan, ptrs, stream):
    """Launch every kernel of ``plan`` (prepared) on raw stream handle ``stream``; ``ptrs``:
    device pointers of the operands followed by those of the workspaces."""
    for c in plan.calls:
        c(ptrs, stream)


def run_plan_on(plan, arrays):
    """``run_plan`` with CuPy arrays (operands, then workspaces) on CuPy's current stream;
    with one event pair a kernel, reported to the recorders, while a profiler records."""
    import cupy
    plan.prepare()
    ptrs = [0 if x is None else x.data.ptr for x in arrays]
    stream = cupy.cuda.get_current_stream().ptr
    if not _recorders:
        run_plan(plan, ptrs, stream)
        return
    for c in plan.calls:
        if not c.empty:
            _recorded(lambda c=c: c(ptrs, stream), name=c.name, backend=c.backend, tile=c.tile,
                      grid=c.grid, block=c.block)
