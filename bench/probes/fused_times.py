"""Kernel times of the fused forward and backward per tile choice, side by side in one run.

    python bench/probes/fused_times.py [--workloads 2D-33:fp16,M5:bf16] [--tiles wgmma,mma.sync]
        [--reps 15] [--out times.json] [--baseline fused/mma_forward.cu=fused/old.cu]
        [--forward-only] [--rounds 3]

Per workload (``bench/workloads.py``'s suite, model-shaped and probe ids) and kernel family
(``wgmma``: the Hopper parts, ``mma.sync``: the mma.sync parts, called directly; ``default``:
the array API's own choice, warm calls; ``F@base``: family F built from other kernel sources,
``--baseline``; ``wgmma+atomic`` / ``wgmma+det``: the Hopper backward with dQ added in its
dK/dV pass / with the dQ pass, whatever ``atomic_pays`` says; ``wgmma+small``: the Hopper
forward with 64-query boxes, ``SMALL_BOX``, and ``wgmma+smallN`` with N stages;
``+big``: its 128-query box (192 in 1-D at head dim 64), ``+bnN`` / ``+wgN``: its tile
with N keys a tile / N compute warpgroups; ``+tma`` /
``+cpasync``: the Hopper forward's loader, ``+boxes`` / ``+flat``: its key
walk, e.g. ``wgmma+small+boxes``; ``+btma`` / ``+bcp``: the Hopper backward's dK/dV
query-tile loads, ``+kvN``: its dK/dV pass with N stages, ``+q1`` / ``+q2``: its dQ pass with one
compute warpgroup (``Q_ONE_WG``) / two, ``+kvwg1`` / ``+kvwg2``: its dK/dV pass with one
(``KV_ONE_WG``) / two; ``+b160`` / ``+b256``: the mma.sync
backward with head dims 136-160 in its 160 bucket / padded to 256 (``BUCKET_160``);
``+qcN`` / ``+kvcN``: its dQ / dK-dV pass in head-dim chunks of N columns at every bucket
from N up; ``+rpb``: with a random relative positional bias, d_rpb from the backward), on
the same inputs: forward and backward CUDA-event medians after warm-up of one call each
(``fwd_ms``, ``bwd_ms``: the call's host work counts where the GPU waits for it, and the
parts called directly plan on every call: hundreds of microseconds on slow hosts) and of
the kernels alone (``*_kernel_ms``: events around each launch, summed per call), and
TFLOP/s on useful FLOPs (forward 4 B N H K D, backward 2.5 times that). Each backward's
gradients are checked to be finite; correctness against the reference is the GPU tests' job.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import cupy  # noqa: E402

from natten_cupy import _args, ops  # noqa: E402
from natten_cupy.profile_cli import random_array  # noqa: E402
from timing import event_ms, kernel_ms  # noqa: E402
from workloads import dtype_spec, probe_workload  # noqa: E402

DEFAULT = "2D-33:fp16,M5:bf16,M4:bf16,M7:bf16,W2b:fp16,3D-D128:bf16,W1:fp16,SA:fp16"


def _parts(family):
    from natten_cupy.backends.fused import (mma_backward, mma_forward, wgmma_backward,
                                            wgmma_forward)
    return {"wgmma": (wgmma_forward, wgmma_backward),
            "mma.sync": (mma_forward, mma_backward)}[family.split("@")[0].split("+")[0]]


@contextlib.contextmanager
def _source(family, baselines):
    """Family ``F@base`` runs F's kernels compiled from the ``--baseline`` sources instead of
    the shipped ones (A/B of a kernel change in one run); plain F the shipped ones."""
    if "@" not in family:
        yield
        return
    parts = _parts(family)
    saved = [m.SOURCE for m in parts]
    try:
        for m in parts:
            m.SOURCE = baselines.get(m.SOURCE, m.SOURCE)
        yield
    finally:
        for m, src in zip(parts, saved):
            m.SOURCE = src


@contextlib.contextmanager
def _buckets(family):
    """``+b160`` / ``+b256``: the mma.sync backward with / without its 160 bucket; ``+qcN``,
    ``+kvcN``: its chunks (decisions re-made on entry and on exit: ``configure`` caches them
    per problem)."""
    from natten_cupy.backends.fused import mma_backward as m
    saved = m.BUCKET_160, dict(m.Q_CHUNKS), dict(m.KV_CHUNKS)
    mods = family.split("@")[0].split("+")[1:]
    if "b160" in mods or "b256" in mods:
        m.BUCKET_160 = "b160" in mods
    for mod in mods:   # qcN, kvcN: chunks of N columns at every bucket from N up
        for prefix, chunks in (("qc", m.Q_CHUNKS), ("kvc", m.KV_CHUNKS)):
            if mod.startswith(prefix) and mod[len(prefix):].isdigit():
                n = int(mod[len(prefix):])
                chunks.update({dp: n for dp in m.D_BUCKETS if dp >= n and dp % n == 0})
    changed = (m.BUCKET_160, m.Q_CHUNKS, m.KV_CHUNKS) != saved
    if changed:
        m._configure.cache_clear()
    try:
        yield
    finally:
        if changed:
            m.BUCKET_160 = saved[0]
            m.Q_CHUNKS.clear()
            m.Q_CHUNKS.update(saved[1])
            m.KV_CHUNKS.clear()
            m.KV_CHUNKS.update(saved[2])
            m._configure.cache_clear()


def run(wid, dtype, family, reps, baselines=None, forward_only=False):
    with _source(family, baselines or {}), _buckets(family):
        try:
            return _run(wid, dtype, family, reps, forward_only)
        except ValueError as e:   # a variant this problem cannot take (e.g. +btma at rank 2)
            return dict(workload=wid, dtype=dtype, tile=family, error=f"refused: {e}"[:300])


def _run(wid, dtype, family, reps, forward_only=False):
    w = probe_workload(wid)
    spec = dtype_spec(dtype)
    q, k, v, do = (random_array(cupy, w.shape, spec["name"], i) for i in range(4))
    opts = dict(stride=w.stride, dilation=w.dilation, is_causal=w.causal,
                allow_tf32=spec["tf32"], backend="fused")
    row = dict(workload=wid, dtype=dtype, tile=family)
    if family == "default":
        def fwd_call():
            return ops.fused_forward(w.rank, q, k, v, w.kernel, return_lse=True, **opts)

        def bwd_call():
            return ops.fused_backward(w.rank, do, q, k, v, out, lse, w.kernel, **opts)
    else:
        fpart, bpart = _parts(family)
        mods = family.split("@")[0].split("+")[1:]
        rpb = d_rpb = None
        if "rpb" in mods:   # a random bias [H, 2k - 1, ...] and its gradient
            rpb = random_array(cupy, (w.shape[-2], *(2 * x - 1 for x in w.kernel)), spec["name"],
                               4)
            d_rpb = cupy.empty_like(rpb)   # (rpb's dtype, as the backward writes it)
        problem = _args.check_fused(w.rank, q, k, v, w.kernel, w.stride, w.dilation, w.causal,
                                    None, "fused", spec["tf32"], rpb=rpb)
        why = fpart.refuse(problem) or bpart.refuse(problem)
        if why:
            row["error"] = f"refused: {why}"[:300]
            return row
        out, lse = cupy.empty_like(q), cupy.empty(q.shape[:-1], cupy.float32)
        grads = [cupy.empty_like(x) for x in (q, k, v)]

        way, box = {}, {}
        if rpb is not None:
            box["rpb"] = rpb
            way.update(rpb=rpb, d_rpb=d_rpb)
        for mod in mods:
            way.update({"atomic": dict(dq_atomic=True), "det": dict(dq_atomic=False)}.get(mod, {}))
            if mod.startswith("small"):   # smallN: the 64-query box with N stages
                tile = fpart.SMALL_BOX[fpart._bucket(problem.head_dim)]
                if mod[5:]:
                    tile = dataclasses.replace(tile, stages=int(mod[5:]))
                box["tile"] = tile
            if mod == "big":   # the 128-query box (192 in 1-D at head dim 64)
                box["tile"] = (fpart.DEFAULT[fpart._bucket(problem.head_dim)]
                               if problem.rank == 1 else fpart.DEFAULT_ND)
            if mod[:2] in ("bn", "wg") and mod[2:].isdigit():   # bnN / wgN: the Hopper
                # forward's tile with N keys a tile / N compute warpgroups (from smallN's
                # tile where one came first, else the problem's default)
                tile = box.get("tile") or fpart._default_tile(problem)
                n = int(mod[2:])
                tile = (dataclasses.replace(tile, bn=n) if mod[:2] == "bn" else
                        dataclasses.replace(tile, wg=n, pp=tile.pp and n > 1))
                box["tile"] = tile
            if mod in ("tma", "cpasync"):   # the Hopper forward's loader
                box["tma"] = mod == "tma"
            if mod in ("boxes", "flat"):   # its key walk (rank 2, 3)
                box["walk_boxes"] = mod == "boxes"
            if mod in ("btma", "bcp"):   # the Hopper backward's dK/dV query-tile loads
                way["tma"] = mod == "btma"
            if mod in ("q1", "q2"):   # the dQ pass with one compute warpgroup (Q_ONE_WG) /
                # two (DEFAULT's tile), deterministic
                way.update(tile=(bpart.Q_ONE_WG if mod == "q1" else bpart.DEFAULT)[
                    bpart._bucket(problem.head_dim)], dq_atomic=False)
            if mod in ("kvwg1", "kvwg2"):   # the dK/dV pass with one / two compute
                # warpgroups (deterministic; the dQ pass from an earlier q1 / q2, else the
                # default's)
                tile = way.get("tile") or bpart.default_tile(problem)
                dp = bpart._bucket(problem.head_dim)
                tile = (bpart.kv_one_wg(tile, dp) if mod == "kvwg1" else dataclasses.replace(
                    tile, kv_wg=2, bq=bpart.DEFAULT[dp].bq,
                    kv_stages=bpart.DEFAULT[dp].kv_stages))
                way.update(tile=tile, dq_atomic=False)
            if mod[:2] == "kv" and mod[2:].isdigit():   # kvN: its dK/dV pass with N stages
                way["tile"] = dataclasses.replace(bpart.DEFAULT[bpart._bucket(problem.head_dim)],
                                                  kv_stages=int(mod[2:]))

        def fwd_call():
            fpart.forward(problem, q, k, v, out, lse, **box)
            return out, lse

        def bwd_call():
            bpart.backward(problem, q, k, v, out, lse, do, *grads, **way)
            return grads
    out, lse = fwd_call()
    fwd = event_ms(fwd_call, reps=reps)
    flops = w.flops()
    kfwd = kernel_ms(fwd_call, reps)
    row.update(fwd_ms=round(fwd, 4), fwd_tflops=round(flops / fwd / 1e9, 1),
               fwd_kernel_ms=round(kfwd, 4), fwd_kernel_tflops=round(flops / kfwd / 1e9, 1))
    if forward_only:
        row["finite"] = bool(cupy.isfinite(out.astype(cupy.float32)).all())
        return row
    finite = all(bool(cupy.isfinite(g.astype(cupy.float32)).all()) for g in bwd_call())
    bwd = event_ms(bwd_call, reps=reps)
    kbwd = kernel_ms(bwd_call, reps)
    row.update(bwd_ms=round(bwd, 4), finite=finite, bwd_tflops=round(2.5 * flops / bwd / 1e9, 1),
               bwd_kernel_ms=round(kbwd, 4),
               bwd_kernel_tflops=round(2.5 * flops / kbwd / 1e9, 1))
    return row


def _print(row, tag=""):
    head = f"{tag}{row['workload']:>10}:{row['dtype']:<5} {row['tile']:<9}"
    if "error" in row:
        print(f"{head} {row['error'][:90]}", flush=True)
        return
    bwd = ("" if "bwd_ms" not in row else f"  bwd {row['bwd_ms']:8.3f} ms "
           f"(kernels {row['bwd_kernel_ms']:8.3f})")
    print(f"{head} fwd {row['fwd_ms']:8.3f} ms (kernels {row['fwd_kernel_ms']:8.3f}, "
          f"{row['fwd_kernel_tflops']:6.1f} TF){bwd}  finite {row['finite']}", flush=True)


def _median_row(rows):
    """One row of several rounds: each time and rate the median over the rounds, the rounds'
    times kept (``*_ms_rounds``), finite only if every round's was."""
    if len(rows) == 1 or any("error" in r for r in rows):
        return rows[0]
    out = dict(rows[0])
    for key in ("fwd_ms", "fwd_tflops", "bwd_ms", "bwd_tflops", "fwd_kernel_ms",
                "fwd_kernel_tflops", "bwd_kernel_ms", "bwd_kernel_tflops"):
        if key in out:
            out[key] = statistics.median(r[key] for r in rows)
            if key.endswith("_ms"):
                out[key + "_rounds"] = [r[key] for r in rows]
    out["finite"] = all(r["finite"] for r in rows)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=DEFAULT)
    ap.add_argument("--tiles", default="wgmma,mma.sync")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone")
    ap.add_argument("--baseline", action="append", default=[], metavar="SHIPPED=OTHER",
                    help="for tiles F@base: compile cuda_src/OTHER in place of cuda_src/SHIPPED "
                         "(e.g. fused/mma_forward.cu=fused/mma_forward_base.cu, the file "
                         "of an earlier commit); repeatable")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every (workload, tile) this many times, interleaved, and keep "
                         "the median of the rounds (a drifting clock then moves every variant)")
    args = ap.parse_args(argv)
    baselines = dict(b.split("=", 1) for b in args.baseline)
    runs = {}
    for r in range(args.rounds):
        for spec in args.workloads.split(","):
            wid, dtype = spec.split(":")
            for tile in args.tiles.split(","):
                row = run(wid, dtype, tile, args.reps, baselines, args.forward_only)
                runs.setdefault((wid, dtype, tile), []).append(row)
                _print(row, f"[{r + 1}/{args.rounds}] " if args.rounds > 1 else "")
            cupy.get_default_memory_pool().free_all_blocks()
    rows = [_median_row(rs) for rs in runs.values()]
    if args.rounds > 1:
        print("medians of the rounds:")
        for row in rows:
            _print(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                           commit=os.environ.get("NATTEN_CUPY_COMMIT", ""), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
