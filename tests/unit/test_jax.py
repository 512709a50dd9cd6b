"""JAX CPU arrays through the public calls: computed on the CPU, handed back as JAX arrays.

A JAX array on JAX's CPU device is read through DLPack as a NumPy array (bfloat16, which
NumPy's DLPack lacks, through the array protocol), so it runs on the reference backend like
any NumPy input; results come back as JAX arrays on the CPU device, bit for bit the NumPy
path's results. Checked here against the float64 oracle (``tests/oracle.py``) for every op
kind and rank, float64 (under ``jax.enable_x64``), float32, float16 and bfloat16, odd
extents, causal axes, dilation and stride. Mixing JAX with NumPy (or torch CPU) arrays works
and gives NumPy results (the library hands results back as the caller's type only when
every array is of one framework). JAX GPU arrays: ``tests/gpu/test_gpu_jax.py``.

Needs JAX (``pip install -e ".[jax]"``, the CPU build); skipped without it. Arrays are put on
``jax.devices("cpu")[0]`` explicitly, so the tests mean the same where JAX also has a GPU.

Tolerances as in ``test_reference.py``: inputs are rounded to the dtype and the oracle runs
on the rounded values, so outputs may differ by ``rtol = 2 eps``, ``atol = 4 eps * max|oracle|``
(``8 eps`` for gradients), float32 with an absolute floor, float64 at rtol 1e-10.
"""

import math
import os

# A JAX with a CUDA plugin would otherwise take most of the GPU's memory at its first use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import ml_dtypes  # noqa: E402
import numpy  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip(
    "jax", reason="JAX is not installed (pip install -e \".[jax]\" runs these tests)")
import jax.numpy as jnp  # noqa: E402

import natten_cupy  # noqa: E402

import oracle  # noqa: E402

CPU = jax.devices("cpu")[0]
BF16 = numpy.dtype(ml_dtypes.bfloat16)
F64 = numpy.dtype(numpy.float64)
EPS = {F64: 0.0, numpy.dtype(numpy.float32): 2.0 ** -24, numpy.dtype(numpy.float16): 2.0 ** -11,
       BF16: 2.0 ** -8}
DTYPES = [numpy.float64, numpy.float32, numpy.float16, BF16]
DTYPE_IDS = ["float64", "float32", "float16", "bfloat16"]

# Odd extents, a causal axis, dilation and (fused only) stride in every rank.
CASES = [
    dict(spatial=(13,), heads=2, dim=8, kernel=5, dilation=2, causal=True, stride=1),
    dict(spatial=(7, 9), heads=2, dim=8, kernel=(3, 5), dilation=(2, 1),
         causal=(True, False), stride=(1, 2)),
    dict(spatial=(5, 4, 7), heads=1, dim=4, kernel=(3, 3, 5), dilation=(1, 1, 1),
         causal=(False, True, False), stride=(2, 1, 1)),
]


def case_id(c):
    return f"{len(c['spatial'])}d-" + "x".join(map(str, c["spatial"]))


def call(rank, suffix=""):
    return getattr(natten_cupy, f"na{rank}d{suffix}")


def fused_kw(c):
    return dict(stride=c["stride"], dilation=c["dilation"], is_causal=c["causal"])


def unfused_kw(c):
    return dict(dilation=c["dilation"], is_causal=c["causal"])


@pytest.fixture
def x64(request):
    """JAX float64 arrays (off by default) for a float64 test, restored after it."""
    if numpy.dtype(request.getfixturevalue("dtype")) != F64:
        yield
        return
    if not hasattr(jax, "enable_x64"):
        pytest.skip("this JAX has no jax.enable_x64 context: float64 arrays need the "
                    "process-wide jax_enable_x64 flag")
    with jax.enable_x64(True):
        yield


def tensors(rng, c, count, dtype):
    shape = (2,) + tuple(c["spatial"]) + (c["heads"], c["dim"])
    return [rng.standard_normal(shape).astype(dtype) for _ in range(count)]


def to_jax(x):
    """A NumPy array (ml_dtypes bfloat16 too) as a JAX array on the CPU device."""
    out = jax.device_put(x, CPU)
    assert out.dtype == x.dtype, (out.dtype, x.dtype)   # no silent float64 -> float32
    return out


def check_jax_cpu(r, dtype, name=""):
    """``r`` is a JAX array of ``dtype`` on the CPU device; returns it as NumPy."""
    assert isinstance(r, jax.Array), (name, type(r))
    assert r.devices() == {CPU}, (name, r.devices())
    assert r.dtype == dtype, (name, r.dtype, dtype)
    return numpy.asarray(r)


def close(got, want, rtol, atol_rel, floor=0.0):
    got = numpy.asarray(got, dtype=numpy.float64)
    atol = floor + atol_rel * float(numpy.abs(want).max(initial=0.0))
    numpy.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def close_logits(got, want, **tol):
    """Logits with -inf at empty (causal) slots: same slots empty, the rest close."""
    got = numpy.asarray(got, dtype=numpy.float64)
    empty = numpy.isneginf(want)
    assert (numpy.isneginf(got) == empty).all()
    close(numpy.where(empty, 0, got), numpy.where(empty, 0, want), **tol)


def tolerances(dtype, floor32):
    eps = EPS[dtype]
    if dtype == F64:
        return dict(rtol=1e-10, atol_rel=1e-12)
    return dict(rtol=2 * eps, atol_rel=4 * eps,
                floor=floor32 if dtype == numpy.float32 else 0.0)


def assert_same_values(jax_inputs, saved):
    for name, x in jax_inputs.items():
        numpy.testing.assert_array_equal(numpy.asarray(x), saved[name], err_msg=name)


# ---- fused ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_fused_forward_and_backward(c, dtype, rng, x64):
    n = len(c["spatial"])
    dtype = numpy.dtype(dtype)
    acc = F64 if dtype == F64 else numpy.dtype(numpy.float32)
    q, k, v, d_out = tensors(rng, c, 4, dtype)
    jx = dict(q=to_jax(q), k=to_jax(k), v=to_jax(v), d_out=to_jax(d_out))
    saved = {name: numpy.asarray(x).copy() for name, x in jx.items()}

    out, lse = call(n)(jx["q"], jx["k"], jx["v"], c["kernel"], return_lse=True, **fused_kw(c))
    out_np = check_jax_cpu(out, dtype, "out")
    lse_np = check_jax_cpu(lse, acc, "lse")
    want_out, want_lse = oracle.fused_forward(q, k, v, c["kernel"], c["stride"],
                                              c["dilation"], c["causal"])
    tol = tolerances(dtype, floor32=2e-6)
    close(out_np, want_out, **tol)
    close(lse_np, want_lse, **(dict(rtol=1e-10, atol_rel=1e-12) if dtype == F64
                               else dict(rtol=1e-5, atol_rel=0.0, floor=1e-5)))
    # The NumPy path gives the very same values: JAX only changes the way in and out.
    ref_out, ref_lse = call(n)(q, k, v, c["kernel"], return_lse=True, **fused_kw(c))
    numpy.testing.assert_array_equal(out_np, ref_out)
    numpy.testing.assert_array_equal(lse_np, ref_lse)

    # The forward's JAX results go straight back in.
    grads = call(n, "_backward")(jx["d_out"], jx["q"], jx["k"], jx["v"], out, lse,
                                 c["kernel"], **fused_kw(c))
    assert len(grads) == 3
    want = oracle.fused_backward(d_out, q, k, v, c["kernel"], c["stride"], c["dilation"],
                                 c["causal"])
    ref = call(n, "_backward")(d_out, q, k, v, ref_out, ref_lse, c["kernel"], **fused_kw(c))
    gtol = dict(tol, atol_rel=2 * tol["atol_rel"], floor=10 * tol.get("floor", 0.0))
    for name, g, w, r in zip(("dq", "dk", "dv"), grads, want, ref):
        g_np = check_jax_cpu(g, dtype, name)
        close(g_np, w, **gtol)
        numpy.testing.assert_array_equal(g_np, r, err_msg=name)
    assert_same_values(jx, saved)


# ---- unfused --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("c", CASES, ids=case_id)
def test_unfused_ops(c, dtype, rng, x64):
    """qk (with rpb where the window is not causal), av, and their backwards."""
    n = len(c["spatial"])
    dtype = numpy.dtype(dtype)
    tol = tolerances(dtype, floor32=2e-5)
    tol["atol_rel"] *= 2                       # 8 eps, as test_reference's unfused checks
    kernel = c["kernel"]
    q, k, v, d_out = tensors(rng, c, 4, dtype)
    causal = any(numpy.atleast_1d(c["causal"]))
    rpb = None
    if not causal:
        kernels = (kernel,) * n if isinstance(kernel, int) else kernel
        rpb = rng.standard_normal((c["heads"],) + tuple(2 * kk - 1 for kk in kernels))
        rpb = rpb.astype(dtype)
    K = math.prod((kernel,) * n if isinstance(kernel, int) else kernel)
    weights = rng.standard_normal(q.shape[:-1] + (K,)).astype(dtype)
    jx = dict(q=to_jax(q), k=to_jax(k), v=to_jax(v), d_out=to_jax(d_out),
              weights=to_jax(weights))
    if rpb is not None:
        jx["rpb"] = to_jax(rpb)
    saved = {name: numpy.asarray(x).copy() for name, x in jx.items()}
    kw = unfused_kw(c)
    ockw = (kernel, c["dilation"], c["causal"])

    attn = call(n, "_qk")(jx["q"], jx["k"], kernel, rpb=jx.get("rpb"), **kw)
    close_logits(check_jax_cpu(attn, dtype, "attn"), oracle.qk(q, k, *ockw, rpb=rpb), **tol)
    numpy.testing.assert_array_equal(numpy.asarray(attn),
                                     call(n, "_qk")(q, k, kernel, rpb=rpb, **kw))

    out = call(n, "_av")(jx["weights"], jx["v"], kernel, **kw)
    close(check_jax_cpu(out, dtype, "av"), oracle.av(weights, v, *ockw), **tol)

    got = call(n, "_qk_backward")(jx["weights"], jx["q"], jx["k"], kernel, rpb=jx.get("rpb"),
                                  **kw)
    want = oracle.qk_backward(weights, q, k, *ockw, with_rpb=rpb is not None)
    assert len(got) == (2 if rpb is None else 3)
    for name, g, w in zip(("dq", "dk", "d_rpb"), got, want):
        close(check_jax_cpu(g, dtype, name), w, **tol)

    got = call(n, "_av_backward")(jx["d_out"], jx["weights"], jx["v"], kernel, **kw)
    for name, g, w in zip(("d_attn", "dv"), got, oracle.av_backward(d_out, weights, v, *ockw)):
        close(check_jax_cpu(g, dtype, name), w, **tol)
    assert_same_values(jx, saved)


# ---- framework mixes, edge cases, errors ------------------------------------------------

def _inputs(rng, shape=(2, 7, 5, 3, 4), dtype=numpy.float32):
    return [rng.standard_normal(shape).astype(dtype) for _ in range(4)]


def test_mixing_jax_and_numpy_gives_numpy(rng):
    """One framework in, that framework out; a JAX/NumPy mix runs (on the CPU) and gives
    NumPy arrays, equal to the all-NumPy call."""
    q, k, v, d_out = _inputs(rng)
    want, want_lse = natten_cupy.na2d(q, k, v, 3, return_lse=True)
    got, got_lse = natten_cupy.na2d(q, to_jax(k), to_jax(v), 3, return_lse=True)
    assert type(got) is numpy.ndarray and type(got_lse) is numpy.ndarray
    numpy.testing.assert_array_equal(got, want)
    numpy.testing.assert_array_equal(got_lse, want_lse)
    # JAX d_out and q with the NumPy forward's out and lse.
    grads = natten_cupy.na2d_backward(to_jax(d_out), to_jax(q), k, to_jax(v), want, want_lse, 3)
    ref = natten_cupy.na2d_backward(d_out, q, k, v, want, want_lse, 3)
    for g, r in zip(grads, ref):
        assert type(g) is numpy.ndarray
        numpy.testing.assert_array_equal(g, r)
    attn = natten_cupy.na2d_qk(to_jax(q), k, 3, rpb=to_jax(rng.standard_normal((3, 5, 5))
                                                            .astype(numpy.float32)))
    assert type(attn) is numpy.ndarray


def test_mixing_jax_and_torch_cpu_gives_numpy(rng):
    torch = pytest.importorskip("torch")
    q, k, v, _ = _inputs(rng)
    got = natten_cupy.na1d(to_jax(q[:, :, 0]), torch.from_numpy(k[:, :, 0]), v[:, :, 0], 5)
    assert type(got) is numpy.ndarray
    numpy.testing.assert_array_equal(got, natten_cupy.na1d(q[:, :, 0], k[:, :, 0],
                                                           v[:, :, 0], 5))


def test_results_are_new_arrays(rng):
    """Results share no memory with the inputs (JAX arrays are immutable, but the library
    reads them through read-only NumPy views: nothing may come back as such a view)."""
    q, k, v, _ = _inputs(rng)
    jq, jk, jv = map(to_jax, (q, k, v))
    out = natten_cupy.na2d(jq, jk, jv, 3)
    ptrs = {x.unsafe_buffer_pointer() for x in (jq, jk, jv)}
    assert out.unsafe_buffer_pointer() not in ptrs


@pytest.mark.parametrize("dtype", [numpy.float32, BF16], ids=["float32", "bfloat16"])
def test_empty_batch(dtype):
    z = to_jax(numpy.zeros((0, 7, 5, 3, 4), dtype))
    out, lse = natten_cupy.na2d(z, z, z, 3, return_lse=True)
    assert check_jax_cpu(out, numpy.dtype(dtype)).shape == (0, 7, 5, 3, 4)
    assert check_jax_cpu(lse, numpy.dtype(numpy.float32)).shape == (0, 7, 5, 3)
    grads = natten_cupy.na2d_backward(z, z, z, z, out, lse, 3)
    assert [check_jax_cpu(g, numpy.dtype(dtype)).shape for g in grads] == [z.shape] * 3


def test_bad_jax_inputs_raise_naming_the_argument(rng):
    q, k, v, _ = _inputs(rng)
    jq, jk, jv = map(to_jax, (q, k, v))
    with pytest.raises(TypeError, match="q has dtype int32; supported: float64, float32"):
        natten_cupy.na2d(jq.astype(jnp.int32), jk, jv, 3)
    with pytest.raises(ValueError, match=r"k shape \(2, 7, 5, 3, 4\) does not match q shape"):
        natten_cupy.na2d(jq[..., :3], jk, jv, 3)
    with pytest.raises(ValueError, match="backend 'fused' runs on the GPU and needs CuPy or "
                                         "CUDA arrays; NumPy/CPU arrays run on backend "
                                         "'reference'"):
        natten_cupy.na2d(jq, jk, jv, 3, backend="fused")
    # Inside jax.jit the arguments are tracers, not arrays: the array-level calls need data.
    with pytest.raises(TypeError, match="q must be an array .*got .*Tracer"):
        jax.jit(lambda a: natten_cupy.na2d(a, jk, jv, 3))(jq)
