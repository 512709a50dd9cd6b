"""Per-kernel profiler: ``with natten_cupy.profile() as prof: ...``.

Inside the block every kernel natten_cupy launches goes through ``_launch.launch``, which
brackets it with a pair of CUDA events and hands them here with the kernel's name, backend,
tile config, grid and block. On exit the profiler waits for the last event and turns the
pairs into milliseconds. Needs CuPy only when kernels were launched; no PyTorch.

The cost model used by the table (and by the benchmark suite) lives here too: useful FLOPs
(BENCH.md: forward ``4 * B * N * H * K * D``, backward 2.5x) and the floor, the larger of
"bytes that must move / copy bandwidth" and "FLOPs / matmul ceiling of the dtype".
"""

from __future__ import annotations

import collections

__all__ = ["Profiler", "CEILINGS", "COPY_BANDWIDTH", "BACKWARD_FLOP_FACTOR", "ceiling_key",
           "flops", "bytes_moved", "floor_ms"]

# Measured on the lent H200 (BENCH.md "Device ceilings").
COPY_BANDWIDTH = 4.28e12                     # bytes/s, read + write
CEILINGS = {                                 # FLOP/s of a dense matmul
    "float16": 657e12,
    "bfloat16": 698e12,
    "tf32": 362e12,
    "float32": 51e12,
}
BACKWARD_FLOP_FACTOR = 2.5


def ceiling_key(dtype_name, allow_tf32=False):
    """Key of CEILINGS for a dtype name (float32 with TF32 counts as 'tf32'); None for float64."""
    if dtype_name == "float32" and allow_tf32:
        return "tf32"
    return dtype_name if dtype_name in CEILINGS else None


def flops(batch, tokens, heads, neighbors, head_dim, backward=False):
    """Useful FLOPs of NA: forward ``4 * B * N * H * K * D`` (QK^T and PV), backward 2.5x."""
    fwd = 4 * batch * tokens * heads * neighbors * head_dim
    return fwd * BACKWARD_FLOP_FACTOR if backward else fwd


def bytes_moved(batch, tokens, heads, head_dim, itemsize, backward=False, lse_itemsize=4):
    """Bytes a fused NA must move at least.

    Forward reads q, k, v and writes out and lse; backward reads q, k, v, out, dO and lse and
    writes dq, dk, dv.
    """
    tensor = batch * tokens * heads * head_dim * itemsize
    lse = batch * tokens * heads * lse_itemsize
    return (8 if backward else 4) * tensor + lse


def floor_ms(batch, tokens, heads, neighbors, head_dim, dtype_name, backward=False,
             allow_tf32=False):
    """What no implementation can beat: max(bytes / bandwidth, FLOPs / ceiling), in ms.

    float64 has no matmul ceiling in BENCH.md, so its floor is the memory term alone.
    """
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype_name]
    lse_itemsize = 8 if dtype_name == "float64" else 4
    mem = bytes_moved(batch, tokens, heads, head_dim, itemsize, backward, lse_itemsize)
    t = mem / COPY_BANDWIDTH
    key = ceiling_key(dtype_name, allow_tf32)
    if key is not None:
        t = max(t, flops(batch, tokens, heads, neighbors, head_dim, backward) / CEILINGS[key])
    return t * 1e3


def _elapsed_ms(start, stop):
    import cupy
    return cupy.cuda.get_elapsed_time(start, stop)


class Profiler:
    """Records every kernel launch made through natten_cupy while the block runs.

    ``records``: one dict per launch (name, backend, tile, grid, block, ms), in launch order.
    ``total_ms``: the sum of the kernels' times. ``summary()`` groups launches of the same
    kernel, backend, tile and grid; ``table(...)`` renders that as a rich table.
    """

    def __init__(self):
        self.records = []
        self._pending = []
        self._active = False

    # -- recorder protocol (called by _launch.launch) --------------------------------------

    def record(self, *, name, backend, tile, grid, block, start, stop):
        self._pending.append((dict(name=name, backend=backend,
                                   tile=None if tile is None else tuple(tile),
                                   grid=tuple(grid), block=tuple(block)), start, stop))

    # -- context manager -------------------------------------------------------------------

    def __enter__(self):
        from . import _launch
        if self._active:
            raise RuntimeError("this Profiler is already active")
        self.records, self._pending = [], []
        _launch.add_recorder(self)
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb):
        from . import _launch
        _launch.remove_recorder(self)
        self._active = False
        pending, self._pending = self._pending, []
        try:
            if pending:
                pending[-1][2].synchronize()
            self.records = [dict(info, ms=float(_elapsed_ms(start, stop)))
                            for info, start, stop in pending]
        except Exception:
            if exc_type is None:
                raise
            # The block already failed (maybe a CUDA error): keep the launches, untimed,
            # and let the original exception through.
            self.records = [dict(info, ms=None) for info, _, _ in pending]
        return False

    # -- results ---------------------------------------------------------------------------

    @property
    def total_ms(self):
        return sum(r["ms"] for r in self.records if r["ms"] is not None)

    def summary(self):
        """Launches grouped by (name, backend, tile, grid), in first-launch order."""
        groups = collections.OrderedDict()
        for r in self.records:
            key = (r["name"], r["backend"], r["tile"], r["grid"])
            g = groups.get(key)
            if g is None:
                g = groups[key] = dict(name=r["name"], backend=r["backend"], tile=r["tile"],
                                       grid=r["grid"], block=r["block"], calls=0, ms=0.0)
            g["calls"] += 1
            g["ms"] += r["ms"] or 0.0
        return list(groups.values())

    def table(self, flops=None, floor_ms=None, measured_ms=None, title="natten_cupy kernels"):
        """A ``rich.table.Table`` of the kernels.

        ``flops``: useful FLOPs of the profiled work (adds a TFLOP/s line for the total);
        ``floor_ms``: its floor (adds the fraction of the floor reached); ``measured_ms``: the
        time measured around the whole call, shown next to the kernels' sum so the two can
        be compared (their gap is work outside natten_cupy's launches, e.g. a CuPy softmax).
        """
        from rich.table import Table

        total = self.total_ms
        t = Table(title=title)
        for col, just in (("kernel", "left"), ("backend", "left"), ("tile", "left"),
                          ("grid", "left"), ("calls", "right"), ("time ms", "right"),
                          ("share", "right")):
            t.add_column(col, justify=just)
        for g in self.summary():
            share = g["ms"] / total if total > 0 else 0.0
            t.add_row(g["name"], g["backend"] or "-", _dims(g["tile"]), _dims(g["grid"]),
                      str(g["calls"]), f"{g['ms']:.4f}", f"{100 * share:.1f}%")
        t.add_section()
        t.add_row("sum of kernels", "", "", "", str(len(self.records)), f"{total:.4f}",
                  "100.0%" if total > 0 else "-")
        if measured_ms is not None:
            gap = measured_ms - total
            t.add_row("measured around the call", "", "", "", "", f"{measured_ms:.4f}",
                      f"{100 * total / measured_ms:.1f}% in kernels" if measured_ms > 0
                      else "-")
            t.add_row("outside natten kernels", "", "", "", "", f"{gap:.4f}", "")
        ref = measured_ms if measured_ms is not None else total
        if flops is not None and ref > 0:
            t.add_row("useful TFLOP/s", "", "", "", "", f"{flops / ref / 1e9:.2f}", "")
        if floor_ms is not None and ref > 0:
            t.add_row("floor ms (fraction reached)", "", "", "", "", f"{floor_ms:.4g}",
                      f"{100 * floor_ms / ref:.1f}%")
        return t


def _dims(t):
    return "-" if t is None else "x".join(str(x) for x in t)
