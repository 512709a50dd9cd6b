"""Cases, inputs, runs and tolerances of the shared GPU correctness suite.

A ``Case`` is one op kind on one geometry and dtype. Its inputs are fresh random values
(seeded by the case id so a failure reproduces), made once per case and shared by every
backend under test, together with two reference results computed on the CPU by the
reference backend: one in float64 on float64 copies of the inputs (the truth), one in the
case's own dtype (the yardstick). A GPU backend passes when, for every output,

    max |backend - truth| <= FACTOR * max |yardstick - truth| + FLOORS[dtype] * max(1, max |truth|)

with FACTOR 2 for forward outputs and 3 for gradients (the FlashAttention rule). float32
cases with ``tf32`` measure the yardstick in float16, whose 10-bit mantissa is TF32's.

Every backend output is poisoned with NaN before the run and must hold no NaN after it, and
empty causal slots must be exactly -inf (qk) or 0 (d_attn of av_backward). Inputs of the
unfused ops hold NaN at empty slots (attn, d_attn), which every backend must ignore. Some
fused cases draw q and k so that every score lies near -25 or +25 (``Case.scores``): very
negative or very positive log-sum-exps, where anything a kernel computes outside a window
and does not mask overflows.

``NATTEN_CUPY_GPU_QUICK=1`` keeps about one case in four.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib

import numpy

from natten_cupy import _args, _window, ops
from natten_cupy._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, accumulator_dtype
from natten_cupy.backends import get_backend

BACKENDS = ("naive", "tiled", "fused")
KINDS = ("fused", "fused_rpb", "fused_extra", "qk", "qk_rpb", "av", "qk_backward",
         "qk_backward_rpb", "av_backward")
STRIDED = ("fused", "fused_extra")   # kinds that take a stride (rpb and unfused ops: 1)
DTYPES = {"float64": FLOAT64, "float32": FLOAT32, "float16": FLOAT16, "bfloat16": BFLOAT16}

# Absolute floor per dtype, relative to the largest true value (or 1). float64 kernels carry
# a float64 softmax scale and accumulate in float64: they agree with the reference to ~1e-15.
FLOORS = {"float64": 1e-12, "float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
FACTOR = {"forward": 2.0, "gradient": 3.0}
GRADIENTS = ("dq", "dk", "dv", "d_rpb", "d_attn", "d_xk", "d_xv")

QUICK = bool(os.environ.get("NATTEN_CUPY_GPU_QUICK"))

# (spatial, kernel, stride, dilation, causal) per rank: odd extents, odd and even kernels,
# dilation, stride, every causal mix, and kernel == extent (plain self-attention).
GEOMETRIES = {
    1: [((13,), (5,), (1,), (1,), (False,)),
        ((17,), (4,), (2,), (2,), (True,)),
        ((15,), (3,), (3,), (3,), (False,)),
        ((11,), (6,), (5,), (1,), (True,)),
        ((9,), (9,), (1,), (1,), (False,))],
    2: [((7, 9), (3, 4), (1, 2), (1, 2), (False, True)),
        ((9, 11), (5, 5), (2, 1), (1, 1), (True, True)),
        ((10, 7), (4, 3), (4, 3), (2, 2), (False, False)),
        ((11, 6), (2, 6), (1, 1), (3, 1), (True, False)),
        ((5, 7), (5, 7), (1, 1), (1, 1), (False, False))],
    3: [((5, 6, 7), (3, 2, 4), (1, 2, 3), (1, 2, 1), (False, True, False)),
        ((7, 5, 6), (4, 3, 3), (1, 1, 1), (1, 1, 2), (True, True, True)),
        ((6, 7, 5), (2, 3, 5), (2, 3, 5), (3, 2, 1), (False, False, False)),
        ((5, 9, 5), (3, 4, 2), (3, 1, 2), (1, 2, 2), (True, False, True)),
        ((3, 5, 5), (3, 5, 5), (1, 1, 1), (1, 1, 1), (False, False, False))],
}
HEAD_DIMS = (32, 16, 64, 33, 8, 40)  # 33: not a multiple of 8 (naive only)
SCORE_STYLES = ("negative", "positive")   # Case.scores other than "normal"
SCORE_HEAD_DIMS = (32, 64, 40)


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    rank: int
    dtype: str
    spatial: tuple
    kernel: tuple
    stride: tuple
    dilation: tuple
    causal: tuple
    head_dim: int
    batch: int = 2
    heads: int = 3
    permuted: bool = False   # [B, H, *spatial, D] buffers viewed as [B, *spatial, H, D]
    tf32: bool = False
    kv_heads: int | None = None   # heads of k, v (grouped-query attention); None: heads
    v_dim: int | None = None      # head dim of v, out (fused cases); None: head_dim
    # fused_extra: additional tokens xk, xv [B, T, H_x, D] every query attends to
    extra_tokens: int = 5
    extra_heads: int | None = None   # None: heads
    deterministic: bool = False      # the fused ops' deterministic=True
    # fused cases: "normal" q, k; or every score near -25 ("negative": each lse too, so
    # whatever is computed outside a window from exp(-lse) overflows 16 bits unless masked)
    # or near +25 ("positive": exp(score) past float16's range before the max comes off)
    scores: str = "normal"

    @property
    def id(self):
        def axes(t):
            return "x".join(str(int(v)) for v in t)
        return (f"{self.kind}-{self.rank}d-{self.dtype}{'-tf32' if self.tf32 else ''}"
                f"-L{axes(self.spatial)}-k{axes(self.kernel)}-s{axes(self.stride)}"
                f"-d{axes(self.dilation)}-c{axes(self.causal)}-D{self.head_dim}"
                f"-B{self.batch}H{self.heads}"
                f"{'' if self.kv_heads is None else f'kv{self.kv_heads}'}"
                f"{'' if self.v_dim is None else f'-Dv{self.v_dim}'}"
                f"{f'-T{self.extra_tokens}x{self.h_x}' if self.extra else ''}"
                f"{'-perm' if self.permuted else ''}{'-det' if self.deterministic else ''}"
                f"{'' if self.scores == 'normal' else f'-scores{self.scores}'}")

    @property
    def dv(self):
        return self.head_dim if self.v_dim is None else self.v_dim

    @property
    def h_kv(self):
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def np_dtype(self):
        return DTYPES[self.dtype]

    @property
    def fused(self):
        return self.kind.startswith("fused")

    @property
    def rpb(self):
        return self.kind.endswith("_rpb")

    @property
    def extra(self):
        return self.kind == "fused_extra"

    @property
    def h_x(self):
        return self.heads if self.extra_heads is None else self.extra_heads

    @property
    def ops(self):
        """The ops (backends/__init__.OPS names) this case runs."""
        if self.fused:
            return ("fused_forward", "fused_backward")
        return (self.kind.replace("_rpb", ""),)


def make_cases():
    """The suite: every kind x rank x dtype, on rotating geometries and head dims."""
    cases = []
    n = 0
    for kind in KINDS:
        per = 3 if kind == "fused" else 2
        for rank in (1, 2, 3):
            geoms = GEOMETRIES[rank] if kind.startswith("fused") else GEOMETRIES[rank][:4]
            for di, dtype in enumerate(DTYPES):
                for j in range(per):
                    spatial, kernel, stride, dilation, causal = geoms[(di * per + j) % len(geoms)]
                    if kind not in STRIDED:   # unfused ops and rpb: stride 1
                        stride = (1,) * rank
                    cases.append(Case(kind, rank, dtype, spatial, kernel, stride, dilation,
                                      causal, HEAD_DIMS[n % len(HEAD_DIMS)],
                                      permuted=n % 3 == 1, **_extra_of(kind, n)))
                    n += 1
            # allow_tf32 on float32: the yardstick is float16 (same mantissa as TF32).
            spatial, kernel, stride, dilation, causal = geoms[rank % len(geoms)]
            if kind not in STRIDED:
                stride = (1,) * rank
            cases.append(Case(kind, rank, "float32", spatial, kernel, stride, dilation, causal,
                              32, tf32=True, **_extra_of(kind, rank)))
            if kind == "fused":   # scores far from zero, every dtype, both signs
                for di, dtype in enumerate(DTYPES):
                    for si, scores in enumerate(SCORE_STYLES):
                        geom = geoms[(2 * di + si + 1) % len(geoms)]
                        cases.append(Case(kind, rank, dtype, *geom,
                                          SCORE_HEAD_DIMS[(di + si) % len(SCORE_HEAD_DIMS)],
                                          permuted=si == 1, scores=scores))
    if QUICK:
        cases = cases[::4]
    return cases


# Additional tokens of the fused_extra cases: counts (one, a partial 16-key step, more than
# one 64-token dK/dV tile) and extra heads (as many as the queries', or one).
EXTRA_TOKENS = (1, 7, 40, 70)


def _extra_of(kind, n):
    if kind != "fused_extra":
        return {}
    return {"extra_tokens": EXTRA_TOKENS[n % len(EXTRA_TOKENS)],
            "extra_heads": None if n % 2 else 1}


# Grouped-query attention: (query heads, kv heads). 8/2 is GQA, 4/1 MQA, 6/3 two per group.
GQA_HEADS = ((8, 2), (4, 1), (6, 3))


def gqa_cases():
    """GQA/MQA cases: every kind x rank x dtype once, rotating geometries, head dims, head
    splits (GQA_HEADS) and permuted layouts; float32 also with TF32 once per rank. Batch 1
    keeps the emulator's runs short (8 heads)."""
    cases = []
    n = 0
    for kind in KINDS:
        for rank in (1, 2, 3):
            geoms = GEOMETRIES[rank] if kind.startswith("fused") else GEOMETRIES[rank][:4]
            for di, dtype in enumerate(list(DTYPES) + ["float32"]):
                spatial, kernel, stride, dilation, causal = geoms[(n + di) % len(geoms)]
                if kind not in STRIDED:
                    stride = (1,) * rank
                heads, kv_heads = GQA_HEADS[n % len(GQA_HEADS)]
                tf32 = di == len(DTYPES)
                more = _extra_of(kind, n)
                if more:   # extra heads: the kv heads' count, or one
                    more["extra_heads"] = kv_heads if n % 2 else 1
                cases.append(Case(kind, rank, dtype, spatial, kernel, stride, dilation, causal,
                                  32 if tf32 else HEAD_DIMS[n % len(HEAD_DIMS)], batch=1,
                                  heads=heads, kv_heads=kv_heads, permuted=n % 3 == 1,
                                  tf32=tf32, **more))
                n += 1
    if QUICK:
        cases = cases[::4]
    return cases


# (head dim, value head dim) of the Dv cases: smaller, larger, and odd.
DV_DIMS = ((32, 16), (16, 40), (64, 33), (8, 24))


def dv_cases():
    """Fused cases whose values have their own head dim Dv (every rank x dtype, half of them
    with GQA); the fused kernels refuse them (naive and reference run them)."""
    cases = []
    n = 0
    for rank in (1, 2, 3):
        for dtype in DTYPES:
            spatial, kernel, stride, dilation, causal = GEOMETRIES[rank][n % 5]
            d, dv = DV_DIMS[n % len(DV_DIMS)]
            heads, kv_heads = ((3, None), (4, 2))[n % 2]
            cases.append(Case("fused", rank, dtype, spatial, kernel, stride, dilation, causal,
                              d, batch=1, heads=heads, kv_heads=kv_heads, v_dim=dv,
                              permuted=n % 3 == 2))
            n += 1
    return cases


# ---- arrays -----------------------------------------------------------------------------

def _rng(case):
    return numpy.random.default_rng(zlib.crc32(case.id.encode()))


def empty_slots(case):
    """Boolean ``[*spatial, K]``: slots outside a (causal) window, by the window tables."""
    valid = None
    for L, k, s, d, c in zip(case.spatial, case.kernel, case.stride, case.dilation,
                             case.causal):
        _, v = _window.forward_table(L, k, s, d, c)  # [L, k]
        if valid is None:
            valid = v
        else:
            n = valid.ndim - 1
            valid = (valid[..., None, :, None] & v.reshape((1,) * n + (L, 1, k)))
            valid = valid.reshape(valid.shape[:-3] + (L, -1))
    return ~valid


def far_scores(rng, q_shape, k_shape, sign, noise):
    """float64 q, k ([..., H, D] and [..., H_kv, D]) with every score (scale 1 / sqrt(D)) near
    sign * 25: q near a, k near sign * a for one random vector a per kv head (|a|^2 / sqrt(D)
    about 25), plus ``noise`` times standard normal."""
    a = rng.standard_normal(k_shape[-2:]) * (25 / k_shape[-1] ** 0.5) ** 0.5
    q = numpy.repeat(a, q_shape[-2] // k_shape[-2], axis=0) + noise * rng.standard_normal(q_shape)
    k = sign * a + noise * rng.standard_normal(k_shape)
    return q, k


def make_inputs(case):
    """Low-precision inputs of the case (dict name -> NumPy array in the case's dtype)."""
    rng = _rng(case)
    dt = case.np_dtype
    full = (case.batch,) + case.spatial + (case.heads, case.head_dim)
    kv = (case.batch,) + case.spatial + (case.h_kv, case.head_dim)   # k, v: H_kv heads
    vf = kv[:-1] + (case.dv,)       # v of the fused ops: its own head dim Dv
    of = full[:-1] + (case.dv,)     # out, d_out
    weights = (case.batch,) + case.spatial + (case.heads, math.prod(case.kernel))

    def normal(shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(dt)

    def with_empty_nan(x):
        empty = empty_slots(case)[None, ..., None, :]
        return numpy.where(numpy.broadcast_to(empty, x.shape), numpy.array(numpy.nan, dt), x)

    x = {}
    if case.fused:
        x["q"], x["k"], x["v"], x["d_out"] = (normal(s) for s in (full, kv, vf, of))
        if case.scores != "normal":
            q, k = far_scores(rng, full, kv, -1.0 if case.scores == "negative" else 1.0, 0.5)
            x["q"], x["k"] = q.astype(dt), k.astype(dt)
    elif case.kind.startswith("qk_backward"):
        x["d_attn"] = with_empty_nan(normal(weights))
        x["q"], x["k"] = normal(full), normal(kv)
    elif case.kind.startswith("qk"):
        x["q"], x["k"] = normal(full), normal(kv)
    elif case.kind == "av":
        x["attn"] = with_empty_nan(normal(weights, 0.5))
        x["v"] = normal(kv)
    else:  # av_backward
        x["d_out"], x["v"] = normal(full), normal(kv)
        x["attn"] = with_empty_nan(normal(weights, 0.5))
    if case.rpb:
        x["rpb"] = normal((case.heads,) + tuple(2 * k - 1 for k in case.kernel))
    if case.extra:
        x["xk"] = normal((case.batch, case.extra_tokens, case.h_x, case.head_dim))
        x["xv"] = normal((case.batch, case.extra_tokens, case.h_x, case.dv))
    return x


def _head_major(shape, rank):
    """Axis order of a [B, H, *spatial(, last)] buffer viewed as [B, *spatial, H(, last)]."""
    tail = len(shape) - 2 - rank  # 1 with a last axis, 0 for lse
    order = (0,) + tuple(range(2, 2 + rank)) + (1,) + tuple(range(2 + rank, 2 + rank + tail))
    buffer_shape = (shape[0], shape[1 + rank]) + tuple(shape[1:1 + rank]) + tuple(
        shape[2 + rank:])
    return buffer_shape, order


def on_device(x, case):
    """A NumPy array as a CuPy array (head-major buffer, permuted view, when case.permuted)."""
    import cupy
    if case.permuted and x.ndim >= case.rank + 2 and x.shape[0] == case.batch:
        buffer_shape, order = _head_major(x.shape, case.rank)
        inverse = numpy.argsort(order)
        host = numpy.ascontiguousarray(x.transpose(inverse))
        assert host.shape == buffer_shape
        return upload(cupy, host).transpose(order)
    return upload(cupy, numpy.ascontiguousarray(x))


def inputs_on_device(x, case):
    """A case's NumPy inputs on the GPU (rpb as is; the additional tokens [B, T, H_x, D] from
    [B, H_x, T, D] buffers when case.permuted; the rest as ``on_device`` lays them out)."""
    import cupy

    def place(n, a):
        if n == "rpb":
            return upload(cupy, a)
        if n in ("xk", "xv"):
            if case.permuted:
                return upload(cupy, numpy.ascontiguousarray(a.transpose(0, 2, 1, 3))).transpose(
                    0, 2, 1, 3)
            return upload(cupy, a)
        return on_device(a, case)
    return {n: place(n, a) for n, a in x.items()}


def upload(cupy, host):
    """A NumPy array as a contiguous CuPy array of the same dtype.

    16-bit types travel as 16-bit integers, so bfloat16 needs no CuPy-side dtype support.
    """
    host = numpy.ascontiguousarray(host)
    if host.dtype.itemsize == 2:
        return cupy.asarray(host.view(numpy.uint16)).view(host.dtype)
    return cupy.asarray(host)


def to_host(x):
    """Any NumPy/CuPy array as a float64 NumPy array."""
    if isinstance(x, numpy.ndarray):
        return x.astype(numpy.float64)
    import cupy
    if x.dtype.itemsize == 2:
        dt = x.dtype
        return cupy.asnumpy(x.view(cupy.uint16)).view(dt).astype(numpy.float64)
    return cupy.asnumpy(x).astype(numpy.float64)


def poisoned(xp, shape, dtype, case):
    """An output filled with NaN (head-major permuted view on the GPU when case.permuted)."""
    host = numpy.full(shape, numpy.nan, dtype=dtype)
    if xp is numpy:
        return host
    return on_device(host, case)


# ---- runs -------------------------------------------------------------------------------

def problems(case, x, backend_name="reference"):
    """NAProblem per op of the case, built from arrays ``x`` (NumPy or CuPy)."""
    r, kw = case.rank, dict(allow_tf32=case.tf32)
    ks, dl, ca = case.kernel, case.dilation, case.causal
    if case.fused:
        fwd = _args.check_fused(r, x["q"], x["k"], x["v"], ks, case.stride, dl, ca, None,
                                backend_name, rpb=x.get("rpb"), additional_keys=x.get("xk"),
                                additional_values=x.get("xv"),
                                deterministic=case.deterministic, **kw)
        # The backward problem has the forward's geometry; out and lse do not exist yet.
        return {"fused_forward": fwd, "fused_backward": fwd}
    if case.kind.startswith("qk_backward"):
        return {"qk_backward": _args.check_qk_backward(r, x["d_attn"], x["q"], x["k"], ks, dl,
                                                       ca, x.get("rpb"), backend_name, **kw)}
    if case.kind.startswith("qk"):
        return {"qk": _args.check_qk(r, x["q"], x["k"], ks, dl, ca, x.get("rpb"), backend_name,
                                     **kw)}
    if case.kind == "av":
        return {"av": _args.check_av(r, x["attn"], x["v"], ks, dl, ca, backend_name, **kw)}
    return {"av_backward": _args.check_av_backward(r, x["d_out"], x["attn"], x["v"], ks, dl,
                                                   ca, backend_name, **kw)}


def refusal(case, backend):
    """Why ``backend`` (a module or None) cannot run the case, or None."""
    if backend is None:
        return "backend not available in this install"
    shaped = make_inputs(case)
    for op, problem in problems(case, shaped, backend.NAME).items():
        why = backend.refuse(op, problem)
        if why is not None:
            return f"{backend.NAME} refuses {op}: {why}"
    return None


def run(case, backend, x, xp):
    """Run the case's ops on ``backend`` with inputs ``x`` (arrays of module ``xp``).

    Outputs are NaN-poisoned before the run; returns the dict of outputs (arrays of ``xp``).
    """
    probs = problems(case, x, backend.NAME)
    dt = x["q"].dtype if "q" in x else x["v"].dtype
    acc = accumulator_dtype(dt)
    full = (case.batch,) + case.spatial + (case.heads, case.head_dim)
    kv = (case.batch,) + case.spatial + (case.h_kv, case.head_dim)
    rows = full[:-1]
    vf, of = kv[:-1] + (case.dv,), rows + (case.dv,)   # fused: v, dv and out, d_out
    weights = rows + (math.prod(case.kernel),)

    def out(shape, dtype=dt):
        return poisoned(xp, shape, dtype, case)

    y = {}
    if case.fused:
        y["out"], y["lse"] = out(of), out(rows, acc)
        extra = (x["xk"], x["xv"]) if case.extra else None
        ops.run_fused_forward(probs["fused_forward"], backend, x["q"], x["k"], x["v"],
                              y["out"], y["lse"], x.get("rpb"), extra)
        y["dq"], y["dk"], y["dv"] = out(full), out(kv), out(vf)
        if case.rpb:   # the bias gradient comes back in the bias's dtype
            y["d_rpb"] = xp.full(x["rpb"].shape, numpy.nan, dtype=dt)
        d_extra = None
        if case.extra:
            y["d_xk"] = xp.full(x["xk"].shape, numpy.nan, dtype=dt)
            y["d_xv"] = xp.full(x["xv"].shape, numpy.nan, dtype=dt)
            d_extra = (y["d_xk"], y["d_xv"])
        ops.run_fused_backward(probs["fused_backward"], backend, x["d_out"], x["q"], x["k"],
                               x["v"], y["out"], y["lse"], y["dq"], y["dk"], y["dv"],
                               x.get("rpb"), y.get("d_rpb"), extra, d_extra)
    elif case.kind.startswith("qk_backward"):
        y["dq"], y["dk"] = out(full), out(kv)
        y["d_rpb"] = None
        if case.rpb:
            y["d_rpb"] = xp.full(x["rpb"].shape, numpy.nan, dtype=acc)
        ops.run_qk_backward(probs["qk_backward"], backend, x["d_attn"], x["q"], x["k"], y["dq"],
                            y["dk"], y["d_rpb"])
        if y["d_rpb"] is None:
            del y["d_rpb"]
    elif case.kind.startswith("qk"):
        y["attn"] = out(weights)
        ops.run_qk(probs["qk"], backend, x["q"], x["k"], x.get("rpb"), y["attn"])
    elif case.kind == "av":
        y["out"] = out(full)
        ops.run_av(probs["av"], backend, x["attn"], x["v"], y["out"])
    else:
        y["d_attn"], y["dv"] = out(weights), out(kv)
        ops.run_av_backward(probs["av_backward"], backend, x["d_out"], x["attn"], x["v"],
                            y["d_attn"], y["dv"])
    return y


def assert_runs_repeat(case, backend_name, runs=3):
    """``runs`` runs of the case on a GPU backend give the same bits in every output."""
    import cupy
    mod = get_backend(backend_name)
    x, _, _ = references(case)
    xd = inputs_on_device(x, case)
    results = [run(case, mod, xd, cupy) for _ in range(runs)]
    cupy.cuda.get_current_stream().synchronize()
    for other in results[1:]:
        for name, got in other.items():
            bits = f"u{got.dtype.itemsize}"
            assert bool((got.view(bits) == results[0][name].view(bits)).all()), name


_references = {}


def references(case):
    """(inputs, truth, yardstick) of the case, computed once and shared by every backend."""
    if case not in _references:
        ref = get_backend("reference")
        x = make_inputs(case)
        x64 = {n: a.astype(numpy.float64) for n, a in x.items()}
        truth = {n: to_host(a) for n, a in run(case, ref, x64, numpy).items()}
        low = x
        if case.tf32:
            low = {n: a.astype(numpy.float16) for n, a in x.items()}
        yard = {n: to_host(a) for n, a in run(case, ref, low, numpy).items()}
        _references[case] = (x, truth, yard)
    return _references[case]


# ---- checks -----------------------------------------------------------------------------

def error_bound(case, name, truth, yard):
    kind = "gradient" if name in GRADIENTS else "forward"
    finite = numpy.isfinite(truth)
    ref_err = float(numpy.abs(yard[finite] - truth[finite]).max(initial=0.0))
    scale = max(1.0, float(numpy.abs(truth[finite]).max(initial=0.0)))
    return FACTOR[kind] * ref_err + FLOORS[case.dtype] * scale, ref_err


def compare(case, got, truth, yard, where=""):
    """Assert every output of ``got`` (float64 NumPy) against truth within the bound."""
    empty = None if case.fused else empty_slots(case)[None, ..., None, :]
    for name, t in truth.items():
        g = got[name]
        assert g.shape == t.shape, f"{where}{name}: shape {g.shape} != {t.shape}"
        assert not numpy.isnan(g).any(), (
            f"{where}{name}: {int(numpy.isnan(g).sum())} of {g.size} elements left unwritten "
            f"(NaN), first at {numpy.argwhere(numpy.isnan(g))[0].tolist()}")
        if name == "attn":
            e = numpy.broadcast_to(empty, g.shape)
            assert (g[e] == -numpy.inf).all(), f"{where}attn: empty causal slots must be -inf"
            assert numpy.isfinite(g[~e]).all(), f"{where}attn: non-finite weight in a window"
        if name == "d_attn" and case.kind == "av_backward":
            e = numpy.broadcast_to(empty, g.shape)
            assert (g[e] == 0).all(), f"{where}d_attn: empty causal slots must be 0"
        bound, ref_err = error_bound(case, name, t, yard[name])
        finite = numpy.isfinite(t)
        err = float(numpy.abs(g[finite] - t[finite]).max(initial=0.0))
        if err > bound:
            worst = numpy.unravel_index(numpy.argmax(numpy.where(finite, numpy.abs(g - t), 0)),
                                        g.shape)
            raise AssertionError(
                f"{where}{name}: max error {err:.3g} > bound {bound:.3g} (reference "
                f"{case.dtype}{'/fp16' if case.tf32 else ''} error {ref_err:.3g}); worst at "
                f"{list(worst)}: got {g[worst]!r}, expected {t[worst]!r}")


def expected_refusal(case, backend_name):
    """What ``backend_name`` must say of ``case``, from the SPEC's backend table alone: None
    if it must run it, else a fragment of the message its refusal must hold. Written apart
    from the backends' own ``refuse`` so that a backend that wrongly starts refusing a
    supported case fails the suite instead of skipping it."""
    tensor_cores = case.dtype in ("float16", "bfloat16") or (case.dtype == "float32"
                                                              and case.tf32)
    if backend_name == "naive":
        return None
    if backend_name == "tiled":
        if case.fused:
            return "runs only the unfused ops"
        if case.dtype == "float64":
            return "dtype float64 is not supported"
        if case.head_dim % 8 or case.head_dim > 256:
            return "is not a multiple of 8"
        return None
    if backend_name == "fused":
        if not case.fused:
            return "runs only the fused ops"
        if case.dtype == "float64":
            return "dtype float64 is not supported"
        if case.dv != case.head_dim:
            return "need the value head dim equal to the query/key head dim"
        if case.rpb and case.dtype == "float32" and not case.tf32:
            return "exact-float32 kernels take no relative positional bias"
        if tensor_cores and (case.head_dim % 8 or case.head_dim > 256):
            return "multiple of 8"
        if not tensor_cores and (case.head_dim % 4 or case.head_dim > 256):
            return "multiple of 4"
        return None
    raise ValueError(f"no capability entry for backend {backend_name!r}")


def check_backend(case, backend_name):
    """Run ``case`` on a GPU backend and compare. A case the backend must run (by
    ``expected_refusal``) fails if it is refused; one it must refuse fails unless the refusal
    names the expected reason. Returns None (ran) or the expected refusal's text."""
    import cupy
    backend = get_backend(backend_name)
    if backend is None:
        raise AssertionError(f"backend {backend_name} is not available in this install")
    why = refusal(case, backend)
    expected = expected_refusal(case, backend_name)
    if expected is None and why is not None:
        raise AssertionError(f"{backend_name} must run {case.id} but refuses it: {why}")
    if expected is not None:
        if why is None or expected not in why:
            raise AssertionError(f"{backend_name} should refuse {case.id} with a message "
                                 f"holding {expected!r}, got {why!r}")
        return why
    x, truth, yard = references(case)
    xd = inputs_on_device(x, case)
    y = run(case, backend, xd, cupy)
    cupy.cuda.get_current_stream().synchronize()
    compare(case, {n: to_host(a) for n, a in y.items()}, truth, yard,
            where=f"[{backend_name} {case.id}] ")
    return None
