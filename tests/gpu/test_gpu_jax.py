"""JAX GPU arrays through na2d forward and backward: zero-copy in, JAX GPU arrays out.

A JAX array on a CUDA device is viewed as a CuPy array through DLPack (no copy), runs on the
GPU backends, and its results come back as JAX arrays on the same GPU, sharing the memory
the kernels wrote (no copy either). Checked against the float64 oracle with the GPU suite's
rule (``gpu_cases``: FACTOR x the CPU reference's own error in the dtype + FLOORS), on one
geometry with odd extents, a causal axis and dilation, in float32, float16 and bfloat16.
Also: JAX GPU next to NumPy arrays is refused (different devices), next to CuPy arrays it
runs and gives CuPy arrays (mixed frameworks: no single caller type).

Marked gpu (skipped without a GPU, as every GPU test) and skipped when JAX is missing or has
no CUDA device (a CPU-only JAX: ``pip install "jax[cuda13]"`` or ``[cuda12]`` for the
driver's CUDA). JAX preallocates 75% of the GPU's memory at its first GPU use, which would
leave CuPy's kernels and the other GPU tests in this process little room: preallocation is
switched off below, before JAX is imported (unless the environment already says otherwise).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ml_dtypes  # noqa: E402
import numpy  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="JAX is not installed (a CUDA build of JAX runs "
                                        "these tests: pip install \"jax[cuda13]\")")

import natten_cupy  # noqa: E402
from natten_cupy import _arrays  # noqa: E402

import gpu_cases  # noqa: E402
import oracle  # noqa: E402


def _jax_gpu():
    """(JAX's first CUDA device or None, why not)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError as e:            # no CUDA platform in this JAX install
        return None, f"JAX has no CUDA device ({str(e).splitlines()[0]}); a CUDA build of " \
                     "JAX runs these tests: pip install \"jax[cuda13]\""
    return devices[0], None


GPU, NO_GPU_REASON = _jax_gpu()
ORDINAL = getattr(GPU, "local_hardware_id", None)   # the CUDA device number (CuPy's id)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(GPU is None, reason=NO_GPU_REASON or "")]

BF16 = numpy.dtype(ml_dtypes.bfloat16)
SHAPE = (2, 9, 7, 2, 32)                    # [B, X, Y, H, D]: odd extents
OPTS = dict(kernel_size=(3, 5), dilation=(2, 1), is_causal=(True, False))
ORACLE_OPTS = ((3, 5), 1, (2, 1), (True, False))   # kernel, stride, dilation, causal


def _inputs(dtype, seed=0):
    rng = numpy.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(dtype) for _ in range(4)]


def _check_gpu_result(r, dtype, name):
    """``r`` is a JAX array of ``dtype`` on the inputs' GPU; returns it as NumPy."""
    assert isinstance(r, jax.Array), (name, type(r))
    assert r.devices() == {GPU}, (name, r.devices())
    assert r.dtype == dtype, (name, r.dtype)
    return numpy.asarray(r)


def _within_bound(name, got, truth, yard, kind, dtype_name):
    """gpu_cases' rule: |got - truth| <= FACTOR * |yard - truth| + FLOOR * max(1, |truth|)."""
    got = numpy.asarray(got, dtype=numpy.float64)
    yard = numpy.asarray(yard, dtype=numpy.float64)
    scale = max(1.0, float(numpy.abs(truth).max()))
    bound = (gpu_cases.FACTOR[kind] * float(numpy.abs(yard - truth).max())
             + gpu_cases.FLOORS[dtype_name] * scale)
    err = float(numpy.abs(got - truth).max())
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float16, BF16],
                         ids=["float32", "float16", "bfloat16"])
def test_na2d_forward_backward(dtype):
    dtype = numpy.dtype(dtype)
    dtype_name = str(dtype)
    q, k, v, d_out = _inputs(dtype)
    jq, jk, jv, jd = (jax.device_put(x, GPU) for x in (q, k, v, d_out))

    out, lse = natten_cupy.na2d(jq, jk, jv, return_lse=True, **OPTS)
    out_h = _check_gpu_result(out, dtype, "out")
    lse_h = _check_gpu_result(lse, numpy.dtype(numpy.float32), "lse")
    truth_out, truth_lse = oracle.fused_forward(q, k, v, *ORACLE_OPTS)
    yard_out, yard_lse = natten_cupy.na2d(q, k, v, return_lse=True, **OPTS)   # CPU, in dtype
    _within_bound("out", out_h, truth_out, yard_out, "forward", dtype_name)
    numpy.testing.assert_allclose(lse_h, truth_lse, rtol=1e-3, atol=1e-3)

    grads = natten_cupy.na2d_backward(jd, jq, jk, jv, out, lse, **OPTS)
    truth = oracle.fused_backward(d_out, q, k, v, *ORACLE_OPTS)
    yard = natten_cupy.na2d_backward(d_out, q, k, v, yard_out, yard_lse, **OPTS)
    for name, g, t, y in zip(("dq", "dk", "dv"), grads, truth, yard):
        _within_bound(name, _check_gpu_result(g, dtype, name), t, y, "gradient", dtype_name)
    for name, x, host in zip("qkvd", (jq, jk, jv, jd), (q, k, v, d_out)):
        numpy.testing.assert_array_equal(numpy.asarray(x), host, err_msg=name)


def test_zero_copy_in_and_out(monkeypatch):
    """The CuPy views of the inputs are the JAX buffers themselves, and each JAX result is
    the buffer the kernels wrote (observed at the interop layer's two crossings)."""
    seen_in, seen_out = [], []
    as_cupy, give_back = _arrays._as_cupy, _arrays.Inputs.give_back

    def spy_as_cupy(cupy, x):
        view = as_cupy(cupy, x)
        seen_in.append((x.unsafe_buffer_pointer(), view.data.ptr))
        return view

    def spy_give_back(self, x):
        r = give_back(self, x)
        seen_out.append((x.data.ptr, r.unsafe_buffer_pointer()))
        return r

    monkeypatch.setattr(_arrays, "_as_cupy", spy_as_cupy)
    monkeypatch.setattr(_arrays.Inputs, "give_back", spy_give_back)
    q, k, v, d_out = (jax.device_put(x, GPU) for x in _inputs(numpy.float16))
    out, lse = natten_cupy.na2d(q, k, v, return_lse=True, **OPTS)
    natten_cupy.na2d_backward(d_out, q, k, v, out, lse, **OPTS)
    assert len(seen_in) == 3 + 6 and len(seen_out) == 2 + 3
    for src, dst in seen_in + seen_out:
        assert src == dst


def test_jax_gpu_next_to_numpy_is_refused():
    q, k, v, _ = _inputs(numpy.float16)
    with pytest.raises(ValueError, match="all arrays must be on the same device, got q on "
                                         "GPU, k on CPU, v on GPU"):
        natten_cupy.na2d(jax.device_put(q, GPU), k, jax.device_put(v, GPU), **OPTS)


def test_jax_gpu_next_to_cupy_gives_cupy():
    cupy = pytest.importorskip("cupy")
    q, k, v, _ = _inputs(numpy.float16)
    with cupy.cuda.Device(ORDINAL):
        got = natten_cupy.na2d(jax.device_put(q, GPU), cupy.asarray(k),
                               jax.device_put(v, GPU), **OPTS)
        assert isinstance(got, cupy.ndarray) and got.device.id == ORDINAL
        want = natten_cupy.na2d(*(cupy.asarray(x) for x in (q, k, v)), **OPTS)
        cupy.testing.assert_array_equal(got, want)
