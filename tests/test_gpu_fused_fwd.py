"""Fused tensor-core forward (backends/_fused_fwd.py) against the reference backend.

Each case runs the fused kernel on NaN-poisoned outputs and checks, against the reference in
float64, that its error is at most 2x the error of the reference run in the same precision
plus a small floor (FlashAttention's rule); every output element must be written.
"""

import numpy
import pytest

from natten_cupy import _args
from natten_cupy._dtypes import BFLOAT16
from natten_cupy.backends import get_backend
from natten_cupy.ops import run_fused_forward

pytestmark = pytest.mark.gpu

F16, BF16, F32 = numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32)
# Absolute floors (inputs and values are standard normal, outputs well under 1).
OUT_FLOOR = {F16: 2e-3, BF16: 1.6e-2, F32: 4e-3}
LSE_FLOOR = {F16: 2e-3, BF16: 2e-3, F32: 2e-2}

# (spatial, kernel, stride, dilation, causal, heads, head_dim, dtype, tile)
CASES = [
    ((97,), 7, 1, 2, True, 2, 64, F16, None),
    ((200,), 33, 4, 1, False, 3, 40, BF16, None),
    ((300,), 300, 1, 1, False, 2, 128, F16, None),          # self-attention
    ((3000,), 1023, 1, 1, False, 1, 64, F16, None),         # streamed halo
    ((3000,), 1024, 3, 1, True, 1, 32, BF16, (64,)),
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 2, 32, F16, None),
    ((24, 24), (4, 6), 1, 1, False, 1, 72, BF16, None),
    ((40, 37), 13, 1, 1, False, 2, 128, F16, None),         # streamed halo, D 128
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 1, 200, F16, None),
    ((30, 30), 9, 1, 1, False, 2, 32, BF16, (16, 8)),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 2, 64, F16, None),
    ((8, 12, 12), 3, (1, 3, 2), 1, False, 1, 256, BF16, None),
    ((6, 10, 11), (3, 5, 5), 1, 1, (True, False, False), 1, 32, F16, (4, 4, 4)),
    ((45, 33), (9, 7), 1, 1, False, 2, 32, F32, None),       # TF32
    ((7, 13, 9), (3, 5, 3), (1, 2, 1), (2, 1, 1), False, 1, 48, F32, None),
    ((257,), 64, 1, 1, True, 2, 128, F32, None),
]


def _rand(cp, rng, shape, dtype):
    return cp.asarray(rng.standard_normal(shape, dtype=numpy.float32)).astype(dtype)


def _problem(x, case, allow_tf32=False):
    spatial, ks, st, dl, ca, _, _, _, tile = case
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, None, "fused",
                             allow_tf32=allow_tf32, tile=tile)


def _run(backend, problem, q, k, v):
    import cupy as cp
    out = cp.full(q.shape, cp.nan, dtype=q.dtype)
    lse = cp.full(q.shape[:-1], cp.nan, dtype=cp.float64 if q.dtype == F64 else cp.float32)
    run_fused_forward(problem, backend, q, k, v, out, lse)
    return out, lse


F64 = numpy.dtype(numpy.float64)


def check_case(case, rng, layout="canonical"):
    """Run one case; returns (out error, reference out error, lse error)."""
    import cupy as cp
    spatial, _, _, _, _, heads, dim, dtype, _ = case
    shape = (2,) + tuple(spatial) + (heads, dim)
    if layout == "heads_first":  # [B, H, *spatial, D] permuted to canonical (no copy)
        perm = (0,) + tuple(range(2, 2 + len(spatial))) + (1, 2 + len(spatial))
        hf = (2, heads) + tuple(spatial) + (dim,)
        q, k, v = (_rand(cp, rng, hf, dtype).transpose(perm) for _ in range(3))
    elif layout == "strided_last":  # last dim not contiguous: the launcher copies
        q, k, v = (_rand(cp, rng, shape + (2,), dtype)[..., 0] for _ in range(3))
    else:
        q, k, v = (_rand(cp, rng, shape, dtype) for _ in range(3))
    tf32 = dtype == F32
    fused = get_backend("fused")
    ref = get_backend("reference")
    prob = _problem(q, case, allow_tf32=tf32)
    assert fused.refuse("fused_forward", prob) is None, fused.refuse("fused_forward", prob)
    out, lse = _run(fused, prob, q, k, v)
    q64, k64, v64 = (x.astype(F64) for x in (q, k, v))
    ref_out, ref_lse = _run(ref, _problem(q64, case), q64, k64, v64)
    low_out, _ = _run(ref, _problem(q, case, allow_tf32=tf32), q, k, v)
    assert not bool(cp.isnan(out).any()), "unwritten (NaN) elements in out"
    assert not bool(cp.isnan(lse).any()), "unwritten (NaN) elements in lse"
    err = float(cp.abs(out.astype(F64) - ref_out).max())
    ref_err = float(cp.abs(low_out.astype(F64) - ref_out).max())
    lse_err = float(cp.abs(lse.astype(F64) - ref_lse).max())
    assert err <= 2 * ref_err + OUT_FLOOR[dtype], (err, ref_err)
    assert lse_err <= LSE_FLOOR[dtype], lse_err
    return err, ref_err, lse_err


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-D{c[6]}-{numpy.dtype(c[7]).name}")
def test_fused_forward_matches_reference(case, rng):
    check_case(case, rng)


@pytest.mark.parametrize("layout", ["heads_first", "strided_last"])
def test_fused_forward_strided_inputs(layout, rng):
    check_case(((21, 18), (5, 7), 1, (2, 1), False, 3, 64, F16, None), rng, layout)


def test_fused_forward_self_attention_equals_dense(rng):
    """kernel == extent, no stride/dilation/causality: plain softmax attention."""
    import cupy as cp
    L, H, D = 160, 2, 64
    q, k, v = (_rand(cp, rng, (1, L, H, D), F16) for _ in range(3))
    prob = _problem(q, ((L,), L, 1, 1, False, H, D, F16, None))
    out, _ = _run(get_backend("fused"), prob, q, k, v)
    qf, kf, vf = (x.astype(F64)[0].transpose(1, 0, 2) for x in (q, k, v))
    s = qf @ kf.transpose(0, 2, 1) * D ** -0.5
    p = cp.exp(s - s.max(-1, keepdims=True))
    dense = (p / p.sum(-1, keepdims=True)) @ vf
    assert float(cp.abs(out[0].astype(F64).transpose(1, 0, 2) - dense).max()) < 3e-3


def test_refuses_exact_fp32_and_odd_head_dims():
    import cupy as cp
    from natten_cupy.backends import _fused_fwd
    x = cp.zeros((1, 16, 1, 32), F32)
    assert "TF32" in _fused_fwd.refuse(_problem(x, ((16,), 3, 1, 1, False, 1, 32, F32, None)))
    y = cp.zeros((1, 16, 1, 20), F16)
    assert "multiple of 8" in _fused_fwd.refuse(_problem(y, ((16,), 3, 1, 1, False, 1, 20, F16, None)))
    assert "tile" in _fused_fwd.refuse(_problem(y[..., :16], ((16,), 3, 1, 1, False, 1, 16, F16, (48,))))
