"""Per-kernel times and bandwidth of the unfused chain (qk -> softmax -> av and back), tiled
next to naive, on the BENCH workloads W2 and W3.

For every kernel the chain launches: median ms over the timed repetitions (the profiler hook's
events, ``bench/timing.py``'s ``launch_times``), the bytes it must move (its operands read
once, its result written once) and the fraction of the copy bandwidth (BENCH.md: 4.28 TB/s)
that is. Also the whole chain, forward and forward+backward, per backend side by side (CUDA
events, medians), and its speedup over naive.

    python bench/probes/tiled_probe.py --out probe.json [--workloads W2,W3] [--dtypes fp16,fp32,tf32]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # the repository (natten_cupy), bench/

import cupy  # noqa: E402

import natten_cupy  # noqa: E402
from natten_cupy import ops  # noqa: E402
from natten_cupy.profile_cli import random_array  # noqa: E402
from timing import event_ms, launch_times  # noqa: E402
from workloads import COPY_BANDWIDTH, WORKLOADS, dtype_spec  # noqa: E402


def _kernels(fn, reps):
    """[(name, backend, ms)] of the kernels one call of ``fn`` launches, in launch order: per
    launch, the median over ``reps`` calls."""
    runs = [launch_times(fn, backend=True) for _ in range(reps)]
    return [(name, backend, statistics.median(run[i][2] for run in runs))
            for i, (name, backend, _) in enumerate(runs[0])]


def _rel(got, want):
    """Largest |got - want| over the largest |want|, finite entries only (qk has -inf)."""
    g, t = got.astype(cupy.float32), want.astype(cupy.float32)
    fin = cupy.isfinite(t)
    if not bool((cupy.isfinite(g) == fin).all()):
        return float("inf")
    return float(cupy.abs(cupy.where(fin, g - t, 0)).max() / cupy.abs(cupy.where(fin, t, 0)).max())


def probe(w, dtype, tf32, backends, reps, slow_reps, variants=()):
    shape = w.shape
    s = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    q, k, v, do = (random_array(cupy, shape, dtype, i) for i in range(4))
    kw = dict(dilation=w.dilation, is_causal=w.causal, allow_tf32=tf32)
    scale = w.dim ** -0.5
    tensor = q.size * s                      # one of q, k, v, out, ...
    weights = q.size // w.dim * w.neighbors * s
    # Bytes each step must move: (reads, writes), per kernel of the tiled backend.
    need = {
        "qk": 2 * tensor + weights,
        "softmax": 2 * weights,
        "av": weights + 2 * tensor,
        "av_backward.d_attn": 2 * tensor + weights,
        "av_backward.dv": weights + 2 * tensor,
        "softmax_backward": 3 * weights,
        "qk_backward.dq": weights + 2 * tensor,
        "qk_backward.dk": weights + 2 * tensor,
    }
    result = {"workload": w.id, "dtype": dtype, "tf32": tf32, "bytes": need, "backends": {}}
    for be in backends:
        result["backends"][be] = _probe_backend(w, be, q, k, v, do, kw, scale, need,
                                                reps if be != "naive" else slow_reps)
        cupy.get_default_memory_pool().free_all_blocks()
    if variants and "tiled" in backends:
        # Side by side: the tiled backend with module settings changed (tiled.<NAME> = value,
        # or softmax.<NAME> for natten_cupy._softmax), each checked against the default's qk
        # and av first.
        from natten_cupy import _softmax
        from natten_cupy.backends import tiled
        c = dict(kw, backend="tiled")
        want_s = ops.qk(w.rank, q, k, w.kernel, **c)
        attn = natten_cupy.softmax(want_s, scale)
        want_o = ops.av(w.rank, attn, v, w.kernel, **c)
        for name, value in variants:
            mod, attr = (_softmax, name[8:]) if name.startswith("softmax.") else (tiled, name)
            old = getattr(mod, attr)
            setattr(mod, attr, value)
            try:
                err = max(_rel(ops.qk(w.rank, q, k, w.kernel, **c), want_s),
                          _rel(ops.av(w.rank, attn, v, w.kernel, **c), want_o))
                d = _probe_backend(w, "tiled", q, k, v, do, kw, scale, need, reps)
                d["max_rel_diff_vs_default"] = err
                result["backends"][f"tiled[{name}={value}]"] = d
            finally:
                setattr(mod, attr, old)
        del attn, want_s, want_o
        cupy.get_default_memory_pool().free_all_blocks()
    if "naive" in result["backends"]:
        base = result["backends"]["naive"]["chain"]
        for be, d in result["backends"].items():
            d["chain"]["speedup_fwd"] = base["fwd_ms"] / d["chain"]["fwd_ms"]
            d["chain"]["speedup_fwd_bwd"] = base["fwd_bwd_ms"] / d["chain"]["fwd_bwd_ms"]
    return result


def _probe_backend(w, be, q, k, v, do, kw, scale, need, r):
    c = dict(kw, backend=be)
    logits = ops.qk(w.rank, q, k, w.kernel, **c)
    attn = natten_cupy.softmax(logits, scale)
    d_attn, _ = ops.av_backward(w.rank, do, attn, v, w.kernel, **c)
    d_logits = natten_cupy.softmax_backward(attn, d_attn, scale)
    steps = [
        ("qk", lambda: ops.qk(w.rank, q, k, w.kernel, **c)),
        ("softmax", lambda: natten_cupy.softmax(logits, scale)),
        ("av", lambda: ops.av(w.rank, attn, v, w.kernel, **c)),
        ("av_backward", lambda: ops.av_backward(w.rank, do, attn, v, w.kernel, **c)),
        ("softmax_backward", lambda: natten_cupy.softmax_backward(attn, d_attn, scale)),
        ("qk_backward", lambda: ops.qk_backward(w.rank, d_logits, q, k, w.kernel, **c)),
    ]
    rows = []
    for step, fn in steps:
        fn()
        for i, (name, backend, ms) in enumerate(_kernels(fn, r)):
            label = step
            if step == "av_backward":
                label += (".d_attn", ".dv")[min(i, 1)]
            elif step == "qk_backward":
                label += (".dq", ".dk")[min(i, 1)]
            b = need.get(label)
            rows.append({"step": label, "kernel": name, "backend": backend, "ms": ms,
                         "bytes": b, "bandwidth_fraction":
                         None if b is None else b / (ms * 1e-3) / COPY_BANDWIDTH})
    from natten_cupy.profile_cli import unfused_backward, unfused_forward
    state = {}

    def fwd():
        state["out"], state["attn"] = unfused_forward(w.rank, q, k, v, w.kernel, **c)

    def fwd_bwd():
        fwd()
        unfused_backward(w.rank, do, q, k, v, state["attn"], w.kernel, **c)

    fwd_bwd()
    chain = {"fwd_ms": event_ms(fwd, warmup=0, reps=r),
             "fwd_bwd_ms": event_ms(fwd_bwd, warmup=0, reps=r)}
    return {"kernels": rows, "chain": chain}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="W2,W3")
    ap.add_argument("--dtypes", default="fp16,fp32,tf32")
    ap.add_argument("--extra", default="",
                    help="more WORKLOAD:DTYPE pairs, comma-separated (e.g. W1:fp16)")
    ap.add_argument("--backends", default="tiled,naive")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--slow-reps", type=int, default=3)
    ap.add_argument("--variants", default="",
                    help="tiled-backend settings to compare, NAME=PYTHON_LITERAL separated by "
                         "';' (e.g. 'SCORE_BATCH={False: 1, True: 1}')")
    args = ap.parse_args(argv)
    results = []
    t0 = time.time()
    pairs = [(wid, dt) for wid in args.workloads.split(",") for dt in args.dtypes.split(",")]
    pairs += [tuple(x.split(":")) for x in args.extra.split(",") if x]
    for wid, dt in pairs:
        spec = dtype_spec(dt)
        dtype, tf32 = spec["name"], spec["tf32"]
        bes = [b for b in args.backends.split(",") if not (b == "naive" and tf32)]
        variants = [(a.split("=", 1)[0].strip(), ast.literal_eval(a.split("=", 1)[1]))
                    for a in args.variants.split(";") if a.strip()]
        res = probe(WORKLOADS[wid], dtype, tf32, bes, args.reps, args.slow_reps, variants)
        results.append(res)
        print(f"== {wid} {dt}  ({time.time() - t0:.0f} s)")
        for be, d in res["backends"].items():
            ch = d["chain"]
            sp = (f"  speedup {ch['speedup_fwd']:.2f}x / {ch['speedup_fwd_bwd']:.2f}x"
                  if "speedup_fwd" in ch else "")
            if "max_rel_diff_vs_default" in d:
                print(f"  {be}: qk/av differ from the default by "
                      f"{d['max_rel_diff_vs_default']:.2e} (relative)")
            print(f"  {be:6s} chain fwd {ch['fwd_ms']:8.2f} ms  fwd+bwd "
                  f"{ch['fwd_bwd_ms']:8.2f} ms{sp}")
            for row in d["kernels"]:
                bw = row["bandwidth_fraction"]
                print(f"    {row['step']:20s} {row['ms']:8.3f} ms  "
                      f"{'' if bw is None else f'{100 * bw:5.1f}% of copy bw'}  "
                      f"{row['kernel'][:70]}")
        with open(args.out, "w") as f:
            json.dump({"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "commit": os.environ.get("NATTEN_CUPY_COMMIT", ""),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
