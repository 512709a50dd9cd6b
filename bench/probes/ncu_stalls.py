"""Where a kernel's warps wait, instruction by instruction, from an Nsight Compute report.

Reads the CSV of a report's source page (SASS with the sampled warp states per instruction)
and prints the instructions with the most stall samples, each with its leading stall
reasons, then the sums per reason over the kernel.

    ncu --set full --import-source yes -o rep ... python bench/probes/ncu_fused.py ...
    ncu --import rep.ncu-rep --page source --print-source sass --csv > src.csv
    python bench/probes/ncu_stalls.py src.csv [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path):
    """(header, rows) of the source page's table (the lines before the header skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if '"Source"' in line or "Source," in line)
    table = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    return table[0], table[1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    header, rows = read_rows(args.csv)
    col = {name: i for i, name in enumerate(header)}
    total = next((n for n in header if re.match(r"Warp Stall Sampling \(All", n)), None)
    if total is None:
        print("no stall-sampling column; columns:", header)
        return 1
    reasons = [n for n in header if n.startswith("stall_") or "pcsamp_warps_issue_stalled" in n]
    src = col.get("Source", 0)
    addr = col.get("Address", None)
    ranked = sorted(rows, key=lambda r: -_number(r[col[total]]))
    grand = sum(_number(r[col[total]]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {grand:.0f} samples ({total}); reason columns: "
          f"{len(reasons)}")
    for r in ranked[:args.top]:
        n = _number(r[col[total]])
        top = sorted(((_number(r[col[x]]), x) for x in reasons), reverse=True)[:3]
        why = ", ".join(f"{x.replace('smsp__pcsamp_warps_issue_stalled_', '')} {v:.0f}"
                        for v, x in top if v > 0)
        at = r[addr] if addr is not None else ""
        print(f"{100 * n / grand:5.1f}%  {at:>6s}  {r[src].strip()[:70]:70s}  {why}")
    sums = sorted(((sum(_number(r[col[x]]) for r in rows), x) for x in reasons), reverse=True)
    print("by reason:", ", ".join(f"{x.replace('smsp__pcsamp_warps_issue_stalled_', '')} "
                                  f"{100 * v / grand:.1f}%" for v, x in sums[:12] if v > 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
