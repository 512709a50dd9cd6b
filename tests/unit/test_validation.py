"""Every error message of argument validation (``_args``) and interop (``_arrays``).

Each bad input raises the documented type with a message that names the argument, the rule
and the value given (SPEC section 5), before any work; the caller's arrays are untouched.
"""

import re
import types

import numpy
import pytest

import natten_cupy
from natten_cupy import _arrays


def arr(*shape, dtype=numpy.float32):
    return numpy.random.default_rng(0).standard_normal(shape).astype(dtype)


def qkv(shape=(1, 9, 2, 4), dtype=numpy.float32):
    return arr(*shape, dtype=dtype), arr(*shape, dtype=dtype), arr(*shape, dtype=dtype)


# ---- ranks, shapes, dtypes ------------------------------------------------------------

def test_wrong_rank_for_the_call():
    q, k, v = qkv((1, 9, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "q must have 5 dimensions [B, X, Y, H, D] for a 2-D call, got shape (1, 9, 2, 4)")):
        natten_cupy.na2d(q, k, v, 3)
    q3 = arr(1, 5, 5, 5, 5, 2, 4)
    with pytest.raises(ValueError, match=r"q must have 6 dimensions \[B, X, Y, Z, H, D\]"):
        natten_cupy.na3d(q3, q3, q3, 3)


def test_shape_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape(
            "k shape (1, 8, 2, 4) does not match q shape (1, 9, 2, 4)")):
        natten_cupy.na1d(q, arr(1, 8, 2, 4), v, 3)
    with pytest.raises(ValueError, match=re.escape("v shape (1, 8, 2, 5) does not match q")):
        natten_cupy.na1d(q, k, arr(1, 8, 2, 5), 3)   # (a value head dim of its own is fine)


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="v dtype float16 does not match q dtype float32"):
        natten_cupy.na1d(q, k, v.astype(numpy.float16), 3)


@pytest.mark.parametrize("dtype", [numpy.int32, numpy.complex64, numpy.bool_])
def test_unsupported_dtype(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k has dtype \w+; supported: float64, float32, "
                                        r"float16, bfloat16"):
        natten_cupy.na1d(q, k.astype(dtype), v, 3)


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], "q", 3.0, None])
def test_non_array_argument(bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q must be an array \(NumPy, CuPy, or a DLPack "
                                        rf"tensor\), got {type(bad).__name__}"):
        natten_cupy.na1d(bad, k, v, 3)


def test_zero_spatial_extent():
    q, k, v = qkv((1, 0, 5, 2, 4))
    with pytest.raises(ValueError, match=re.escape("spatial extents must be positive, got "
                                                   "(0, 5)")):
        natten_cupy.na2d(q, k, v, 3)


def test_zero_head_dim():
    q, k, v = qkv((1, 9, 2, 0))
    with pytest.raises(ValueError, match=re.escape("head dim must be positive, got shape "
                                                   "(1, 9, 2, 0)")):
        natten_cupy.na1d(q, k, v, 3)


# ---- per-axis options -----------------------------------------------------------------

def test_kernel_size_too_small():
    q, k, v = qkv((1, 9, 9, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "kernel_size must be >= 2 on every axis, got (3, 1)")):
        natten_cupy.na2d(q, k, v, (3, 1))


def test_wrong_number_of_axes():
    q, k, v = qkv((1, 9, 9, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "kernel_size must have 2 entries for a 2-D call, got (3, 3, 3)")):
        natten_cupy.na2d(q, k, v, (3, 3, 3))
    with pytest.raises(ValueError, match=re.escape(
            "is_causal must have 2 entries for a 2-D call, got (True,)")):
        natten_cupy.na2d(q, k, v, 3, is_causal=(True,))
    q1, k1, v1 = qkv()
    with pytest.raises(ValueError, match=re.escape(
            "dilation must have 1 entry for a 1-D call, got [1, 2]")):
        natten_cupy.na1d(q1, k1, v1, 3, dilation=[1, 2])


@pytest.mark.parametrize("stride", [0, 4, (1, 5), -1])
def test_stride_out_of_range(stride):
    q, k, v = qkv((1, 9, 9, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            f"stride must satisfy 1 <= stride <= kernel_size on every axis, got "
            f"stride={stride!r} with kernel_size=(3, 4)")):
        natten_cupy.na2d(q, k, v, (3, 4), stride=stride)


def test_dilation_too_small():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape("dilation must be >= 1 on every axis, "
                                                   "got 0")):
        natten_cupy.na1d(q, k, v, 3, dilation=0)


def test_kernel_times_dilation_exceeds_extent():
    q, k, v = qkv((1, 9, 7, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "axis 1 has kernel_size 4 * dilation 2 = 8 > extent 7")):
        natten_cupy.na2d(q, k, v, 4, dilation=(2, 2))
    with pytest.raises(ValueError, match="kernel_size \\* dilation must not exceed the extent"):
        natten_cupy.na2d_qk(q, k, (10, 3))


@pytest.mark.parametrize("name,value,what", [
    ("kernel_size", 3.0, "an int"), ("kernel_size", "3", "an int"),
    ("kernel_size", True, "an int"), ("stride", 1.5, "an int"),
    ("dilation", None, "an int"), ("is_causal", 1, "a bool"), ("is_causal", "yes", "a bool"),
])
def test_bad_option_type(name, value, what):
    q, k, v = qkv()
    kw = {"kernel_size": 3, name: value}
    with pytest.raises(TypeError, match=re.escape(f"{name} must be {what} or a tuple of 1, "
                                                  f"got {value!r}")):
        natten_cupy.na1d(q, k, v, **kw)


def test_bad_entry_type_in_tuple():
    q, k, v = qkv((1, 9, 9, 2, 4))
    with pytest.raises(TypeError, match=re.escape(
            "kernel_size must be an int or a tuple of them, got (3, 3.0)")):
        natten_cupy.na2d(q, k, v, (3, 3.0))
    with pytest.raises(TypeError, match=re.escape(
            "is_causal must be a bool or a tuple of them, got (True, 0)")):
        natten_cupy.na2d(q, k, v, 3, is_causal=(True, 0))


@pytest.mark.parametrize("scale", ["0.5", True, [0.5]])
def test_bad_scale_type(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=re.escape(f"scale must be a real number or None, got "
                                                  f"{scale!r}")):
        natten_cupy.na1d(q, k, v, 3, scale=scale)


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_non_finite_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be finite, got"):
        natten_cupy.na1d(q, k, v, 3, scale=scale)


# ---- backends and options -------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cuda", "Reference"])
def test_bad_backend_name(backend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape(
            f"backend must be one of auto, reference, naive, tiled, fused, got {backend!r}")):
        natten_cupy.na1d(q, k, v, 3, backend=backend)


@pytest.mark.parametrize("backend", [3, None])
def test_bad_backend_type(backend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=re.escape(
            "backend must be a str, one of auto, reference, naive, tiled, fused, got "
            f"{backend!r}")):
        natten_cupy.na1d(q, k, v, 3, backend=backend)


@pytest.mark.parametrize("backend", ["naive", "tiled", "fused"])
def test_gpu_backend_for_numpy_arrays(backend):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape(
            f"backend {backend!r} runs on the GPU and needs CuPy or CUDA arrays; NumPy/CPU "
            "arrays run on backend 'reference'")):
        natten_cupy.na1d(q, k, v, 3, backend=backend)
    with pytest.raises(ValueError, match="runs on the GPU"):
        natten_cupy.na1d_qk(q, k, 3, backend=backend)


@pytest.mark.parametrize("tile", [(0, 4), (), "64", (64, 2.0)])
def test_bad_tile(tile):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape(f"tile must be a tuple of positive ints or "
                                                   f"'autotune', got {tile!r}")):
        natten_cupy.na1d(q, k, v, 3, tile=tile)


# ---- backward arguments ----------------------------------------------------------------

def _forward(dtype=numpy.float32):
    q, k, v = qkv(dtype=dtype)
    out, lse = natten_cupy.na1d(q, k, v, 3, return_lse=True)
    return q, k, v, out, lse


def test_lse_shape():
    q, k, v, out, lse = _forward()
    with pytest.raises(ValueError, match=re.escape(
            "lse shape (1, 9, 2, 1) must be q's shape without the head dim, (1, 9, 2)")):
        natten_cupy.na1d_backward(out, q, k, v, out, lse[..., None], 3)


@pytest.mark.parametrize("dtype,lse_dtype,want", [
    (numpy.float16, numpy.float16, "float32"), (numpy.float32, numpy.float64, "float32"),
    (numpy.float64, numpy.float32, "float64")])
def test_lse_dtype(dtype, lse_dtype, want):
    q, k, v, out, lse = _forward(dtype)
    with pytest.raises(ValueError, match=f"lse dtype must be {want} for {numpy.dtype(dtype)} "
                                         f"inputs, got {numpy.dtype(lse_dtype)}"):
        natten_cupy.na1d_backward(out, q, k, v, out, lse.astype(lse_dtype), 3)


def test_lse_not_an_array():
    q, k, v, out, lse = _forward()
    with pytest.raises(TypeError, match="lse must be an array"):
        natten_cupy.na1d_backward(out, q, k, v, out, lse.tolist(), 3)


def test_backward_shape_mismatch_names_the_argument():
    q, k, v, out, lse = _forward()
    with pytest.raises(ValueError, match=re.escape("d_out shape (1, 9, 2, 3) does not match q")):
        natten_cupy.na1d_backward(out[..., :3], q, k, v, out, lse, 3)
    with pytest.raises(ValueError, match="out dtype float64 does not match q dtype float32"):
        natten_cupy.na1d_backward(out, q, k, v, out.astype(numpy.float64), lse, 3)


# ---- unfused: attn and rpb -------------------------------------------------------------

def test_attn_shape():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape(
            "attn shape (1, 9, 2, 4) does not match the expected shape (1, 9, 2, 3)")):
        natten_cupy.na1d_av(arr(1, 9, 2, 4), v, 3)
    with pytest.raises(ValueError, match=re.escape(
            "attn must have 4 dimensions [B, L, H, K] for a 1-D call, got shape (9, 2, 3)")):
        natten_cupy.na1d_av(arr(9, 2, 3), v, 3)
    with pytest.raises(ValueError, match=re.escape(
            "d_attn shape (1, 9, 2, 9) does not match the expected shape (1, 9, 2, 3)")):
        natten_cupy.na1d_qk_backward(arr(1, 9, 2, 9), q, k, 3)
    with pytest.raises(ValueError, match="attn dtype float64 does not match the expected "
                                         "dtype float32"):
        natten_cupy.na1d_av_backward(v, arr(1, 9, 2, 3, dtype=numpy.float64), v, 3)


def test_rpb_shape_and_dtype():
    q, k, v = qkv((1, 9, 9, 2, 4))
    with pytest.raises(ValueError, match=re.escape(
            "rpb shape (2, 5, 3) must be [H, 2k-1, ...] = (2, 5, 5)")):
        natten_cupy.na2d_qk(q, k, 3, rpb=arr(2, 5, 3))
    with pytest.raises(ValueError, match=re.escape(
            "rpb shape (3, 5, 5) must be [H, 2k-1, ...] = (2, 5, 5)")):
        natten_cupy.na2d_qk_backward(arr(1, 9, 9, 2, 9), q, k, 3, rpb=arr(3, 5, 5))
    with pytest.raises(ValueError, match="rpb dtype float16 does not match q dtype float32"):
        natten_cupy.na2d_qk(q, k, 3, rpb=arr(2, 5, 5, dtype=numpy.float16))
    with pytest.raises(TypeError, match="rpb must be an array"):
        natten_cupy.na2d_qk(q, k, 3, rpb=[[0.0]])
    with pytest.raises(TypeError, match="rpb has dtype int64; supported: float64"):
        natten_cupy.na2d_qk(q, k, 3, rpb=numpy.zeros((2, 5, 5), dtype=numpy.int64))


# ---- interop errors (_arrays) ---------------------------------------------------------

class FakeTensor:
    """Array-shaped object that claims a DLPack device (no data)."""

    def __init__(self, like, device_type=None):
        self.shape, self.dtype, self.ndim = like.shape, like.dtype, like.ndim
        if device_type is not None:
            self._dev = (device_type, 0)

    def __dlpack_device__(self):
        return self._dev


class NoDLPack:
    def __init__(self, like):
        self.shape, self.dtype, self.ndim = like.shape, like.dtype, like.ndim


def test_array_like_without_dlpack():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be an array \\(NumPy, CuPy, or a DLPack "
                                        "tensor\\), got NoDLPack"):
        natten_cupy.na1d(q, NoDLPack(k), v, 3)


def test_unsupported_dlpack_device():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="v lives on DLPack device type 7; only CPU and CUDA "
                                        "arrays are supported"):
        natten_cupy.na1d(q, k, FakeTensor(v, device_type=7), 3)


def test_mixing_cpu_and_gpu_arrays():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="all arrays must be on the same device, got q on CPU, "
                                         "k on GPU, v on CPU"):
        natten_cupy.na1d(q, FakeTensor(k, device_type=2), v, 3)


def test_arrays_on_two_gpus_before_any_gpu_work(monkeypatch):
    monkeypatch.setattr(_arrays, "_cupy", lambda: types.SimpleNamespace(ndarray=type(None)))
    q, k, v = qkv()
    gpu = [FakeTensor(x, device_type=2) for x in (q, k, v)]
    gpu[2]._dev = (2, 1)
    with pytest.raises(ValueError, match=re.escape("all arrays must be on the same GPU, got "
                                                   "devices [0, 1]")):
        natten_cupy.na1d(*gpu, 3, backend="reference")


def test_gpu_arrays_without_cupy(monkeypatch):
    q, k, v = qkv()
    monkeypatch.setattr(_arrays, "_cupy", lambda: None)
    gpu = [FakeTensor(x, device_type=2) for x in (q, k, v)]
    with pytest.raises(TypeError, match="GPU arrays were given but CuPy is not installed"):
        natten_cupy.na1d(*gpu, 3)


def test_backend_refusal_comes_before_any_gpu_work(monkeypatch):
    """A backend that cannot run the problem is refused before the arrays are imported into
    CuPy (no stream is asked for, no DLPack import runs)."""
    def touched(*args):
        raise AssertionError("GPU touched before the backend was chosen")
    monkeypatch.setattr(_arrays, "_caller_stream", touched)
    monkeypatch.setattr(_arrays, "_as_cupy", touched)
    monkeypatch.setattr(_arrays, "_cupy", lambda: types.SimpleNamespace(ndarray=type(None)))
    gpu = [FakeTensor(x, device_type=2) for x in qkv(dtype=numpy.float64)]
    with pytest.raises(ValueError, match="backend 'fused' cannot run fused_forward"):
        natten_cupy.na1d(*gpu, 3, backend="fused")


# ---- empty problems, untouched inputs ---------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 9, 2, 4), (2, 9, 0, 4)], ids=["batch0", "heads0"])
def test_zero_batch_or_heads_gives_empty_results(shape):
    q, k, v = qkv(shape)
    out, lse = natten_cupy.na1d(q, k, v, 3, return_lse=True)
    assert out.shape == shape and lse.shape == shape[:-1]
    assert lse.dtype == numpy.float32
    grads = natten_cupy.na1d_backward(out, q, k, v, out, lse, 3)
    assert [g.shape for g in grads] == [shape] * 3
    rpb = numpy.zeros((shape[2], 5), dtype=numpy.float32)
    attn = natten_cupy.na1d_qk(q, k, 3, rpb=rpb)
    assert attn.shape == shape[:-1] + (3,)
    assert natten_cupy.na1d_av(attn, v, 3).shape == shape
    dq, dk, d_rpb = natten_cupy.na1d_qk_backward(attn, q, k, 3, rpb=rpb)
    assert dq.shape == dk.shape == shape and d_rpb.shape == rpb.shape
    assert not d_rpb.any()
    d_attn, dv = natten_cupy.na1d_av_backward(out, attn, v, 3)
    assert d_attn.shape == attn.shape and dv.shape == shape


def test_failing_calls_leave_inputs_unchanged():
    q, k, v, out, lse = _forward()
    saved = [x.copy() for x in (q, k, v, out, lse)]
    failing = [
        lambda: natten_cupy.na1d(q, k, v, 3, stride=5),
        lambda: natten_cupy.na1d(q, k, v, 3, backend="fused"),
        lambda: natten_cupy.na1d_backward(out, q, k, v, out, lse.astype(numpy.float16), 3),
        lambda: natten_cupy.na1d_backward(out, q, k, v, out, lse, 3, dilation=4),
        lambda: natten_cupy.na1d_av(out[..., :3], v.astype(numpy.float16), 3),
        lambda: natten_cupy.na1d_qk_backward(out[..., :3], q, k, 3, rpb=lse),
    ]
    for call in failing:
        with pytest.raises((ValueError, TypeError)):
            call()
        for x, s in zip((q, k, v, out, lse), saved):
            numpy.testing.assert_array_equal(x, s)
