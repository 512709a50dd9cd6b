"""Counts of a pytest JUnit XML file per test file (passed, failed, skipped), as JSON.

    python bench/junit_summary.py tests.xml OUT.json [--commit HASH] [--device TEXT]

Failures and errors are listed by test id with the first line of their message.
"""

import argparse
import collections
import datetime
import json
import sys
import xml.etree.ElementTree as ET


def summarize(path):
    per_file = collections.defaultdict(collections.Counter)
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")[-1] or case.get("file", "?")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                msg = (child.get("message") or "").splitlines()
                failures.append(f"{case.get('classname')}::{case.get('name')}: "
                                f"{msg[0][:200] if msg else child.tag}")
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        per_file[name][outcome] += 1
    totals = collections.Counter()
    for counts in per_file.values():
        totals.update(counts)
    return {"totals": dict(totals), "per_file": {k: dict(v) for k, v in sorted(per_file.items())},
            "failures": failures}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("xml")
    ap.add_argument("out")
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="")
    ap.add_argument("--command", default="bash bench/gpu_run.sh (pytest -m gpu -n 8)")
    args = ap.parse_args(argv)
    data = {"device": args.device, "commit": args.commit, "command": args.command,
            "date": datetime.date.today().isoformat(), **summarize(args.xml)}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    t = data["totals"]
    print(f"GPU tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
          f"{t.get('skipped', 0)} skipped")
    return 1 if data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
