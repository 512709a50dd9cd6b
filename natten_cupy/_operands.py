"""Operands as the kernels see them: layouts (shape, strides, dtype, alignment) without data.

A backend part plans a call from its operands' ``Layout``s alone, so a plan can be cached per
call signature and reused for any arrays of the same layouts. The kernels read rows of the
head dim with 16-byte accesses: ``rows_ready`` says whether an operand can be used as it is;
``ready_inputs`` / ``writable_outputs`` make stand-ins for those that cannot (contiguous
copies in, contiguous temporaries out, copied back by ``copy_back``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy

__all__ = ["Layout", "layout_of", "rows_ready", "ready_inputs", "writable_outputs",
           "copy_back", "contiguous_strides", "run_forward", "run_backward"]


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


def layout_of(x):
    """The Layout of a CuPy array."""
    return Layout(tuple(x.shape), tuple(x.strides), x.dtype, x.data.ptr % 16 == 0)


def rows_ready(x, vector=16):
    """Whether kernels can access ``x`` (array or Layout) by rows of ``vector``-byte pieces:
    last axis contiguous, base and every other stride a multiple of ``vector`` bytes (axes
    of extent 1 aside)."""
    aligned = x.aligned if isinstance(x, Layout) else x.data.ptr % vector == 0
    if not aligned:
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


def _workspaces(plan):
    """Fresh CuPy arrays for a plan's workspaces (any contents)."""
    import cupy
    return tuple(cupy.empty(shape, dtype) for shape, dtype in plan.workspaces)


def run_forward(plan_forward, problem, q, k, v, out, lse, rpb=None):
    """A fused forward on CuPy arrays through a part's ``plan_forward``: stand-ins for q, k, v,
    out where they are not ``rows_ready``, the plan with its workspaces, then the copy back
    (rpb, read element by element, goes as it is)."""
    from ._launch import run_plan_on
    q, k, v = ready_inputs((q, k, v))
    (dst,) = writable_outputs((out,))
    arrays = (q, k, v, dst, lse) + (() if rpb is None else (rpb,))
    plan = plan_forward(problem, *map(layout_of, arrays))
    run_plan_on(plan, arrays + _workspaces(plan))
    copy_back((out,), (dst,))


def run_backward(plan_backward, problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None,
                 d_rpb=None):
    """A fused backward on CuPy arrays through a part's ``plan_backward`` (operands d_out, q,
    k, v, out, lse, dq, dk, dv [, rpb, d_rpb: element by element, as they are], then the
    plan's workspaces)."""
    from ._launch import run_plan_on
    q, k, v, out, d_out = ready_inputs((q, k, v, out, d_out))
    grads = (dq, dk, dv)
    written = writable_outputs(grads)
    arrays = (d_out, q, k, v, out, lse, *written) + (() if rpb is None else (rpb, d_rpb))
    plan = plan_backward(problem, *map(layout_of, arrays))
    run_plan_on(plan, arrays + _workspaces(plan))
    copy_back(grads, written)
