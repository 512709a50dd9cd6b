"""The README's tables are what bench/report.py and bench/probes/probe_report.py make of the
committed results."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository
RESULTS = ROOT / "bench" / "results"
# (README block, the script that writes it, the committed results it is made of)
TABLES = [("performance", "report.py", "suite.json"),
          ("unfused chain", "probes/probe_report.py", "tiled_probe.json")]


@pytest.mark.parametrize("what, script, results", TABLES, ids=[t[0] for t in TABLES])
def test_readme_table_matches_committed_results(what, script, results):
    path = RESULTS / results
    if not path.exists():
        pytest.skip(f"no committed {results}")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / script), str(path), "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"README's {what} table: " + res.stdout + res.stderr


def test_probe_report_renders_a_probe_file(tmp_path):
    """The README block of a small probe JSON: one row per tiled result, speedups, bandwidth."""
    sys.path.insert(0, str(ROOT / "bench" / "probes"))
    import probe_report
    k = {"step": "qk", "kernel": "natten::tiled::x", "backend": "tiled", "ms": 2.0,
         "bandwidth_fraction": 0.25}
    data = {"device": "GPU", "commit": "abc", "results": [{
        "workload": "W2", "dtype": "float16", "tf32": False, "backends": {
            "tiled": {"kernels": [k], "chain": {"fwd_ms": 10.0, "fwd_bwd_ms": 30.0,
                                                "speedup_fwd": 5.0, "speedup_fwd_bwd": 6.0}},
            "naive": {"kernels": [], "chain": {"fwd_ms": 50.0, "fwd_bwd_ms": 180.0}}}}]}
    readme = tmp_path / "README.md"
    readme.write_text(f"x\n{probe_report.START}\nold\n{probe_report.END}\ny\n")
    probe_report.update_readme(data, str(readme))
    text = readme.read_text()
    assert "| W2 | fp16 | 10 / 30 | 50 / 180 | 5.00x / 6.00x | 25-25% |" in text
    assert "| qk | `tiled::x` | 2.00 | 25% |" in text
    assert text.startswith("x\n") and text.endswith("y\n")
    assert probe_report.update_readme(data, str(readme), check=True)


def test_readme_call_tables_match_committed_results():
    """The overhead and model-shaped tables are what bench/calls_report.py makes of the
    committed overhead.json and models.json."""
    if not ((RESULTS / "overhead.json").exists() or (RESULTS / "models.json").exists()):
        pytest.skip("no committed overhead.json or models.json")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "calls_report.py"), "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
