"""The tiled backend's four unfused ops against the float64 reference, on the GPU.

Cases come from ``gpu_cases`` (inputs, NaN-poisoned outputs, NaN at empty slots of attn and
d_attn, FlashAttention-style tolerance), over geometries chosen for the tiled kernels' edges:
patches cut by odd extents, dilation groups of unequal length, causal axes mixed with
non-causal ones, odd and even kernels, and head dims on and off the fast sizes (32, 64, 128;
40, 72, 136, 256 take masked chunks and several head-dim slices). A few tests check the
launcher: unaligned or strided q/k/v/outputs, multi-pass rpb gradients, refusals.
"""

import numpy
import pytest

import gpu_cases
from gpu_cases import Case
from natten_cupy import _args
from natten_cupy._dtypes import FLOAT64
from natten_cupy.backends import get_backend, tiled

KINDS = ("qk", "qk_rpb", "av", "qk_backward", "qk_backward_rpb", "av_backward")
DTYPES = (("float16", False), ("bfloat16", False), ("float32", True), ("float32", False))
HEAD_DIMS = (32, 64, 128, 40, 72)

# (spatial, kernel, dilation, causal): stride is 1 for the unfused ops.
GEOMETRIES = {
    1: [((37,), (7,), (1,), (False,)),
        ((29,), (4,), (3,), (True,)),
        ((50,), (16,), (2,), (False,)),
        ((21,), (2,), (1,), (True,))],
    2: [((13, 11), (3, 4), (2, 1), (False, True)),
        ((9, 17), (5, 5), (1, 3), (True, False)),
        ((18, 7), (6, 3), (3, 2), (True, True)),
        ((8, 8), (8, 8), (1, 1), (False, False))],
    3: [((5, 9, 7), (3, 4, 2), (1, 2, 3), (False, True, False)),
        ((6, 7, 10), (2, 3, 5), (3, 2, 2), (True, True, True)),
        ((4, 13, 6), (3, 3, 6), (1, 4, 1), (True, False, False)),
        ((3, 5, 5), (3, 5, 5), (1, 1, 1), (False, False, False))],
}


def _cases():
    cases = []
    n = 0
    for kind in KINDS:
        for rank in (1, 2, 3):
            for di, (dtype, tf32) in enumerate(DTYPES):
                spatial, kernel, dilation, causal = GEOMETRIES[rank][(n + di) % 4]
                cases.append(Case(kind, rank, dtype, spatial, kernel, (1,) * rank, dilation,
                                  causal, HEAD_DIMS[n % len(HEAD_DIMS)], batch=2, heads=3,
                                  permuted=n % 2 == 1, tf32=tf32))
                n += 1
    # Large head dims (several slices of the weighted kernels, A reloaded by the scores one).
    for kind in ("qk_rpb", "av", "qk_backward", "av_backward"):
        for head_dim, dtype, tf32 in ((136, "float16", False), (256, "bfloat16", False),
                                      (256, "float32", True), (136, "float32", False)):
            spatial, kernel, dilation, causal = GEOMETRIES[2][n % 4]
            cases.append(Case(kind, 2, dtype, spatial, kernel, (1, 1), dilation, causal,
                              head_dim, batch=1, heads=2, tf32=tf32))
            n += 1
    # Staged weights under 48 KiB that with the kernel's static shared memory pass it (exact
    # float32 av, 182 neighbors: 45.5 KiB staged + 5 KiB static), once an invalid launch.
    cases.append(Case("av", 3, "float32", (7, 2, 13), (7, 2, 13), (1, 1, 1), (1, 1, 1),
                      (False, True, False), 8, batch=3, heads=3, permuted=True))
    return cases


CASES = _cases()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tiled_against_reference(case):
    why = gpu_cases.check_backend(case, "tiled")
    assert why is None, why


def _device_inputs(cupy, shape, dtype, rng):
    return cupy.asarray(rng.standard_normal(shape).astype(numpy.float32)).astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tf32", [("float16", False), ("float32", True),
                                        ("float32", False)])
def test_strided_operands_and_outputs_match_contiguous(dtype, tf32):
    """Head dims read with a stride and outputs that are strided views go through copies
    and give the same bits as contiguous arrays."""
    import cupy
    rng = numpy.random.default_rng(5)
    dt = numpy.dtype(dtype)
    B, X, Y, H, D = 2, 9, 11, 2, 32
    shape = (B, X, Y, H, D)
    wide = (B, X, Y, H, 2 * D)
    ks, dil, causal = (3, 4), (2, 1), (False, True)
    be = get_backend("tiled")

    def strided(x):
        buf = cupy.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]

    q, k, v, d_out = (_device_inputs(cupy, shape, dt, rng) for _ in range(4))
    problem = _args.check_qk(2, q, k, ks, dil, causal, None, "tiled", allow_tf32=tf32)
    K = problem.num_neighbors

    attn = cupy.empty((B, X, Y, H, K), dt)
    be.qk(problem, q, k, None, attn)
    attn_s = cupy.full((B, X, Y, H, 2 * K), numpy.nan, dt)[..., ::2]
    be.qk(problem, strided(q), strided(k), None, attn_s)
    assert bool((attn_s == attn).all())

    weights = cupy.where(cupy.isinf(attn), 0, attn).astype(dt)
    out = cupy.empty(shape, dt)
    be.av(problem, weights, v, out)
    out_s = cupy.full(wide, numpy.nan, dt)[..., ::2]
    be.av(problem, weights, strided(v), out_s)
    assert bool((out_s == out).all())

    grads = [cupy.empty(shape, dt) for _ in range(2)]
    be.qk_backward(problem, weights, q, k, *grads, None)
    grads_s = [cupy.full(wide, numpy.nan, dt)[..., ::2] for _ in range(2)]
    be.qk_backward(problem, weights, strided(q), strided(k), *grads_s, None)
    for g, gs in zip(grads, grads_s):
        assert bool((gs == g).all())

    d_attn, dv = cupy.empty((B, X, Y, H, K), dt), cupy.empty(shape, dt)
    be.av_backward(problem, d_out, weights, v, d_attn, dv)
    d_attn_s = cupy.full((B, X, Y, H, 2 * K), numpy.nan, dt)[..., ::2]
    dv_s = cupy.full(wide, numpy.nan, dt)[..., ::2]
    be.av_backward(problem, strided(d_out), weights, strided(v), d_attn_s, dv_s)
    assert bool((d_attn_s == d_attn).all())
    assert bool((dv_s == dv).all())


@pytest.mark.gpu
def test_rpb_gradient_in_several_passes(monkeypatch):
    """Offsets split over several shared-memory passes add up to the one-pass result."""
    import cupy
    rng = numpy.random.default_rng(9)
    shape = (2, 7, 9, 3, 32)
    ks, dil, causal = (5, 4), (1, 2), (True, False)
    be = get_backend("tiled")
    q = _device_inputs(cupy, shape, numpy.float16, rng)
    problem = _args.check_qk(2, q, q, ks, dil, causal, None, "tiled")
    d_attn = _device_inputs(cupy, shape[:-1] + (problem.num_neighbors,), numpy.float16, rng)
    one = cupy.zeros((3, 9, 7), numpy.float32)
    be._rpb_grad(problem, d_attn, one)
    monkeypatch.setattr(tiled, "RPB_SMEM_FLOATS", 10)
    several = cupy.zeros((3, 9, 7), numpy.float32)
    be._rpb_grad(problem, d_attn, several)
    numpy.testing.assert_allclose(cupy.asnumpy(several), cupy.asnumpy(one), rtol=1e-5,
                                  atol=1e-4)


def _problem(dtype, head_dim=32, allow_tf32=False):
    q = numpy.zeros((1, 9, 2, head_dim), dtype=dtype)
    return _args.check_qk(1, q, q, 3, 1, False, None, "tiled", allow_tf32=allow_tf32)


def test_refusals():
    be = tiled
    assert be.refuse("qk", _problem(numpy.float16)) is None
    assert be.refuse("av_backward", _problem(numpy.float32, allow_tf32=True)) is None
    assert be.refuse("qk_backward", _problem(numpy.float32)) is None
    assert "unfused" in be.refuse("fused_forward", _problem(numpy.float16))
    assert "float64" in be.refuse("qk", _problem(FLOAT64))
    assert "multiple of 8" in be.refuse("av", _problem(numpy.float16, head_dim=36))
    assert "multiple of 8" in be.refuse("av", _problem(numpy.float16, head_dim=264))


def test_instantiations_cover_every_config():
    exprs = {e for _, e in tiled.instantiations()}
    for dtype in tiled.DTYPES:
        for head_dim in range(8, 257, 8):
            for tf32 in (False, True):
                p = _problem(dtype, head_dim, allow_tf32=tf32)
                assert tiled._scores_expr(p) in exprs
                assert tiled._weighted_expr(p, True) in exprs
                assert tiled._weighted_expr(p, False) in exprs
        assert tiled._rpb_expr(p) in exprs


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [(False, False), (True, False)])
def test_unstaged_scores_match_staged(monkeypatch, causal):
    """Scores stored one by one (no room to stage a head in shared memory) equal the staged
    ones bit for bit, empty causal slots included."""
    import cupy
    rng = numpy.random.default_rng(3)
    shape = (1, 11, 9, 5, 40)
    q, k = (_device_inputs(cupy, shape, numpy.float16, rng) for _ in range(2))
    rpb = _device_inputs(cupy, (5, 7, 5), numpy.float16, rng)
    problem = _args.check_qk(2, q, k, (4, 3), (2, 1), causal, rpb, "tiled")
    assert tiled.score_heads(problem)[1]
    staged = cupy.full(shape[:-1] + (12,), numpy.nan, numpy.float16)
    tiled.qk(problem, q, k, rpb, staged)
    monkeypatch.setattr(tiled, "STAGE_BYTES", 1)
    assert not tiled.score_heads(problem)[1]
    direct = cupy.full(shape[:-1] + (12,), numpy.nan, numpy.float16)
    tiled.qk(problem, q, k, rpb, direct)
    assert not bool(cupy.isnan(direct).any())
    assert bool((direct == staged).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tf32", [("float16", False), ("float32", False)])
def test_unstaged_weighted_sums_match_staged(monkeypatch, dtype, tf32):
    """av and dq gathering weights from global memory equal the staged run bit for bit."""
    import cupy
    rng = numpy.random.default_rng(4)
    dt = numpy.dtype(dtype)
    shape = (2, 10, 7, 6, 32)
    v = _device_inputs(cupy, shape, dt, rng)
    problem = _args.check_av(2, cupy.zeros(shape[:-1] + (12,), dt), v, (3, 4), (3, 1),
                             (True, False), "tiled", allow_tf32=tf32)
    weights = _device_inputs(cupy, shape[:-1] + (12,), dt, rng)
    assert tiled.weight_stage_bytes(problem) > 0
    staged = cupy.full(shape, numpy.nan, dt)
    tiled.av(problem, weights, v, staged)
    monkeypatch.setattr(tiled, "WEIGHT_STAGE_BYTES", 0)
    assert tiled.weight_stage_bytes(problem) == 0
    direct = cupy.full(shape, numpy.nan, dt)
    tiled.av(problem, weights, v, direct)
    assert bool((direct == staged).all())
