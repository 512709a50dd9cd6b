"""Interop: NumPy and PyTorch (CPU) arrays in, the caller's array type out.

CPU inputs always run on the reference backend. The GPU tests at the end (CuPy arrays and
CUDA torch tensors on the reference backend) skip on machines without a GPU.
"""

import re

import ml_dtypes
import numpy
import pytest

import natten_cupy

torch = pytest.importorskip("torch")

BF16 = numpy.dtype(ml_dtypes.bfloat16)
SHAPE = (2, 7, 5, 3, 4)      # [B, X, Y, H, D]
KERNEL = (3, 2)
K = 6
RPB_SHAPE = (3, 5, 3)
TORCH_DTYPES = {numpy.dtype(numpy.float64): torch.float64,
                numpy.dtype(numpy.float32): torch.float32,
                numpy.dtype(numpy.float16): torch.float16, BF16: torch.bfloat16}


def inputs(dtype, seed=0):
    rng = numpy.random.default_rng(seed)
    names = ("q", "k", "v", "d_out", "d_attn", "rpb")
    shapes = (SHAPE,) * 4 + (SHAPE[:-1] + (K,), RPB_SHAPE)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in zip(names, shapes)}


def run_all(x, **kw):
    """All six ops of the 2-D API on the dict ``x``; returns a dict of results."""
    out, lse = natten_cupy.na2d(x["q"], x["k"], x["v"], KERNEL, return_lse=True,
                                is_causal=(True, False), **kw)
    dq, dk, dv = natten_cupy.na2d_backward(x["d_out"], x["q"], x["k"], x["v"], out, lse,
                                           KERNEL, is_causal=(True, False), **kw)
    attn = natten_cupy.na2d_qk(x["q"], x["k"], KERNEL, rpb=x["rpb"], **kw)
    av = natten_cupy.na2d_av(x["d_attn"], x["v"], KERNEL, **kw)
    qk_dq, qk_dk, d_rpb = natten_cupy.na2d_qk_backward(x["d_attn"], x["q"], x["k"], KERNEL,
                                                       rpb=x["rpb"], **kw)
    av_da, av_dv = natten_cupy.na2d_av_backward(x["d_out"], x["d_attn"], x["v"], KERNEL, **kw)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, attn=attn, av=av, qk_dq=qk_dq,
                qk_dk=qk_dk, d_rpb=d_rpb, av_da=av_da, av_dv=av_dv)


def to_torch(x):
    """NumPy (ml_dtypes bfloat16 too) -> CPU torch tensor with the same values."""
    if x.dtype == BF16:
        return torch.from_numpy(x.astype(numpy.float32)).to(torch.bfloat16)
    return torch.from_numpy(x.copy())


def to_numpy(t):
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(BF16)
    return t.numpy()


DTYPES = [numpy.float64, numpy.float32, numpy.float16, BF16]
DTYPE_IDS = ["float64", "float32", "float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_numpy_in_numpy_out(dtype):
    dtype = numpy.dtype(dtype)
    res = run_all(inputs(dtype))
    acc = numpy.float64 if dtype == numpy.float64 else numpy.float32
    for name, r in res.items():
        assert type(r) is numpy.ndarray, name
        assert r.dtype == (acc if name == "lse" else dtype), name
        assert r.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_cpu_in_torch_out(dtype):
    """Torch CPU tensors (bfloat16 included) give torch tensors equal to the NumPy path."""
    dtype = numpy.dtype(dtype)
    x = inputs(dtype)
    want = run_all(x)
    xt = {n: to_torch(a) for n, a in x.items()}
    saved = {n: t.clone() for n, t in xt.items()}
    got = run_all(xt)
    for name, r in got.items():
        assert isinstance(r, torch.Tensor) and r.device.type == "cpu", name
        assert r.dtype == TORCH_DTYPES[want[name].dtype], name
        numpy.testing.assert_array_equal(to_numpy(r), want[name], err_msg=name)
    for n, t in xt.items():
        assert torch.equal(t, saved[n]), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_permuted_inputs(dtype):
    """A [B, H, X, Y, D] tensor permuted to [B, X, Y, H, D] is read as is."""
    gen = torch.Generator().manual_seed(0)
    heads_first = [torch.randn(2, 3, 7, 5, 4, generator=gen).to(dtype) for _ in range(3)]
    q, k, v = (t.permute(0, 2, 3, 1, 4) for t in heads_first)
    assert not q.is_contiguous()
    got = natten_cupy.na2d(q, k, v, KERNEL, dilation=(2, 1))
    want = natten_cupy.na2d(*(t.contiguous() for t in (q, k, v)), KERNEL, dilation=(2, 1))
    assert got.dtype == dtype and torch.equal(got, want)


def test_results_do_not_alias_inputs():
    x = {n: to_torch(a) for n, a in inputs(numpy.float32).items()}
    out = natten_cupy.na2d(x["q"], x["k"], x["v"], KERNEL)
    assert out.data_ptr() not in {t.data_ptr() for t in x.values()}
    before = out.clone()
    x["q"].add_(1.0)
    assert torch.equal(out, before)


def test_mixing_numpy_and_torch_cpu():
    """A NumPy array next to CPU torch tensors works; the result is a NumPy array."""
    x = inputs(numpy.float32)
    want = natten_cupy.na2d(x["q"], x["k"], x["v"], KERNEL)
    got = natten_cupy.na2d(x["q"], to_torch(x["k"]), to_torch(x["v"]), KERNEL)
    assert type(got) is numpy.ndarray
    numpy.testing.assert_array_equal(got, want)
    dq, dk = natten_cupy.na2d_qk_backward(to_torch(x["d_attn"]), x["q"], to_torch(x["k"]),
                                          KERNEL)
    want_dq, want_dk = natten_cupy.na2d_qk_backward(x["d_attn"], x["q"], x["k"], KERNEL)
    numpy.testing.assert_array_equal(dq, want_dq)
    numpy.testing.assert_array_equal(dk, want_dk)


def test_torch_requires_grad_raises():
    x = {n: to_torch(a) for n, a in inputs(numpy.float32).items()}
    q = x["q"].requires_grad_()
    with pytest.raises(TypeError, match="q requires grad; the array-level calls do not record "
                                        "autograd. Use natten_cupy.torch"):
        natten_cupy.na2d(q, x["k"], x["v"], KERNEL)
    rpb = x["rpb"].requires_grad_()
    with pytest.raises(TypeError, match="rpb requires grad"):
        natten_cupy.na2d_qk(x["q"].detach(), x["k"], KERNEL, rpb=rpb)
    # Detached, the same tensors work.
    assert natten_cupy.na2d(q.detach(), x["k"], x["v"], KERNEL).shape == SHAPE


@pytest.mark.parametrize("bad", [[[1.0]], "q", b"q", 1.5, {"shape": (1,)}])
def test_unsupported_objects_raise_type_error(bad):
    x = inputs(numpy.float32)
    with pytest.raises(TypeError, match=f"q must be an array .*got {type(bad).__name__}"):
        natten_cupy.na2d(bad, x["k"], x["v"], KERNEL)
    with pytest.raises(TypeError, match=f"v must be an array .*got {type(bad).__name__}"):
        natten_cupy.na2d_av(x["d_attn"], bad, KERNEL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_negative_views_are_read_negated(dtype):
    q = torch.randn(SHAPE).to(dtype)
    neg = torch.complex(torch.zeros(SHAPE), q.float()).conj().imag.to(dtype) \
        if dtype == torch.float32 else torch._neg_view(q)
    assert neg.is_neg()
    got = natten_cupy.na2d(neg, q, q, KERNEL)
    want = natten_cupy.na2d(-q, q, q, KERNEL)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_launch_stream_is_the_current_stream_of_the_arrays_gpu():
    """CuPy keeps a current stream per device: arrays on GPU 1 launch on GPU 1's, whatever
    device is current (checked with a stand-in CuPy module, no GPU needed)."""
    from natten_cupy import _arrays

    class FakeCuda:
        @staticmethod
        def get_current_stream(device_id=-1):
            return ("stream of device", device_id)

    class FakeCupy:
        cuda = FakeCuda
        ndarray = type(None)

    class OnGpu1:
        def __dlpack_device__(self):
            return (2, 1)

    got = _arrays._caller_stream(FakeCupy, "dlpack", [("q", OnGpu1())],
                                 _arrays._device_id(FakeCupy, OnGpu1()))
    assert got == ("stream of device", 1)


def test_torch_layer_and_array_api_share_the_launch_context(monkeypatch):
    """Both ways in launch on torch's current stream of the tensors' GPU, that GPU current,
    through the same ``_arrays`` helpers (stand-in CuPy and torch stream, no GPU needed)."""
    from natten_cupy import _arrays, _torch_common
    entered = []

    class Context:
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            entered.append(self.what)

        def __exit__(self, *exc):
            entered.append(("left",) + self.what)

    class FakeCuda:
        class Stream:
            @staticmethod
            def from_external(stream):
                return Context(("stream", stream))

        @staticmethod
        def Device(device_id):
            return Context(("device", device_id))

    class FakeCupy:
        cuda = FakeCuda
        ndarray = type(None)

    monkeypatch.setattr(_arrays, "_cupy", lambda: FakeCupy)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"torch's on {device}")
    gpu1 = torch.device("cuda", 1)
    with _torch_common._on_torch_stream(gpu1):
        pass
    tensor = type("TensorOnGpu1", (), {"device": gpu1})()
    stream = _arrays._caller_stream(FakeCupy, "torch", [("q", tensor)], 1)
    with _arrays.Inputs(FakeCupy, "torch", stream, [], 1).on_device():
        pass
    once = [("device", 1), ("stream", "torch's on cuda:1"), ("left", "stream", "torch's on cuda:1"),
            ("left", "device", 1)]
    assert entered == once * 2
    with _torch_common._on_torch_stream(torch.device("cpu")):
        pass
    assert entered == once * 2


def test_torch_layer_shares_the_device_errors(monkeypatch):
    from natten_cupy import _arrays, _torch_common
    assert _arrays.module_for(False) is numpy
    with pytest.raises(ValueError, match=re.escape("all arrays must be on the same GPU, got "
                                                   "devices [0, 1]")):
        _arrays.check_one_gpu([1, 0, 1])
    _arrays.check_one_gpu([1, 1])
    _arrays.check_one_gpu([])
    monkeypatch.setattr(_arrays, "_cupy", lambda: None)
    with pytest.raises(TypeError, match="GPU arrays were given but CuPy is not installed"):
        _torch_common._on_torch_stream(torch.device("cuda", 0))


def test_torch_meta_tensor_raises_type_error():
    x = torch.empty(SHAPE, device="meta")
    q = torch.zeros(SHAPE)
    with pytest.raises(TypeError, match="k lives on a device DLPack cannot describe"):
        natten_cupy.na2d(q, x, q, KERNEL)


def test_torch_unsupported_dtype():
    x = {n: to_torch(a) for n, a in inputs(numpy.float32).items()}
    with pytest.raises(TypeError, match="k has dtype torch.int32; supported"):
        natten_cupy.na2d(x["q"], x["k"].to(torch.int32), x["v"], KERNEL)


def test_torch_empty_batch():
    q = torch.zeros((0,) + SHAPE[1:])
    out, lse = natten_cupy.na2d(q, q, q, KERNEL, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32


# ---- GPU: the reference backend on CuPy arrays and CUDA tensors -------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cupy_reference_matches_numpy(dtype):
    import cupy
    x = inputs(numpy.dtype(dtype))
    want = run_all(x)
    got = run_all({n: cupy.asarray(a) for n, a in x.items()}, backend="reference")
    for name, r in got.items():
        assert isinstance(r, cupy.ndarray), name
        tol = 1e-12 if dtype == numpy.float64 else 1e-5
        numpy.testing.assert_allclose(cupy.asnumpy(r).astype(numpy.float64),
                                      want[name].astype(numpy.float64), rtol=tol, atol=tol,
                                      err_msg=name)


@pytest.mark.gpu
def test_torch_cuda_reference_gives_cuda_tensors():
    x = inputs(numpy.float32)
    want = run_all(x)
    got = run_all({n: to_torch(a).cuda() for n, a in x.items()}, backend="reference")
    for name, r in got.items():
        assert isinstance(r, torch.Tensor) and r.is_cuda, name
        numpy.testing.assert_allclose(r.cpu().numpy(), want[name], rtol=1e-5, atol=1e-5,
                                      err_msg=name)


def test_cuda_arrays_without_a_usable_gpu_get_one_clear_sentence(monkeypatch):
    """A CUDA array on a machine where CuPy cannot use a GPU: NoGPUError naming the reason,
    before any CuPy call (CuPy would say 'CUDA driver version is insufficient')."""
    from natten_cupy import _device, _env

    class FakeCuda:
        shape, dtype, ndim = (1, 8, 1, 4), numpy.dtype(numpy.float32), 4

        def __dlpack_device__(self):
            return (2, 0)   # kDLCUDA

    monkeypatch.setattr(_env, "gpu_unavailable_reason", lambda: "no GPU in this test")
    x = FakeCuda()
    with pytest.raises(_env.NoGPUError, match="no GPU in this test"):
        natten_cupy.na1d(x, x, x, 3)
