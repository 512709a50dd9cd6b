#!/usr/bin/env python3
"""Benchmark suite: BENCH.md's workloads x dtypes x natten_cupy's backends, next to the peers.

    python bench/suite.py [--workloads W2,W3] [--dtypes fp16,fp32] [--backends fused,naive]
                          [--no-peers] [--budget-s 330] [--item-s 15] --out results.json

Everything runs in one process, side by side. Per (workload, dtype) group, every
implementation (ours: the fused op on each backend that accepts it, the unfused chain
qk -> softmax -> av on naive/tiled; peers: FlexAttention in two token orders, dense masked
SDPA) goes through the same steps:

1. setup (inputs in the implementation's layout; masks), the extra memory it holds recorded;
2. first forward and first forward+backward timed on their own (they compile);
3. output and gradients of that forward+backward compared with our best backend's
   (relative error recorded), its memory high-water mark recorded as the peak extra memory;
4. one timed call of each gives the repetition counts that fit the per-item time limit
   (an implementation slower than the limit gets that one measurement, or no backward);
5. CUDA-event timing after warm-up, medians: forward, forward+backward (random dO), and
   backward as their difference.

One failing implementation records its error and the run goes on. The run has two phases
within ``--budget-s``: phase 1 runs every group's core items (our best implementation and the
best peer), with fewer repetitions (down to ``--min-reps``) where the budget cannot cover them
all; phase 2 then runs the other items group by group, each only if its estimated cost fits
what is left. Results are listed group by group in plan order. The JSON is rewritten after
every item, so an interrupted run still leaves its results.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from natten_cupy.profile_cli import unfused_backward, unfused_forward  # noqa: E402
import timing  # noqa: E402
import workloads as wl  # noqa: E402
from natten_cupy import ops as na_ops  # noqa: E402

# Our implementations, best first: (name, backend, path). The first that runs in a group
# is the reference the others are checked against.
OURS = (("fused", "fused", "fused"), ("naive", "naive", "fused"),
        ("tiled_unfused", "tiled", "unfused"), ("naive_unfused", "naive", "unfused"),
        ("reference", "reference", "fused"))
DEFAULT_BACKENDS = ("fused", "naive", "tiled")
# Rough lower bounds of throughput (useful FLOP/s) to skip hopeless items without running.
SLOW_FLOPS = {"naive": 0.2e12, "naive_unfused": 0.2e12, "reference": 0.02e12}
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-3, "tf32": 2e-2}
L2_BYTES = 50 * 2 ** 20
# The unfused chain is skipped where its attention weights alone would exceed this.
MAX_ATTN_BYTES = 8 * 2 ** 30
# Planning estimates of what an item takes besides its timed repetitions (setup, first calls,
# check): torch.compile of FlexAttention forward+backward for a new shape (H200 runs: 5-8 s,
# about 10 s more for the first in a process), anything else.
FLEX_COMPILE_S = 15.0
SETUP_S = 3.0
# "cuda" for real runs; "cpu" runs the same control flow on NumPy/eager torch (smoke tests).
DEVICE = {"name": "cuda"}


def _on_gpu():
    return DEVICE["name"] == "cuda"


class Skip(Exception):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(wl.DEFAULT_WORKLOADS),
                   help=f"comma list of {', '.join(wl.WORKLOADS)}")
    p.add_argument("--dtypes", default=",".join(wl.DEFAULT_DTYPES),
                   help=f"comma list of {', '.join(wl.DTYPES)} (tf32: fp32 I/O, TF32 math)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help="comma list of natten_cupy backends to time (reference is opt-in)")
    p.add_argument("--groups", default="",
                   help="comma list of WORKLOAD:dtype pairs; replaces --workloads x --dtypes")
    p.add_argument("--others-on", default="",
                   help="comma list of workloads on which ours beyond the best backend "
                        "(naive, unfused chains) run; default: all")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="stop starting new items after this many seconds")
    p.add_argument("--item-s", type=float, default=15.0,
                   help="time limit of the timed repetitions of one item")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "suite.json"))
    p.add_argument("--list", action="store_true",
                   help="print the planned items with their floors and exit (no GPU needed)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the control flow (reference backend, eager peers)")
    args = p.parse_args(argv)
    args.workloads = _pick(args.workloads, wl.WORKLOADS, "workload")
    args.dtypes = _pick(args.dtypes, wl.DTYPES, "dtype")
    args.backends = [b for b in args.backends.split(",") if b]
    if args.groups:
        pairs = [g.split(":") for g in args.groups.split(",") if g]
        bad = [g for g in pairs if len(g) != 2 or g[0] not in wl.WORKLOADS or g[1] not in wl.DTYPES]
        if bad:
            p.error(f"--groups: bad entries {bad}")
        args.groups = [tuple(g) for g in pairs]
        args.workloads = list(dict.fromkeys(w for w, _ in args.groups))
    else:
        args.groups = [(w, d) for w in args.workloads for d in args.dtypes]
    args.others_on = [w for w in args.others_on.split(",") if w] or list(wl.WORKLOADS)
    return args


def _pick(text, known, what):
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in known]
    if bad:
        raise SystemExit(f"unknown {what}(s) {bad}; known: {', '.join(known)}")
    return names


# ---- implementations of natten_cupy -------------------------------------------------------

class Ours:
    kind = "ours"

    def __init__(self, name, backend, path, w, spec):
        self.name, self.backend, self.path, self.w, self.spec = name, backend, path, w, spec
        self.sets, self._i = [], 0

    def check_available(self, torch_q):
        from natten_cupy import _args
        from natten_cupy.backends import get_backend
        mod = get_backend(self.backend)
        if mod is None:
            raise Skip(f"backend {self.backend} is not available")
        w = self.w
        problem = _args.check_fused(w.rank, torch_q, torch_q, torch_q, w.kernel, w.stride,
                                    w.dilation, w.causal, None, self.backend,
                                    self.spec["tf32"])
        ops = (("fused_forward", "fused_backward") if self.path == "fused"
               else ("qk", "av", "qk_backward", "av_backward"))
        why = [f"{op}: {r}" for op in ops for r in [mod.refuse(op, problem)] if r]
        if why:
            raise Skip("refused: " + "; ".join(why))
        if self.path == "unfused":
            attn = w.batch * w.tokens * w.heads * w.neighbors * self.spec["itemsize"]
            if attn >= MAX_ATTN_BYTES:
                raise Skip(f"the attention weights alone need {attn / 2 ** 30:.1f} GiB")
        floor_flops = SLOW_FLOPS.get(self.name)
        return w.flops() / floor_flops if floor_flops else None

    def setup(self, input_sets):
        if _on_gpu():
            import cupy
            self.sets = [tuple(cupy.from_dlpack(x) for x in s) for s in input_sets]
        else:
            self.sets = [tuple(x.numpy() for x in s) for s in input_sets]
        w = self.w
        self.kw = dict(dilation=w.dilation, is_causal=w.causal, backend=self.backend,
                       allow_tf32=self.spec["tf32"])

    def _next(self):
        s = self.sets[self._i % len(self.sets)]
        self._i += 1
        return s

    def _fwd(self, q, k, v):
        w = self.w
        if self.path == "fused":
            return na_ops.fused_forward(w.rank, q, k, v, w.kernel, stride=w.stride,
                                     return_lse=True, **self.kw)
        return unfused_forward(w.rank, q, k, v, w.kernel, **self.kw)

    def _bwd(self, q, k, v, do, saved):
        w = self.w
        if self.path == "fused":
            out, lse = saved
            return na_ops.fused_backward(w.rank, do, q, k, v, out, lse, w.kernel,
                                      stride=w.stride, **self.kw)
        return unfused_backward(w.rank, do, q, k, v, saved[1], w.kernel, **self.kw)

    def forward(self):
        q, k, v, _ = self._next()
        return self._fwd(q, k, v)

    def forward_backward(self):
        q, k, v, do = self._next()
        return self._bwd(q, k, v, do, self._fwd(q, k, v))

    def results(self):
        import torch
        q, k, v, do = self.sets[0]
        saved = self._fwd(q, k, v)
        grads = self._bwd(q, k, v, do, saved)
        return tuple(torch.from_dlpack(x) for x in (saved[0], *grads))

    def teardown(self):
        self.sets = []


# ---- measuring ----------------------------------------------------------------------------

def _sync():
    if _on_gpu():
        timing.sync()


def _wall(fn):
    t0 = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - t0) * 1e3


def _timed(fn, reps):
    """ms of each of ``reps`` calls: CUDA events on the GPU, wall clock on the CPU."""
    if not _on_gpu():
        return [_wall(fn) for _ in range(reps)]
    return timing.event_times(fn, reps)


class Memory:
    """Peak extra device memory of a block: torch's and CuPy's pools' high-water marks."""

    def __enter__(self):
        self.peak = None
        if not _on_gpu():
            return self
        import cupy
        import torch
        self.pool = cupy.get_default_memory_pool()
        self.pool.free_all_blocks()
        self.cupy0 = self.pool.total_bytes()
        torch.cuda.reset_peak_memory_stats()
        self.torch0 = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if not _on_gpu():
            return False
        import torch
        _sync()
        self.peak = (max(0, torch.cuda.max_memory_allocated() - self.torch0)
                     + max(0, self.pool.total_bytes() - self.cupy0))
        return False


def _from_host(ref, like):
    import torch
    return torch.from_numpy(ref).to(like.device)


def _rel_err(a, b):
    a, b = a.float(), b.float()
    scale = float(b.abs().max())
    err = float((a - b).abs().max())
    if not math.isfinite(err):
        return float("inf")
    return err / scale if scale > 0 else err


def _reps(t_ms, limit_ms, lo, hi):
    return max(lo, min(hi, int(limit_ms / max(t_ms, 1e-3))))


def _to_host(t):
    """A reference output kept between phases: a NumPy copy (bfloat16 as float32)."""
    import torch
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).to("cpu", copy=True).numpy()


def run_item(impl, w, spec, group, args, measure_s):
    """Measure one implementation; returns its record (raises Skip or errors).

    Compiling calls are timed on their own (wall clock). The per-item limit ``args.item_s``
    applies to calls after compilation: an implementation whose single forward, times 3.5 for
    a backward at 2.5x, exceeds it is timed once and its backward is not run; one whose
    forward+backward exceeds it is timed once. Otherwise the repetitions fill
    min(``args.item_s``, ``measure_s``), within [``args.min_reps``, ``args.max_reps``].
    """
    rec = {"notes": []}
    notes = rec["notes"]
    limit_ms = 1e3 * args.item_s
    with Memory() as m:
        impl.setup(group["inputs"])
    rec["setup_bytes"] = m.peak
    rec["first_fwd_ms"] = _wall(impl.forward)
    t_f = _timed(impl.forward, 1)[0]
    if t_f * (1 + wl.BACKWARD_FLOP_FACTOR) > limit_ms:
        notes.append(f"backward not run: one forward takes {t_f / 1e3:.1f} s, so "
                     f"forward+backward would exceed the {args.item_s:.0f} s limit")
        _finish(rec, w, spec, [t_f], None)
        return rec

    # The first forward+backward (it compiles the backward) also gives the outputs, checked
    # against our best backend's (the first of ours to run in this group).
    # Its memory high-water mark is the item's peak extra memory (compiling allocates none).
    t0 = time.perf_counter()
    with Memory() as m:
        outs = tuple(t.detach() for t in impl.results())
    rec["first_fwdbwd_ms"] = (time.perf_counter() - t0) * 1e3
    rec["peak_extra_bytes"] = m.peak
    if group.get("ref") is None:
        group["ref"] = (impl.name, tuple(_to_host(t) for t in outs))
    ref_name, ref = group["ref"]
    errs = {n: _rel_err(a, _from_host(b, a))
            for n, a, b in zip(("out", "dq", "dk", "dv"), outs, ref)}
    tol = TOLERANCE["tf32" if spec["tf32"] else spec["name"]]
    rec.update(checked_against=ref_name, rel_err=errs,
               check_ok=all(e <= (tol if n == "out" else 2 * tol) for n, e in errs.items()))
    del outs

    t_fb = _timed(impl.forward_backward, 1)[0]
    budget_ms = min(limit_ms, 1e3 * max(0.0, measure_s))
    if t_f + t_fb > limit_ms:
        f_times, fb_times = [t_f], [t_fb]
        notes.append(f"one repetition: a forward+backward takes {t_fb / 1e3:.2f} s")
    else:
        # As many forwards as forward+backwards: together they fill the budget.
        reps = _reps(t_f + t_fb, budget_ms, args.min_reps, args.max_reps)
        for _ in range(max(0, min(args.warmup, int(budget_ms / (t_f + t_fb)) - 2))):
            impl.forward_backward()
        f_times = _timed(impl.forward, reps)
        fb_times = _timed(impl.forward_backward, reps)
    _finish(rec, w, spec, f_times, fb_times)
    return rec


def _finish(rec, w, spec, f_times, fb_times):
    """Medians, backward by difference, TFLOP/s and fractions of the floor."""
    fl_f, fl_b = w.flops(), w.flops(True)
    fwd = statistics.median(f_times)
    rec.update(fwd_ms=fwd, reps_fwd=len(f_times), fwd_spread=_spread(f_times),
               fwd_tflops=fl_f / fwd / 1e9, floor_fraction_fwd=w.floor_ms(spec["key"]) / fwd,
               fwdbwd_ms=None, bwd_ms=None, fwdbwd_tflops=None, bwd_tflops=None,
               floor_fraction_bwd=None)
    if fb_times:
        fwdbwd = statistics.median(fb_times)
        bwd = fwdbwd - fwd
        rec.update(fwdbwd_ms=fwdbwd, bwd_ms=bwd, reps_fwdbwd=len(fb_times),
                   fwdbwd_spread=_spread(fb_times), fwdbwd_tflops=(fl_f + fl_b) / fwdbwd / 1e9)
        if bwd > 0:
            rec.update(bwd_tflops=fl_b / bwd / 1e9,
                       floor_fraction_bwd=w.floor_ms(spec["key"], True) / bwd)


def _spread(times):
    return [min(times), max(times)]


# ---- the run ------------------------------------------------------------------------------

def make_inputs(w, spec, seed, copies):
    import torch
    dtype = wl.torch_dtype(spec)
    dev = DEVICE["name"]
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    return [tuple(torch.randn(w.shape, generator=g, device=dev, dtype=torch.float32)
                  .to(dtype) for _ in range(4)) for _ in range(copies)]


def input_copies(w, spec):
    """Copies of the inputs to rotate through so that timed calls do not hit a warm L2."""
    size = 3 * w.batch * w.tokens * w.heads * w.dim * spec["itemsize"]
    return 1 if size >= 2 * L2_BYTES else min(8, math.ceil(2 * L2_BYTES / size))


def plan_group(w, spec, args):
    """[(name, kind, factory)] in priority order for one (workload, dtype)."""
    from natten_cupy.backends import get_backend
    items = []
    # Our implementations whose backend exists here, best first.
    ours = [o for o in OURS if o[1] in args.backends and get_backend(o[1]) is not None
            and (_on_gpu() or o[1] == "reference")]
    for name, backend, path in ours[:1]:
        items.append((name, "ours", lambda n=name, b=backend, p=path: Ours(n, b, p, w, spec)))
    peer_list = []
    if args.peers:
        import peers
        dt = wl.torch_dtype(spec)
        published = wl.PUBLISHED_PEERS.get((w.id, spec["key"]), {})
        order = sorted(peers.peers_for(w),
                       key=lambda p: published.get(p[0], (math.inf, math.inf))[1])
        peer_list = [(n, "peer", lambda f=f: f(dt, spec["tf32"])) for n, f in order]
    # Best of ours first, then the peers (their compile is shared across token orders),
    # then the slower implementations of ours.
    items += peer_list
    for name, backend, path in (ours[1:] if w.id in args.others_on else []):
        items.append((name, "ours", lambda n=name, b=backend, p=path: Ours(n, b, p, w, spec)))
    return items


def list_plan(args):
    for wid in args.workloads:
        w = wl.WORKLOADS[wid]
        print(f"{wid}: {w.describe()}  ({w.flops() / 1e9:.1f} GFLOP fwd)")
        for dt in [d for g, d in args.groups if g == wid]:
            spec = wl.dtype_spec(dt)
            names = [n for n, _, _ in plan_group(w, spec, args)]
            print(f"  {dt:<5} floor {w.floor_ms(dt):.3f} / {w.floor_ms(dt, True):.3f} ms: "
                  + ", ".join(names))
    return 0


def environment():
    env = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["device"] = torch.cuda.get_device_name(0) if _on_gpu() else "cpu"
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        env["torch_error"] = repr(e)
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        env["cupy_error"] = repr(e)
    # The device machine gets the tree without .git: the runner passes the commit along.
    env["commit"] = os.environ.get("NATTEN_CUPY_COMMIT", "")
    if not env["commit"]:
        try:
            env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True,
                                           timeout=5).stdout.strip()
        except Exception:  # noqa: BLE001
            pass
    from natten_cupy.backends import NAMES, get_backend
    env["backends"] = [n for n in NAMES if get_backend(n) is not None]
    return env


def write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(x):
    if isinstance(x, tuple):
        return list(x)
    return str(x)


def main(argv=None):
    args = parse_args(argv)
    DEVICE["name"] = args.device
    if args.list:
        return list_plan(args)
    t_start = time.time()
    deadline = t_start + args.budget_s
    import torch
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if _on_gpu():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False

    data = {
        "meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t_start)),
                 "args": {k: v for k, v in vars(args).items()},
                 "env": environment(),
                 "ceilings_flops": wl.CEILINGS, "copy_bandwidth": wl.COPY_BANDWIDTH},
        "workloads": {wid: wl.WORKLOADS[wid].as_dict() for wid in args.workloads},
        "published_peers": {f"{k[0]}/{k[1]}": v for k, v in wl.PUBLISHED_PEERS.items()},
        "results": [],
    }
    groups = [(wl.WORKLOADS[wid], wl.dtype_spec(dt)) for wid, dt in args.groups]
    plans = [plan_group(w, spec, args) for w, spec in groups]
    schedule = make_schedule(plans)
    last = {gi: pos for pos, (gi, _, _) in enumerate(schedule)}
    # What a group needs across phases: the check reference (on the host), whether its
    # FlexAttention is compiled, our best's fwd + fwd+bwd seconds; inputs only while it runs.
    states = [{"inputs": None, "ref": None} for _ in groups]
    records = {}
    context_lost = None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("bench", total=len(schedule))
        for pos, (gi, ii, phase) in enumerate(schedule):
            (w, spec), (name, kind, factory), state = groups[gi], plans[gi][ii], states[gi]
            rec = {"workload": w.id, "dtype": spec["key"], "impl": name, "kind": kind,
                   "floor_fwd_ms": w.floor_ms(spec["key"]),
                   "floor_bwd_ms": w.floor_ms(spec["key"], True)}
            progress.update(task, description=f"{w.id} {spec['key']} {name} (phase {phase})")
            left = deadline - time.time()
            fixed, least = item_cost_s(name, w, spec, state, args)
            if context_lost:
                rec.update(status="not run", reason=f"CUDA context lost ({context_lost})")
            elif phase == 2 and least > left:
                rec.update(status="not run", reason="time budget spent")
            else:
                if phase == 1:
                    # Phase 1 runs regardless; what is left beyond the least every remaining
                    # core item needs is shared out for repetitions.
                    todo = [(g, i) for g, i, ph in schedule[pos:] if ph == 1]
                    spare = left - sum(item_cost_s(plans[g][i][0], *groups[g], states[g],
                                                   args)[1] for g, i in todo)
                    measure_s = max(0.0, spare) / len(todo)
                else:
                    measure_s = left - fixed
                rec.update(_run_one(name, factory, w, spec, state, args, measure_s))
                if rec["status"] == "ok":
                    if name.startswith("flex"):
                        state["flex_compiled"] = True
                    if kind == "ours" and "pair_s" not in state and rec.get("fwdbwd_ms"):
                        state["pair_s"] = (rec["fwd_ms"] + rec["fwdbwd_ms"]) / 1e3
                if rec["status"] == "error" and not _cuda_alive():
                    context_lost = f"after {w.id} {spec['key']} {name}"
            records[gi, ii] = rec
            if pos + 1 == len(schedule) or schedule[pos + 1][0] != gi:
                state["inputs"] = None          # regenerated from the seed if needed again
                if last[gi] == pos:
                    state.clear()
                _free()
            data["results"] = [records[k] for k in sorted(records)]
            data["meta"]["elapsed_s"] = time.time() - t_start
            write_json(args.out, data)
            progress.console.print(_line(rec))
            progress.advance(task)
    data["meta"]["elapsed_s"] = time.time() - t_start
    try:
        import report
        data["summary"] = report.summarize(data)
        console.print(report.summary_table(data))
    except Exception as e:  # noqa: BLE001 - the JSON is what matters
        console.print(f"(no summary: {e!r})")
    write_json(args.out, data)
    console.print(f"wrote {args.out} in {data['meta']['elapsed_s']:.0f} s")
    return 0


def make_schedule(plans):
    """[(group index, item index, phase)]: phase 1 the core items of every group (the first
    of ours and the first peer of its plan), then phase 2 the others, group by group."""
    core = []
    for plan in plans:
        firsts = {}
        for ii, (_, kind, _) in enumerate(plan):
            firsts.setdefault(kind, ii)
        core.append(sorted(firsts.values()))
    return ([(gi, ii, 1) for gi, c in enumerate(core) for ii in c]
            + [(gi, ii, 2) for gi, plan in enumerate(plans) for ii in range(len(plan))
               if ii not in core[gi]])


def item_cost_s(name, w, spec, state, args):
    """Estimated seconds (fixed, least) of an item before it runs. fixed: setup, compiling
    (FlexAttention: once per group) and checking. least: fixed plus its first, sizing and
    fewest (``--min-reps``) timed calls of forward and forward+backward, taking those from
    BENCH.md's figures for a peer, else from our best's in this group (0 before it ran)."""
    published = wl.PUBLISHED_PEERS.get((w.id, spec["key"]), {}).get(name)
    pair = sum(published) / 1e3 if published else state.get("pair_s") or 0.0
    fixed = (FLEX_COMPILE_S if name.startswith("flex") and not state.get("flex_compiled")
             else SETUP_S)
    calls = 2 + (args.min_reps if pair <= args.item_s else 0)
    return fixed, fixed + calls * pair


def _run_one(name, factory, w, spec, group, args, measure_s):
    t0 = time.time()
    impl = None
    try:
        impl = factory()
        if group["inputs"] is None:
            group["inputs"] = make_inputs(w, spec, args.seed, input_copies(w, spec))
        if isinstance(impl, Ours):
            guess_s = impl.check_available(group["inputs"][0][0])
            if guess_s is not None and guess_s > args.item_s:
                raise Skip(f"predicted too slow: about {guess_s:.0f} s per forward")
        rec = run_item(impl, w, spec, group, args, measure_s)
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one failure must not end the run
        if type(e).__name__ == "Skip":
            rec = {"status": "skipped", "reason": str(e)}
        else:
            rec = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
    finally:
        if impl is not None:
            try:
                impl.teardown()
            except Exception:  # noqa: BLE001
                pass
        impl = None
        _free()
    rec["item_s"] = time.time() - t0
    return rec


def _free():
    if not _on_gpu():
        return
    try:
        import cupy
        import torch
        torch.cuda.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def _cuda_alive():
    if not _on_gpu():
        return True
    try:
        import torch
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


def _line(rec):
    head = f"{rec['workload']:>4} {rec['dtype']:<5} {rec['impl']:<14}"
    if rec.get("status") != "ok":
        return f"{head} {rec.get('status')}: {rec.get('reason', '')[:150]}"
    def ms(key, fmt=".3f"):
        return "-" if rec.get(key) is None else format(rec[key], fmt)
    err = (f"err {max(rec['rel_err'].values()):.1e} vs {rec['checked_against']}  "
           if rec.get("rel_err") else "")
    return (f"{head} fwd {ms('fwd_ms')} ms ({ms('fwd_tflops', '.1f')} TF/s)  "
            f"fwd+bwd {ms('fwdbwd_ms')} ms  bwd {ms('bwd_ms')} ms  "
            f"first {ms('first_fwd_ms', '.0f')}/{ms('first_fwdbwd_ms', '.0f')} ms  " + err
            + " ".join(rec.get("notes", [])) + " "
            + (f"peak {rec['peak_extra_bytes'] / 2 ** 30:.2f} GiB"
               if rec.get("peak_extra_bytes") is not None else ""))


if __name__ == "__main__":
    sys.exit(main())
