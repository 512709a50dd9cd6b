"""The softmax kernels (cuda_src/na_softmax.cu) against float64 on the GPU.

Every output element must be written: the output's memory is poisoned with NaN first (CuPy's
pool hands the freed poisoned block to the next allocation of the same size; the test checks
that it did). Rows counts are odd so the last warp is partial; K covers one lane per row up
to whole warps striding over thousands of slots.
"""

import numpy
import pytest

import natten_cupy
from gpu_cases import DTYPES as DTYPES_NP, to_host, upload

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16", "float32", "float64")
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}


def _poisoned_call(cupy, fn, like):
    """fn() with its result allocated over a NaN-filled block; asserts the block was reused."""
    junk = upload(cupy, numpy.full(like.shape, numpy.nan, dtype=like.dtype))
    ptr = junk.data.ptr
    del junk
    out = fn()
    assert out.data.ptr == ptr, "the output did not reuse the poisoned block"
    return out


def _inputs(rng, dtype, rows, k, empty_rows=True):
    """(host array of dtype, the same values in float64); -inf tails on every third row."""
    x = (rng.standard_normal((rows, k)) * 2).astype(DTYPES_NP[dtype])
    if empty_rows:
        for r in range(0, rows, 3):
            x[r, int(rng.integers(1, k + 1)):] = -numpy.inf
    return x, x.astype(numpy.float64)


def _misaligned(cupy, a):
    """a's values in an array that starts 1 element past a 16-byte boundary (group kernels)."""
    buf = cupy.empty(a.size + 8, dtype=a.dtype)
    view = buf[1:1 + a.size].reshape(a.shape)
    word = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[a.dtype.itemsize]
    view.view(word)[...] = a.view(word)
    assert view.data.ptr % 16
    return view


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 9, 25, 81, 128, 169, 256, 257, 2047, 5000])
def test_forward_and_backward(rng, dtype, k, aligned):
    """Aligned inputs of short rows take the one-lane-a-row kernels, the rest the lane-group
    kernels (registers, or streamed for long rows)."""
    cupy = pytest.importorskip("cupy")
    rows = 1237 if k < 1000 else 67
    xh, a = _inputs(rng, dtype, rows, k)
    x = upload(cupy, xh)
    if not aligned:
        x = _misaligned(cupy, x)
    scale = 0.37
    a = a * scale
    m = numpy.max(a, axis=-1, keepdims=True)
    e = numpy.where(numpy.isfinite(a), numpy.exp(a - m), 0.0)
    truth = e / e.sum(-1, keepdims=True)

    p = _poisoned_call(cupy, lambda: natten_cupy.softmax(x, scale), x)
    ph = to_host(p)
    assert not numpy.isnan(ph).any()
    assert (ph[~numpy.isfinite(a)] == 0).all()
    numpy.testing.assert_allclose(ph, truth, atol=TOL[dtype] * truth.max(), rtol=0)

    gh, g64 = _inputs(rng, dtype, rows, k, empty_rows=False)
    g = upload(cupy, gh)
    if not aligned:
        g = _misaligned(cupy, g)
    dtruth = scale * ph * (g64 - (ph * g64).sum(-1, keepdims=True))
    dx = _poisoned_call(cupy, lambda: natten_cupy.softmax_backward(p, g, scale), p)
    dxh = to_host(dx)
    assert not numpy.isnan(dxh).any()
    numpy.testing.assert_allclose(dxh, dtruth, atol=2 * TOL[dtype] * numpy.abs(dtruth).max(),
                                  rtol=0)


def test_strided_input_and_leading_axes(rng):
    cupy = pytest.importorskip("cupy")
    base = cupy.asarray(rng.standard_normal((2, 9, 4, 7, 30)), dtype=cupy.float32)
    x = base.transpose(0, 3, 1, 2, 4)[..., ::2]          # not contiguous, K = 15
    p = natten_cupy.softmax(x, 1.5)
    want = natten_cupy.softmax(cupy.asnumpy(x), 1.5)
    numpy.testing.assert_allclose(cupy.asnumpy(p), want, atol=1e-6)
    assert p.shape == x.shape


def test_torch_cuda_tensors_on_the_current_stream():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    x = torch.randn(33, 4, 81, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        p = natten_cupy.softmax(x, 0.5)
        g = torch.randn_like(x)
        dx = natten_cupy.softmax_backward(p, g, 0.5)
    s.synchronize()
    assert isinstance(p, torch.Tensor) and p.device.type == "cuda"
    torch.testing.assert_close(p.float(), torch.softmax(0.5 * x.float(), -1), atol=2e-3, rtol=0)
    xr = x.float().requires_grad_()
    torch.softmax(0.5 * xr, -1).backward(g.float())
    torch.testing.assert_close(dx.float(), xr.grad, atol=5e-3, rtol=0)
