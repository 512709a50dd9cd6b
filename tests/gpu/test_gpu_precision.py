"""Precision and robustness on the GPU: float64 exactness of the naive kernels, bitwise
reproducible fused backward in deterministic mode, non-finite inputs, -inf rows.

* float64: the naive backend (fused forward/backward, qk with and without rpb, av and their
  backward with d_rpb) against the float64 reference at 1e-12 relative, on head dims whose
  default scale D ** -0.5 is not a power of two (8, 24, 32): a float32 scalar anywhere on the
  path shows up as about 1e-8.
* ``deterministic=True``: three fused backward runs give bitwise identical dq, dk, dv
  (float16, bfloat16; ranks 1-3; problems of many CTAs).
* A NaN (or a +inf whose scores are all +inf) planted in one element of q, k, v, attn, d_attn,
  d_out or rpb reaches every output that reads it through a window, on every backend that
  runs the op (reference on CuPy, naive, tiled, fused), and nothing else on reference and
  naive; where tiles multiply masked zeros by it (``test_robustness.SPREADS``: fused, tiled
  av), it may spoil other rows of its tile, never another batch or head. Rows of only -inf
  logits give exact zeros through the whole unfused chain (qk -> softmax -> av and back).

The CPU twins (reference backend on NumPy, naive kernels through the emulator) and the shared
machinery live in ``tests/unit/test_robustness.py``.
"""

from __future__ import annotations

import os
import sys

import numpy
import pytest

import gpu_cases

# The CPU twins' machinery is in tests/unit/test_robustness.py: one module, whichever file
# pytest imports first (it imports test modules by basename, its folder on sys.path).
_UNIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit")
if _UNIT not in sys.path:
    sys.path.insert(0, _UNIT)
import test_robustness as robust  # noqa: E402
from natten_cupy._dtypes import BFLOAT16, FLOAT16
from natten_cupy.backends import get_backend

pytestmark = [pytest.mark.gpu, robust.QUIET]

FUSED_BACKENDS = ("reference", "naive", "fused")
UNFUSED_BACKENDS = ("reference", "naive", "tiled")
DTYPES = {"float32": numpy.float32, "float16": numpy.float16}


def _cupy():
    import cupy
    return cupy


def _sync():
    _cupy().cuda.get_current_stream().synchronize()


# ---- float64 -------------------------------------------------------------------------------

@pytest.mark.parametrize("index", range(len(robust.PCASES)), ids=[c.id for c in robust.PCASES])
def test_float64_naive_matches_the_float64_reference(index):
    case = robust.PCASES[index]
    x, truth, _ = gpu_cases.references(case)
    y = gpu_cases.run(case, get_backend("naive"), gpu_cases.inputs_on_device(x, case), _cupy())
    _sync()
    robust.check_float64(case, robust.host(y), truth, f"[naive {case.id}] ")


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("k", [9, 81, 200, 3000])
def test_float64_softmax_is_exact(rng, k, aligned):
    """natten_cupy.softmax / softmax_backward in float64 (row kernels, register-held and
    streamed lane-group kernels) against NumPy float64 at 1e-12, a scale that is not a
    float32 (0.1)."""
    import natten_cupy
    cupy = _cupy()
    x = 3 * rng.standard_normal((67, k))
    x[::4, k // 2:] = -numpy.inf
    g = rng.standard_normal(x.shape)
    a = x * 0.1
    m = a.max(axis=-1, keepdims=True)
    e = numpy.exp(a - m)
    p_want = e / e.sum(-1, keepdims=True)
    d_want = 0.1 * p_want * (g - (p_want * g).sum(-1, keepdims=True))

    def put(h):
        if aligned:
            return cupy.asarray(h)
        buf = cupy.empty(h.size + 1, dtype=h.dtype)
        view = buf[1:].reshape(h.shape)
        view[...] = cupy.asarray(h)
        return view
    p = natten_cupy.softmax(put(x), 0.1)
    d = natten_cupy.softmax_backward(p, put(g), 0.1)
    assert robust.relative_error(cupy.asnumpy(p), p_want) <= robust.FLOAT64_RTOL
    assert robust.relative_error(cupy.asnumpy(d), d_want) <= robust.FLOAT64_RTOL


# ---- deterministic mode ----------------------------------------------------------------------

DETERMINISTIC_GEOMS = {
    1: ((1000,), (13,), (1,), (1,), (False,)),
    2: ((40, 37), (7, 9), (1, 2), (1, 1), (False, True)),
    3: ((12, 13, 11), (3, 5, 3), (1, 1, 1), (2, 1, 1), (True, False, False)),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_deterministic_fused_backward_is_bitwise_reproducible(rng, rank, dtype):
    geom = DETERMINISTIC_GEOMS[rank]
    np_dtype = {"float16": FLOAT16, "bfloat16": BFLOAT16}[dtype]
    x = robust.normal_inputs(rng, ("q", "k", "v", "d_out"), geom, np_dtype, heads=4,
                             head_dim=64)
    xd = robust.to_device(_cupy(), x)
    runs = []
    for _ in range(3):
        y = robust.run_fused("fused", _cupy(), xd, geom, deterministic=True)
        _sync()
        runs.append({n: gpu_cases.to_host(y[n]) for n in ("dq", "dk", "dv")})
    for name, first in runs[0].items():
        assert numpy.isfinite(first).all(), f"{name}: non-finite gradient"
        assert numpy.abs(first).max() > 0, f"{name}: all zero"
        for i, later in enumerate(runs[1:], 2):
            same = first.view(numpy.uint64) == later[name].view(numpy.uint64)
            assert same.all(), (f"{name}: run {i} differs from run 1 in {int((~same).sum())} "
                                f"of {same.size} elements")


# ---- non-finite inputs -------------------------------------------------------------------------

@pytest.mark.parametrize("value", sorted(robust.VALUES))
@pytest.mark.parametrize("source", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_fused_nonfinite_reaches_only_its_windows(rng, backend, rank, dtype, source, value):
    geom = robust.GEOMS[rank]
    x, token = robust.fused_planted_inputs(rng, geom, DTYPES[dtype], source,
                                           robust.VALUES[value])
    y = robust.run_fused(backend, _cupy(), robust.to_device(_cupy(), x), geom)
    _sync()
    robust.check_reach(robust.host(y), robust.fused_reach(geom, source, token),
                       f"[{backend} {dtype} {source}={value}] ",
                       spread=robust.spreads(backend, "fused", source))


@pytest.mark.parametrize("kind,source", robust.UNFUSED_SOURCES,
                         ids=[f"{k}-{s}" for k, s in robust.UNFUSED_SOURCES])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("backend", UNFUSED_BACKENDS)
def test_unfused_nan_reaches_only_its_slots(rng, backend, rank, dtype, kind, source):
    geom = robust.unit_stride(robust.GEOMS[rank])
    x, token, slot = robust.unfused_planted_inputs(rng, geom, DTYPES[dtype], kind, source)
    y = robust.run_unfused(backend, _cupy(), kind, robust.to_device(_cupy(), x), geom)
    _sync()
    got = robust.host(y)
    where = f"[{backend} {dtype} {kind} {source}] "
    robust.check_reach(got, robust.unfused_reach(geom, kind, source, token, slot), where,
                       spread=robust.spreads(backend, kind, source))
    robust.check_unfused_empty_slots(got, geom, where)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("which", sorted(robust.CHAIN_GEOMS, key=str))
@pytest.mark.parametrize("backend", UNFUSED_BACKENDS)
def test_minus_inf_rows_of_the_unfused_chain_give_zeros(rng, backend, which, dtype):
    """Both softmax kernel families run: K <= 24 takes the one-lane-a-row kernels, K = 121
    the lane-group ones (float32 both ways, float16 backward)."""
    geom = robust.CHAIN_GEOMS[which]
    y = robust.run_chain(backend, _cupy(), geom, DTYPES[dtype], rng)
    robust.check_chain(y, geom, f"[{backend} {dtype} {which}] ")
