"""Fused tensor-core forward (backends/mma_forward.py) against the reference backend.

Each case runs the fused kernel on NaN-poisoned outputs and checks, against the reference in
float64, that its error is at most 2x the error of the reference run in the same precision
plus a small floor (FlashAttention's rule); every output element must be written.
"""

import numpy
import pytest

from natten_cupy import _args
from natten_cupy._dtypes import BFLOAT16
from natten_cupy.backends import get_backend
from gpu_cases import to_host, upload
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
    ((1500,), 511, 1, 1, False, 1, 64, F16, None),          # streamed halo
    ((1500,), 512, 3, 1, True, 1, 64, BF16, (64,)),
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 2, 32, F16, None),
    ((24, 24), (4, 6), 1, 1, False, 1, 72, BF16, None),
    ((30, 29), 13, 1, 1, False, 1, 128, F16, None),         # streamed halo, D 128
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 1, 200, F16, None),
    ((30, 30), 9, 1, 1, False, 2, 32, BF16, (16, 8)),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 2, 64, F16, None),
    ((8, 12, 12), 3, (1, 3, 2), 1, False, 1, 256, BF16, None),
    ((6, 10, 11), (3, 5, 5), 1, 1, (True, False, False), 1, 32, F16, (4, 4, 4)),
    ((45, 33), (9, 7), 1, 1, False, 2, 32, F32, None),       # TF32
    ((7, 13, 9), (3, 5, 3), (1, 2, 1), (2, 1, 1), False, 1, 48, F32, None),
    ((257,), 64, 1, 1, True, 2, 128, F32, None),
    ((37, 45), 9, 1, 1, False, 2, 32, F16, None),           # 2x8 patches, 9x9 (W2's shape)
    ((40, 40), 15, (1, 2), 1, (False, True), 1, 128, F32, None),  # TF32, streamed
    ((40, 44), 21, 1, (1, 2), False, 1, 64, F32, None),     # TF32, streamed by lines
    ((10, 20, 21), (5, 9, 9), 1, (1, 1, 2), False, 1, 64, F16, None),  # 3-D streamed by lines
]


F64 = numpy.dtype(numpy.float64)



def _problem(x, case, allow_tf32=False):
    spatial, ks, st, dl, ca, _, _, _, tile = case
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, None, "fused",
                             allow_tf32=allow_tf32, tile=tile)


def _reference(problem, q, k, v):
    """The reference backend on host arrays: (out, lse) as float64."""
    out = numpy.empty(q.shape, q.dtype)
    lse = numpy.empty(q.shape[:-1], F64 if q.dtype == F64 else numpy.float32)
    run_fused_forward(problem, get_backend("reference"), q, k, v, out, lse)
    return out.astype(F64), lse.astype(F64)


def check_case(case, rng, layout="canonical"):
    """Run one case; returns (out error, reference out error, lse error)."""
    import cupy as cp
    spatial, _, _, _, _, heads, dim, dtype, _ = case
    rank = len(spatial)
    shape = (2,) + tuple(spatial) + (heads, dim)
    host = [rng.standard_normal(shape).astype(dtype) for _ in range(3)]
    if layout == "heads_first":  # [B, H, *spatial, D] buffers permuted to canonical (no copy)
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        back = tuple(numpy.argsort(to_hf))
        dev = [upload(cp, x.transpose(to_hf)).transpose(back) for x in host]
    elif layout == "strided_last":  # last dim not contiguous: the launcher copies
        dev = [upload(cp, numpy.stack([x, x], axis=-1))[..., 0] for x in host]
    else:
        dev = [upload(cp, x) for x in host]
    tf32 = dtype == F32
    fused = get_backend("fused")
    prob = _problem(host[0], case, allow_tf32=tf32)
    assert fused.refuse("fused_forward", prob) is None, fused.refuse("fused_forward", prob)
    out = upload(cp, numpy.full(shape, numpy.nan, dtype))
    lse = cp.full(shape[:-1], cp.nan, dtype=cp.float32)
    run_fused_forward(prob, fused, *dev, out, lse)
    out, lse = to_host(out), to_host(lse)
    h64 = [x.astype(F64) for x in host]
    ref_out, ref_lse = _reference(_problem(h64[0], case), *h64)
    low_out, _ = _reference(prob, *host)
    assert not numpy.isnan(out).any(), "unwritten (NaN) elements in out"
    assert not numpy.isnan(lse).any(), "unwritten (NaN) elements in lse"
    err = float(numpy.abs(out - ref_out).max())
    ref_err = float(numpy.abs(low_out - ref_out).max())
    lse_err = float(numpy.abs(lse - ref_lse).max())
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
    host = [rng.standard_normal((1, L, H, D)).astype(F16) for _ in range(3)]
    prob = _problem(host[0], ((L,), L, 1, 1, False, H, D, F16, None))
    out = upload(cp, numpy.full(host[0].shape, numpy.nan, F16))
    lse = cp.empty((1, L, H), cp.float32)
    run_fused_forward(prob, get_backend("fused"), *(upload(cp, x) for x in host), out, lse)
    qf, kf, vf = (x.astype(F64)[0].transpose(1, 0, 2) for x in host)
    s = qf @ kf.transpose(0, 2, 1) * D ** -0.5
    p = numpy.exp(s - s.max(-1, keepdims=True))
    dense = (p / p.sum(-1, keepdims=True)) @ vf
    assert float(numpy.abs(to_host(out)[0].transpose(1, 0, 2) - dense).max()) < 3e-3


def test_refuses_exact_fp32_and_odd_head_dims():
    from natten_cupy.backends.fused import mma_forward
    x = numpy.zeros((1, 16, 1, 32), F32)
    assert "TF32" in mma_forward.refuse(_problem(x, ((16,), 3, 1, 1, False, 1, 32, F32, None)))
    y = numpy.zeros((1, 16, 1, 20), F16)
    assert "multiple of 8" in mma_forward.refuse(_problem(y, ((16,), 3, 1, 1, False, 1, 20, F16, None)))
    assert "tile" in mma_forward.refuse(_problem(y[..., :16], ((16,), 3, 1, 1, False, 1, 16, F16, (48,))))
