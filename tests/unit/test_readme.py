"""The README is a user's document: its install commands are what CI runs, it speaks of nothing
a user does not have, and it states the layout, the sizes and times, and the license."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository
README = (ROOT / "README.md").read_text()
GENERATED = [("<!-- perf-table:start -->", "<!-- perf-table:end -->"),
             ("<!-- unfused-table:start -->", "<!-- unfused-table:end -->")]


def _prose():
    """The README less the tables bench/report.py and bench/probes/probe_report.py write."""
    text = README
    for start, end in GENERATED:
        text = text[:text.index(start)] + text[text.index(end) + len(end):]
    return text


def _install_commands():
    section = README[README.index("## Install and run"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_ci_runs_the_readme_commands_verbatim():
    commands = _install_commands()
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    ran = re.findall(r"^readme '(.*)'$", ci, re.M)
    assert ran == commands


@pytest.mark.parametrize("pattern", [r"\bSPEC\b", r"BENCH\.md", r"\bissue \d", r"main job",
                                     r"\.\./shared", r"the project's", r"\bsession\b",
                                     r"device call", r"targets?\b"])
def test_no_internal_references(pattern):
    hits = [line for line in _prose().splitlines() if re.search(pattern, line, re.I)]
    assert not hits, hits


def test_layout_is_stated_with_the_wrong_layout_example():
    prose = _prose()
    assert "## Layout: `[B, *spatial, H, D]`" in prose
    assert "batch first, then the spatial\naxes" in prose
    assert "`[B, H, N, D]`" in prose and "silently" in prose
    assert "t.movedim(1, -2)" in prose and "moveaxis(q, 1, -2)" in prose


def test_states_sizes_times_and_what_the_demo_prints():
    prose = _prose()
    assert re.search(r"about \d{3} MB", prose) and re.search(r"about 5\.\d GB", prose)
    assert re.search(r"\d+ min", prose), "the test run's duration"
    assert "natten_cupy demo on CPU (NumPy;" in prose
    assert "natten_cupy demo on GPU (" in prose
    assert "python -m natten_cupy demo --check" in prose


def _shape_of(text):
    """Demo output with its numbers and its no-GPU reason blanked out."""
    text = re.sub(r"\(NumPy; .*\)$", "(NumPy; REASON)", text.strip(), flags=re.M)
    return re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "N", text).splitlines()


def test_demo_cpu_output_in_the_readme_is_the_demos():
    block = re.search(r"```text\n(natten_cupy demo on CPU.*?)```", README, re.S).group(1)
    env = dict(os.environ, NATTEN_CUPY_NO_GPU="1")
    res = subprocess.run([sys.executable, "-m", "natten_cupy", "demo"], capture_output=True,
                         text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert _shape_of(block) == _shape_of(res.stdout)


def test_license_is_shipped():
    assert (ROOT / "LICENSE").is_file()
    assert "MIT (`LICENSE`)" in README
