"""Operands as the kernels see them: layouts (shape, strides, dtype, alignment) without data.

A backend part plans a call from its operands' ``Layout``s alone, so a plan can be cached per
call signature and reused for any arrays of the same layouts. The kernels read rows of the
head dim with 16-byte accesses: ``rows_ready`` says whether an operand can be used as it is
(``is_aligned``: whether its first element is); ``ready_inputs`` / ``writable_outputs`` make
stand-ins for those that cannot (contiguous copies in, contiguous temporaries out, copied
back by ``copy_back``).

What else the launchers share: ``head_dim_bucket`` (a head dim rounded up to a part's
compiled sizes) and ``device_limits`` (shared memory and multiprocessors, read from the
device). The key halo a box of rows reaches is window arithmetic: ``_window.box_span``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import numpy

__all__ = ["Layout", "layout_of", "is_aligned", "rows_ready", "ready_inputs", "writable_outputs",
           "copy_back", "contiguous_strides", "run_forward", "run_backward", "workspaces_from",
           "head_dim_bucket", "DeviceLimits", "device_limits", "current_limits",
           "compute_capability",
           "smem_refusal", "arch_refusal", "SM90_SMEM_PER_BLOCK"]


def contiguous_strides(shape, itemsize):
    """C-order strides in bytes."""
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a plan may depend on of one array: shape, byte strides (as NumPy/CuPy report
    them), dtype, and whether its first element is 16-byte aligned."""
    shape: tuple
    strides: tuple
    dtype: numpy.dtype
    aligned: bool = True

    @classmethod
    def contiguous(cls, shape, dtype):
        dtype = numpy.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        return cls(shape, contiguous_strides(shape, dtype.itemsize), dtype, True)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    def unsqueezed(self, pad):
        """This layout with ``pad`` unit axes after the batch axis (as ``x[:, None, ...]``)."""
        return Layout(self.shape[:1] + (1,) * pad + self.shape[1:],
                      self.strides[:1] + (0,) * pad + self.strides[1:], self.dtype,
                      self.aligned)


def is_aligned(x, vector=16):
    """Whether the first element of CuPy array ``x`` is ``vector``-byte aligned."""
    return x.data.ptr % vector == 0


def layout_of(x):
    """The Layout of a CuPy array."""
    return Layout(tuple(x.shape), tuple(x.strides), x.dtype, is_aligned(x))


def rows_ready(x, vector=16):
    """Whether kernels can access ``x`` (array or Layout) by rows of ``vector``-byte pieces:
    last axis contiguous, base and every other stride a multiple of ``vector`` bytes (axes
    of extent 1 aside)."""
    if not (x.aligned if isinstance(x, Layout) else is_aligned(x, vector)):
        return False
    item = x.dtype.itemsize
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != item:
        return False
    return all(s % vector == 0 for s, n in zip(x.strides[:-1], x.shape[:-1]) if n > 1)


def ready_inputs(arrays, ready=rows_ready):
    """The CuPy arrays themselves where ``ready``, else fresh C-contiguous copies."""
    return [x if x is None or ready(x) else x.copy(order="C") for x in arrays]


def writable_outputs(arrays, ready=rows_ready):
    """Per output: the array itself where ``ready``, else a C-contiguous temporary of the
    same shape and dtype (``copy_back`` then moves its contents into the caller's array)."""
    import cupy
    return [x if ready(x) else cupy.empty(x.shape, dtype=f"u{x.dtype.itemsize}").view(x.dtype)
            for x in arrays]


def copy_back(outputs, written):
    """Copy each temporary of ``writable_outputs`` into its output (bit for bit)."""
    for dst, src in zip(outputs, written):
        if src is not dst:
            unsigned = f"u{dst.dtype.itemsize}"
            dst.view(unsigned)[...] = src.view(unsigned)


# Who allocates the workspaces of ``run_forward``/``run_backward``: CuPy's pool unless a
# caller (the torch layer: its own allocator, so that CUDA graph capture works) says otherwise.
_workspace_allocator = contextvars.ContextVar("workspace_allocator", default=None)


@contextlib.contextmanager
def workspaces_from(allocate):
    """Inside the block, workspaces come from ``allocate(shape, numpy dtype) -> array``."""
    token = _workspace_allocator.set(allocate)
    try:
        yield
    finally:
        _workspace_allocator.reset(token)


def _workspaces(plan):
    """Fresh arrays for a plan's workspaces (any contents)."""
    allocate = _workspace_allocator.get()
    if allocate is None:
        import cupy
        allocate = cupy.empty
    return tuple(allocate(shape, dtype) for shape, dtype in plan.workspaces)


def _layouts(arrays):
    return [None if x is None else layout_of(x) for x in arrays]


def run_forward(plan_forward, problem, q, k, v, out, lse, rpb=None, extra=None):
    """A fused forward on CuPy arrays through a part's ``plan_forward``: stand-ins for q, k, v,
    out (and the additional tokens ``extra``) where they are not ``rows_ready``, the plan with
    its workspaces, then the copy back (rpb, read element by element, goes as it is).
    Operands: q, k, v, out, lse, then rpb and the two extra arrays where given (None in
    rpb's place when only the extra tokens are)."""
    from ._launch import run_plan_on
    q, k, v = ready_inputs((q, k, v))
    (dst,) = writable_outputs((out,))
    arrays = (q, k, v, dst, lse)
    if extra is not None:
        arrays += (rpb, *ready_inputs(extra))
    elif rpb is not None:
        arrays += (rpb,)
    plan = plan_forward(problem, *_layouts(arrays))
    run_plan_on(plan, arrays + _workspaces(plan))
    copy_back((out,), (dst,))


def run_backward(plan_backward, problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None,
                 d_rpb=None, extra=None, d_extra=None):
    """A fused backward on CuPy arrays through a part's ``plan_backward`` (operands d_out, q,
    k, v, out, lse, dq, dk, dv [, rpb, d_rpb: element by element, as they are] [, xk, xv,
    dxk, dxv: the additional tokens and their gradients, None in rpb's places when only they
    are given], then the plan's workspaces)."""
    from ._launch import run_plan_on
    q, k, v, out, d_out = ready_inputs((q, k, v, out, d_out))
    grads = (dq, dk, dv) + (() if d_extra is None else tuple(d_extra))
    written = writable_outputs(grads)
    arrays = (d_out, q, k, v, out, lse, *written[:3])
    if extra is not None:
        arrays += (rpb, d_rpb, *ready_inputs(extra), *written[3:])
    elif rpb is not None:
        arrays += (rpb, d_rpb)
    plan = plan_backward(problem, *_layouts(arrays))
    run_plan_on(plan, arrays + _workspaces(plan))
    copy_back(grads, written)


# ---- what the launchers size their kernels by ---------------------------------------------

# Opt-in shared memory of one block on compute capability 9.0 (H100, H200): what the Hopper
# parts, which run there only, size their tiles by before any device is at hand (refusals).
SM90_SMEM_PER_BLOCK = 227 * 1024


def head_dim_bucket(head_dim, buckets):
    """The smallest of ``buckets`` (ascending) that holds ``head_dim``; None if none does."""
    for b in buckets:
        if head_dim <= b:
            return b
    return None


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What the launchers size shared memory and grids by, as the device reports it."""
    smem_per_block: int   # opt-in dynamic shared memory of one block, bytes
    smem_per_sm: int      # shared memory of one multiprocessor, bytes
    sm_count: int         # multiprocessors


def _current_device():
    """The current CUDA device's id, or None without a usable GPU."""
    from ._device import gpu_unavailable_reason
    if gpu_unavailable_reason() is not None:
        return None
    import cupy
    return cupy.cuda.Device().id


@functools.lru_cache(maxsize=None)
def _capability(device_id):
    import cupy
    cc = cupy.cuda.Device(device_id).compute_capability
    return int(cc[:-1]), int(cc[-1])


def compute_capability():
    """(major, minor) of the current device, or None without a usable GPU."""
    dev = _current_device()
    return None if dev is None else _capability(dev)


def arch_refusal(what):
    """Why ``what`` (tensor-core kernels: mma.sync m16n8k16, cp.async, bfloat16 tiles) cannot
    run on the current device, or None: compute capability 8.0 or newer (Ampere on), or no
    usable GPU to ask."""
    cc = compute_capability()
    if cc is None or cc >= (8, 0):
        return None
    return (f"{what} needs compute capability 8.0 or newer (Ampere on); this device has "
            f"{cc[0]}.{cc[1]}")


def current_limits():
    """The ``DeviceLimits`` of the current device, or None without a usable GPU."""
    dev = _current_device()
    return None if dev is None else device_limits(dev)


def smem_refusal(needed, what):
    """Why a kernel needing ``needed`` bytes of dynamic shared memory per block cannot run on
    the current device (``what`` names it), or None: it fits, or there is no usable GPU to
    ask. GPUs below the data-centre parts allow ~99 KB a block."""
    limits = current_limits()
    if limits is None:
        return None
    limit = limits.smem_per_block
    if needed <= limit:
        return None
    return (f"{what} needs {needed} bytes of shared memory per block; this device allows "
            f"{limit}")


@functools.lru_cache(maxsize=None)
def device_limits(device_id):
    """The ``DeviceLimits`` of CUDA device ``device_id`` (read once per device)."""
    import cupy
    attrs = cupy.cuda.Device(device_id).attributes
    return DeviceLimits(attrs["MaxSharedMemoryPerBlockOptin"],
                        attrs["MaxSharedMemoryPerMultiprocessor"], attrs["MultiProcessorCount"])
