"""The README's performance table is what bench/report.py makes of the committed results."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "suite.json"


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed benchmark results")
def test_readme_table_matches_committed_results():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), str(RESULTS),
                          "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


PROBE = ROOT / "bench" / "results" / "tiled_probe.json"


@pytest.mark.skipif(not PROBE.exists(), reason="no committed unfused-chain probe results")
def test_readme_unfused_table_matches_committed_probe():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "probe_report.py"), str(PROBE),
                          "--check"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def test_probe_report_renders_a_probe_file(tmp_path):
    """The README block of a small probe JSON: one row per tiled result, speedups, bandwidth."""
    sys.path.insert(0, str(ROOT / "bench"))
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
