"""One timer for every benchmark script: CUDA events around calls, medians.

* ``event_ms(fn)``: median over ``reps`` of the time of ``inner`` back-to-back calls divided by
  ``inner``, by CUDA events on torch's current stream. Host work between launches counts when
  the GPU waits for it, so this is what a user sees of an eager call.
* ``graph_ms(fn)``: ``fn`` captured once in a torch CUDA graph, replays timed the same way:
  the kernels alone, without host overhead.
* ``wall_us(fn)``: host wall time per call over ``calls`` calls and one final synchronize,
  median of ``reps``: the per-call overhead on problems whose kernels are tiny.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["event_ms", "graph_ms", "wall_us", "sync"]


def sync():
    import torch
    torch.cuda.synchronize()


def event_ms(fn, *, warmup=3, reps=15, inner=1):
    import torch
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / inner)
    return statistics.median(times)


def graph_ms(fn, *, warmup=3, reps=15, inner=1):
    """Kernel time of ``fn`` from CUDA-graph replays (``fn`` warmed up on a side stream)."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = event_ms(graph.replay, warmup=2, reps=reps, inner=inner)
    del graph
    return ms


def wall_us(fn, *, calls=500, reps=5, warmup=20, host=False):
    """Microseconds per call: wall time of ``calls`` calls and a synchronize, median of
    ``reps``; with ``host=True`` also the host time alone (before the synchronize: what the
    calls cost the CPU while the GPU queue absorbs their kernels), as (wall, host)."""
    for _ in range(warmup):
        fn()
    sync()
    walls, hosts = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        walls.append((time.perf_counter() - t0) / calls * 1e6)
        hosts.append((t1 - t0) / calls * 1e6)
    if host:
        return statistics.median(walls), statistics.median(hosts)
    return statistics.median(walls)
