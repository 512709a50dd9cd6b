#!/usr/bin/env python3
"""Turn a suite JSON into the README's performance table, a speedup chart and a summary.

    python bench/report.py [RESULTS.json]            # write the PNG and the README block
    python bench/report.py [RESULTS.json] --summary  # only print the summary table
    python bench/report.py [RESULTS.json] --check    # exit 1 if README's block is stale

The README block lies between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->``;
only that block is rewritten. Speedups are over the best peer measured in the same run;
where no peer ran, BENCH.md's published figure stands in (marked with *).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_JSON = os.path.join(HERE, "results", "suite.json")
DEFAULT_README = os.path.join(ROOT, "README.md")
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"

__all__ = ["summarize", "markdown_table", "summary_table", "chart", "update_readme", "main"]


def _ok(r):
    return r.get("status") == "ok"


def _best(rows, key):
    rows = [r for r in rows if r.get(key) is not None and r[key] > 0]
    return min(rows, key=lambda r: r[key]) if rows else None


def summarize(data):
    """One row per (workload, dtype) in run order: our best vs the best peer."""
    groups = {}
    for r in data.get("results", []):
        groups.setdefault((r["workload"], r["dtype"]), []).append(r)
    published = data.get("published_peers", {})
    workloads = data.get("workloads", {})
    rows = []
    for (wid, dt), recs in groups.items():
        ours = [r for r in recs if r["kind"] == "ours" and _ok(r)]
        peers = [r for r in recs if r["kind"] == "peer" and _ok(r)]
        row = {"workload": wid, "dtype": dt, "what": _what(workloads.get(wid))}
        measured = {r["impl"] for r in peers}
        # BENCH.md's figures stand in for the peers that did not run here.
        unmeasured = {impl: v for impl, v in published.get(f"{wid}/{dt}", {}).items()
                      if impl not in measured}
        for key in ("fwd_ms", "fwdbwd_ms", "bwd_ms"):
            o, p = _best(ours, key), _best(peers, key)
            row[f"ours_{key}"] = o[key] if o else None
            row[f"ours_{key}_impl"] = o["impl"] if o else None
            pub = _published_best(unmeasured, key)
            if p is not None and (pub[0] is None or p[key] <= pub[0]):
                row[f"peer_{key}"], row[f"peer_{key}_impl"] = p[key], p["impl"]
                row[f"peer_{key}_live"] = True
            else:
                row[f"peer_{key}"], row[f"peer_{key}_impl"] = pub
                row[f"peer_{key}_live"] = False
            if row[f"ours_{key}"] and row[f"peer_{key}"]:
                row[f"speedup_{key}"] = row[f"peer_{key}"] / row[f"ours_{key}"]
            else:
                row[f"speedup_{key}"] = None
        best_f = _best(ours, "fwd_ms")
        best_fb = _best(ours, "fwdbwd_ms")
        row["ours_fwd_tflops"] = best_f["fwd_tflops"] if best_f else None
        row["ours_fwdbwd_tflops"] = best_fb["fwdbwd_tflops"] if best_fb else None
        row["floor_fraction_fwd"] = best_f["floor_fraction_fwd"] if best_f else None
        best_b = _best(ours, "bwd_ms")
        row["floor_fraction_bwd"] = best_b.get("floor_fraction_bwd") if best_b else None
        # Ours must agree with each other; a peer that disagrees with ours while another peer
        # agrees is the peer's fault, and is named rather than failing the row.
        agreeing = [r for r in peers if r.get("check_ok", True)]
        row["peers_disagree"] = sorted(r["impl"] for r in peers if not r.get("check_ok", True))
        row["check_ok"] = (all(r.get("check_ok", True) for r in ours)
                           and (not peers or bool(agreeing)))
        rows.append(row)
    return rows


def _published_best(pub, key):
    """(ms, impl) of BENCH.md's best peer for a metric; bwd is fwd+bwd minus fwd."""
    best = (None, None)
    for impl, (f, fb) in pub.items():
        val = {"fwd_ms": f, "fwdbwd_ms": fb,
               "bwd_ms": fb - f if f is not None and fb is not None else None}[key]
        if val is not None and (best[0] is None or val < best[0]):
            best = (val, impl)
    return best


def _what(w):
    if not w:
        return ""
    grid = "x".join(map(str, w["spatial"]))
    kern = "x".join(map(str, w["kernel"]))
    return f"{grid}, k {kern}, H {w['heads']}, D {w['dim']}"


def _ms(x):
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _x(x):
    return "-" if x is None else f"{x:.2f}x"


def _pct(x):
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown_table(data):
    rows = summarize(data)
    meta = data.get("meta", {})
    env = meta.get("env", {})
    lines = [
        f"Measured on {env.get('device', 'unknown GPU')} (torch {env.get('torch', '?')}, "
        f"cupy {env.get('cupy', '?')}, commit {env.get('commit', '?')}, "
        f"{meta.get('started', '?')}), B = 1, medians of CUDA-event timings. "
        "Peers ran in the same process; * marks an earlier measurement on the same GPU "
        "(`bench/workloads.py`) for a peer that did not run here (when it is the best). "
        "Floor: the larger of bytes/bandwidth and FLOPs/matmul ceiling (measured ceilings, "
        "`bench/workloads.py`).",
        "",
        "| workload | dtype | natten_cupy fwd / fwd+bwd ms | TFLOP/s fwd / fwd+bwd "
        "| of floor fwd / bwd | best peer fwd / fwd+bwd ms | speedup fwd / fwd+bwd / bwd |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        ours = f"{_ms(r['ours_fwd_ms'])} / {_ms(r['ours_fwdbwd_ms'])}"
        impls = {r["ours_fwd_ms_impl"], r["ours_fwdbwd_ms_impl"]} - {None}
        if impls:
            ours += f" ({', '.join(sorted(impls))})"
        tf = (f"{_num(r['ours_fwd_tflops'])} / {_num(r['ours_fwdbwd_tflops'])}")
        floor = f"{_pct(r['floor_fraction_fwd'])} / {_pct(r['floor_fraction_bwd'])}"
        peer = " / ".join(_peer_ms(r, k) for k in ("fwd_ms", "fwdbwd_ms"))
        pimpls = {r["peer_fwd_ms_impl"], r["peer_fwdbwd_ms_impl"]} - {None}
        if pimpls:
            peer += f" ({', '.join(sorted(pimpls))})"
        sp = " / ".join(_x(r[f"speedup_{k}"]) for k in ("fwd_ms", "fwdbwd_ms", "bwd_ms"))
        check = "" if r["check_ok"] else " (check failed)"
        if r.get("peers_disagree"):
            notes.append(f"{r['workload']} {r['dtype']}: {', '.join(r['peers_disagree'])} "
                         "disagreed with natten_cupy and the other peers (peer harness issue)")
        lines.append(f"| {r['workload']} ({r['what']}) | {r['dtype']} | {ours}{check} | {tf} "
                     f"| {floor} | {peer} | {sp} |")
    if not rows:
        lines.append("| (no results) | | | | | | |")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


def _peer_ms(row, key):
    """The best peer's time, starred when it is BENCH.md's figure rather than measured."""
    value = row[f"peer_{key}"]
    return _ms(value) + ("*" if value is not None and not row[f"peer_{key}_live"] else "")


def _num(x):
    return "-" if x is None else f"{x:.1f}"


def summary_table(data):
    """A short rich table: one line per (workload, dtype)."""
    from rich.table import Table
    t = Table(title="natten_cupy vs best peer (ms; speedup = peer / ours)")
    for c in ("workload", "dtype", "ours fwd", "ours f+b", "peer fwd", "peer f+b",
              "x fwd", "x f+b", "x bwd", "TF/s fwd", "check"):
        t.add_column(c, justify="left" if c in ("workload", "dtype") else "right")
    for r in summarize(data):
        t.add_row(r["workload"], r["dtype"], _ms(r["ours_fwd_ms"]), _ms(r["ours_fwdbwd_ms"]),
                  _peer_ms(r, "fwd_ms"), _peer_ms(r, "fwdbwd_ms"),
                  _x(r["speedup_fwd_ms"]), _x(r["speedup_fwdbwd_ms"]), _x(r["speedup_bwd_ms"]),
                  _num(r["ours_fwd_tflops"]), "ok" if r["check_ok"] else "FAILED")
    counts = {}
    for r in data.get("results", []):
        counts[r.get("status")] = counts.get(r.get("status"), 0) + 1
    t.caption = "items: " + ", ".join(f"{v} {k}" for k, v in counts.items())
    return t


def chart(data, path):
    """Bar chart of our speedup over the best peer (fwd, fwd+bwd, bwd) per workload/dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = summarize(data)
    labels = [f"{r['workload']}\n{r['dtype']}" for r in rows]
    keys = (("fwd_ms", "forward"), ("fwdbwd_ms", "forward+backward"), ("bwd_ms", "backward"))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    width = 0.8 / len(keys)
    for i, (k, name) in enumerate(keys):
        vals = [r[f"speedup_{k}"] or 0.0 for r in rows]
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, vals, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels)
    vals = [r[f"speedup_{k}"] for r in rows for k, _ in keys if r[f"speedup_{k}"]]
    if vals and max(vals) / max(min(vals), 1e-9) > 20:
        ax.set_yscale("log")
    ax.set_ylabel("speedup over the best peer (x)")
    env = data.get("meta", {}).get("env", {})
    ax.set_title(f"natten_cupy vs best peer, {env.get('device', '')}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _block(data):
    return f"{START}\n{markdown_table(data)}\n{END}"


def update_blocks(readme, blocks, check=False):
    """Replace what lies between each ``(start, end, body)``'s markers in file ``readme`` by
    ``body`` on lines of its own; with ``check``, change nothing and say whether every block is
    current (the README blocks of calls_report.py and probes/probe_report.py)."""
    with open(readme) as f:
        text = f.read()
    new = text
    for start, end, body in blocks:
        if start not in new or end not in new:
            raise SystemExit(f"{readme} has no {start} ... {end} block")
        head, rest = new.split(start, 1)
        _, tail = rest.split(end, 1)
        new = f"{head}{start}\n{body}\n{end}{tail}"
    if check:
        return new == text
    with open(readme, "w") as f:
        f.write(new)
    return True


def update_readme(data, readme, check=False):
    """Rewrite the marked block (or, with ``check``, say whether it is current)."""
    text = open(readme).read() if os.path.exists(readme) else ""
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        if check:
            return False
        text = text.rstrip("\n") + "\n\n## Performance\n\n" + _block(data) + "\n"
    else:
        current = pattern.search(text).group(0)
        if check:
            return current == _block(data)
        text = pattern.sub(lambda m: _block(data), text, count=1)
    with open(readme, "w") as f:
        f.write(text)
    return True


def _placeholder_block(readme):
    """True when README has the markers and no table between them (no results yet)."""
    text = open(readme).read() if os.path.exists(readme) else ""
    m = re.search(re.escape(START) + r"(.*?)" + re.escape(END), text, re.S)
    return bool(m) and "|" not in m.group(1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", default=DEFAULT_JSON)
    p.add_argument("--summary", action="store_true", help="only print the summary table")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if README's perf-table block differs from this JSON's")
    p.add_argument("--readme", default=DEFAULT_README)
    p.add_argument("--png", default=None, help="chart path (default: next to the JSON)")
    args = p.parse_args(argv)
    if not os.path.exists(args.json):
        if args.check and _placeholder_block(args.readme):
            print(f"no results at {args.json}, and README's block holds no table: consistent")
            return 0
        print(f"no results at {args.json}", file=sys.stderr)
        return 1
    with open(args.json) as f:
        data = json.load(f)
    if args.check:
        if update_readme(data, args.readme, check=True):
            print(f"{args.readme}: performance table matches {args.json}")
            return 0
        print(f"{args.readme}: performance table differs from {args.json}; "
              f"run python bench/report.py {args.json}", file=sys.stderr)
        return 1
    from rich.console import Console
    console = Console(width=None if sys.stdout.isatty() else 160)
    if not args.summary:
        png = args.png or os.path.splitext(args.json)[0] + "_speedup.png"
        try:
            chart(data, png)
            console.print(f"wrote {png}")
        except ImportError as e:
            console.print(f"(no chart: {e})")
        update_readme(data, args.readme)
        console.print(f"updated the performance table in {args.readme}")
    console.print(summary_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
