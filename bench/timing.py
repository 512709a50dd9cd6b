"""One timer for every benchmark script and probe: CUDA events around calls, medians.

* ``event_ms(fn)``: median over ``reps`` of the time of ``inner`` back-to-back calls divided by
  ``inner``, by CUDA events on the current stream. Host work between launches counts when the
  GPU waits for it, so this is what a user sees of an eager call.
* ``event_times(fn, reps)``: the ``reps`` single-call times themselves (no warm-up unless
  asked), their events recorded back to back and read after one synchronize: for a caller
  that takes its own medians and spreads (``suite.py`` sizes its repetitions from them).
* ``graph_ms(fn)``: ``fn`` captured once in a torch CUDA graph, replays timed the same way:
  the kernels alone, without host overhead.
* ``wall_us(fn)``: host wall time per call over ``calls`` calls and one final synchronize,
  median of ``reps`` (or every run's): the per-call overhead on problems whose kernels are
  tiny, or of calls on the CPU (``cpu=True``, nothing to synchronize);
* ``python_profile(fn)``: the Python calls one warm call of ``fn`` makes and the functions
  with the most own time (cProfile, which inflates small calls): where that overhead goes;
* ``profiled_once(fn)``: one warm-up call, then one between cudaProfilerStart and Stop (what
  ``ncu --profile-from-start off`` profiles);
* ``launch_times(fn)``, ``kernel_split(fn)``, ``kernel_ms(fn)``: kernels alone, by the library's
  profiler hook (``natten_cupy._launch.add_recorder``: CUDA events around every launch of
  natten_cupy), so host time between launches does not count: (name, ms) of every launch of
  one call (with its backend on request); per kernel name the median over calls of its
  launches' sum; the median of a call's summed kernel times.
* ``save_rows(path, rows)``: a probe's rows as JSON, with the device and commit they came from.

The events go on the stream the caller's work runs on: torch's current stream when the caller
has imported torch (the suite, the torch layer, the peers), else CuPy's current stream (the
probes, which launch CuPy kernels and never import torch). Importing this module imports
neither.
"""

from __future__ import annotations

import statistics
import sys
import time

__all__ = ["event_ms", "event_times", "graph_ms", "wall_us", "python_profile", "profiled_once",
           "sync", "launch_times", "kernel_split", "kernel_ms"]


class _TorchClock:
    def __init__(self):
        import torch
        self.torch = torch

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    @staticmethod
    def ms(start, stop):
        return start.elapsed_time(stop)

    def sync(self):
        self.torch.cuda.synchronize()


class _CupyClock:
    def __init__(self):
        import cupy
        self.cupy = cupy

    def event(self):
        return self.cupy.cuda.Event()

    def ms(self, start, stop):
        return self.cupy.cuda.get_elapsed_time(start, stop)

    def sync(self):
        self.cupy.cuda.Device().synchronize()


def _clock():
    return _TorchClock() if "torch" in sys.modules else _CupyClock()


def sync():
    _clock().sync()


def event_times(fn, reps=1, *, warmup=0):
    """Milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` calls, one
    synchronize."""
    clock = _clock()
    for _ in range(warmup):
        fn()
    pairs = [(clock.event(), clock.event()) for _ in range(reps)]
    for start, stop in pairs:
        start.record()
        fn()
        stop.record()
    clock.sync()
    return [clock.ms(start, stop) for start, stop in pairs]


def event_ms(fn, *, warmup=3, reps=15, inner=1):
    clock = _clock()
    for _ in range(warmup):
        fn()
    clock.sync()
    times = []
    for _ in range(reps):
        start, stop = clock.event(), clock.event()
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(clock.ms(start, stop) / inner)
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


def wall_us(fn, *, calls=500, reps=5, warmup=20, host=False, cpu=False, per_run=False):
    """Microseconds per call: wall time of ``calls`` calls and a synchronize, median of
    ``reps``; with ``host=True`` also the host time alone (before the synchronize: what the
    calls cost the CPU while the GPU queue absorbs their kernels), as (wall, host).
    ``cpu=True``: the calls work on the CPU, so there is no device to synchronize (and none is
    touched). ``per_run=True``: the figure of every run, a list of ``reps``, instead of their
    median (for a caller that also wants the best run, the steadier one on a shared machine)."""
    wait = (lambda: None) if cpu else sync
    for _ in range(warmup):
        fn()
    wait()
    walls, hosts = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        wait()
        walls.append((time.perf_counter() - t0) / calls * 1e6)
        hosts.append((t1 - t0) / calls * 1e6)
    if per_run:
        return list(zip(walls, hosts)) if host else walls
    if host:
        return statistics.median(walls), statistics.median(hosts)
    return statistics.median(walls)


def python_profile(fn, n=200, top=12):
    """{calls, functions, top} of one warm call of ``fn`` (cProfile over ``n`` calls after
    one): Python calls per call, distinct functions, and the ``top`` functions by own time
    (function, calls and own microseconds per call)."""
    import cProfile
    import pstats
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    best = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return dict(calls=st.total_calls / n, functions=len(st.stats),
                top=[dict(function=f"{f[0].rsplit('/', 1)[-1]}:{f[1]}:{f[2]}", calls=v[1] / n,
                          tottime_us=v[2] / n * 1e6) for f, v in best])


def profiled_once(fn):
    """``fn()`` once to warm up, then once between cudaProfilerStart and cudaProfilerStop."""
    import cupy
    fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    try:
        fn()
        cupy.cuda.Device().synchronize()
    finally:
        cupy.cuda.profiler.stop()


class _Launches:
    """A profiler recorder (``natten_cupy._launch``) that keeps every launch's events."""

    def __init__(self):
        self.events = []

    def record(self, name, backend, start, stop, **_):
        self.events.append((name, backend, start, stop))


def launch_times(fn, *, backend=False):
    """(name, ms) of every kernel launch of one call of ``fn``, in launch order; with
    ``backend=True`` (name, backend, ms), the backend the launch was made for."""
    import cupy
    from natten_cupy._launch import add_recorder, remove_recorder
    rec = _Launches()
    add_recorder(rec)
    try:
        fn()
    finally:
        remove_recorder(rec)
    cupy.cuda.Device().synchronize()
    if backend:
        return [(name, be, cupy.cuda.get_elapsed_time(a, b)) for name, be, a, b in rec.events]
    return [(name, cupy.cuda.get_elapsed_time(a, b)) for name, _, a, b in rec.events]


def kernel_split(fn, reps=1):
    """{kernel name: ms} of a call of ``fn`` (after a warm-up): per kernel name, the median
    over ``reps`` calls of its launches' summed times."""
    fn()
    runs = []
    for _ in range(reps):
        run = {}
        for name, ms in launch_times(fn):
            run[name] = run.get(name, 0.0) + ms
        runs.append(run)
    return {name: round(statistics.median(r.get(name, 0.0) for r in runs), 4)
            for name in runs[0]}


def kernel_ms(fn, reps):
    """Median over ``reps`` calls of the summed kernel times of one call of ``fn`` (after a
    warm-up)."""
    fn()
    return statistics.median(sum(ms for _, ms in launch_times(fn)) for _ in range(reps))


def save_rows(path, rows):
    """Write a probe's ``rows`` to ``path`` as JSON under ``meta``: the device and the commit
    (``$NATTEN_CUPY_COMMIT``) they were measured on."""
    import json
    import os

    import cupy
    meta = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                commit=os.environ.get("NATTEN_CUPY_COMMIT", ""))
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
