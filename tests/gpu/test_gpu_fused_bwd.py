"""Fused tensor-core backward (backends/mma_backward.py) against the reference backend.

Each case computes out and lse with the reference forward in float64 (rounded to the case's
dtype, as a real forward would store them), runs the fused backward on NaN-poisoned
gradients, and checks dq, dk, dv against the reference backward in float64: the error must
be at most 3x the error of the reference backward run in the same precision plus a small
floor (FlashAttention's rule for gradients); every element must be written. float32 runs as
TF32, whose yardstick is the reference in float16 (the same 10-bit mantissa).
"""

import numpy
import pytest

from natten_cupy import _args
from natten_cupy._dtypes import BFLOAT16
from natten_cupy.backends import get_backend
from gpu_cases import to_host, upload
from natten_cupy.ops import run_fused_backward, run_fused_forward

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = (numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32),
                       numpy.dtype(numpy.float64))
# Absolute floors relative to max(1, max |true gradient|).
FLOOR = {F16: 2e-3, BF16: 1.6e-2, F32: 2e-3}

# (spatial, kernel, stride, dilation, causal, heads, head_dim, dtype)
CASES = [
    ((37,), 5, 1, 1, False, 2, 32, F16),
    ((50,), 8, 3, 2, True, 1, 64, BF16),
    ((97,), 7, 1, 2, True, 2, 40, F16),
    ((300,), 129, 1, 1, False, 1, 256, F16),                 # streamed slabs, 4 column chunks
    ((700,), 257, 1, 1, False, 2, 64, F16),    # on sm_90 the Hopper part (1-D from 160 at D64)
    ((1200,), 511, 3, 2, True, 1, 64, BF16),   # the same, strided, dilated, causal
    ((13, 11), (3, 4), (1, 2), (2, 1), (False, True), 2, 40, F16),
    ((20, 20), 7, 1, 1, False, 1, 128, BF16),
    ((24, 24), 9, 1, 1, False, 2, 32, F16),
    ((21, 19), (5, 6), (5, 3), (2, 3), (True, True), 1, 72, BF16),
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 1, 64, F16),
    ((5, 9, 7), (3, 3, 5), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 72, F16),
    ((6, 12, 12), (3, 5, 5), 1, 1, False, 2, 32, BF16),
    ((7, 10, 9), (4, 3, 3), (2, 1, 3), (1, 3, 1), (False, True, False), 1, 128, F16),
    ((24, 24), 9, 1, 1, False, 2, 32, F32),                  # TF32
    ((97,), 7, 1, 2, True, 2, 64, F32),
    ((21, 19), (5, 6), (5, 3), (2, 3), (True, True), 1, 200, F32),
    # head dims 136-160: the 160 bucket (dK/dV in two chunks of 80, dQ in one of 160)
    ((300,), 65, 1, 1, False, 2, 160, F16),
    ((19, 23), (5, 7), (2, 1), (1, 2), (False, True), 1, 136, BF16),
    ((4, 9, 11), (3, 3, 5), 1, (1, 2, 1), (True, False, False), 1, 152, F16),
    ((97,), 9, 1, 2, True, 1, 160, F32),
    ((23, 17), (5, 3), (1, 2), (2, 1), (False, True), 2, 256, BF16),  # chunks of 128 and 256
]



def _layout(cp, host, layout):
    rank = host.ndim - 3
    if layout == "heads_first":  # [B, H, *spatial, D] buffers permuted to canonical (no copy)
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        return upload(cp, host.transpose(to_hf)).transpose(tuple(numpy.argsort(to_hf)))
    if layout == "strided_last":  # last dim not contiguous: the launcher copies
        return upload(cp, numpy.stack([host, host], axis=-1))[..., 0]
    return upload(cp, host)


def _problem(x, case, deterministic=False):
    spatial, ks, st, dl, ca = case[:5]
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, None, "fused",
                             allow_tf32=x.dtype == F32, deterministic=deterministic)


def _reference_backward(problem, q, k, v, out, lse, d_out):
    grads = [numpy.empty(q.shape, q.dtype) for _ in range(3)]
    run_fused_backward(problem, get_backend("reference"), d_out, q, k, v, out, lse, *grads)
    return [g.astype(F64) for g in grads]


def _inputs(case, rng):
    """Host q, k, v, d_out in the case's dtype, out in it too, lse float32 (both from the
    float64 forward), and the float64 truth of dq, dk, dv."""
    spatial, _, _, _, _, heads, dim, dtype = case
    shape = (2,) + tuple(spatial) + (heads, dim)
    q, k, v, d_out = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    h64 = [x.astype(F64) for x in (q, k, v, d_out)]
    p64 = _problem(h64[0], case)
    out64 = numpy.empty(shape, F64)
    lse64 = numpy.empty(shape[:-1], F64)
    run_fused_forward(p64, get_backend("reference"), *h64[:3], out64, lse64)
    truth = _reference_backward(p64, h64[0], h64[1], h64[2], out64, lse64, h64[3])
    return q, k, v, d_out, out64.astype(dtype), lse64.astype(F32), truth


def _yardstick(case, q, k, v, d_out, out, lse):
    """The reference backward in the case's precision (float16 for TF32)."""
    low = F16 if q.dtype == F32 else q.dtype
    hosts = [x.astype(low) for x in (q, k, v, d_out, out)]
    return _reference_backward(_problem(hosts[0], case), hosts[0], hosts[1], hosts[2],
                               hosts[4], lse, hosts[3])


def _run_fused(cp, problem, dev, shape, dtype, grad_layout="canonical"):
    grads = [_layout(cp, numpy.full(shape, numpy.nan, dtype), grad_layout) for _ in range(3)]
    q, k, v, d_out, out, lse = dev
    run_fused_backward(problem, get_backend("fused"), d_out, q, k, v, out, lse, *grads)
    return [to_host(g) for g in grads]


def check_case(case, rng, layout="canonical", grad_layout="canonical"):
    """Run one case; returns [(error, yardstick error)] for dq, dk, dv."""
    import cupy as cp
    q, k, v, d_out, out, lse, truth = _inputs(case, rng)
    problem = _problem(q, case)
    fused = get_backend("fused")
    assert fused.refuse("fused_backward", problem) is None, fused.refuse("fused_backward",
                                                                         problem)
    dev = [_layout(cp, x, layout) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
    got = _run_fused(cp, problem, dev, q.shape, q.dtype, grad_layout)
    low = _yardstick(case, q, k, v, d_out, out, lse)
    result = []
    for name, g, t, y in zip(("dq", "dk", "dv"), got, truth, low):
        assert not numpy.isnan(g).any(), f"unwritten (NaN) elements in {name}"
        err = float(numpy.abs(g - t).max())
        ref_err = float(numpy.abs(y - t).max())
        floor = FLOOR[q.dtype] * max(1.0, float(numpy.abs(t).max()))
        assert err <= 3 * ref_err + floor, (name, err, ref_err)
        result.append((err, ref_err))
    return result


def _case_id(c):
    return f"{len(c[0])}d-{c[0]}-k{c[1]}-D{c[6]}-{numpy.dtype(c[7]).name}"


@pytest.fixture(params=[False, True], ids=["two_launches", "one_launch"])
def one_launch(request, monkeypatch):
    """The mma.sync backward's passes one by one, or in one launch wherever its kernel takes
    the problem (``mma_backward.ONE_LAUNCH``; by default only small problems run so)."""
    from natten_cupy.backends.fused import mma_backward
    monkeypatch.setattr(mma_backward, "ONE_LAUNCH", request.param)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_backward_matches_reference(case, rng, one_launch):
    check_case(case, rng)


@pytest.mark.parametrize("layout", ["heads_first", "strided_last"])
def test_fused_backward_strided_inputs(layout, rng):
    check_case(((17, 15), (5, 4), (2, 1), (1, 2), (True, False), 3, 64, F16), rng, layout)


@pytest.mark.parametrize("layout,dtype", [("heads_first", F16), ("strided_last", F16),
                                          ("strided_last", BF16)])
def test_fused_backward_strided_outputs(layout, dtype, rng):
    """Gradients written in place through any strides (rows that are not 16-byte ready go
    through a contiguous stand-in)."""
    check_case(((17, 15), (5, 4), (2, 1), (1, 2), (True, False), 3, 64, dtype), rng,
               grad_layout=layout)


def test_fused_backward_deterministic_is_bitwise_reproducible(rng, one_launch):
    import cupy as cp
    case = ((30, 29), (7, 5), 1, (1, 2), (False, True), 2, 64, BF16)
    q, k, v, d_out, out, lse, _ = _inputs(case, rng)
    problem = _problem(q, case, deterministic=True)
    dev = [upload(cp, x) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
    runs = [_run_fused(cp, problem, dev, q.shape, q.dtype) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert numpy.array_equal(a, b)


def test_fused_backward_self_attention_equals_dense(rng):
    """kernel == extent, no stride/dilation/causality: plain softmax attention gradients."""
    import cupy as cp
    L, H, D = 96, 2, 64
    case = ((L,), L, 1, 1, False, H, D, F16)
    q, k, v, d_out, out, lse, _ = _inputs(case, rng)
    dev = [upload(cp, x) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
    dq, dk, dv = _run_fused(cp, _problem(q, case), dev, q.shape, F16)
    qf, kf, vf, df = (x.astype(F64)[0].transpose(1, 0, 2) for x in (q, k, v, d_out))
    s = qf @ kf.transpose(0, 2, 1) * D ** -0.5
    p = numpy.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ vf
    dp = df @ vf.transpose(0, 2, 1)
    ds = p * (dp - (df * o).sum(-1, keepdims=True))
    dense = (ds @ kf * D ** -0.5, ds.transpose(0, 2, 1) @ qf * D ** -0.5,
             p.transpose(0, 2, 1) @ df)
    for got, want in zip((dq, dk, dv), dense):
        assert float(numpy.abs(got[0].transpose(1, 0, 2) - want).max()) < 5e-3


def test_refuses_exact_fp32_and_odd_head_dims():
    from natten_cupy.backends.fused import mma_backward
    case = ((16,), 3, 1, 1, False, 1, 32, F32)
    x = numpy.zeros((1, 16, 1, 32), F32)
    exact = _args.check_fused(1, x, x, x, 3, 1, 1, False, None, "fused")
    assert "exact float32" in mma_backward.refuse(exact)
    assert mma_backward.refuse(_problem(x, case)) is None
    y = numpy.zeros((1, 16, 1, 20), F16)
    assert "multiple of 8" in mma_backward.refuse(_problem(y, ((16,), 3, 1, 1, False, 1, 20, F16)))
