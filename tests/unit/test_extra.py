"""Additional tokens (``additional_keys`` / ``additional_values``) in the fused ops, on the CPU.

The reference backend (the windows, then ``natten_cupy._extra``'s merge) against the float64
oracle (``oracle.fused_forward_extra`` / ``fused_backward_extra``: one dense softmax over
every query's window and the extra tokens, written apart from the library), every rank, with
stride, dilation, causal axes, GQA on k/v and on the extra tokens; the errors owed to bad
input; which kernels take the tokens themselves. The GPU kernels are checked in
``tests/gpu/test_gpu_extra.py`` and the suite's kind ``fused_extra``.
"""

import numpy
import pytest

import natten_cupy
import oracle
from natten_cupy import _args
from natten_cupy._dtypes import BFLOAT16
from natten_cupy.backends import fused
from natten_cupy.backends.fused import mma_backward, mma_forward

# (rank, spatial, kernel, stride, dilation, causal, heads, kv heads, extra heads, tokens)
CASES = [
    (1, (13,), 5, 1, 1, False, 4, 4, 4, 5),
    (1, (17,), 4, 2, 2, True, 4, 2, 1, 1),
    (2, (7, 9), (3, 4), (1, 2), (1, 2), (False, True), 2, 1, 2, 9),
    (2, (9, 6), 3, 1, (2, 1), (True, True), 6, 3, 3, 3),
    (3, (4, 5, 6), (3, 2, 3), (1, 1, 2), 1, (False, True, False), 4, 2, 2, 4),
    (3, (5, 4, 4), 2, 1, (1, 2, 1), True, 2, 2, 1, 7),
]


def _inputs(rng, case, d=8):
    rank, spatial, _, _, _, _, h, hkv, hx, t = case
    q = rng.standard_normal((2, *spatial, h, d))
    k, v = (rng.standard_normal((2, *spatial, hkv, d)) for _ in range(2))
    xk, xv = (rng.standard_normal((2, t, hx, d)) for _ in range(2))
    return q, k, v, xk, xv


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}d-{c[1]}-T{c[-1]}")
def test_reference_matches_the_oracle(rng, case):
    rank, spatial, ks, st, dl, ca = case[:6]
    q, k, v, xk, xv = _inputs(rng, case)
    fwd = getattr(natten_cupy, f"na{rank}d")
    bwd = getattr(natten_cupy, f"na{rank}d_backward")
    opts = dict(stride=st, dilation=dl, is_causal=ca)
    out, lse = fwd(q, k, v, ks, return_lse=True, additional_keys=xk, additional_values=xv,
                   **opts)
    want_out, want_lse = oracle.fused_forward_extra(q, k, v, xk, xv, ks, st, dl, ca)
    numpy.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    d_out = rng.standard_normal(out.shape)
    got = bwd(d_out, q, k, v, out, lse, ks, additional_keys=xk, additional_values=xv, **opts)
    want = oracle.fused_backward_extra(d_out, q, k, v, xk, xv, ks, st, dl, ca)
    assert len(got) == 5
    for name, g, w in zip(("dq", "dk", "dv", "d_xk", "d_xv"), got, want):
        assert g.shape == w.shape, name
        numpy.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10, err_msg=name)


def test_the_tokens_change_the_result_and_none_of_them_do_not(rng):
    """Extra tokens move out and lse (the test above could not tell them apart from none
    otherwise); zero tokens give the plain result and zero gradients of the right shape."""
    q, k, v = (rng.standard_normal((1, 11, 2, 8)) for _ in range(3))
    plain, plain_lse = natten_cupy.na1d(q, k, v, 3, return_lse=True)
    xk, xv = rng.standard_normal((1, 4, 2, 8)), rng.standard_normal((1, 4, 2, 8))
    out, lse = natten_cupy.na1d(q, k, v, 3, return_lse=True, additional_keys=xk,
                                additional_values=xv)
    assert (lse > plain_lse).all() and not numpy.allclose(out, plain)
    none = numpy.zeros((1, 0, 2, 8))
    out0, lse0 = natten_cupy.na1d(q, k, v, 3, return_lse=True, additional_keys=none,
                                  additional_values=none)
    numpy.testing.assert_array_equal(out0, plain)
    numpy.testing.assert_array_equal(lse0, plain_lse)
    grads = natten_cupy.na1d_backward(q, q, k, v, out0, lse0, 3, additional_keys=none,
                                      additional_values=none)
    assert [g.shape for g in grads[3:]] == [(1, 0, 2, 8)] * 2


def test_array_types_and_layouts(rng):
    """Float32 inputs (float32 math) and strided extra tokens give the float64 result."""
    q, k, v = (rng.standard_normal((2, 9, 4, 8)) for _ in range(3))
    buf = rng.standard_normal((2, 2, 6, 8))   # [B, H_x, T, D] viewed as [B, T, H_x, D]
    xk, xv = buf.transpose(0, 2, 1, 3), buf[:, ::-1].transpose(0, 2, 1, 3)
    want, _ = oracle.fused_forward_extra(q, k, v, xk, xv, 3)
    out = natten_cupy.na1d(*(x.astype(numpy.float32) for x in (q, k, v)), 3,
                           additional_keys=xk.astype(numpy.float32),
                           additional_values=xv.astype(numpy.float32))
    assert out.dtype == numpy.float32
    numpy.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


def test_bad_additional_tokens_are_refused_by_name(rng):
    q = rng.standard_normal((2, 9, 4, 8))
    xk = rng.standard_normal((2, 5, 2, 8))
    with pytest.raises(ValueError, match="given together"):
        natten_cupy.na1d(q, q, q, 3, additional_keys=xk)
    with pytest.raises(ValueError, match="given together"):
        natten_cupy.na1d(q, q, q, 3, additional_values=xk)
    with pytest.raises(TypeError, match="additional_keys"):
        natten_cupy.na1d(q, q, q, 3, additional_keys=[1, 2], additional_values=xk)
    with pytest.raises(ValueError, match=r"additional_values shape \(2, 5, 2, 4\)"):
        natten_cupy.na1d(q, q, q, 3, additional_keys=xk, additional_values=xk[..., :4])
    with pytest.raises(ValueError, match="q's batch 2"):
        natten_cupy.na1d(q, q, q, 3, additional_keys=xk[:1], additional_values=xk[:1])
    with pytest.raises(ValueError, match="agree on T and H_x"):
        natten_cupy.na1d(q, q, q, 3, additional_keys=xk, additional_values=xk[:, :4])
    with pytest.raises(ValueError, match="H_x = 3 heads, which does not divide"):
        x3 = rng.standard_normal((2, 5, 3, 8))
        natten_cupy.na1d(q, q, q, 3, additional_keys=x3, additional_values=x3)
    with pytest.raises(ValueError, match="dtype float32 does not match"):
        x32 = xk.astype(numpy.float32)
        natten_cupy.na1d(q, q, q, 3, additional_keys=x32, additional_values=x32)
    with pytest.raises(ValueError, match="must be \\[B, T, H_x, D\\]"):
        natten_cupy.na1d(q, q, q, 3, additional_keys=xk[0], additional_values=xk[0])


def _problem(rank=2, dtype=numpy.float16, head_dim=64, tile=None, rpb=False, tf32=False):
    spatial = (12,) * rank
    q = numpy.zeros((1, *spatial, 4, head_dim), dtype)
    xk = numpy.zeros((1, 8, 2, head_dim), dtype)
    bias = numpy.zeros((4,) + (5,) * rank, dtype) if rpb else None
    return _args.check_fused(rank, q, q, q, 3, 1, 1, False, None, "auto", tf32, False, tile,
                             bias, xk, xk)


def test_which_kernels_take_the_tokens_themselves():
    """The mma.sync kernels with their default tile, no bias, head dims up to 128 (float16,
    bfloat16, TF32); elsewhere the tokens are merged in array math."""
    for rank in (1, 2, 3):
        for dtype in (numpy.float16, BFLOAT16):
            for d in (32, 64, 128):
                p = _problem(rank, dtype, d)
                assert fused.runs_extra("fused_forward", p), (rank, d)
                assert fused.runs_extra("fused_backward", p), (rank, d)
                assert not fused._hopper_serves(p)   # no additional tokens there
    assert fused.runs_extra("fused_forward", _problem(tf32=True, dtype=numpy.float32))
    for p in (_problem(head_dim=256), _problem(rpb=True), _problem(tile=(8, 8)),
              _problem(dtype=numpy.float32)):
        assert not fused.runs_extra("fused_forward", p)
        assert not fused.runs_extra("fused_backward", p)


def test_kernels_with_the_tokens_are_listed():
    fwd = {n for _, n in mma_forward.instantiations()}
    bwd = {n for _, n in mma_backward.instantiations()}
    # dtype x rank x head dims 32..128, default tiles, no bias
    assert sum(n.endswith(", false, true>") for n in fwd) == 3 * 3 * 3
    for ct in ("__half", "__nv_bfloat16", "float"):
        assert f"na_bwd_extra_sum<{ct}>" in bwd
        for dp in (32, 64, 128):
            assert f"na_bwd_extra_kv<{ct}, {dp}, {min(dp, 64)}>" in bwd
            assert any(n.startswith(f"na_bwd_fused_q<{ct}, {dp},") and n.endswith(", false, true>")
                       for n in bwd)


def test_splits_of_the_extra_dk_dv_pass():
    """Enough CTAs for the device, at least 256 query tokens a split, every token covered."""
    for tokens, n, heads in ((256, 40960, 16), (7, 300, 2), (64, 100, 1), (1000, 4096, 8)):
        q = numpy.zeros((2, n, heads, 64), numpy.float16)
        xk = numpy.zeros((2, tokens, heads, 64), numpy.float16)
        p = _args.check_fused(1, q, q, q, 3, 1, 1, False, None, "auto", additional_keys=xk,
                              additional_values=xk)
        splits, rows = mma_backward._extra_splits(p, 64, 132)
        assert splits * rows >= n > (splits - 1) * rows
        assert rows >= min(n, 256)
        ctas = -(-tokens // 64) * 2 * heads * splits
        assert ctas >= min(4 * 132, -(-tokens // 64) * 2 * heads * max(1, n // 256))
