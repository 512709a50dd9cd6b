"""natten_cupy.softmax / softmax_backward on the CPU: math, -inf slots, validation, interop."""

import numpy
import pytest

import natten_cupy
from natten_cupy import _softmax


def _truth(x, scale):
    """Softmax in float64 straight from the definition, -inf slots at 0."""
    a = numpy.asarray(x, dtype=numpy.float64) * scale
    out = numpy.zeros_like(a)
    for idx in numpy.ndindex(a.shape[:-1]):
        row = a[idx]
        keep = numpy.isfinite(row)
        if keep.any():
            e = numpy.exp(row[keep] - row[keep].max())
            out[idx][keep] = e / e.sum()
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("k", [1, 4, 9, 81, 300])
def test_forward_matches_definition(rng, dtype, k):
    x = rng.standard_normal((3, 7, 2, k)).astype(dtype) * 3
    if k > 1:
        x[0, :, :, k // 2:] = -numpy.inf   # causal-like empty slots
    before = x.copy()
    p = natten_cupy.softmax(x, 0.7)
    assert p.dtype == x.dtype and p.shape == x.shape
    tol = {"float64": 1e-12, "float32": 1e-6, "float16": 1e-3}[dtype]
    numpy.testing.assert_allclose(p.astype(numpy.float64), _truth(x, 0.7), atol=tol, rtol=tol)
    numpy.testing.assert_array_equal(x, before)   # the input is not modified
    assert (p[0, :, :, k // 2:] == 0).all() if k > 1 else True


def test_row_of_only_empty_slots_gives_zeros():
    x = numpy.full((2, 5), -numpy.inf, dtype=numpy.float32)
    x[1, 2] = 4.0
    p = natten_cupy.softmax(x)
    assert not numpy.isnan(p).any()
    numpy.testing.assert_array_equal(p[0], 0)
    numpy.testing.assert_array_equal(p[1], [0, 0, 1, 0, 0])


def test_backward_matches_finite_differences(rng):
    x = rng.standard_normal((4, 6))
    x[1, 4:] = -numpy.inf
    g = rng.standard_normal((4, 6))
    scale = 0.8
    p = natten_cupy.softmax(x, scale)
    dx = natten_cupy.softmax_backward(p, g, scale)
    eps = 1e-6
    num = numpy.zeros_like(x)
    for idx in numpy.ndindex(x.shape):
        if not numpy.isfinite(x[idx]):
            continue
        hi, lo = x.copy(), x.copy()
        hi[idx] += eps
        lo[idx] -= eps
        num[idx] = ((natten_cupy.softmax(hi, scale) - natten_cupy.softmax(lo, scale)) * g).sum() / (2 * eps)
    numpy.testing.assert_allclose(dx, num, atol=1e-7, rtol=1e-6)
    assert (dx[1, 4:] == 0).all()


def test_chain_equals_fused_forward(rng):
    """qk -> softmax -> av (all public calls) equals the fused na2d on NumPy inputs."""
    q, k, v = (rng.standard_normal((1, 9, 8, 2, 8)) for _ in range(3))
    kw = dict(dilation=(1, 2), is_causal=(True, False))
    logits = natten_cupy.na2d_qk(q, k, (3, 3), **kw)
    out = natten_cupy.na2d_av(natten_cupy.softmax(logits, 8 ** -0.5), v, (3, 3), **kw)
    numpy.testing.assert_allclose(out, natten_cupy.na2d(q, k, v, (3, 3), **kw), atol=1e-12)


def test_lanes_per_row():
    ks = (1, 4, 5, 9, 25, 81, 128, 129, 4096)
    assert [_softmax.lanes_per_row(k, "backward") for k in ks] == [1, 1, 2, 4, 8, 32, 32, 32, 32]
    assert [_softmax.lanes_per_row(k, "forward") for k in ks] == [1, 1, 1, 2, 4, 16, 16, 32, 32]


def test_slots_per_lane():
    # Backward: rows up to 128 slots hold 4 a lane, up to 256 8 a lane (a warp); longer stream.
    ks = (1, 4, 5, 81, 128, 129, 256, 257, 5000)
    assert [_softmax.slots_per_lane(k, "float", "backward") for k in ks] == \
        [4, 4, 4, 4, 4, 8, 8, 0, 0]
    assert [_softmax.slots_per_lane(k, "float", "forward") for k in ks] == \
        [4, 4, 8, 8, 8, 8, 8, 0, 0]
    assert [_softmax.slots_per_lane(k, "double", "backward") for k in (81, 128, 129, 256)] == \
        [4, 4, 0, 0]


def test_every_dtype_has_both_kernels():
    names = [e for _, e in _softmax.instantiations()]
    for t in ("double", "float", "__half", "__nv_bfloat16"):
        for v in (0, 4) + ((8,) if t != "double" else ()):
            assert f"natten::softmax::na_softmax_forward<{t}, {v}>" in names
            assert f"natten::softmax::na_softmax_backward<{t}, {v}>" in names


@pytest.mark.parametrize("call, exc, match", [
    (lambda x: natten_cupy.softmax([1.0, 2.0]), TypeError, "attn must be an array"),
    (lambda x: natten_cupy.softmax(x.astype(numpy.int32)), TypeError, "attn has dtype int32"),
    (lambda x: natten_cupy.softmax(x[..., :0]), ValueError, r"attn must have a non-empty .*\(3, 0\)"),
    (lambda x: natten_cupy.softmax(x, "2"), TypeError, "scale must be a real number or None, got '2'"),
    (lambda x: natten_cupy.softmax(x, True), TypeError, "scale must be a real number or None, got True"),
    (lambda x: natten_cupy.softmax(x, float("inf")), ValueError, "scale must be finite, got inf"),
    (lambda x: natten_cupy.softmax_backward(x, x[:2]), ValueError,
     r"d_probs shape \(2, 5\) does not match probs shape \(3, 5\)"),
    (lambda x: natten_cupy.softmax_backward(x, x.astype(numpy.float16)), ValueError,
     "d_probs dtype float16 does not match probs dtype float32"),
    (lambda x: natten_cupy.softmax_backward(x, None), TypeError, "d_probs must be an array"),
])
def test_bad_input(call, exc, match):
    x = numpy.ones((3, 5), dtype=numpy.float32)
    with pytest.raises(exc, match=match):
        call(x)


def test_torch_cpu_tensors_round_trip():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 9, dtype=torch.float64)
    p = natten_cupy.softmax(x, 0.5)
    assert isinstance(p, torch.Tensor)
    torch.testing.assert_close(p, torch.softmax(0.5 * x, dim=-1))
    g = torch.randn_like(x)
    xr = x.clone().requires_grad_()
    torch.softmax(0.5 * xr, dim=-1).backward(g)
    torch.testing.assert_close(natten_cupy.softmax_backward(p, g, 0.5), xr.grad)


def test_row_kernels_take_short_rows_of_aligned_arrays():
    class Arr:  # what use_row_kernels reads of a CuPy array
        def __init__(self, ptr):
            self.data = type("Mem", (), {"ptr": ptr})()

    aligned, off = Arr(1 << 20), Arr((1 << 20) + 2)
    limit = _softmax.ROW_TILE_BYTES // 32          # bytes a row may have
    assert _softmax.use_row_kernels(81, 2, 1, aligned, aligned)
    assert _softmax.use_row_kernels(81, 2, 2, aligned, aligned, aligned)
    assert _softmax.use_row_kernels(limit // 4, 4, 1, aligned)
    assert not _softmax.use_row_kernels(limit // 4 + 1, 4, 1, aligned)
    assert not _softmax.use_row_kernels(limit // 8 + 1, 4, 2, aligned)   # backward: 2 tiles
    assert not _softmax.use_row_kernels(81, 2, 1, aligned, off)
