"""README table of the unfused chain (tiled next to naive) from bench/probes/tiled_probe.py's JSON.

The block lies between ``<!-- unfused-table:start -->`` and ``<!-- unfused-table:end -->``.

    python bench/probes/probe_report.py [bench/results/tiled_probe.json] [--check] [--readme README.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

from report import update_blocks  # noqa: E402
from workloads import dtype_key  # noqa: E402

DEFAULT_JSON = os.path.join(BENCH, "results", "tiled_probe.json")
DEFAULT_README = os.path.join(os.path.dirname(BENCH), "README.md")
START, END = "<!-- unfused-table:start -->", "<!-- unfused-table:end -->"
STEPS = ("qk", "softmax", "av", "av_backward.d_attn", "av_backward.dv", "softmax_backward",
         "qk_backward.dq", "qk_backward.dk")


def _ms(x):
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def chain_table(data):
    lines = ["| workload | dtype | tiled fwd / fwd+bwd ms | naive fwd / fwd+bwd ms | "
             "speedup fwd / fwd+bwd | tiled kernels: % of copy bandwidth |",
             "|---|---|---|---|---|---|"]
    for r in data["results"]:
        be = r["backends"]
        if "tiled" not in be:
            continue
        t = be["tiled"]["chain"]
        n = be.get("naive", {}).get("chain")
        bw = [k["bandwidth_fraction"] for k in be["tiled"]["kernels"]
              if k["backend"] == "tiled" and k["bandwidth_fraction"]]
        naive = f"{_ms(n['fwd_ms'])} / {_ms(n['fwd_bwd_ms'])}" if n else "-"
        speed = (f"{t['speedup_fwd']:.2f}x / {t['speedup_fwd_bwd']:.2f}x"
                 if "speedup_fwd" in t else "-")
        lines.append(f"| {r['workload']} | {dtype_key(r['dtype'], r['tf32'])} | "
                     f"{_ms(t['fwd_ms'])} / {_ms(t['fwd_bwd_ms'])} | {naive} | {speed} | "
                     f"{100 * min(bw):.0f}-{100 * max(bw):.0f}% |")
    return "\n".join(lines)


def kernel_table(data, workload="W2", dtype=("float16", False)):
    r = next((r for r in data["results"] if r["workload"] == workload
              and (r["dtype"], r["tf32"]) == dtype), None)
    if r is None or "tiled" not in r["backends"]:
        return ""
    lines = [f"Per kernel, {workload} {dtype_key(*dtype)} (bytes each must move at least / time):", "",
             "| step | kernel | ms | % of copy bandwidth |", "|---|---|---|---|"]
    for k in r["backends"]["tiled"]["kernels"]:
        bw = k["bandwidth_fraction"]
        name = k["kernel"].replace("natten::", "")
        lines.append(f"| {k['step']} | `{name}` | {k['ms']:.2f} | "
                     f"{'-' if bw is None else f'{100 * bw:.0f}%'} |")
    return "\n".join(lines)


def block(data):
    head = (f"Measured on {data['device']} (commit {data.get('commit') or '?'}) by "
            "`bench/probes/tiled_probe.py`: the chain qk -> softmax -> av and its backward, medians "
            "of CUDA-event timings, tiled and naive side by side in one run.")
    parts = [head, "", chain_table(data)]
    kt = kernel_table(data)
    if kt:
        parts += ["", kt]
    return "\n".join(parts)


def update_readme(data, readme, check=False):
    return update_blocks(readme, [(START, END, block(data))], check)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", default=DEFAULT_JSON)
    p.add_argument("--check", action="store_true",
                   help="exit 1 if README's unfused-table block differs from this JSON's")
    p.add_argument("--readme", default=DEFAULT_README)
    args = p.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    ok = update_readme(data, args.readme, check=args.check)
    if args.check and not ok:
        print(f"{args.readme}: unfused table differs from {args.json}; run "
              f"python bench/probes/probe_report.py {args.json}", file=sys.stderr)
        return 1
    print(block(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
