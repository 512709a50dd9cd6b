"""bench/ without a GPU: every script and probe imports (GPU work waits for main()), every probe
answers --help, bench/README.md lists every file, and the probes share bench/timing.py's timer
and bench/workloads.py's workloads instead of keeping their own."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository
BENCH = ROOT / "bench"
PROBES = BENCH / "probes"
SCRIPTS = sorted(BENCH.glob("*.py")) + sorted(PROBES.glob("*.py"))
# A machine with a GPU must not see it here either: an import that reaches for the device
# fails instead of passing by luck.
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def _id(path):
    return str(path.relative_to(BENCH))


def _run(args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=NO_GPU, capture_output=True,
                          text=True, timeout=300, **kw)


@pytest.mark.parametrize("path", SCRIPTS, ids=_id)
def test_imports_without_a_gpu(path):
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location({path.stem!r}, {str(path)!r})\n"
            f"sys.modules[{path.stem!r}] = module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n")
    res = _run(["-c", code])
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("path", [p for p in SCRIPTS if "ArgumentParser" in p.read_text()
                                  or p.parent == PROBES], ids=_id)
def test_help(path):
    res = _run([str(path), "--help"])
    assert res.returncode == 0 and "usage:" in res.stdout, res.stdout + res.stderr[-3000:]


def test_readme_lists_every_file():
    readme = (BENCH / "README.md").read_text()
    files = [p for p in BENCH.iterdir() if p.is_file() and p.name != "README.md"]
    files += [p for p in PROBES.iterdir() if p.is_file()]
    missing = [_id(p) for p in files if f"`{_id(p)}`" not in readme]
    assert not missing, f"bench/README.md does not list {missing}"


@pytest.mark.parametrize("path", [p for p in SCRIPTS
                                  if p.name not in ("timing.py", "workloads.py")], ids=_id)
def test_one_timer_and_one_workload_table(path):
    src = path.read_text()
    assert "Event(" not in src, f"{_id(path)} makes CUDA events: time with bench/timing.py"
    for own in ("elapsed_time(", "add_recorder("):   # reading events, or the launch hook
        assert own not in src, f"{_id(path)} times with {own}...): use bench/timing.py"
    assert not re.search(r"^WORKLOADS\s*=", src, re.M), \
        f"{_id(path)} has its own workload table: add its workloads to bench/workloads.py"


def test_timing_imports_neither_library_and_follows_the_callers():
    code = ("import sys; sys.path.insert(0, 'bench'); import timing\n"
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n"
            "assert type(timing._clock()).__name__ == '_CupyClock'\n"
            "import torch\n"
            "assert type(timing._clock()).__name__ == '_TorchClock'\n")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode:
        pytest.skip("torch is not installed")
    res = _run(["-c", code])
    assert res.returncode == 0, res.stderr[-3000:]


class _FakeClock:
    """Events that read a counter the timed function advances: 'milliseconds' are calls."""

    def __init__(self):
        self.now = 0.0

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass
        return Event()

    @staticmethod
    def ms(start, stop):
        return stop.t - start.t

    def sync(self):
        pass


def test_timer_medians(monkeypatch):
    sys.path.insert(0, str(BENCH))
    import timing
    clock = _FakeClock()
    monkeypatch.setattr(timing, "_clock", lambda: clock)
    costs = iter([1.0] * 3 + [5.0, 2.0, 2.0, 3.0, 9.0])   # 3 warm-up calls, then 5 timed

    def fn():
        clock.now += next(costs)
    assert timing.event_ms(fn, warmup=3, reps=5) == 3.0
    costs = iter([7.0, 1.0, 2.0, 4.0])
    assert timing.event_times(fn, 3, warmup=1) == [1.0, 2.0, 4.0]
    costs = iter([1.0, 3.0] * 3)
    assert timing.event_ms(fn, warmup=0, reps=3, inner=2) == 2.0


def test_wall_us_runs_cpu_work_without_a_device(monkeypatch):
    sys.path.insert(0, str(BENCH))
    import timing
    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def fn():   # a call costs 1 us of host time
        now[0] += 1e-6

    def device_sync():   # the device's queue takes 4 us more
        now[0] += 4e-6
    monkeypatch.setattr(timing, "sync", device_sync)
    assert timing.wall_us(fn, calls=2, reps=3, warmup=1) == pytest.approx(3.0)
    assert timing.wall_us(fn, calls=2, reps=3, warmup=1, host=True) == pytest.approx((3.0, 1.0))
    runs = timing.wall_us(fn, calls=2, reps=2, warmup=1, host=True, per_run=True)
    assert [pytest.approx(run) for run in runs] == [(3.0, 1.0)] * 2
    monkeypatch.setattr(timing, "sync", lambda: pytest.fail("cpu=True synchronized a device"))
    assert timing.wall_us(fn, calls=2, reps=3, warmup=1, cpu=True, per_run=True) == \
        pytest.approx([1.0] * 3)


def _fake_cupy(clock):
    """What launch_times and natten_cupy._launch.region use of CuPy, on ``clock``'s events."""
    device = types.SimpleNamespace(synchronize=lambda: None)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=clock.event, get_elapsed_time=clock.ms, Device=lambda: device))


def test_launch_times_through_the_profiler_hook(monkeypatch):
    sys.path.insert(0, str(BENCH))
    import timing
    from natten_cupy import _launch
    clock = _FakeClock()
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(clock))

    def fn():
        for name, backend, ms in (("qk", "tiled", 2.0), ("softmax", "softmax", 1.0),
                                  ("qk", "tiled", 3.0)):
            with _launch.region(name, backend):
                clock.now += ms
    assert timing.launch_times(fn) == [("qk", 2.0), ("softmax", 1.0), ("qk", 3.0)]
    assert timing.launch_times(fn, backend=True) == [
        ("qk", "tiled", 2.0), ("softmax", "softmax", 1.0), ("qk", "tiled", 3.0)]
    assert timing.kernel_split(fn) == {"qk": 5.0, "softmax": 1.0}
    assert not _launch.profiling()


def test_tiled_probe_takes_each_launchs_median(monkeypatch):
    spec = importlib.util.spec_from_file_location("tiled_probe", PROBES / "tiled_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    runs = iter([[("a", "tiled", 1.0), ("b", "naive", 9.0)],
                 [("a", "tiled", 3.0), ("b", "naive", 5.0)],
                 [("a", "tiled", 2.0), ("b", "naive", 7.0)]])
    monkeypatch.setattr(probe, "launch_times", lambda fn, backend: next(runs))
    assert probe._kernels(None, 3) == [("a", "tiled", 2.0), ("b", "naive", 7.0)]
