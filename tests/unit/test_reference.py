"""The reference backend against the float64 oracle, finite differences and itself.

Every call goes through the public API (``natten_cupy.na{n}d*``) with NumPy arrays, which
always run on the reference backend.

Tolerances. float64: rtol 1e-10 (only rounding order differs). Low precision: inputs are
rounded to the dtype first and the oracle runs on the rounded values in float64, so the
error is the float32 compute plus the rounding of the result to the dtype: we allow
``rtol = 2 eps`` and ``atol = 4 eps * max|oracle|`` for outputs (``8 eps`` for gradients,
which also see the rounded ``out`` through ``delta``), with eps 2^-11 (float16), 2^-8
(bfloat16) and 2^-24 (float32, plus an absolute floor for float32 accumulation: 2e-6 for
outputs, 2e-5 for gradients); lse stays float32 and is checked at 1e-5. Observed errors use
at most about a third of these bounds.
"""

import math

import ml_dtypes
import numpy
import pytest

import natten_cupy
from natten_cupy.backends import reference

import oracle

BF16 = numpy.dtype(ml_dtypes.bfloat16)
EPS = {numpy.dtype(numpy.float32): 2.0 ** -24, numpy.dtype(numpy.float16): 2.0 ** -11,
       BF16: 2.0 ** -8}


def call(rank, suffix=""):
    return getattr(natten_cupy, f"na{rank}d{suffix}")


# ---- random problems -------------------------------------------------------------------

def make_case(rng, rank, unfused=False, max_tokens=150):
    """One random geometry: mostly odd extents, odd and even kernels, stride, dilation,
    causal per axis; total tokens at most ``max_tokens``."""
    while True:
        kernel, dilation, stride, spatial, causal = [], [], [], [], []
        for _ in range(rank):
            k = int(rng.integers(2, 6 if rank < 3 else 4))
            d = int(rng.integers(1, 4 if rank == 1 else 3))
            L = k * d + int(rng.integers(0, 6 if rank < 3 else 3))
            if L % 2 == 0 and rng.random() < 0.7:
                L += 1
            kernel.append(k)
            dilation.append(d)
            stride.append(1 if unfused else int(rng.integers(1, k + 1)))
            spatial.append(L)
            causal.append(bool(rng.random() < 0.35))
        if math.prod(spatial) <= max_tokens:
            break
    return dict(spatial=tuple(spatial), kernel=tuple(kernel), stride=tuple(stride),
                dilation=tuple(dilation), causal=tuple(causal),
                B=int(rng.integers(1, 3)), H=int(rng.integers(1, 4)),
                D=int(rng.choice([1, 3, 5, 8, 13])))


def make_cases(seed, count, unfused=False):
    rng = numpy.random.default_rng(seed)
    return [make_case(rng, 1 + i % 3, unfused) for i in range(count)]


FUSED_CASES = make_cases(11, 180)
UNFUSED_CASES = make_cases(12, 150, unfused=True)
LOWP_CASES = make_cases(13, 24)


def case_id(c):
    return (f"{c['spatial']}k{c['kernel']}s{c['stride']}d{c['dilation']}"
            f"c{''.join('T' if x else 'F' for x in c['causal'])}").replace(" ", "")


def tensors(rng, c, count, dtype=numpy.float64, scale=1.0):
    shape = (c["B"],) + c["spatial"] + (c["H"], c["D"])
    return [(scale * rng.standard_normal(shape)).astype(dtype) for _ in range(count)]


def fused_kw(c):
    return dict(stride=c["stride"], dilation=c["dilation"], is_causal=c["causal"])


def unfused_kw(c):
    return dict(dilation=c["dilation"], is_causal=c["causal"])


def oracle_fused(c):
    return (c["kernel"], c["stride"], c["dilation"], c["causal"])


def oracle_unfused(c):
    return (c["kernel"], c["dilation"], c["causal"])


def rpb_shape(c):
    return (c["H"],) + tuple(2 * k - 1 for k in c["kernel"])


def close(got, want, rtol=1e-10, atol=1e-12, atol_rel=0.0):
    got = numpy.asarray(got, dtype=numpy.float64)
    want = numpy.asarray(want, dtype=numpy.float64)
    assert got.shape == want.shape
    floor = atol + atol_rel * float(numpy.abs(want).max(initial=0.0))
    numpy.testing.assert_allclose(got, want, rtol=rtol, atol=floor)


def close_logits(got, want, **tol):
    """Logits with -inf at empty causal slots: same -inf pattern, finite parts close."""
    got = numpy.asarray(got, dtype=numpy.float64)
    empty = numpy.isneginf(want)
    assert (numpy.isneginf(got) == empty).all()
    close(numpy.where(empty, 0, got), numpy.where(empty, 0, want), **tol)


# ---- float64 against the oracle ---------------------------------------------------------

def test_cases_cover_the_options():
    for cases in (FUSED_CASES, UNFUSED_CASES):
        ks = [k for c in cases for k in c["kernel"]]
        assert {k % 2 for k in ks} == {0, 1}
        assert any(any(c["causal"]) and not all(c["causal"]) for c in cases)
        assert any(max(c["dilation"]) > 1 for c in cases)
        assert any(c["B"] == 2 for c in cases) and any(c["H"] == 3 for c in cases)
    assert any(max(c["stride"]) > 1 for c in FUSED_CASES)
    assert any(s == k for c in FUSED_CASES for s, k in zip(c["stride"], c["kernel"]))


@pytest.mark.parametrize("c", FUSED_CASES, ids=case_id)
def test_fused_float64(c, rng):
    n = len(c["spatial"])
    q, k, v, d_out = tensors(rng, c, 4)
    scale = float(rng.uniform(0.2, 1.5))
    out, lse = call(n)(q, k, v, c["kernel"], scale=scale, return_lse=True, **fused_kw(c))
    want_out, want_lse = oracle.fused_forward(q, k, v, *oracle_fused(c), scale=scale)
    assert out.dtype == lse.dtype == numpy.float64
    close(out, want_out)
    close(lse, want_lse)
    grads = call(n, "_backward")(d_out, q, k, v, out, lse, c["kernel"], scale=scale,
                                 **fused_kw(c))
    want = oracle.fused_backward(d_out, q, k, v, *oracle_fused(c), scale=scale)
    for g, w in zip(grads, want):
        close(g, w)


@pytest.mark.parametrize("c", UNFUSED_CASES, ids=case_id)
def test_unfused_float64(c, rng):
    n = len(c["spatial"])
    q, k, v, d_out = tensors(rng, c, 4)
    rpb = rng.standard_normal(rpb_shape(c))
    use_rpb = bool(rng.integers(2))
    attn = call(n, "_qk")(q, k, c["kernel"], rpb=rpb if use_rpb else None, **unfused_kw(c))
    want_attn = oracle.qk(q, k, *oracle_unfused(c), rpb=rpb if use_rpb else None)
    close_logits(attn, want_attn)

    # av sees softmax-like weights with junk (NaN) in the empty slots, which it must ignore.
    weights = rng.standard_normal(attn.shape)
    weights[numpy.isneginf(want_attn)] = numpy.nan
    close(call(n, "_av")(weights, v, c["kernel"], **unfused_kw(c)),
          oracle.av(weights, v, *oracle_unfused(c)))

    d_attn = rng.standard_normal(attn.shape)
    got = call(n, "_qk_backward")(d_attn, q, k, c["kernel"], rpb=rpb, **unfused_kw(c))
    want = oracle.qk_backward(d_attn, q, k, *oracle_unfused(c), with_rpb=True)
    assert len(got) == 3
    for g, w in zip(got, want):
        close(g, w)
    dq_dk = call(n, "_qk_backward")(d_attn, q, k, c["kernel"], **unfused_kw(c))
    assert len(dq_dk) == 2
    for g, w in zip(dq_dk, want):
        close(g, w)

    got = call(n, "_av_backward")(d_out, weights, v, c["kernel"], **unfused_kw(c))
    want = oracle.av_backward(d_out, weights, v, *oracle_unfused(c))
    for g, w in zip(got, want):
        close(g, w)
    assert (got[0][numpy.isneginf(want_attn)] == 0).all()


# ---- low precision ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16, BF16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("c", LOWP_CASES, ids=case_id)
def test_fused_low_precision(c, dtype, rng):
    n = len(c["spatial"])
    dtype = numpy.dtype(dtype)
    eps = EPS[dtype]
    floor = 2e-6 if dtype == numpy.float32 else 0.0
    q, k, v, d_out = tensors(rng, c, 4, dtype)
    out, lse = call(n)(q, k, v, c["kernel"], return_lse=True, **fused_kw(c))
    assert out.dtype == dtype and lse.dtype == numpy.float32
    want_out, want_lse = oracle.fused_forward(q, k, v, *oracle_fused(c))
    close(out, want_out, rtol=2 * eps, atol=floor, atol_rel=4 * eps)
    close(lse, want_lse, rtol=1e-5, atol=1e-5)
    grads = call(n, "_backward")(d_out, q, k, v, out, lse, c["kernel"], **fused_kw(c))
    want = oracle.fused_backward(d_out, q, k, v, *oracle_fused(c))
    for g, w in zip(grads, want):
        assert g.dtype == dtype
        close(g, w, rtol=2 * eps, atol=10 * floor, atol_rel=8 * eps)


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16, BF16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("c", UNFUSED_CASES[:24], ids=case_id)
def test_unfused_low_precision(c, dtype, rng):
    n = len(c["spatial"])
    dtype = numpy.dtype(dtype)
    eps = EPS[dtype]
    tol = dict(rtol=2 * eps, atol=2e-5 if dtype == numpy.float32 else 0.0, atol_rel=8 * eps)
    q, k, v, d_out = tensors(rng, c, 4, dtype)
    rpb = rng.standard_normal(rpb_shape(c)).astype(dtype)
    attn = call(n, "_qk")(q, k, c["kernel"], rpb=rpb, **unfused_kw(c))
    assert attn.dtype == dtype
    close_logits(attn, oracle.qk(q, k, *oracle_unfused(c), rpb=rpb), **tol)
    weights = rng.standard_normal(attn.shape).astype(dtype)
    close(call(n, "_av")(weights, v, c["kernel"], **unfused_kw(c)),
          oracle.av(weights, v, *oracle_unfused(c)), **tol)
    got = call(n, "_qk_backward")(weights, q, k, c["kernel"], rpb=rpb, **unfused_kw(c))
    want = oracle.qk_backward(weights, q, k, *oracle_unfused(c), with_rpb=True)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        close(g, w, **tol)
    got = call(n, "_av_backward")(d_out, weights, v, c["kernel"], **unfused_kw(c))
    for g, w in zip(got, oracle.av_backward(d_out, weights, v, *oracle_unfused(c))):
        close(g, w, **tol)


# ---- self-attention equivalence --------------------------------------------------------

@pytest.mark.parametrize("spatial", [(13,), (8,), (5, 7), (4, 6), (3, 4, 5)])
def test_kernel_equal_to_extent_is_self_attention(spatial, rng):
    n = len(spatial)
    c = dict(spatial=spatial, B=2, H=3, D=7)
    q, k, v, d_out = tensors(rng, c, 4)
    assert oracle.neighborhood_mask(spatial, spatial).all()
    out, lse = call(n)(q, k, v, spatial, return_lse=True)
    want_out, want_lse = oracle.dense_attention(q, k, v)
    close(out, want_out)
    close(lse, want_lse)
    # Backward of plain attention: compare with the oracle's formulas on the full mask.
    grads = call(n, "_backward")(d_out, q, k, v, out, lse, spatial)
    for g, w in zip(grads, oracle.fused_backward(d_out, q, k, v, spatial)):
        close(g, w)


# ---- the oracle on a subset of queries (the device probes' check of full-size problems) ---

@pytest.mark.parametrize("spatial, kernel, stride, dilation, causal", [
    ((40,), (7,), (1,), (1,), (False,)),
    ((37,), (5,), (3,), (2,), (True,)),
    ((24,), (24,), (1,), (1,), (False,)),
    ((9, 11), (3, 4), (2, 1), (1, 2), (True, False)),
    ((4, 6, 5), (3, 3, 2), (1, 2, 1), (1, 1, 2), (False, True, False)),
])
def test_oracle_rows_are_the_full_oracle_at_those_rows(spatial, kernel, stride, dilation, causal,
                                                       rng):
    B, H, D, Dv = 2, 3, 8, 5
    q, k = (rng.standard_normal((B, *spatial, H, D)) for _ in range(2))
    v = rng.standard_normal((B, *spatial, H, Dv))
    N = math.prod(spatial)
    rows = numpy.concatenate([numpy.arange(min(N, 6)), rng.choice(N, 5, replace=False)])
    want_out, want_lse = oracle.fused_forward(q, k, v, kernel, stride, dilation, causal, 0.3)
    out, lse = oracle.fused_forward_rows(q, k, v, rows, kernel, stride, dilation, causal, 0.3)
    assert out.shape == (B, len(rows), H, Dv) and lse.shape == (B, len(rows), H)
    flat = lambda x: x.reshape(B, N, *x.shape[len(spatial) + 1:])  # noqa: E731
    numpy.testing.assert_allclose(out, flat(want_out)[:, rows], rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, flat(want_lse)[:, rows], rtol=1e-12, atol=1e-12)


# ---- finite differences ----------------------------------------------------------------

FD_CASES = [
    dict(spatial=(7,), kernel=(3,), stride=(2,), dilation=(2,), causal=(False,)),
    dict(spatial=(6,), kernel=(4,), stride=(1,), dilation=(1,), causal=(True,)),
    dict(spatial=(5, 4), kernel=(3, 2), stride=(1, 2), dilation=(1, 2), causal=(True, False)),
    dict(spatial=(3, 3, 4), kernel=(2, 3, 2), stride=(1, 1, 2), dilation=(1, 1, 2),
         causal=(False, True, False)),
]


def numeric_grad(f, x, h=1e-6):
    """Central differences of the scalar ``f()`` with respect to every element of ``x``."""
    g = numpy.zeros_like(x)
    for idx in numpy.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        up = f()
        x[idx] = old - h
        down = f()
        x[idx] = old
        g[idx] = (up - down) / (2 * h)
    return g


@pytest.mark.parametrize("c", FD_CASES, ids=case_id)
def test_fused_gradients_finite_differences(c, rng):
    c = dict(c, B=1, H=2, D=3)
    n = len(c["spatial"])
    q, k, v, w = tensors(rng, c, 4)

    def loss():
        return float((call(n)(q, k, v, c["kernel"], **fused_kw(c)) * w).sum())

    out, lse = call(n)(q, k, v, c["kernel"], return_lse=True, **fused_kw(c))
    grads = call(n, "_backward")(w, q, k, v, out, lse, c["kernel"], **fused_kw(c))
    for g, x in zip(grads, (q, k, v)):
        close(g, numeric_grad(loss, x), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("c", FD_CASES, ids=case_id)
def test_unfused_gradients_finite_differences(c, rng):
    c = dict(c, B=1, H=2, D=3)
    n = len(c["spatial"])
    q, k, v, w_out = tensors(rng, c, 4)
    rpb = rng.standard_normal(rpb_shape(c))
    empty = numpy.isneginf(call(n, "_qk")(q, k, c["kernel"], **unfused_kw(c)))
    w_attn = rng.standard_normal(empty.shape)
    weights = rng.standard_normal(empty.shape)

    def qk_loss():
        a = call(n, "_qk")(q, k, c["kernel"], rpb=rpb, **unfused_kw(c))
        return float(numpy.where(empty, 0, a * w_attn).sum())

    # Junk in d_attn's empty slots must not leak into the gradients.
    d_attn = numpy.where(empty, 1e3, w_attn)
    dq, dk, d_rpb = call(n, "_qk_backward")(d_attn, q, k, c["kernel"], rpb=rpb,
                                            **unfused_kw(c))
    for g, x in ((dq, q), (dk, k), (d_rpb, rpb)):
        close(g, numeric_grad(qk_loss, x), rtol=1e-6, atol=1e-8)
    assert numpy.abs(d_rpb).max() > 0

    def av_loss():
        return float((call(n, "_av")(weights, v, c["kernel"], **unfused_kw(c)) * w_out).sum())

    d_weights, dv = call(n, "_av_backward")(w_out, weights, v, c["kernel"], **unfused_kw(c))
    close(dv, numeric_grad(av_loss, v), rtol=1e-6, atol=1e-8)
    close(d_weights, numeric_grad(av_loss, weights), rtol=1e-6, atol=1e-8)


# ---- layouts, chunking, full writes ---------------------------------------------------

def heads_first(rng, c, dtype=numpy.float64):
    """A [B, H, *spatial, D] contiguous array seen as [B, *spatial, H, D] (strided view)."""
    n = len(c["spatial"])
    x = rng.standard_normal((c["B"], c["H"]) + c["spatial"] + (c["D"],)).astype(dtype)
    return x.transpose((0,) + tuple(range(2, 2 + n)) + (1, 2 + n))


@pytest.mark.parametrize("dtype", [numpy.float64, numpy.float16])
@pytest.mark.parametrize("c", [FUSED_CASES[i] for i in (0, 1, 2, 4, 5)], ids=case_id)
def test_strided_inputs_match_contiguous(c, dtype, rng):
    n = len(c["spatial"])
    c = dict(c, H=max(c["H"], 2))
    q, k, v, d_out = (heads_first(rng, c, dtype) for _ in range(4))
    assert not q.flags.c_contiguous
    dense = [numpy.ascontiguousarray(x) for x in (q, k, v, d_out)]
    out, lse = call(n)(q, k, v, c["kernel"], return_lse=True, **fused_kw(c))
    want_out, want_lse = call(n)(*dense[:3], c["kernel"], return_lse=True, **fused_kw(c))
    numpy.testing.assert_array_equal(out, want_out)
    numpy.testing.assert_array_equal(lse, want_lse)
    got = call(n, "_backward")(d_out, q, k, v, out, lse, c["kernel"], **fused_kw(c))
    want = call(n, "_backward")(dense[3], *dense[:3], want_out, want_lse, c["kernel"],
                                **fused_kw(c))
    for g, w in zip(got, want):
        numpy.testing.assert_array_equal(g, w)
    kw = dict(dilation=c["dilation"], is_causal=c["causal"])
    attn = call(n, "_qk")(q, k, c["kernel"], **kw)
    numpy.testing.assert_array_equal(attn, call(n, "_qk")(*dense[:2], c["kernel"], **kw))
    weights = numpy.where(numpy.isneginf(attn), 0, attn).astype(dtype)
    strided_weights = numpy.asfortranarray(weights)
    numpy.testing.assert_array_equal(call(n, "_av")(strided_weights, v, c["kernel"], **kw),
                                     call(n, "_av")(weights, dense[2], c["kernel"], **kw))


@pytest.mark.parametrize("c", FUSED_CASES[:9] + UNFUSED_CASES[:6], ids=case_id)
def test_tiny_chunks_match_oracle(c, rng, monkeypatch):
    """One query (or key) per chunk: every chunk boundary is exercised."""
    monkeypatch.setitem(reference.CHUNK_BYTES, "numpy", 1)
    n = len(c["spatial"])
    q, k, v, d_out = tensors(rng, c, 4)
    out, lse = call(n)(q, k, v, c["kernel"], return_lse=True, **fused_kw(c))
    close(out, oracle.fused_forward(q, k, v, *oracle_fused(c))[0])
    grads = call(n, "_backward")(d_out, q, k, v, out, lse, c["kernel"], **fused_kw(c))
    for g, w in zip(grads, oracle.fused_backward(d_out, q, k, v, *oracle_fused(c))):
        close(g, w)
    d_attn = rng.standard_normal(tuple(q.shape[:-1]) + (math.prod(c["kernel"]),))
    got = call(n, "_qk_backward")(d_attn, q, k, c["kernel"], rpb=numpy.zeros(rpb_shape(c)),
                                  **unfused_kw(c))
    for g, w in zip(got, oracle.qk_backward(d_attn, q, k, *oracle_unfused(c), with_rpb=True)):
        close(g, w)


@pytest.mark.parametrize("c", FUSED_CASES[:6], ids=case_id)
def test_backend_writes_every_output_element(c, rng):
    """Outputs poisoned with NaN before the backend runs come back fully written."""
    from natten_cupy import _args
    n = len(c["spatial"])
    q, k, v, d_out = tensors(rng, c, 4)
    p = _args.check_fused(n, q, k, v, c["kernel"], c["stride"], c["dilation"], c["causal"],
                          None, "reference")
    out, lse = numpy.full_like(q, numpy.nan), numpy.full(q.shape[:-1], numpy.nan)
    reference.fused_forward(p, q, k, v, out, lse)
    grads = [numpy.full_like(q, numpy.nan) for _ in range(3)]
    reference.fused_backward(p, q, k, v, out, lse, d_out, *grads)
    pu = _args.check_qk(n, q, k, c["kernel"], c["dilation"], c["causal"], None, "reference")
    attn = numpy.full(q.shape[:-1] + (pu.num_neighbors,), numpy.nan)
    reference.qk(pu, q, k, None, attn)
    av_out = numpy.full_like(v, numpy.nan)
    reference.av(pu, numpy.where(numpy.isneginf(attn), numpy.nan, attn), v, av_out)
    dq, dk = numpy.full_like(q, numpy.nan), numpy.full_like(k, numpy.nan)
    d_rpb = numpy.zeros(rpb_shape(c))
    reference.qk_backward(pu, attn.clip(-1, 1), q, k, dq, dk, d_rpb)
    d_attn, dv = numpy.full_like(attn, numpy.nan), numpy.full_like(v, numpy.nan)
    reference.av_backward(pu, d_out, attn.clip(-1, 1), v, d_attn, dv)
    for x in (out, lse, *grads, av_out, dq, dk, d_rpb, d_attn, dv):
        assert numpy.isfinite(x).all()
    assert numpy.isneginf(attn).any() == any(c["causal"])


def test_backend_interface():
    assert reference.NAME == "reference"
    assert set(reference.DTYPES) == {numpy.dtype(t) for t in
                                     (numpy.float64, numpy.float32, numpy.float16, BF16)}
    assert reference.instantiations() == []
    for op in ("fused_forward", "fused_backward", "qk", "av", "qk_backward", "av_backward"):
        assert callable(getattr(reference, op))


def test_chunks_bound_memory_on_large_problems():
    """W2 (1024 x 1024, kernel 9 x 9, 8 heads, D 32): every chunk's gathered operands fit in
    CHUNK_BYTES, for the forward (width K) and the inverse passes (width M, two live)."""
    from natten_cupy._args import NAProblem
    p = NAProblem(rank=2, batch=1, spatial=(1024, 1024), heads=8, head_dim=32,
                  kernel_size=(9, 9), stride=(1, 1), dilation=(1, 1), is_causal=(False, False),
                  scale=32 ** -0.5, dtype=numpy.dtype(numpy.float32))
    tables = reference._Tables(p, numpy, inverse=True)
    # Keys near a border are held by up to k + k//2 = 13 queries per axis (windows shift).
    assert tables.inverse_width == 13 * 13
    for width, live in ((p.num_neighbors, 1), (tables.inverse_width, 2)):
        chunks = list(reference._chunks(numpy, p, width, live))
        assert chunks[0][0] == 0 and chunks[-1][1] == p.num_tokens
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        rows = max(hi - lo for lo, hi in chunks)
        assert live * rows * width * 8 * 32 * 4 <= reference.CHUNK_BYTES["numpy"]
        keys, valid, rel = tables.forward(*chunks[len(chunks) // 2])
        assert keys.shape == (rows, 81) and valid.all()
        assert rel.min() >= 0 and rel.max() < 17 * 17


@pytest.mark.parametrize("c", FUSED_CASES[3:6], ids=case_id)
def test_strided_outputs(c, rng):
    """The backend writes outputs of any strides (here heads-first storage seen heads-last)."""
    from natten_cupy import _args
    n = len(c["spatial"])
    c = dict(c, H=max(c["H"], 2))
    q, k, v, d_out = tensors(rng, c, 4, numpy.float32)
    p = _args.check_fused(n, q, k, v, c["kernel"], c["stride"], c["dilation"], c["causal"],
                          None, "reference")
    out = numpy.full_like(heads_first(rng, c, numpy.float32), numpy.nan)
    lse = numpy.full(q.shape[:-1][::-1], numpy.nan, dtype=numpy.float32).T
    assert not (out.flags.c_contiguous or lse.flags.c_contiguous)
    reference.fused_forward(p, q, k, v, out, lse)
    want_out, want_lse = call(n)(q, k, v, c["kernel"], return_lse=True, **fused_kw(c))
    numpy.testing.assert_array_equal(out, want_out)
    numpy.testing.assert_array_equal(lse, want_lse)
    grads = [numpy.full_like(heads_first(rng, c, numpy.float32), numpy.nan) for _ in range(3)]
    reference.fused_backward(p, q, k, v, out, lse, d_out, *grads)
    want = call(n, "_backward")(d_out, q, k, v, want_out, want_lse, c["kernel"], **fused_kw(c))
    for g, w in zip(grads, want):
        numpy.testing.assert_array_equal(g, w)
