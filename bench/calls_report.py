"""README tables of what users see per call: host overhead (bench/overhead.py), the
model-shaped workloads as users call them (bench/models.py), the same for the layers of
other models (the G set, bench/models.py --groups G1:bf16,...) and for seeded random
model-shaped problems (bench/perf_sweep.py).

The blocks lie between ``<!-- overhead-table:start -->`` / ``end -->``,
``<!-- models-table:start -->`` / ``end -->``, ``<!-- general-table:start -->`` / ``end -->``
and ``<!-- perf-sweep:start -->`` / ``end -->``.

    python bench/calls_report.py [--overhead bench/results/overhead.json]
        [--models bench/results/models.json] [--general bench/results/general.json]
        [--perf-sweep bench/results/perf_sweep.json] [--readme README.md] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import workloads  # noqa: E402
from report import update_blocks  # noqa: E402

RESULTS = os.path.join(HERE, "results")
DEFAULT_README = os.path.join(os.path.dirname(HERE), "README.md")
BLOCKS = {"overhead": ("<!-- overhead-table:start -->", "<!-- overhead-table:end -->"),
          "models": ("<!-- models-table:start -->", "<!-- models-table:end -->"),
          "general": ("<!-- general-table:start -->", "<!-- general-table:end -->"),
          "perf-sweep": ("<!-- perf-sweep:start -->", "<!-- perf-sweep:end -->")}


def _ms(x):
    return "-" if x is None else f"{x:.3g}"


def overhead_table(data):
    p = data["problem"]
    lines = [f"Measured on {data['device']} (torch {data['torch']}, cupy {data['cupy']}, commit "
             f"{data.get('commit') or '?'}) by `bench/overhead.py`: a {p['dtype']} problem of "
             f"shape {tuple(p['shape'])} (kernel {p['kernel']}) whose kernels take "
             f"{data['kernel_only_us']['forward']:.0f} us (forward) and "
             f"{data['kernel_only_us']['forward_backward']:.0f} us (forward + backward) from a "
             f"CUDA graph; host microseconds per call, {data.get('calls', 500)} calls then one "
             "synchronize, median of 5 runs (every row warmed up first, the garbage "
             "collector off). \"general\" is the same call with the fast path switched off "
             "(`NATTEN_CUPY_FAST_PATH=0`). Host times of such tiny calls differ by up to 2.5x "
             "from one machine to another: compare the rows of one run.",
             "",
             "| call | warm call (fast path) | general path |",
             "|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['call']} | {r['fast_host_us']:.1f} us | {r['general_host_us']:.1f} us |")
    flex = data.get("flex_eager_forward_us")
    if flex:
        lines.append(f"| FlexAttention forward, eager (compiled `flex_attention`), same problem "
                     f"| {flex:.1f} us | |")
    return "\n".join(lines)


def _shape(r):
    """A record's layer in words: batch, map, window, heads and head dim (its q shape), and
    its workload's dilation and causal axes where it has them."""
    b, *spatial, h, d = r["shape"]
    text = (f"B{b} {'x'.join(map(str, spatial))}, window {'x'.join(map(str, r['kernel']))}, "
            f"H{h} D{d}")
    try:
        w = workloads.model_workload(r["workload"])
    except KeyError:
        return text
    if any(x != 1 for x in w.dilation):
        text += f", dilation {'x'.join(map(str, w.dilation))}"
    if any(w.causal):
        text += ", causal in " + "/".join("THW"[3 - w.rank + a] if w.rank > 1 else "sequence"
                                          for a, c in enumerate(w.causal) if c)
    return text


def general_table(data):
    """models_table with each layer's shape after its id."""
    rows = [dict(r, workload=f"{r['workload']} ({_shape(r)})") if "shape" in r else r
            for r in data["results"]]
    return models_table(dict(data, results=rows))


def models_table(data):
    lines = [f"Measured on {data['device']} (torch {data['torch']}, cupy {data['cupy']}, commit "
             f"{data.get('commit') or '?'}, {data.get('date', '')}) by `bench/models.py`: each "
             "workload called as users call it, side by side in one process. Ours: "
             "`natten_cupy.torch.na{n}d` on tensors that require grad, eager; Flex: "
             "`torch.compile(flex_attention)` with a `create_block_mask` mask in row-major "
             "token order. \"kernels\" are CUDA-graph replays of the same calls (no host "
             "overhead). Medians of CUDA-event timings.",
             "",
             "| workload | dtype | ours fwd / fwd+bwd ms | Flex fwd / fwd+bwd ms | speedup fwd / "
             "fwd+bwd | kernels only, ours / Flex fwd+bwd ms | ours TFLOP/s fwd / fwd+bwd |",
             "|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['dtype']} | error | | | | |")
            continue
        o, f = r["ours_eager"], r.get("flex_eager", {})
        ours = f"{_ms(o['fwd'])} / {_ms(o['fwd_bwd'])}"
        tf = f"{o['tflops_fwd']:.0f} / {o['tflops_fwd_bwd']:.0f}"
        if "fwd" in f:
            flex = f"{_ms(f['fwd'])} / {_ms(f['fwd_bwd'])}"
            sp = f"{f['fwd'] / o['fwd']:.2f}x / {f['fwd_bwd'] / o['fwd_bwd']:.2f}x"
            kk = f"{_ms(o.get('fwd_bwd_kernels'))} / {_ms(f.get('fwd_bwd_kernels'))}"
        else:
            flex, sp, kk = "did not run", "-", f"{_ms(o.get('fwd_bwd_kernels'))} / -"
        mark = " *" if r.get("commit", data.get("commit")) != data.get("commit") else ""
        lines.append(f"| {r['workload']} | {r['dtype']}{mark} | {ours} | {flex} | {sp} | {kk} "
                     f"| {tf} |")
    older = sorted({(r["commit"], r.get("date", "")) for r in data["results"]
                    if r.get("commit", data.get("commit")) != data.get("commit")})
    for commit, date in older:
        lines.append("")
        lines.append(f"\\* measured at commit {commit} ({date}), not in the run above"
                     + (f": {data['carried_over']}." if data.get("carried_over") else "."))
    if data.get("not_run"):
        lines.append("")
        lines.append("Not run in this call's time budget: " + ", ".join(data["not_run"]) + ".")
    return "\n".join(lines)


PERF_MEASURES = (("fwd", "forward, eager"), ("fwd_bwd", "forward + backward, eager"),
                 ("fwd_kernels", "forward, kernels"), ("fwd_bwd_kernels",
                                                       "forward + backward, kernels"))


DTYPE_WORDS = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "tf32": "TF32"}


def _quantile(xs, f):
    """The ``f`` quantile of sorted ``xs`` (nearest rank)."""
    return xs[min(len(xs) - 1, max(0, round(f * (len(xs) - 1))))]


def perf_sweep_summary(data):
    """bench/perf_sweep.py's run in words and one table: per measure, FlexAttention's time
    over ours across the problems (least, 10th percentile, median), and the closest
    problems."""
    res = [r for r in data["results"] if r.get("flex_over_ours")]
    both = [r for r in res if all(r["flex_over_ours"].get(m) for m, _ in PERF_MEASURES)]
    lines = [f"Measured on {data['device']} (torch {data['torch']}, commit "
             f"{data.get('commit') or '?'}, {data.get('date', '')}) by `bench/perf_sweep.py "
             f"--seed {data['seed']}`: {len(res)} random model-shaped problems (1-D/2-D/3-D "
             "maps, windows, batch, heads, head dims 32-128, causal and dilated axes; "
             + "/".join(DTYPE_WORDS[d] for d in data.get("dtypes", ("fp16", "bf16")))
             + "), each timed as above next to FlexAttention. "
             f"{len(data.get('losses', []))} of them had a measure slower than "
             f"FlexAttention's; FlexAttention ran {len(both)} of them (the rest ran out of "
             "memory or failed to compile)"
             + (f"; {len(data['not_run'])} drawn were not reached in the time budget."
                if data.get("not_run") else "."),
             "",
             "| FlexAttention's time / ours | least (problem) | 10th percentile | median |",
             "|---|---|---|---|"]
    for m, text in PERF_MEASURES:
        xs = sorted((r["flex_over_ours"][m], r["workload"]) for r in both)
        if not xs:
            continue
        lo, at = xs[0]
        lines.append(f"| {text} | {lo:.2f}x ({at}) | {_quantile(xs, 0.1)[0]:.2f}x | "
                     f"{_quantile(xs, 0.5)[0]:.2f}x |")
    closest = sorted(both, key=lambda r: min(r["flex_over_ours"].values()))[:3]
    if closest:
        lines.append("")
        lines.append("Closest: " + "; ".join(
            f"{r['workload']} ({r['dtype']}, {_shape(r)}): "
            f"{min(r['flex_over_ours'].values()):.2f}x" for r in closest) + ".")
    return "\n".join(lines)


def update_readme(blocks, readme, check=False):
    """Replace each block's text in ``readme``; with ``check``, True if already current."""
    return update_blocks(readme, [(*BLOCKS[name], body) for name, body in blocks.items()],
                         check)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overhead", default=os.path.join(RESULTS, "overhead.json"),
                    help="bench/overhead.py's JSON (default: bench/results/overhead.json)")
    ap.add_argument("--models", default=os.path.join(RESULTS, "models.json"),
                    help="bench/models.py's JSON (default: bench/results/models.json)")
    ap.add_argument("--general", default=os.path.join(RESULTS, "general.json"),
                    help="bench/models.py's JSON of the G set (default: "
                         "bench/results/general.json)")
    ap.add_argument("--perf-sweep", default=os.path.join(RESULTS, "perf_sweep.json"),
                    help="bench/perf_sweep.py's JSON (default: bench/results/perf_sweep.json)")
    ap.add_argument("--readme", default=DEFAULT_README, help="README to update (default: ours)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the README's blocks differ from the JSON (change nothing)")
    args = ap.parse_args(argv)
    blocks = {}
    for name, path, render in (("overhead", args.overhead, overhead_table),
                               ("models", args.models, models_table),
                               ("general", args.general, general_table),
                               ("perf-sweep", args.perf_sweep, perf_sweep_summary)):
        if os.path.exists(path):
            with open(path) as f:
                blocks[name] = render(json.load(f))
    ok = update_readme(blocks, args.readme, check=args.check)
    if args.check and not ok:
        print("README's overhead/models/general/perf-sweep blocks are out of date: run "
              "bench/calls_report.py")
        sys.exit(1)


if __name__ == "__main__":
    main()
