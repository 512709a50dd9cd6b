"""The command-line tools: every option has help text and states its default, and on a machine
without a GPU none of them ends in a traceback (NATTEN_CUPY_NO_GPU=1 makes any machine one)."""

import argparse
import os
import pathlib
import subprocess
import sys

import pytest

from natten_cupy import __main__ as cli
from natten_cupy import profile_cli
from natten_cupy import _device, _env

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository


def _run(*args, no_gpu=True, timeout=300):
    env = dict(os.environ)
    if no_gpu:
        env["NATTEN_CUPY_NO_GPU"] = "1"
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def _options(parser):
    """(parser, action) for every option of a parser and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield parser, action


PARSERS = {"python -m natten_cupy": cli.make_parser(),
           "natten-cupy-profile": profile_cli.make_parser()}


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_option_has_help_and_states_its_default(prog):
    missing = []
    for parser, action in _options(PARSERS[prog]):
        text = (action.help or "").lower()
        flag = action.nargs == 0
        # Value options say their default or that they are required; flags say what they
        # change (their default is off) and, where it is not obvious, what happens without.
        if not text or (not flag and "default" not in text and "required" not in text):
            missing.append(f"{parser.prog} {'/'.join(action.option_strings)}: {action.help!r}")
    assert not missing, missing


@pytest.mark.parametrize("args", [("-m", "natten_cupy", "--help"),
                                  ("-m", "natten_cupy", "demo", "--help"),
                                  ("-m", "natten_cupy.profile_cli", "--help")])
def test_help_runs_without_a_gpu(args):
    res = _run(*args)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout and "Traceback" not in res.stderr


def test_profile_help_gives_the_defaults():
    out = " ".join(_run("-m", "natten_cupy.profile_cli", "--help").stdout.split())
    for text in ("head dim D (default 64)", "(default fp16)", "(default auto",
                 "default 10", "(default 0)", "(default 1)"):
        assert text in out, text


@pytest.mark.parametrize("backend", ["auto", "reference", "fused"])
def test_profile_without_a_gpu_says_so(backend):
    pytest.importorskip("rich")
    res = _run("-m", "natten_cupy.profile_cli", "-i", "32", "32", "-k", "3", "--backend", backend)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "needs a CUDA GPU, and none is visible here (NATTEN_CUPY_NO_GPU is set)" in res.stderr
    assert "--dry-run" in res.stderr


def test_profile_dry_run_needs_no_gpu():
    pytest.importorskip("rich")
    res = _run("-m", "natten_cupy.profile_cli", "-i", "32", "32", "-k", "3", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "auto picks" in res.stdout and "Traceback" not in res.stderr


def test_profile_rejects_a_bad_problem_in_one_line():
    pytest.importorskip("rich")
    res = _run("-m", "natten_cupy.profile_cli", "-i", "4", "4", "-k", "7")
    assert res.returncode == 2
    assert "invalid problem" in res.stdout and "Traceback" not in res.stderr


def test_smoke_script_without_a_gpu_says_so():
    res = _run(str(ROOT / "bench" / "smoke.py"))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr, res.stderr
    assert "bench/smoke.py needs a CUDA GPU" in res.stderr


def test_require_gpu_names_the_reason(monkeypatch):
    monkeypatch.setenv("NATTEN_CUPY_NO_GPU", "1")
    _device.gpu_unavailable_reason.cache_clear()
    try:
        with pytest.raises(_env.NoGPUError, match=r"CuPy arrays needs a CUDA GPU, and none is "
                                                  r"visible here \(NATTEN_CUPY_NO_GPU is set\)"):
            _env.require_gpu("CuPy arrays")
        assert _env.is_no_gpu_error(RuntimeError(
            "cudaErrorInsufficientDriver: CUDA driver version is insufficient"))
        assert not _env.is_no_gpu_error(ValueError("kernel_size must be positive"))
    finally:
        _device.gpu_unavailable_reason.cache_clear()


def test_several_cupy_builds_are_reported(monkeypatch):
    monkeypatch.setattr(_env, "cupy_packages", lambda: ["cupy-cuda12x 14.2.0",
                                                        "cupy-cuda13x 14.2.0"])
    assert "several CuPy builds are installed (cupy-cuda12x 14.2.0, cupy-cuda13x 14.2.0)" \
        in _env.cupy_problem()
    monkeypatch.setattr(_env, "cupy_packages", lambda: [])
    assert _env.cupy_problem().startswith("CuPy is not installed")
    assert _env.nvrtc_unavailable_reason().startswith("CuPy is not installed")
