"""compute-sanitizer memcheck, racecheck and initcheck over every kernel family.

Runs ``bench/sanitize_cases.py`` (small cases of each op, rank, dtype and tile variant, CuPy's
memory pools off) once without a sanitizer, which compiles every kernel into CuPy's disk
cache and checks that every output element is written, then once under each tool:

    compute-sanitizer --tool memcheck|racecheck|initcheck python3 bench/sanitize_cases.py ...

and writes one summary JSON: per tool the errors the sanitizer reported (its ERROR SUMMARY;
racecheck's hazards too), the first error lines, the cases run of those planned, and whether
the tool's time ran out; plus the kernels the cases used and the registered instantiations
none of them used. Full logs sit next to the summary.

    python3 bench/sanitize.py --out-dir $OUT/sanitize --time-budget-s 420

The budget covers the warm-up and the three tools (shared 2 : 2 : 3 : 2 between warm-up,
memcheck, racecheck and initcheck; time a stage leaves unused goes to the next); a tool that runs out of time stops cleanly and says how
many cases it ran. Exit status 1 when a tool reported errors, a case failed or a tool could
not run, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
CASES = HERE / "sanitize_cases.py"
TOOLS = ("memcheck", "racecheck", "initcheck")
SHARES = {"warmup": 2, "memcheck": 2, "racecheck": 3, "initcheck": 2}
TOOL_OPTIONS = {
    "memcheck": ["--leak-check", "no"],
    "racecheck": ["--racecheck-report", "all"],
    "initcheck": [],
}
GRACE_S = 90      # past its own budget, a run is killed (the cases script stops itself first)

ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s+(\d+)\s+error")
RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s+(\d+)\s+hazards?\s+displayed\s+\((\d+)\s+"
                          r"errors?,\s+(\d+)\s+warnings?\)")
CASES_RUN = re.compile(r"CASES RUN (\d+) of (\d+)")


def find_sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and (pathlib.Path(base) / "bin" / "compute-sanitizer").is_file():
            return str(pathlib.Path(base) / "bin" / "compute-sanitizer")
    nvcc = shutil.which("nvcc")
    if nvcc:
        cand = pathlib.Path(nvcc).resolve().parent / "compute-sanitizer"
        if cand.is_file():
            return str(cand)
    return None


def run_logged(cmd, log, timeout):
    """Run ``cmd``, stdout and stderr into ``log``; (exit code or None if killed, text)."""
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                cwd=HERE.parent).returncode
        except subprocess.TimeoutExpired:
            rc = None
    text = pathlib.Path(log).read_text(errors="replace")
    return rc, text, round(time.time() - t0, 1)


def error_lines(text, limit=40):
    """The sanitizer's error headers, each with the kernel (its "at ..." line) it hit."""
    keep = []
    lines = [ln[9:].strip() for ln in text.splitlines() if ln.startswith("=========")]
    for i, body in enumerate(lines):
        if re.match(r"(Invalid|Race|Uninitialized|Error|Program hit|Out of range|Misaligned|"
                    r"Barrier|Cuda API|Warning: Race)", body):
            at = next((ln for ln in lines[i + 1:i + 4] if ln.startswith("at ")), "")
            keep.append(f"{body} {at}".strip())
            if len(keep) >= limit:
                break
    return keep


def parse(tool, rc, text, elapsed, cases_json):
    m = ERROR_SUMMARY.findall(text)
    res = {"tool": tool, "exit_code": rc, "killed": rc is None, "elapsed_s": elapsed,
           "errors": int(m[-1]) if m else None, "first_errors": error_lines(text)}
    if tool == "racecheck":
        h = RACE_SUMMARY.findall(text)
        res["hazards"] = int(h[-1][0]) if h else None
        if h and res["errors"] is None:
            res["errors"] = int(h[-1][1])
    c = CASES_RUN.findall(text)
    res["cases_run"], res["cases_total"] = (int(c[-1][0]), int(c[-1][1])) if c else (0, None)
    try:
        info = json.loads(pathlib.Path(cases_json).read_text())
        res["out_of_time"] = info["out_of_time"]
        res["case_failures"] = [f"{f['case']}: {f['error']}" for f in info["failures"]]
    except (OSError, ValueError, KeyError):
        res["out_of_time"] = None
        res["case_failures"] = ["no case summary (the run was killed or crashed)"]
    if res["errors"] is None and tool != "warmup":
        res["problem"] = "no ERROR SUMMARY in the log (the sanitizer did not finish)"
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="sanitize_out")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--time-budget-s", type=float, default=420.0)
    ap.add_argument("--families", default=None, help="passed to sanitize_cases.py")
    ap.add_argument("--limit", type=int, default=0, help="passed to sanitize_cases.py")
    ap.add_argument("--no-warmup", action="store_true")
    a = ap.parse_args(argv)
    tools = [t for t in a.tools.split(",") if t]
    bad = set(tools) - set(TOOLS)
    if bad:
        ap.error(f"unknown tools {sorted(bad)} (choose from {', '.join(TOOLS)})")
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"tools": {}, "time_budget_s": a.time_budget_s}
    sanitizer = find_sanitizer()
    summary["sanitizer"] = sanitizer
    if sanitizer is None:
        summary["problem"] = "compute-sanitizer not found (PATH, $CUDA_PATH/bin, nvcc's folder)"
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(summary["problem"])
        return 1
    extra = []
    if a.families:
        extra += ["--families", a.families]
    if a.limit:
        extra += ["--limit", str(a.limit)]
    stages = ([] if a.no_warmup else ["warmup"]) + tools
    t_start = time.time()
    status = 0
    for i, stage in enumerate(stages):
        left = a.time_budget_s - (time.time() - t_start)
        share = sum(SHARES[s] for s in stages[i:])
        budget = max(5.0, left * SHARES[stage] / share)
        cases_json = out / f"cases_{stage}.json"
        cmd = [sys.executable, str(CASES), "--time-budget-s", f"{budget:.0f}",
               "--out", str(cases_json), *extra]
        if stage != "warmup":
            cmd = [sanitizer, "--tool", stage, "--print-limit", "100", *TOOL_OPTIONS[stage],
                   *cmd]
        rc, text, elapsed = run_logged(cmd, out / f"{stage}.log", budget + GRACE_S)
        res = parse(stage, rc, text, elapsed, cases_json)
        res["budget_s"] = round(budget, 1)
        summary["tools"][stage] = res
        if (res.get("errors") or res.get("hazards") or res["case_failures"]
                or res.get("problem") or rc != 0):
            status = 1
        print(f"{stage:<10} {res['cases_run']}/{res['cases_total']} cases, errors "
              f"{res['errors']}{', hazards ' + str(res['hazards']) if 'hazards' in res else ''}"
              f", {elapsed:.0f} s of {budget:.0f}{' (out of time)' if res['out_of_time'] else ''}"
              f"{' KILLED' if res['killed'] else ''}", flush=True)
        for line in res["first_errors"][:8] + res["case_failures"][:5]:
            print(f"   {line}")
    try:
        info = json.loads((out / f"cases_{stages[0]}.json").read_text())
        summary["kernels_used"] = len(info["kernels_used"])
        summary["never_used"] = info["never_used"]
    except (OSError, ValueError, KeyError, IndexError):
        pass
    summary["elapsed_s"] = round(time.time() - t_start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"sanitize: summary in {out / 'summary.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
