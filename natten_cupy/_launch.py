"""The one place kernels are launched, so the profiler sees every launch.

``launch`` runs a compiled kernel on the current CuPy stream. While a profiler is active
(``natten_cupy.profile()``), each launch is bracketed by CUDA events and reported to it with
the kernel's name, backend, tile config and grid. Code that runs array-library operations on
the GPU instead of its own kernels (the reference backend on CuPy) wraps them in ``region``,
which the profiler records as one entry.
"""

from __future__ import annotations

import contextlib

__all__ = ["launch", "region", "add_recorder", "remove_recorder"]

_recorders = []


def add_recorder(rec):
    _recorders.append(rec)


def remove_recorder(rec):
    _recorders.remove(rec)


def launch(fn, grid, block, args, *, shared_mem=0, name="", backend="", tile=None):
    """Launch ``fn`` (a cupy.RawKernel) with ``args`` on the current stream.

    Empty grids are skipped (zero-size launches are invalid in CUDA).
    """
    grid = tuple(int(g) for g in grid)
    block = tuple(int(b) for b in block)
    if any(g == 0 for g in grid):
        return
    if shared_mem >= 48 * 1024:
        fn.max_dynamic_shared_size_bytes = int(shared_mem)
    if not _recorders:
        fn(grid, block, args, shared_mem=int(shared_mem))
        return
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn(grid, block, args, shared_mem=int(shared_mem))
    stop.record()
    for rec in _recorders:
        rec.record(name=name or fn.name, backend=backend, tile=tile, grid=grid, block=block,
                   start=start, stop=stop)


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
