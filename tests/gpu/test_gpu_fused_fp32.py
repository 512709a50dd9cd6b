"""Exact-float32 fused NA (backends/exact_fp32.py) against the reference backend.

Forward and backward run on NaN-poisoned outputs and must write every element. Each output's
error against the reference in float64 must stay within 2x (forward) or 3x (gradients) the
error of the reference run in float32, plus a floor of 2e-5 relative to the largest true
value (FlashAttention's rule, as in tests/gpu_cases.py).
"""

import zlib

import numpy
import pytest

from natten_cupy import _args
from natten_cupy.backends import get_backend
from natten_cupy.ops import run_fused_backward, run_fused_forward

pytestmark = pytest.mark.gpu

F32, F64 = numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)
FLOOR = 2e-5
FACTOR = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}

# (spatial, kernel, stride, dilation, causal, heads, head_dim): hand-picked cases.
CASES = [
    ((37,), 5, 1, 1, False, 2, 32),
    ((53,), 8, 3, 2, True, 2, 64),
    ((40,), 40, 1, 1, False, 1, 32),                        # self-attention
    ((700,), 301, 1, 1, False, 1, 64),                     # streamed (several slabs)
    ((300,), 64, 5, 1, True, 1, 256),                      # largest head dim, slabs
    ((23, 29), (7, 5), (2, 1), (2, 3), (True, False), 2, 32),
    ((31, 30), 9, 1, 1, False, 2, 32),                     # W2's window
    ((40, 37), 13, 1, 1, False, 1, 128),                   # W2b's window, slabs
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 1, 100),
    ((12, 11), (12, 11), 1, 1, False, 1, 20),              # self-attention in 2-D
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 2, 64),
    ((8, 12, 12), 3, (1, 3, 2), 1, False, 1, 128),
    ((6, 10, 11), (3, 5, 5), 1, 1, (True, False, False), 1, 32),
    ((7, 13, 9), (3, 5, 3), (1, 2, 1), (2, 1, 1), False, 2, 20),
]


def _random_case(seed):
    """A random geometry: rank 1-3, odd extents, odd/even kernels, stride, dilation, causal."""
    rng = numpy.random.default_rng(seed)
    rank = int(rng.integers(1, 4))
    spatial, ks, st, dl, ca = [], [], [], [], []
    for _ in range(rank):
        k = int(rng.integers(2, 8 if rank < 3 else 5))
        d = int(rng.choice([1, 1, 2, 3]))
        spatial.append(k * d + int(rng.integers(0, 24 if rank == 1 else 9)) | 1)
        ks.append(k)
        st.append(int(rng.integers(1, k + 1)))
        dl.append(d)
        ca.append(bool(rng.random() < 0.4))
    dim = int(rng.choice([32, 64, 128, 20, 100]))
    return (tuple(spatial), tuple(ks), tuple(st), tuple(dl), tuple(ca), int(rng.integers(1, 4)),
            dim)


RANDOM = [_random_case(s) for s in range(24)]


def _problem(x, case):
    spatial, ks, st, dl, ca, _, _ = case
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, None, "fused")


def _run_reference(problem, q, k, v, d_out, out=None, lse=None):
    """Reference forward (when out is None) then backward on host arrays of one dtype."""
    ref = get_backend("reference")
    acc = F64 if q.dtype == F64 else F32
    if out is None:
        out = numpy.empty(q.shape, q.dtype)
        lse = numpy.empty(q.shape[:-1], acc)
        run_fused_forward(problem, ref, q, k, v, out, lse)
    grads = [numpy.empty(q.shape, q.dtype) for _ in range(3)]
    run_fused_backward(problem, ref, d_out, q, k, v, out, lse, *grads)
    return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])


def _strided(cp, host, layout):
    """Upload with the given memory layout (values equal to host)."""
    rank = host.ndim - 3
    if layout == "heads_first":  # [B, H, *spatial, D] buffer permuted to canonical, no copy
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        return cp.asarray(numpy.ascontiguousarray(host.transpose(to_hf))).transpose(
            tuple(numpy.argsort(to_hf)))
    if layout == "strided_last":  # last dim not contiguous: the launcher copies
        return cp.asarray(numpy.stack([host, host], axis=-1))[..., 0]
    return cp.asarray(host)


def _poisoned(cp, shape, layout):
    """A NaN-filled output buffer of the given layout."""
    rank = len(shape) - 3
    if layout == "heads_first":
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        buf = cp.full(tuple(shape[i] for i in to_hf), cp.nan, dtype=cp.float32)
        return buf.transpose(tuple(numpy.argsort(to_hf)))
    if layout == "strided_last":
        return cp.full(tuple(shape) + (2,), cp.nan, dtype=cp.float32)[..., 1]
    return cp.full(shape, cp.nan, dtype=cp.float32)


def check_case(case, layout="canonical"):
    import cupy as cp
    spatial, _, _, _, _, heads, dim = case
    rng = numpy.random.default_rng(zlib.crc32(repr((case, layout)).encode()))
    shape = (2,) + tuple(spatial) + (heads, dim)
    q, k, v, d_out = (rng.standard_normal(shape).astype(F32) for _ in range(4))
    prob = _problem(q, case)
    fused = get_backend("fused")
    for op in ("fused_forward", "fused_backward"):
        assert fused.refuse(op, prob) is None, fused.refuse(op, prob)

    truth = _run_reference(_problem(q.astype(F64), case),
                           *(x.astype(F64) for x in (q, k, v, d_out)))
    # The backward under test and its yardstick take the true forward, rounded to float32.
    out32, lse32 = truth["out"].astype(F32), truth["lse"].astype(F32)
    truth = _run_reference(_problem(q.astype(F64), case),
                           *(x.astype(F64) for x in (q, k, v, d_out)),
                           out=out32.astype(F64), lse=lse32.astype(F64)) | \
        dict(out=truth["out"], lse=truth["lse"])
    yard = _run_reference(prob, q, k, v, d_out)
    yard |= {n: g for n, g in _run_reference(prob, q, k, v, d_out, out32, lse32).items()
             if n in ("dq", "dk", "dv")}

    dev = [_strided(cp, x, layout) for x in (q, k, v)]
    out = _poisoned(cp, shape, layout)
    lse = cp.full(shape[:-1], cp.nan, dtype=cp.float32)
    run_fused_forward(prob, fused, *dev, out, lse)
    grads = [_poisoned(cp, shape, layout) for _ in range(3)]
    run_fused_backward(prob, fused, _strided(cp, d_out, layout), *dev,
                       _strided(cp, out32, layout), cp.asarray(lse32), *grads)
    got = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])

    errors = {}
    for name, x in got.items():
        x = cp.asnumpy(x).astype(F64)
        assert not numpy.isnan(x).any(), f"unwritten (NaN) elements in {name}"
        t = truth[name].astype(F64)
        err = float(numpy.abs(x - t).max())
        ref_err = float(numpy.abs(yard[name].astype(F64) - t).max())
        bound = FACTOR[name] * ref_err + FLOOR * max(1.0, float(numpy.abs(t).max()))
        errors[name] = (err, ref_err)
        assert err <= bound, (name, err, ref_err, bound)
    return errors


def _ids(c):
    return f"{len(c[0])}d-{c[0]}-k{c[1]}-s{c[2]}-d{c[3]}-c{c[4]}-D{c[6]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fp32_matches_reference(case):
    check_case(case)


@pytest.mark.parametrize("case", RANDOM, ids=_ids)
def test_fp32_random_geometry(case):
    check_case(case)


@pytest.mark.parametrize("layout", ["heads_first", "strided_last"])
def test_fp32_strided_arrays(layout):
    check_case(((21, 18), (5, 7), 1, (2, 1), (False, True), 3, 64), layout)


def test_fp32_backward_is_deterministic():
    import cupy as cp
    case = ((30, 27), 7, 2, 1, False, 2, 32)
    rng = numpy.random.default_rng(7)
    shape = (1, 30, 27, 2, 32)
    q, k, v, d_out = (cp.asarray(rng.standard_normal(shape).astype(F32)) for _ in range(4))
    prob = _problem(q, case)
    fused = get_backend("fused")
    out = cp.empty(shape, cp.float32)
    lse = cp.empty(shape[:-1], cp.float32)
    run_fused_forward(prob, fused, q, k, v, out, lse)
    runs = []
    for _ in range(2):
        grads = [cp.empty(shape, cp.float32) for _ in range(3)]
        run_fused_backward(prob, fused, d_out, q, k, v, out, lse, *grads)
        runs.append([cp.asnumpy(g) for g in grads])
    for a, b in zip(*runs):
        assert numpy.array_equal(a, b)


def test_fp32_refuses_other_head_dims_and_dtypes():
    from natten_cupy.backends.fused import exact_fp32
    x = numpy.zeros((1, 8, 1, 30), F32)
    prob = _args.check_fused(1, x, x, x, 3, 1, 1, False, None, "fused")
    assert "multiple of 4" in exact_fp32.refuse(prob)
    x = numpy.zeros((1, 8, 1, 260), F32)
    prob = _args.check_fused(1, x, x, x, 3, 1, 1, False, None, "fused")
    assert "up to 256" in exact_fp32.refuse(prob)
    x = numpy.zeros((1, 8, 1, 32), numpy.float16)
    prob = _args.check_fused(1, x, x, x, 3, 1, 1, False, None, "fused")
    assert "float32 only" in exact_fp32.refuse(prob)
