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
