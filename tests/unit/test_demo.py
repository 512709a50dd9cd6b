"""``python -m natten_cupy demo`` runs and passes its own check; ``demo --check`` prints the
environment and every backend's result (on a machine without a GPU, or one told to act so)."""

import os
import subprocess
import sys

import pytest

from natten_cupy.backends import NAMES


def _run(*args, no_gpu=False):
    env = dict(os.environ)
    if no_gpu:
        env["NATTEN_CUPY_NO_GPU"] = "1"
    return subprocess.run([sys.executable, "-m", "natten_cupy", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_demo_runs_and_checks_itself():
    res = _run("demo", "--size", "40")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check: PASSED" in res.stdout
    assert "backend: " in res.stdout


def test_demo_on_cpu_says_what_it_ran():
    res = _run("demo", "--size", "24", no_gpu=True)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "natten_cupy demo on CPU (NumPy; NATTEN_CUPY_NO_GPU is set)"
    assert "  na2d: q/k/v (1, 24, 24, 4, 32) float32, kernel 7x7" in lines
    assert "  backend: reference" in lines
    assert "demo --check" in res.stdout


def test_demo_check_on_cpu_prints_a_bug_report_table():
    res = _run("demo", "--check", no_gpu=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    out = res.stdout
    for item in ("natten_cupy", "python", "numpy", "cupy", "torch", "NVRTC", "CUDA headers",
                 "driver", "GPU"):
        assert f"\n| {item} " in out, item
    assert "| GPU          | none: NATTEN_CUPY_NO_GPU is set" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and line.count("|") == 5}
    for name in NAMES:
        assert name in rows, name
    assert "| numpy  | float32 | ok: na2d, rel. error" in rows["reference"]
    for name in NAMES:
        if name != "reference":
            assert "not run: needs a CUDA GPU" in rows[name], rows[name]
    assert "torch layer" in rows
    assert out.rstrip().endswith("check: PASSED")


def test_demo_rejects_unknown_command():
    res = _run("fly")
    assert res.returncode == 2
    assert "invalid choice" in res.stderr


def test_demo_help_states_the_default_sizes():
    res = _run("demo", "--help")
    assert res.returncode == 0
    assert "default 128 GPU, 96 CPU" in " ".join(res.stdout.split())


@pytest.mark.gpu
def test_demo_check_on_gpu_runs_every_backend():
    res = _run("demo", "--check")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {line.split("|")[1].strip(): line for line in res.stdout.splitlines()
            if line.startswith("| ") and line.count("|") == 5}
    assert not [row for row in rows.values() if "FAILED" in row]
    assert sum("| ok: " in rows[name] for name in ("naive", "tiled", "fused")) == 3
    assert "natten_cupy demo on GPU (" in _run("demo", "--size", "32").stdout
