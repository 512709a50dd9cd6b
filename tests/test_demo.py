"""The README's main job, ``python -m natten_cupy demo``, runs and passes its own check."""

import os
import subprocess
import sys


def test_demo_runs_and_checks_itself():
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-m", "natten_cupy", "demo", "--size", "40"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check: PASSED" in res.stdout
    assert "backend: " in res.stdout


def test_demo_rejects_unknown_command():
    res = subprocess.run([sys.executable, "-m", "natten_cupy", "fly"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert "invalid choice" in res.stderr


def test_demo_help_states_the_default_sizes():
    res = subprocess.run([sys.executable, "-m", "natten_cupy", "demo", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    assert "default 128 GPU, 96 CPU" in " ".join(res.stdout.split())
