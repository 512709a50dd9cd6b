"""Seeded random sweep: every CUDA backend against the float64 reference (issue 13).

For each backend and dtype (a *stream*, e.g. ``naive/float16``; ``tf32`` is float32 with
``allow_tf32``), ``--cases`` random configurations are drawn and each is checked:

* op kinds: fused forward + backward (naive, fused; with rpb and d_rpb on a quarter of the
  cases of stride 1), unfused qk (with or without rpb), av,
  qk_backward (d_rpb when rpb is drawn), av_backward (naive, tiled); the reference backend
  (``--backends reference``) runs all of them; ``hopper`` is the fused backend held to its
  Hopper (wgmma, sm_90a) parts, forward and backward, on every case (float16/bfloat16, head
  dims 16-128), whatever the dispatch would pick for so small a problem: the random shapes
  the wgmma kernels' fixed GPU tests do not reach (a part's refusal counts as refused);
* geometry: rank 1-3; extents odd, prime, smaller than a tile or plain, and now and then one
  axis longer than 2**16 with tiny other axes; kernel sizes odd and even up to the extent
  (sometimes equal to it), dilation, stride (fused ops), causal per axis; batch, heads, head
  dims (multiples of 8 on the tensor-core backends, anything on naive), the default or a
  random scale, contiguous or head-major (permuted) layouts;
* check (FlashAttention's rule, as in ``tests/gpu_cases.py``): for every output,
  ``max |backend - truth| <= F * max |yardstick - truth| + FLOOR[dtype] * max(1, max |truth|)``
  with F = 2 for forward outputs and 3 for gradients; truth is the reference backend in
  float64 on the same (rounded) inputs, the yardstick the reference in the case's own dtype
  (float16 for tf32). Outputs start NaN-poisoned and must be fully written; qk's empty
  causal slots must be -inf and av_backward's d_attn 0 there; attn/d_attn inputs carry NaN
  in empty slots, which every backend must ignore. A quarter of the fused cases draw q and k
  so that every score lies near -25 or +25 (``SCORE_STYLES``): very negative or very
  positive log-sum-exps, where anything computed outside the neighborhood overflows. The *ratio* of a case is error / bound
  (<= 1 passes); the summary keeps the worst per (backend, dtype, op).

Reproducibility and subsets. Case ``i`` of a stream is drawn from its own generator seeded
by ``(seed, crc32(stream), i)``, so a case reproduces alone (``--first i --cases 1
--backends B --dtypes D``) and disjoint index ranges are disjoint subsets of one infinite
sweep. The GPU run (``bench/gpu_run.sh --sweep``) uses the fixed seed 13 and takes subset
``s = $SWEEP_SUBSET`` (default 0): indices ``[s * N, (s + 1) * N)`` with ``N = $SWEEP_CASES``
(default 1000); sessions that raise ``SWEEP_SUBSET`` by one cover new cases, and together
all subsets cover the space over time. Record the subset with its summary. ``--head-dims``
draws head dims from a given list (e.g. the buckets above 128) in streams of their own.

Time. Streams run in parallel worker processes (``--jobs``, one per stream by default, all
on one GPU); each stops cleanly at ``--time-budget-s`` (compiles included) and the summary
says how many cases ran. Problems are kept small (about 3e6 multiply-adds a case) so that
1000 cases a stream take a few minutes on the H200 with a warm kernel cache.

``--device cpu --backends reference`` runs the same control flow on NumPy (CI smoke test).

    python3 bench/sweep.py --seed 13 --cases 1000 --time-budget-s 300 --out summary.json

Exit status 1 when any case failed or a stream aborted (a CUDA error), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import sys
import time
import traceback
import zlib

import numpy

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from natten_cupy import _args, _window, ops  # noqa: E402
from natten_cupy._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, accumulator_dtype  # noqa: E402
from natten_cupy.backends import get_backend  # noqa: E402

KINDS = {
    "reference": ("fused", "qk", "av", "qk_backward", "av_backward"),
    "naive": ("fused", "qk", "av", "qk_backward", "av_backward"),
    "fused": ("fused",),
    "tiled": ("qk", "av", "qk_backward", "av_backward"),
    "hopper": ("fused",),
}
STREAM_DTYPES = {
    "reference": ("float64", "float32", "float16", "bfloat16"),
    "naive": ("float64", "float32", "float16", "bfloat16"),
    "fused": ("float32", "tf32", "float16", "bfloat16"),
    "tiled": ("float32", "tf32", "float16", "bfloat16"),
    "hopper": ("float16", "bfloat16"),
}
TENSOR_CORE = ("fused", "tiled", "hopper")
# Streams that run another backend's kernels held to one of its parts: (backend, tile).
HELD = {"hopper": ("fused", "wgmma")}
NP_DTYPES = {"float64": FLOAT64, "float32": FLOAT32, "tf32": FLOAT32, "float16": FLOAT16,
             "bfloat16": BFLOAT16}
# Absolute floor relative to max(1, max |truth|); float64 is exact up to rounding order.
FLOORS = {"float64": 1e-12, "float32": 2e-5, "tf32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
FACTOR = {"forward": 2.0, "gradient": 3.0}
GRADIENTS = ("dq", "dk", "dv", "d_rpb", "d_attn")
PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79,
          83, 89, 97, 101, 127, 131)
MAX_WORK = 3_000_000        # B * N * H * K * D of a case (the CPU reference's cost)
LONG_AXIS = 1 << 16
MAX_WORK_LONG = 12_000_000  # ... of a case with an axis longer than LONG_AXIS
DRAW_ATTEMPTS = 50
DRAW_FACTOR = 3             # indices a stream may draw per case it must run (refusals)


# ---- drawing configurations -------------------------------------------------------------

def _extent(rng, rank):
    """One axis: odd, prime, smaller than a tile (16), or plain; shorter in higher ranks."""
    top = {1: 200, 2: 40, 3: 14}[rank]
    kind = rng.integers(4)
    if kind == 0:
        return int(rng.choice(numpy.arange(3, top + 1, 2)))
    if kind == 1:
        return int(rng.choice([p for p in PRIMES if p <= top]))
    if kind == 2:
        return int(rng.integers(2, 16))
    return int(rng.integers(2, top + 1))


def _axis(rng, extent, fused, kmax):
    """(kernel, stride, dilation, causal) of one axis: k * d <= extent."""
    kmax = min(extent, kmax)
    if extent <= 16 and rng.random() < 0.15:
        k = extent                                   # the whole axis
    else:
        k = int(rng.integers(2, kmax + 1))
    d = 1 if rng.random() < 0.6 else int(rng.integers(1, extent // k + 1))
    s = 1 if not fused or rng.random() < 0.5 else int(rng.integers(1, k + 1))
    return k, s, d, bool(rng.random() < 0.3)


def _head_dim(rng, backend):
    if backend == "hopper":   # head dims up to 128 (those up to 64 padded to 64)
        return int(rng.choice([16, 32, 40, 48, 64, 72, 96, 128],
                              p=[.05, .1, .1, .05, .25, .1, .1, .25]))
    if backend in TENSOR_CORE:
        return int(rng.choice([8, 16, 24, 32, 40, 48, 64, 72, 96, 128, 256],
                              p=[.14, .14, .1, .14, .07, .07, .14, .05, .05, .07, .03]))
    return int(rng.integers(1, 81)) if rng.random() < 0.7 else int(rng.choice([32, 64, 128]))


def stream_name(backend, dtype, head_dims=None):
    """A stream's name: ``backend/dtype``, with ``--head-dims`` ``backend/dtype/D<dims>``."""
    return f"{backend}/{dtype}" + (f"/D{'-'.join(map(str, head_dims))}" if head_dims else "")


def draw_config(seed, backend, dtype, index, head_dims=None):
    """Configuration ``index`` of stream ``backend/dtype`` (a JSON-able dict); ``head_dims``
    (``--head-dims``): the head dim drawn from these alone, in a stream of its own
    (``backend/dtype/D<dims>``), so that the plain streams' cases stay what they were."""
    stream = zlib.crc32(stream_name(backend, dtype, head_dims).encode())
    rng = numpy.random.default_rng([seed, stream, index])
    for _ in range(DRAW_ATTEMPTS):
        kind = str(rng.choice(KINDS[backend]))
        fused = kind == "fused"
        rank = int(rng.integers(1, 4))
        long_axis = rank < 3 and rng.random() < 0.01
        if long_axis:
            spatial = [2] * rank
            big = int(rng.integers(rank))
            spatial[big] = LONG_AXIS + int(rng.integers(1, 3000))
        else:
            spatial = [_extent(rng, rank) for _ in range(rank)]
        kmax = ({1: 200, 2: 24, 3: 8} if backend == "hopper" else {1: 33, 2: 11, 3: 5})[rank]
        kmax = kmax if not long_axis else 5
        axes = [_axis(rng, L, fused, kmax) for L in spatial]
        kernel, stride, dilation, causal = (list(t) for t in zip(*axes))
        batch, heads = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        head_dim = int(rng.choice(head_dims)) if head_dims else _head_dim(rng, backend)
        if long_axis:
            head_dim = (40 if backend == "hopper" else 8 if backend in TENSOR_CORE
                        else int(rng.integers(1, 9)))
            batch, heads = 1, 1
        n, k = math.prod(spatial), math.prod(kernel)
        cap = MAX_WORK_LONG if long_axis else MAX_WORK
        while batch * heads * n * k * head_dim > cap and (batch > 1 or heads > 1):
            if batch > 1:
                batch -= 1
            else:
                heads -= 1
        if batch * heads * n * k * head_dim > cap:
            continue
        cfg = {
            "backend": backend, "dtype": dtype, "index": index, "seed": seed, "kind": kind,
            "rank": rank, "spatial": spatial, "kernel": kernel, "stride": stride,
            "dilation": dilation, "causal": causal, "batch": batch, "heads": heads,
            "head_dim": head_dim,
            "rpb": bool(kind in ("qk", "qk_backward") and rng.random() < 0.5),
            "scale": None if rng.random() < 0.8 else float(rng.uniform(0.05, 1.0)),
            "permuted": bool(rng.random() < 0.3),
            "input_seed": int(rng.integers(2 ** 31)),
        }
        if head_dims:
            cfg["head_dims"] = list(head_dims)
        # A bias on a quarter of the fused cases of stride 1 (a bias takes no other), read
        # off the input seed: no draw of its own, so every other field of every case stays
        # what it was before fused cases took a bias.
        if kind == "fused" and all(s == 1 for s in stride) and cfg["input_seed"] % 4 == 0:
            cfg["rpb"] = True
        return cfg
    raise RuntimeError(f"no configuration under MAX_WORK after {DRAW_ATTEMPTS} draws "
                       f"({backend}/{dtype} #{index})")


# ---- arrays -----------------------------------------------------------------------------

def empty_slots(cfg):
    """Boolean ``[*spatial, K]``: slots outside a (causal) window (stride 1)."""
    valid = None
    for L, k, d, c in zip(cfg["spatial"], cfg["kernel"], cfg["dilation"], cfg["causal"]):
        _, v = _window.forward_table(L, k, 1, d, c)
        if valid is None:
            valid = v
        else:
            n = valid.ndim - 1
            valid = valid[..., None, :, None] & v.reshape((1,) * n + (L, 1, k))
            valid = valid.reshape(valid.shape[:-3] + (L, -1))
    return ~valid


# How a fused case's q and k are drawn, by its input seed (no draw of the case's own, so the
# geometry of every case stays as it was): standard normal, or q near a random vector a per
# head and k near -a ("negative": every score about -25, each lse too, so whatever is
# computed past a window or a group from exp(-lse) overflows 16 bits unless it is masked) or
# near +a ("positive": scores about +25, exp(score) past float16's range before the max
# is taken off).
SCORE_STYLES = ("normal", "normal", "negative", "normal", "normal", "normal", "positive",
                "normal")


def make_inputs(cfg):
    """Host inputs of the case in its dtype (dict name -> NumPy array)."""
    rng = numpy.random.default_rng(cfg["input_seed"])
    dt = NP_DTYPES[cfg["dtype"]]
    sp = tuple(cfg["spatial"])
    full = (cfg["batch"],) + sp + (cfg["heads"], cfg["head_dim"])
    weights = (cfg["batch"],) + sp + (cfg["heads"], math.prod(cfg["kernel"]))

    def normal(shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dt)

    def with_empty_nan(x):
        e = numpy.broadcast_to(empty_slots(cfg)[None, ..., None, :], x.shape)
        return numpy.where(e, numpy.array(numpy.nan, dt), x)

    kind = cfg["kind"]
    x = {}
    if kind == "fused":
        x["q"], x["k"], x["v"], x["d_out"] = (normal(full) for _ in range(4))
        style = SCORE_STYLES[(cfg["input_seed"] // 4) % len(SCORE_STYLES)]
        if style != "normal":   # scores near -/+25 (after the scale) for every pair
            scale = cfg["scale"] or cfg["head_dim"] ** -0.5
            a = rng.standard_normal(full[-2:]) * (25 / (scale * cfg["head_dim"])) ** 0.5
            sign = -1.0 if style == "negative" else 1.0
            x["q"] = (a + 0.5 * rng.standard_normal(full)).astype(dt)
            x["k"] = (sign * a + 0.5 * rng.standard_normal(full)).astype(dt)
    elif kind == "qk":
        x["q"], x["k"] = normal(full), normal(full)
    elif kind == "av":
        x["attn"], x["v"] = with_empty_nan(normal(weights, 0.5)), normal(full)
    elif kind == "qk_backward":
        x["d_attn"], x["q"], x["k"] = with_empty_nan(normal(weights)), normal(full), normal(full)
    else:
        x["d_out"], x["v"] = normal(full), normal(full)
        x["attn"] = with_empty_nan(normal(weights, 0.5))
    if cfg["rpb"]:
        x["rpb"] = normal((cfg["heads"],) + tuple(2 * k - 1 for k in cfg["kernel"]))
    return x


class Device:
    """Where the backend under test runs: NumPy (cpu) or CuPy (cuda)."""

    def __init__(self, name):
        self.name = name
        if name == "cuda":
            import cupy
            self.xp = cupy
        else:
            self.xp = numpy

    def put(self, host, permuted, rank):
        """A host array on the device; head-major buffer viewed as [B, *spatial, H, ...]
        when ``permuted`` (arrays with batch, spatial and head axes only)."""
        order = None
        if permuted and host.ndim >= rank + 2:
            tail = host.ndim - 2 - rank
            order = (0,) + tuple(range(2, 2 + rank)) + (1,) + tuple(
                range(2 + rank, 2 + rank + tail))
            host = numpy.ascontiguousarray(host.transpose(numpy.argsort(order)))
        host = numpy.ascontiguousarray(host)
        if self.xp is numpy:
            dev = host.copy()
        elif host.dtype.itemsize == 2:      # 16-bit types travel as words (bfloat16)
            dev = self.xp.asarray(host.view(numpy.uint16)).view(host.dtype)
        else:
            dev = self.xp.asarray(host)
        return dev if order is None else dev.transpose(order)

    def get(self, x):
        if isinstance(x, numpy.ndarray):
            return x.astype(numpy.float64)
        if x.dtype.itemsize == 2:
            return self.xp.asnumpy(x.view(self.xp.uint16)).view(x.dtype).astype(numpy.float64)
        return self.xp.asnumpy(x).astype(numpy.float64)

    def sync(self):
        if self.xp is not numpy:
            self.xp.cuda.get_current_stream().synchronize()


# ---- runs -------------------------------------------------------------------------------

def problems(cfg, x, backend_name):
    r, tf32 = cfg["rank"], cfg["dtype"] == "tf32"
    ks, dl, ca = cfg["kernel"], cfg["dilation"], cfg["causal"]
    kind = cfg["kind"]
    if kind == "fused":
        p = _args.check_fused(r, x["q"], x["k"], x["v"], ks, cfg["stride"], dl, ca,
                              cfg["scale"], backend_name, allow_tf32=tf32,
                              tile=cfg.get("tile"), rpb=x.get("rpb"))
        held = HELD.get(cfg["backend"])
        if held is not None:   # the backend's kernels held to one part (an internal tile)
            p = dataclasses.replace(p, tile=held[1])
        return {"fused_forward": p, "fused_backward": p}
    if kind == "qk":
        return {"qk": _args.check_qk(r, x["q"], x["k"], ks, dl, ca, x.get("rpb"), backend_name,
                                     allow_tf32=tf32)}
    if kind == "av":
        return {"av": _args.check_av(r, x["attn"], x["v"], ks, dl, ca, backend_name,
                                     allow_tf32=tf32)}
    if kind == "qk_backward":
        return {"qk_backward": _args.check_qk_backward(r, x["d_attn"], x["q"], x["k"], ks, dl,
                                                       ca, x.get("rpb"), backend_name,
                                                       allow_tf32=tf32)}
    return {"av_backward": _args.check_av_backward(r, x["d_out"], x["attn"], x["v"], ks, dl,
                                                   ca, backend_name, allow_tf32=tf32)}


def refusal(cfg, backend, x):
    for op, p in problems(cfg, x, backend.NAME).items():
        why = backend.refuse(op, p)
        if why is not None:
            return f"{op}: {why}"
    return None


def run(cfg, backend, x, dev, permuted):
    """Run the case's ops on ``backend`` with inputs ``x`` (device arrays), outputs
    NaN-poisoned; returns {output name: (device array, "forward"|"gradient")}."""
    probs = problems(cfg, x, backend.NAME)
    dt = (x["q"] if "q" in x else x["v"]).dtype
    acc = accumulator_dtype(dt)
    r = cfg["rank"]
    full = (cfg["batch"],) + tuple(cfg["spatial"]) + (cfg["heads"], cfg["head_dim"])
    rows = full[:-1]
    weights = rows + (math.prod(cfg["kernel"]),)

    def out(shape, dtype=dt):
        return dev.put(numpy.full(shape, numpy.nan, dtype=dtype), permuted, r)

    y = {}
    kind = cfg["kind"]
    if kind == "fused":
        y["out"], y["lse"] = out(full), out(rows, acc)
        ops.run_fused_forward(probs["fused_forward"], backend, x["q"], x["k"], x["v"], y["out"],
                              y["lse"], x.get("rpb"))
        y["dq"], y["dk"], y["dv"] = out(full), out(full), out(full)
        d_rpb = None
        if cfg["rpb"]:   # (the fused ops' d_rpb takes rpb's dtype)
            y["d_rpb"] = d_rpb = dev.put(numpy.full(x["rpb"].shape, numpy.nan, dt), False, r)
        ops.run_fused_backward(probs["fused_backward"], backend, x["d_out"], x["q"], x["k"],
                               x["v"], y["out"], y["lse"], y["dq"], y["dk"], y["dv"],
                               x.get("rpb"), d_rpb)
    elif kind == "qk":
        y["attn"] = out(weights)
        ops.run_qk(probs["qk"], backend, x["q"], x["k"], x.get("rpb"), y["attn"])
    elif kind == "av":
        y["out"] = out(full)
        ops.run_av(probs["av"], backend, x["attn"], x["v"], y["out"])
    elif kind == "qk_backward":
        y["dq"], y["dk"] = out(full), out(full)
        d_rpb = None
        if cfg["rpb"]:
            d_rpb = dev.put(numpy.full(x["rpb"].shape, numpy.nan, acc), False, r)
            y["d_rpb"] = d_rpb
        ops.run_qk_backward(probs["qk_backward"], backend, x["d_attn"], x["q"], x["k"], y["dq"],
                            y["dk"], d_rpb)
    else:
        y["d_attn"], y["dv"] = out(weights), out(full)
        ops.run_av_backward(probs["av_backward"], backend, x["d_out"], x["attn"], x["v"],
                            y["d_attn"], y["dv"])
    return y


def op_of(kind, name):
    """The op (summary key) an output belongs to."""
    if kind == "fused":
        return "fused_forward" if name in ("out", "lse") else "fused_backward"
    return kind


def check(cfg, got, truth, yard):
    """Per op, the worst error / bound ratio; raises AssertionError on a violation."""
    ratios = {}
    empty = None
    if cfg["kind"] != "fused":
        empty = empty_slots(cfg)[None, ..., None, :]
    for name, t in truth.items():
        g = got[name]
        if g.shape != t.shape:
            raise AssertionError(f"{name}: shape {g.shape} != {t.shape}")
        if numpy.isnan(g).any():
            raise AssertionError(
                f"{name}: {int(numpy.isnan(g).sum())} of {g.size} elements unwritten (NaN), "
                f"first at {numpy.argwhere(numpy.isnan(g))[0].tolist()}")
        if name == "attn":
            e = numpy.broadcast_to(empty, g.shape)
            if not (g[e] == -numpy.inf).all():
                raise AssertionError("attn: empty causal slots must be -inf")
            if not numpy.isfinite(g[~e]).all():
                raise AssertionError("attn: non-finite weight inside a window")
        if name == "d_attn" and cfg["kind"] == "av_backward":
            if not (g[numpy.broadcast_to(empty, g.shape)] == 0).all():
                raise AssertionError("d_attn: empty causal slots must be 0")
        fin = numpy.isfinite(t)
        if not numpy.isfinite(g[fin]).all():
            raise AssertionError(f"{name}: non-finite values where the truth is finite")
        ref_err = float(numpy.abs(yard[name][fin] - t[fin]).max(initial=0.0))
        scale = max(1.0, float(numpy.abs(t[fin]).max(initial=0.0)))
        factor = FACTOR["gradient" if name in GRADIENTS else "forward"]
        bound = factor * ref_err + FLOORS[cfg["dtype"]] * scale
        err = float(numpy.abs(g[fin] - t[fin]).max(initial=0.0))
        op = op_of(cfg["kind"], name)
        ratios[op] = max(ratios.get(op, 0.0), err / bound)
        if err > bound:
            raise AssertionError(f"{name}: max error {err:.3g} > bound {bound:.3g} (reference "
                                 f"{cfg['dtype']} error {ref_err:.3g})")
    return ratios


def references(cfg, x):
    """(truth, yardstick) on the CPU: the reference backend in float64 and in the case's
    dtype (float16 for tf32), on the same rounded inputs."""
    ref = get_backend("reference")
    cpu = Device("cpu")
    x64 = {n: a.astype(numpy.float64) for n, a in x.items()}
    truth = {n: cpu.get(a) for n, a in run(cfg64(cfg), ref, x64, cpu, False).items()}
    if cfg["dtype"] == "float64":
        return truth, truth
    low = x
    if cfg["dtype"] == "tf32":
        low = {n: a.astype(numpy.float16) for n, a in x.items()}
    yard = {n: cpu.get(a) for n, a in run(cfg, ref, low, cpu, False).items()}
    return truth, yard


def cfg64(cfg):
    return dict(cfg, dtype="float64")


def run_case(cfg, backend, dev):
    """Check one configuration: None if refused, else {op: ratio}; raises on failure."""
    x = make_inputs(cfg)
    if refusal(cfg, backend, x) is not None:
        return None
    truth, yard = references(cfg, x)
    xd = {n: dev.put(a, cfg["permuted"] and n != "rpb", cfg["rank"]) for n, a in x.items()}
    y = run(cfg, backend, xd, dev, cfg["permuted"])
    dev.sync()
    return check(cfg, {n: dev.get(a) for n, a in y.items()}, truth, yard)


def _fatal(exc):
    """A CUDA runtime/driver error (illegal address, launch failure...) leaves the context
    unusable: the stream stops there. Compile errors and failed checks are not fatal."""
    try:
        from cupy_backends.cuda.api import driver, runtime
    except ImportError:
        return False
    return isinstance(exc, (runtime.CUDARuntimeError, driver.CUDADriverError))


def run_stream(task):
    """Worker: the cases of one stream until done or out of time (a dict for the summary)."""
    backend_name, dtype, seed, first, count, deadline, device, head_dims = task
    t0 = time.time()
    res = {"stream": stream_name(backend_name, dtype, head_dims), "cases_run": 0, "refused": 0,
           "failures": [], "worst_ratio": {}, "out_of_time": False, "aborted": None}
    digest = hashlib.sha256()
    try:
        dev = Device(device)
        backend = get_backend(HELD.get(backend_name, (backend_name,))[0])
        if device == "cuda":
            import cupy
            cupy.cuda.Device(0).use()
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        res["aborted"] = f"setup: {type(exc).__name__}: {exc}"
        return res
    i = first
    while res["cases_run"] < count and i < first + DRAW_FACTOR * count:
        if time.time() >= deadline:
            res["out_of_time"] = True
            break
        cfg = draw_config(seed, backend_name, dtype, i, head_dims)
        i += 1
        digest.update(json.dumps(cfg, sort_keys=True).encode())
        try:
            ratios = run_case(cfg, backend, dev)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded with its config
            res["cases_run"] += 1
            res["failures"].append({"config": cfg, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc(limit=6)})
            if _fatal(exc):
                res["aborted"] = f"CUDA error at case {cfg['index']}: {exc}"
                break
            continue
        if ratios is None:
            res["refused"] += 1
            continue
        res["cases_run"] += 1
        for op, r in ratios.items():
            res["worst_ratio"][op] = max(res["worst_ratio"].get(op, 0.0), r)
    res["next_index"] = i
    res["digest"] = digest.hexdigest()
    res["elapsed_s"] = round(time.time() - t0, 2)
    return res


# ---- driver -----------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--cases", type=int, default=1000, help="configurations per stream")
    ap.add_argument("--first", type=int, default=0, help="index of the first case (subsets)")
    ap.add_argument("--time-budget-s", type=float, default=300.0)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backends", default=None,
                    help="comma-separated (default: naive,fused,tiled,hopper; cpu: reference)")
    ap.add_argument("--dtypes", default=None, help="comma-separated subset of each backend's")
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (0: one a stream)")
    ap.add_argument("--out", default=None, help="summary JSON")
    ap.add_argument("--head-dims", default=None,
                    help="comma-separated head dims to draw from instead of each backend's "
                         "mix (streams of their own, e.g. 136,144,160,200,256)")
    a = ap.parse_args(argv)
    try:
        a.head_dims = tuple(int(x) for x in a.head_dims.split(",")) if a.head_dims else None
    except ValueError:
        ap.error(f"--head-dims takes comma-separated integers, got {a.head_dims!r}")
    if a.head_dims and min(a.head_dims) < 1:
        ap.error(f"--head-dims must be positive, got {a.head_dims}")
    default = "reference" if a.device == "cpu" else "naive,fused,tiled,hopper"
    a.backends = [b for b in (a.backends or default).split(",") if b]
    for b in a.backends:
        if b not in KINDS:
            ap.error(f"unknown backend {b!r} (choose from {', '.join(KINDS)})")
        if a.device == "cpu" and b != "reference":
            ap.error(f"--device cpu runs only the reference backend, got {b!r}")
    if a.cases < 0 or a.first < 0 or a.time_budget_s <= 0:
        ap.error("--cases and --first must be >= 0 and --time-budget-s > 0")
    wanted = a.dtypes.split(",") if a.dtypes else None
    if wanted:
        unknown = set(wanted) - set(NP_DTYPES)
        if unknown:
            ap.error(f"unknown dtypes {sorted(unknown)} (choose from {', '.join(NP_DTYPES)})")
    a.streams = [(b, d) for b in a.backends for d in STREAM_DTYPES[b]
                 if (wanted is None or d in wanted) and NP_DTYPES[d] is not None]
    if not a.streams:
        ap.error("no (backend, dtype) stream left to run")
    return a


def summarize(a, results, elapsed):
    digest = hashlib.sha256()
    for r in sorted(results, key=lambda r: r["stream"]):
        digest.update(r["stream"].encode() + r.get("digest", "").encode())
    return {
        "seed": a.seed, "first": a.first, "cases_requested": a.cases, "device": a.device,
        "head_dims": list(a.head_dims) if a.head_dims else None,
        "time_budget_s": a.time_budget_s, "elapsed_s": round(elapsed, 2),
        "cases_run": {r["stream"]: r["cases_run"] for r in results},
        "refused": {r["stream"]: r["refused"] for r in results},
        "worst_ratio": {f"{r['stream']}/{op}": round(v, 4) for r in results
                        for op, v in sorted(r["worst_ratio"].items())},
        "failures": [f for r in results for f in r["failures"]],
        "aborted": {r["stream"]: r["aborted"] for r in results if r["aborted"]},
        "out_of_time": any(r["out_of_time"] for r in results),
        "next_index": {r["stream"]: r.get("next_index") for r in results},
        "configs_digest": digest.hexdigest(),
    }


def main(argv=None):
    a = parse_args(argv)
    t0 = time.time()
    deadline = t0 + a.time_budget_s
    tasks = [(b, d, a.seed, a.first, a.cases, deadline, a.device, a.head_dims)
             for b, d in a.streams]
    jobs = a.jobs or len(tasks)
    jobs = max(1, min(jobs, len(tasks), os.cpu_count() or 1))
    if jobs == 1:
        results = [run_stream(t) for t in tasks]
    else:
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            results = pool.map(run_stream, tasks, chunksize=1)
    s = summarize(a, results, time.time() - t0)
    for r in results:
        worst = ", ".join(f"{op} {v:.3f}" for op, v in sorted(r["worst_ratio"].items()))
        note = ""
        if r["out_of_time"]:
            note = f"  (out of time after {r['cases_run']} of {a.cases})"
        if r["aborted"]:
            note += f"  ABORTED: {r['aborted']}"
        print(f"{r['stream']:<18} {r['cases_run']:>5} cases ({r['refused']} refused), "
              f"{len(r['failures'])} failed, {r.get('elapsed_s', 0):.1f} s; worst ratio: "
              f"{worst or '-'}{note}")
    for f in s["failures"][:20]:
        c = f["config"]
        print(f"FAILED {c['backend']}/{c['dtype']} #{c['index']} {c['kind']}: {f['error']}\n"
              f"       {json.dumps(c, sort_keys=True)}")
    print(f"sweep: {sum(s['cases_run'].values())} cases in {s['elapsed_s']:.1f} s, "
          f"{len(s['failures'])} failed{', out of time' if s['out_of_time'] else ''}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(s, indent=1, sort_keys=True) + "\n")
    return 1 if s["failures"] or s["aborted"] else 0


if __name__ == "__main__":
    sys.exit(main())
