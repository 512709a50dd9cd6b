"""bench/junit_summary.py: GPU test counts per file from pytest's JUnit XML."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import junit_summary  # noqa: E402

XML = """<testsuites><testsuite>
<testcase classname="tests.test_a" name="t1"/>
<testcase classname="tests.test_a" name="t2"><skipped message="no GPU"/></testcase>
<testcase classname="tests.test_b" name="t3"><failure message="boom&#10;detail"/></testcase>
<testcase classname="tests.test_b" name="t4"><error message="setup broke"/></testcase>
</testsuite></testsuites>"""


def test_counts_per_file_and_failures(tmp_path):
    xml, out = tmp_path / "t.xml", tmp_path / "t.json"
    xml.write_text(XML)
    assert junit_summary.main([str(xml), str(out), "--commit", "abc"]) == 1
    data = json.loads(out.read_text())
    assert data["totals"] == {"passed": 1, "skipped": 1, "failed": 2}
    assert data["per_file"] == {"test_a": {"passed": 1, "skipped": 1}, "test_b": {"failed": 2}}
    assert data["failures"] == ["tests.test_b::t3: boom", "tests.test_b::t4: setup broke"]
    assert data["commit"] == "abc"


def test_all_passed_exits_zero(tmp_path):
    xml, out = tmp_path / "t.xml", tmp_path / "t.json"
    xml.write_text('<testsuite><testcase classname="tests.test_a" name="t1"/></testsuite>')
    assert junit_summary.main([str(xml), str(out)]) == 0
