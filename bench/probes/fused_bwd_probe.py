"""Device probe of the fused backward: correctness on small configs, then W2/W3 timings.

Run on the GPU machine: ``python3 bench/probes/fused_bwd_probe.py`` (or
``... --time LABEL [--no-fwd]`` for the W2/W3 fp16 timings alone, ``--no-fwd`` leaving the
forward out, e.g. while the forward kernel is being edited in the tree). Correctness is
checked against a dense float64 NumPy computation written straight from SPEC section 1 (mask
per axis, outer product over axes), on fresh random inputs with NaN-poisoned gradients.
Timings are medians of CUDA-event timed runs after warm-up; the last lines are a short table.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy

import cupy

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # the repository (natten_cupy), bench/

from natten_cupy import _args  # noqa: E402
from natten_cupy._dtypes import BFLOAT16, FLOAT16, FLOAT32  # noqa: E402
from natten_cupy._launch import add_recorder, remove_recorder  # noqa: E402
from natten_cupy.backends import _fused_bwd  # noqa: E402


def axis_mask(L, k, s, d, causal):
    """[L, L] bool: query i sees key j (SPEC section 1, full-axis coordinates)."""
    m = numpy.zeros((L, L), bool)
    for i in range(L):
        g, ig = i % d, i // d
        lg = -(-(L - g) // d)
        if causal:
            lead = min((ig // s) * s + s - 1, lg - 1)
            a, e = max(lead - k + 1, 0), ig + 1
        else:
            lead = min((ig // s) * s + s // 2, lg - 1)
            a = min(max(lead - k // 2, 0), lg - k)
            e = a + k
        for jg in range(a, e):
            m[i, g + d * jg] = True
    return m


def dense_mask(spatial, ks, st, dl, ca):
    m = numpy.ones((1, 1), bool)
    for a in range(len(spatial)):
        m = numpy.kron(m, axis_mask(spatial[a], ks[a], st[a], dl[a], ca[a]))
    return m


def reference(q, k, v, d_o, mask, scale):
    """float64 forward (out, lse) and backward (dq, dk, dv); arrays [B, N, H, D]."""
    s = numpy.einsum("bnhd,bmhd->bhnm", q, k) * scale
    s = numpy.where(mask[None, None], s, -numpy.inf)
    lse = numpy.log(numpy.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = numpy.exp(s - lse[..., None])
    out = numpy.einsum("bhnm,bmhd->bnhd", p, v)
    dp = numpy.einsum("bnhd,bmhd->bhnm", d_o, v)
    delta = numpy.einsum("bnhd,bnhd->bhn", d_o, out)
    ds = p * (dp - delta[..., None])
    dq = numpy.einsum("bhnm,bmhd->bnhd", ds, k) * scale
    dk = numpy.einsum("bhnm,bnhd->bmhd", ds, q) * scale
    dv = numpy.einsum("bhnm,bnhd->bmhd", p, d_o)
    return out, lse.transpose(0, 2, 1), dq, dk, dv


# (rank, spatial, kernel, stride, dilation, causal, heads, head_dim, dtype, permuted input)
CONFIGS = [
    (1, (37,), (5,), (1,), (1,), (False,), 2, 32, FLOAT16, False),
    (1, (50,), (8,), (3,), (2,), (True,), 1, 64, BFLOAT16, False),
    (1, (300,), (129,), (1,), (1,), (False,), 1, 256, FLOAT16, False),
    (2, (13, 11), (3, 4), (1, 2), (2, 1), (False, True), 2, 40, FLOAT16, True),
    (2, (20, 20), (7, 7), (1, 1), (1, 1), (False, False), 1, 128, BFLOAT16, False),
    (2, (24, 24), (9, 9), (1, 1), (1, 1), (False, False), 2, 32, FLOAT16, False),
    (2, (16, 16), (16, 16), (1, 1), (1, 1), (False, False), 1, 64, FLOAT16, False),
    (2, (21, 19), (5, 6), (5, 3), (2, 3), (True, True), 1, 72, BFLOAT16, False),
    (3, (5, 9, 7), (3, 3, 5), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 72, FLOAT16, True),
    (3, (6, 12, 12), (3, 5, 5), (1, 1, 1), (1, 1, 1), (False, False, False), 2, 32, BFLOAT16,
     False),
    (2, (17, 15), (5, 4), (2, 1), (1, 2), (True, False), 2, 64, FLOAT16, "strided_last"),
    (2, (24, 24), (9, 9), (1, 1), (1, 1), (False, False), 2, 32, FLOAT32, False),
    (1, (97,), (7,), (1,), (2,), (True,), 2, 64, FLOAT32, True),
    (3, (5, 9, 7), (3, 3, 5), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 128, FLOAT32, False),
    (2, (21, 19), (5, 6), (5, 3), (2, 3), (True, True), 1, 200, FLOAT32, False),
]


# 16-bit tensors live on the device as uint16 storage (the kernels only see pointers), so
# bfloat16 needs no CuPy support; NaN_BITS is a quiet NaN in both float16 and bfloat16.
# float32 runs as TF32.
NAN_BITS = 0x7FC0


def make_problem(rank, shape, ks, st, dl, ca, dtype, scale=None):
    return _args.NAProblem(
        rank=rank, batch=shape[0], spatial=tuple(shape[1:1 + rank]), heads=shape[1 + rank],
        head_dim=shape[2 + rank], kernel_size=tuple(ks), stride=tuple(st), dilation=tuple(dl),
        is_causal=tuple(ca), scale=shape[2 + rank] ** -0.5 if scale is None else scale,
        dtype=numpy.dtype(dtype), allow_tf32=numpy.dtype(dtype) == FLOAT32)


def to_dev(x, dtype, permuted):
    """Device copy of x [B, *sp, H, D]; permuted: stored [B, H, *sp, D] and viewed back."""
    x = x.astype(dtype)
    bits = x if numpy.dtype(dtype) == FLOAT32 else x.view(numpy.uint16)
    if not permuted:
        return cupy.asarray(bits)
    if permuted == "strided_last":  # last dim not contiguous: the launcher copies
        return cupy.asarray(numpy.stack([bits, bits], axis=-1))[..., 0]
    nd = x.ndim
    perm = (0, nd - 2) + tuple(range(1, nd - 2)) + (nd - 1,)
    inv = numpy.argsort(perm)
    stored = cupy.ascontiguousarray(cupy.asarray(bits).transpose(perm))
    return stored.transpose(tuple(int(i) for i in inv))


def from_dev(x, dtype):
    return cupy.asnumpy(x).view(dtype).astype(numpy.float64)


def all_finite(x, dtype):
    if x.dtype == cupy.float32:
        return bool(cupy.isfinite(x).all())
    expo = 0x7C00 if numpy.dtype(dtype) == FLOAT16 else 0x7F80
    return bool(((x & expo) != expo).all())


def poisoned(shape, storage):
    if storage == cupy.float32:
        return cupy.full(shape, cupy.nan, dtype=cupy.float32)
    return cupy.full(shape, NAN_BITS, dtype=cupy.uint16)


def run_backward(problem, q, k, v, o, lse, d_o):
    grads = [poisoned(q.shape, q.dtype) for _ in range(3)]
    _fused_bwd.backward(problem, q, k, v, o, lse, d_o, *grads)
    return grads


def check(cfg, rng):
    rank, sp, ks, st, dl, ca, H, D, dt, perm = cfg
    B = 2
    shape = (B,) + sp + (H, D)
    q, k, v, d_o = (rng.standard_normal(shape).astype(dt).astype(numpy.float64)
                    for _ in range(4))
    N = math.prod(sp)
    flat = lambda x: x.reshape(B, N, H, D)
    scale = D ** -0.5
    mask = dense_mask(sp, ks, st, dl, ca)
    out, lse, dq, dk, dv = reference(flat(q), flat(k), flat(v), flat(d_o), mask, scale)
    qd, kd, vd, dod = (to_dev(x, dt, perm) for x in (q, k, v, d_o))
    od = to_dev(out.reshape(shape), dt, perm)
    lsed = cupy.asarray(lse.reshape(shape[:-1]).astype(numpy.float32))
    problem = make_problem(rank, shape, ks, st, dl, ca, dt)
    assert _fused_bwd.refuse(problem) is None, _fused_bwd.refuse(problem)
    got = run_backward(problem, qd, kd, vd, od, lsed, dod)
    again = run_backward(problem, qd, kd, vd, od, lsed, dod)
    same = all(bool((a == b).all()) for a, b in zip(got, again))
    errs = []
    for g, ref in zip(got, (dq, dk, dv)):
        g = from_dev(g, dt).reshape(ref.shape)
        if not numpy.isfinite(g).all():
            errs.append(float("nan"))
            continue
        errs.append(float(numpy.abs(g - ref).max() / max(numpy.abs(ref).max(), 1e-30)))
    return errs, same


class Recorder:
    def __init__(self):
        self.events = []

    def record(self, name, start, stop, **_):
        self.events.append((name, start, stop))


def bench(name, spatial, ks, H, D, dt, reps=10, fwd=True):
    rank = len(spatial)
    shape = (1,) + spatial + (H, D)
    rs = cupy.random.default_rng(0)

    def rand16():
        x = rs.standard_normal(shape, dtype=cupy.float32)
        if numpy.dtype(dt) == FLOAT32:
            return x
        if numpy.dtype(dt) == FLOAT16:
            return x.astype(cupy.float16).view(cupy.uint16)
        return (x.view(cupy.uint32) >> 16).astype(cupy.uint16)

    q, k, v, o, d_o = (rand16() for _ in range(5))
    lse = (rs.standard_normal(shape[:-1], dtype=cupy.float32) * 0.1
           + math.log(math.prod(ks))).astype(cupy.float32)
    problem = make_problem(rank, shape, ks, (1,) * rank, (1,) * rank, (False,) * rank, dt)
    fwd_ms = float("nan")
    try:  # the forward helper's kernel, when present: real out/lse, and its time
        from natten_cupy.backends import _fused_fwd
        if fwd and _fused_fwd.refuse(problem) is None:
            view = (lambda x: x) if numpy.dtype(dt) == FLOAT32 else (lambda x: x.view(dt))
            for i in range(4):
                a, b = cupy.cuda.Event(), cupy.cuda.Event()
                a.record()
                _fused_fwd.forward(problem, view(q), view(k), view(v), view(o), lse)
                b.record()
                b.synchronize()
                fwd_ms = cupy.cuda.get_elapsed_time(a, b)
    except Exception as e:
        first = str(e).strip().splitlines()[:1] or [""]  # one line: tables stay readable
        print(f"  ({name}: forward not timed: {type(e).__name__}: {first[0][:200]})")
    grads = [cupy.empty_like(q) for _ in range(3)]
    t0 = time.perf_counter()
    _fused_bwd.backward(problem, q, k, v, o, lse, d_o, *grads)
    cupy.cuda.runtime.deviceSynchronize()
    first = time.perf_counter() - t0
    for _ in range(2):
        _fused_bwd.backward(problem, q, k, v, o, lse, d_o, *grads)
    times = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        _fused_bwd.backward(problem, q, k, v, o, lse, d_o, *grads)
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    rec = Recorder()
    add_recorder(rec)
    _fused_bwd.backward(problem, q, k, v, o, lse, d_o, *grads)
    remove_recorder(rec)
    cupy.cuda.runtime.deviceSynchronize()
    split = {n: cupy.cuda.get_elapsed_time(a, b) for n, a, b in rec.events}
    ms = float(numpy.median(times))
    flops = 2.5 * problem.flops_forward()
    finite = all(all_finite(g, dt) for g in grads)
    return name, ms, flops / ms / 1e9, first, split, finite, fwd_ms


TIMED = (("W2 fp16", (1024, 1024), (9, 9), 8, 32, FLOAT16),
         ("W3 fp16", (16, 256, 256), (3, 5, 5), 8, 32, FLOAT16))


def time_only(label, reps=20, fwd=True):
    """``--time LABEL``: W2/W3 fp16 timings only, one table row per workload, tagged LABEL
    (run once per source tree through PYTHONPATH to compare versions in one device call)."""
    for spec in TIMED:
        name, ms, tf, _, split, finite, fwd_ms = bench(*spec, reps=reps, fwd=fwd)
        parts = " / ".join(f"{split.get(n, 0):.3f}" for n in
                           ("na_bwd_delta", "na_bwd_fused_kv", "na_bwd_fused_q"))
        print(f"| {label} | {name} | {ms:.3f} | {tf:.1f} | {parts} | {fwd_ms:.3f} | "
              f"{fwd_ms + ms:.3f} | {finite} |", flush=True)
    return 0


def main():
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--time":
        return time_only(sys.argv[2], fwd=sys.argv[3:] != ["--no-fwd"])
    rng = numpy.random.default_rng(int(time.time()))
    ok = True
    print("correctness (max |err| / max |ref|, float64 dense reference):", flush=True)
    worst = {}
    for cfg in CONFIGS:
        try:
            errs, same = check(cfg, rng)
        except Exception as e:  # report and go on: one device call must say everything
            print(f"  {cfg[:8]} {cfg[8].name}: FAILED {type(e).__name__}: {e}", flush=True)
            ok = False
            continue
        lim = 4e-2 if cfg[8] == BFLOAT16 else 1e-2
        good = all(e <= lim for e in errs) and same
        ok &= good
        key = cfg[8].name
        worst[key] = max(worst.get(key, 0), *errs)
        print(f"  {'ok ' if good else 'BAD'} rank{cfg[0]} {cfg[1]} k{cfg[2]} s{cfg[3]} d{cfg[4]} "
              f"c{cfg[5]} D{cfg[7]} {key}{' perm' if cfg[9] else ''}: dq {errs[0]:.2e} "
              f"dk {errs[1]:.2e} dv {errs[2]:.2e} bitwise-repeat {same}", flush=True)
    rows = []
    for spec in (("W2 fp16", (1024, 1024), (9, 9), 8, 32, FLOAT16),
                 ("W2 bf16", (1024, 1024), (9, 9), 8, 32, BFLOAT16),
                 ("W3 fp16", (16, 256, 256), (3, 5, 5), 8, 32, FLOAT16),
                 ("W3b fp16", (8, 128, 128), (5, 7, 7), 8, 32, FLOAT16),
                 ("W2b fp16", (256, 256), (13, 13), 4, 128, FLOAT16),
                 ("W1 fp16", (32768,), (2047,), 16, 64, FLOAT16),
                 ("W2 tf32", (1024, 1024), (9, 9), 8, 32, FLOAT32)):
        try:
            rows.append(bench(*spec))
        except Exception as e:
            print(f"  {spec[0]}: FAILED {type(e).__name__}: {e}", flush=True)
    print("\n| workload | bwd ms | TFLOP/s | delta / kv / q ms | fwd ms (other helper) | finite |")
    print("|---|---|---|---|---|---|")
    for name, ms, tf, first, split, finite, fwd_ms in rows:
        parts = " / ".join(f"{split.get(n, 0):.3f}" for n in
                           ("na_bwd_delta", "na_bwd_fused_kv", "na_bwd_fused_q"))
        print(f"| {name} | {ms:.3f} | {tf:.1f} | {parts} | {fwd_ms:.3f} | {finite} |")
    print("max rel err per dtype:", {k: f"{v:.2e}" for k, v in worst.items()})
    print("\ntile variants (checked on one small config, then timed):")
    variants = (
        (3, ((2, 4, 8), (1, 4, 4)), ("W3 fp16", (16, 256, 256), (3, 5, 5), 8, 32, FLOAT16),
         (3, (6, 13, 12), (3, 5, 5), (1, 2, 1), (1, 1, 2), (True, False, False), 1, 32, FLOAT16,
          False)),
        (2, ((16, 4, 1), (4, 4, 1)), ("W2 fp16", (1024, 1024), (9, 9), 8, 32, FLOAT16),
         (2, (37, 21), (9, 5), (1, 2), (1, 2), (False, True), 1, 32, FLOAT16, False)),
        (2, ((4, 16, 1), (4, 4, 1)), ("W2 fp16", (1024, 1024), (9, 9), 8, 32, FLOAT16),
         (2, (37, 21), (9, 5), (1, 2), (1, 2), (False, True), 1, 32, FLOAT16, False)))
    for rank, tiles, spec, cfg in variants:
        saved = _fused_bwd.TILES[rank]
        _fused_bwd.TILES[rank] = tiles
        try:
            errs, same = check(cfg, rng)
            name, ms, tf, _, split, finite, _ = bench(*spec)
            print(f"  {name} tile {tiles}: {ms:.3f} ms {tf:.1f} TFLOP/s kv/q "
                  f"{split.get('na_bwd_fused_kv', 0):.3f}/{split.get('na_bwd_fused_q', 0):.3f} "
                  f"check errs {max(errs):.2e} repeat {same}")
        except Exception as e:
            print(f"  {spec[0]} tile {tiles}: FAILED {type(e).__name__}: {e}")
        finally:
            _fused_bwd.TILES[rank] = saved
    print("ALL CORRECT" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
