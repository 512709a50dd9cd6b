"""Seeded random model-shaped problems timed next to FlexAttention: where do we lose?

The M and G sets are fixed layers; this draws new ones (rank 1-3, map sizes, windows, heads,
head dims 32-128, batch, causal axes and dilation as models use them) from a seed and times
each as ``bench/models.py`` times a workload (``models.run_group``: the eager torch layer and
FlexAttention called as users call them, and both again from CUDA-graph replay, the kernels
alone; outputs and gradients compared with Flex's). The summary lists every problem where ours
is slower than Flex's, forward or forward + backward, eager or kernels alone.

Problem ``i`` of seed ``s`` is drawn from its own generator seeded by ``(s, i)``, so one
reproduces alone (``--first i --count 1``) and disjoint ranges are disjoint draws.

    python bench/perf_sweep.py --seed 1 --count 40 --budget-s 400 --out perf_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import workloads as wl  # noqa: E402

# Forward FLOPs of one problem at most (about 2-4 ms of our forward at head dim 128): keeps
# FlexAttention's forward + backward of the largest draws within tens of milliseconds.
MAX_FLOPS = 6e11
# Query rows (batch x tokens x heads) a draw aims at, log-uniform between these.
ROWS = (2 ** 17, 2 ** 21)


def _odd_up_to(rng, lo, hi):
    """An odd number in [lo, hi] (lo odd), log-uniform-ish."""
    hi = max(lo, hi if hi % 2 else hi - 1)
    choices = list(range(lo, hi + 1, 2))
    weights = np.array([1.0 / c for c in choices])
    return int(rng.choice(choices, p=weights / weights.sum()))


DTYPES = ("bf16", "fp16")


def draw(seed, i, dtypes=DTYPES, head_dims=None):
    """Problem ``i`` of ``seed``: (Workload, dtype key), the dtype one of ``dtypes`` (keys of
    ``workloads``: bf16, fp16, fp32, tf32); the other draws do not depend on them. With
    ``head_dims`` the head dim is drawn from those instead (uniformly, by a generator of its
    own, so the other draws stay the same): the head dims models use beyond 32-128's powers
    of two (40, 80, 160 in diffusion U-Nets, 72 in DiT, 256). Such a draw is named
    ``R<seed>-<i>-D<head dim>``, which ``workloads`` resolves back to it."""
    rng = np.random.default_rng([seed, i])
    rank = int(rng.choice([1, 2, 3], p=[0.3, 0.4, 0.3]))
    dtype = str(rng.choice(list(dtypes)))
    dilation = causal = None
    if rank == 1:
        n = int(rng.choice([1024, 2048, 4096, 8192, 16384]))
        k = int(2 ** rng.uniform(5, min(12, math.log2(n))))
        if rng.random() < 0.8:
            k |= 1
        spatial, kernel = (n,), (min(k, n),)
        dim = int(rng.choice([64, 128]))
        heads = int(rng.choice([8, 12, 16]))
        causal = (bool(rng.random() < 0.4),)
    elif rank == 2:
        side = int(rng.choice([14, 16, 24, 28, 32, 48, 56, 64, 96, 128]))
        other = side if rng.random() < 0.7 else int(rng.choice([16, 32, 48, 64, 80]))
        spatial = (side, other)
        k = _odd_up_to(rng, 3, min(33, side, other))
        kernel = (k, k)
        if rng.random() < 0.15:
            d = int(rng.integers(2, 9))
            d = max(1, min(d, min(spatial) // k))
            dilation = (d, d)
        dim = int(rng.choice([32, 64, 96, 128], p=[0.3, 0.3, 0.1, 0.3]))
        heads = int(rng.choice([2, 3, 4, 6, 8, 12, 16]))
    else:
        t = int(rng.choice([4, 8, 12, 16, 24]))
        side = int(rng.choice([16, 24, 32, 40, 48, 64]))
        spatial = (t, side, side if rng.random() < 0.7 else int(rng.choice([32, 48, 64])))
        kt = int(rng.integers(2, min(t, 7) + 1))
        ks = _odd_up_to(rng, 3, min(13, side))
        kernel = (kt, ks, ks)
        causal = (bool(rng.random() < 0.4), False, False)
        dim = int(rng.choice([32, 64, 128], p=[0.2, 0.5, 0.3]))
        heads = int(rng.choice([4, 8, 12, 16]))
    if head_dims:
        dim = int(np.random.default_rng([seed, i, 1]).choice(list(head_dims)))
    tokens = math.prod(spatial)
    rows = 2 ** rng.uniform(math.log2(ROWS[0]), math.log2(ROWS[1]))
    batch = max(1, round(rows / (tokens * heads)))
    per_batch = 4 * tokens * heads * math.prod(kernel) * dim
    most = MAX_FLOPS if dtype in ("bf16", "fp16") else MAX_FLOPS / 8   # fp32 runs ~8x slower
    batch = max(1, min(batch, int(most // per_batch)))
    name = f"R{seed}-{i}" + (f"-D{dim}" if head_dims else "")
    w = wl.Workload(name, spatial, kernel, heads, dim, "random model-shaped draw",
                    batch=batch, dilation=dilation, causal=causal)
    return w, dtype


def _ratio(a, b):
    return b / a if a and b else None


def summarize(rec):
    """Flex time / ours per measure (> 1: ours faster), None where either is missing."""
    ours, flex = rec.get("ours_eager") or {}, rec.get("flex_eager") or {}
    return {m: _ratio(ours.get(m), flex.get(m))
            for m in ("fwd", "fwd_bwd", "fwd_kernels", "fwd_bwd_kernels")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--budget-s", type=float, default=400,
                    help="stop starting new problems after this many seconds")
    ap.add_argument("--dtypes", default=",".join(DTYPES),
                    help="comma-separated dtypes drawn from (bf16, fp16, fp32, tf32; default "
                         "bf16,fp16)")
    ap.add_argument("--head-dims", default=None,
                    help="comma-separated head dims to draw from instead of the model-shaped "
                         "choice per rank (e.g. 40,72,80,160,256)")
    ap.add_argument("--list", action="store_true", help="print the draws and exit (no GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    bad = [d for d in dtypes if d not in ("bf16", "fp16", "fp32", "tf32")]
    if bad:
        ap.error(f"--dtypes: unknown {bad} (bf16, fp16, fp32, tf32)")
    try:
        head_dims = tuple(int(d) for d in args.head_dims.split(",")) if args.head_dims else None
    except ValueError:
        ap.error(f"--head-dims: integers expected, got {args.head_dims!r}")
    if head_dims and any(d < 1 for d in head_dims):
        ap.error(f"--head-dims: positive head dims expected, got {args.head_dims!r}")
    draws = [draw(args.seed, i, dtypes, head_dims)
             for i in range(args.first, args.first + args.count)]
    if args.list:
        for w, dt in draws:
            print(f"{w.id:8s} {dt} B{w.batch} {w.describe()} dil {w.dilation} causal "
                  f"{w.causal} fwd GFLOP {w.flops() / 1e9:.0f}")
        return
    import torch
    import torch._dynamo as dynamo

    import models
    models._flex()
    for name in ("recompile_limit", "cache_size_limit"):   # a new shape compiles anew
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, 4 * args.count + 64)
    t0 = time.perf_counter()
    results, not_run = [], []
    for w, dt in draws:
        if time.perf_counter() - t0 > args.budget_s:
            not_run.append(w.id)
            continue
        try:
            rec = models.run_group(w, dt, compiled=False)
        except Exception as e:  # recorded, not hidden
            rec = dict(workload=w.id, dtype=dt, error=f"{type(e).__name__}: {e}"[:400])
        rec.update(problem=w.as_dict(), flex_over_ours=summarize(rec),
                   seconds=time.perf_counter() - t0)
        results.append(rec)
        r = rec["flex_over_ours"]
        print(f"{w.id:8s} {dt} B{w.batch} {w.describe()} dil {w.dilation} causal {w.causal}: "
              + "  ".join(f"{k} {v:.2f}x" if v else f"{k} -" for k, v in r.items()),
              flush=True)
        torch.cuda.empty_cache()
    losses = [dict(workload=r["workload"], **r["flex_over_ours"]) for r in results
              if any(v is not None and v < 1 for v in r["flex_over_ours"].values())]
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  commit=os.environ.get("NATTEN_CUPY_COMMIT", ""), seed=args.seed,
                  dtypes=list(dtypes), head_dims=list(head_dims) if head_dims else None,
                  first=args.first, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  results=results, not_run=not_run, losses=losses)
    print(f"{len(results)} problems, {len(losses)} with a measure slower than Flex's; "
          f"not run: {len(not_run)}")
    for item in losses:
        print("  LOSS", item)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
