"""Non-finite inputs, -inf rows of the unfused chain, float64 exactness and the random sweep,
on the CPU: the reference backend on NumPy, and the naive kernels through the CPU emulator.

The rules (docs/DESIGN.md, "Non-finite inputs"): a NaN in one element of an input reaches
exactly the outputs whose formula reads that element through a window, and nothing else; an
infinite element whose every score is +inf does the same (here the inputs are arranged so);
a row of unfused logits that is all -inf gives probabilities 0, so the rest of the chain
(av, the backward ops) gives exact zeros there. Expected positions come from the dense mask
and slot table of ``tests/oracle.py`` (independent of ``_window``).

The machinery here (``run_fused``, ``run_unfused``, the expected-position builders) is shared
with ``tests/gpu/test_gpu_precision.py``, which runs the same checks on every CUDA backend.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy
import pytest

import gpu_cases
import natten_cupy
import oracle
from natten_cupy import _args, ops
from natten_cupy._dtypes import accumulator_dtype
from natten_cupy.backends import get_backend

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository
# NumPy warns about the NaN/Inf arithmetic these tests plant on purpose.
QUIET = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# (spatial, kernel, stride, dilation, causal) per rank: causal mixes, dilation, even kernels;
# stride is used by the fused ops only.
GEOMS = {1: gpu_cases.GEOMETRIES[1][1], 2: gpu_cases.GEOMETRIES[2][0],
         3: gpu_cases.GEOMETRIES[3][0]}
BATCH, HEADS, HEAD_DIM = 2, 2, 16
B0, H0, E0 = 1, 1, 3     # batch, head and head-dim element of the planted value


def unit_stride(geom):
    spatial, kernel, _, dilation, causal = geom
    return spatial, kernel, (1,) * len(spatial), dilation, causal


def planted_token(geom):
    """A flat token away from the borders (its windows are full in every backend's tiles)."""
    return math.prod(geom[0]) // 3


# ---- arrays ------------------------------------------------------------------------------

def full(xp, shape, value, dtype):
    """A new array of ``xp`` filled with ``value`` (16-bit types go up as 16-bit words)."""
    host = numpy.full(shape, value, dtype=dtype)
    if xp is numpy:
        return host
    import cupy
    return gpu_cases.upload(cupy, host)


def to_device(xp, x):
    if xp is numpy:
        return x
    import cupy
    return {n: gpu_cases.upload(cupy, a) for n, a in x.items()}


def normal_inputs(rng, names, geom, dtype, heads=HEADS, head_dim=HEAD_DIM):
    """Host arrays ``[B, *spatial, H, D]`` (``attn``/``d_attn``: ``[..., H, K]``, ``rpb``:
    ``[H, 2k-1, ...]``), standard normal in ``dtype``."""
    spatial, kernel = geom[0], geom[1]
    shapes = {"attn": (BATCH,) + spatial + (heads, math.prod(kernel)),
              "rpb": (heads,) + tuple(2 * k - 1 for k in kernel)}
    shapes["d_attn"] = shapes["attn"]
    full_shape = (BATCH,) + spatial + (heads, head_dim)
    return {n: rng.standard_normal(shapes.get(n, full_shape)).astype(dtype) for n in names}


def flat_view(x, geom):
    """``[B, *spatial, H, last]`` as ``[B, N, H, last]`` (a view of the same memory)."""
    return x.reshape((x.shape[0], math.prod(geom[0])) + x.shape[-2:])


# ---- runs --------------------------------------------------------------------------------

def backend_or_skip(name, op, problem):
    be = get_backend(name)
    if be is None:
        pytest.skip(f"backend {name} not in this install")
    why = be.refuse(op, problem)
    if why is not None:
        pytest.skip(f"{name} refuses {op}: {why}")
    return be


def run_fused(name, xp, x, geom, deterministic=False, backward=True):
    """Fused forward (and backward) on backend ``name``; outputs start as +inf, so an
    unwritten element reads as non-finite. Returns the outputs as arrays of ``xp``."""
    spatial, kernel, stride, dilation, causal = geom
    q, k, v = x["q"], x["k"], x["v"]
    problem = _args.check_fused(len(spatial), q, k, v, kernel, stride, dilation, causal, None,
                                name, deterministic=deterministic)
    be = backend_or_skip(name, "fused_forward", problem)
    y = {"out": full(xp, q.shape, numpy.inf, q.dtype),
         "lse": full(xp, q.shape[:-1], numpy.inf, accumulator_dtype(q.dtype))}
    ops.run_fused_forward(problem, be, q, k, v, y["out"], y["lse"])
    if backward:
        be = backend_or_skip(name, "fused_backward", problem)
        for g in ("dq", "dk", "dv"):
            y[g] = full(xp, q.shape, numpy.inf, q.dtype)
        ops.run_fused_backward(problem, be, x["d_out"], q, k, v, y["out"], y["lse"], y["dq"],
                               y["dk"], y["dv"])
    return y


def run_unfused(name, xp, kind, x, geom):
    """One unfused op (``qk``, ``av``, ``qk_backward``, ``av_backward``) on backend ``name``,
    outputs starting as +inf. ``qk_backward`` returns d_rpb when ``x`` holds ``rpb``."""
    spatial, kernel, _, dilation, causal = geom
    r = len(spatial)
    y = {}
    if kind == "qk":
        q, k = x["q"], x["k"]
        problem = _args.check_qk(r, q, k, kernel, dilation, causal, x.get("rpb"), name)
        be = backend_or_skip(name, kind, problem)
        y["attn"] = full(xp, q.shape[:-1] + (problem.num_neighbors,), numpy.inf, q.dtype)
        ops.run_qk(problem, be, q, k, x.get("rpb"), y["attn"])
    elif kind == "av":
        a, v = x["attn"], x["v"]
        problem = _args.check_av(r, a, v, kernel, dilation, causal, name)
        be = backend_or_skip(name, kind, problem)
        y["out"] = full(xp, v.shape, numpy.inf, v.dtype)
        ops.run_av(problem, be, a, v, y["out"])
    elif kind == "qk_backward":
        da, q, k, rpb = x["d_attn"], x["q"], x["k"], x.get("rpb")
        problem = _args.check_qk_backward(r, da, q, k, kernel, dilation, causal, rpb, name)
        be = backend_or_skip(name, kind, problem)
        y["dq"], y["dk"] = (full(xp, q.shape, numpy.inf, q.dtype) for _ in range(2))
        y["d_rpb"] = None
        if rpb is not None:
            y["d_rpb"] = full(xp, rpb.shape, numpy.inf, accumulator_dtype(q.dtype))
        ops.run_qk_backward(problem, be, da, q, k, y["dq"], y["dk"], y["d_rpb"])
        if rpb is None:
            del y["d_rpb"]
    elif kind == "av_backward":
        do, a, v = x["d_out"], x["attn"], x["v"]
        problem = _args.check_av_backward(r, do, a, v, kernel, dilation, causal, name)
        be = backend_or_skip(name, kind, problem)
        y["d_attn"] = full(xp, a.shape, numpy.inf, a.dtype)
        y["dv"] = full(xp, v.shape, numpy.inf, v.dtype)
        ops.run_av_backward(problem, be, do, a, v, y["d_attn"], y["dv"])
    else:
        raise ValueError(f"unknown unfused kind {kind!r}")
    return y


def host(y):
    return {n: gpu_cases.to_host(a) for n, a in y.items()}


# ---- where a planted value must reach ------------------------------------------------------

def _rows(geom, last, sel_rows, col=None):
    """Boolean ``[B, *spatial, H, last]``: True at (B0, tokens ``sel_rows``, H0, ``col`` or
    every column)."""
    N = math.prod(geom[0])
    m = numpy.zeros((BATCH, N, HEADS, last), dtype=bool)
    idx = numpy.flatnonzero(sel_rows)
    if col is None:
        m[B0, idx, H0, :] = True
    else:
        m[B0, idx, H0, col] = True
    return m.reshape((BATCH,) + geom[0] + (HEADS, last))


def fused_reach(geom, source, token, element=E0, backward=True):
    """Outputs of the fused ops a non-finite ``source`` (q, k or v) element at (B0, token,
    H0, element) reaches: dict name -> boolean array of the output's shape.

    Forward: a q element spoils its own row, a k element every row whose window holds the
    key, a v element column ``element`` of those rows (lse stays finite). Backward: the rows
    whose out/lse is spoilt (or, for q, the planted row) spoil their dq and the dk of every key
    of their windows; their dv too unless the source is v (dv reads P and d_out only).
    """
    spatial, kernel, stride, dilation, causal = geom
    mask = oracle.neighborhood_mask(spatial, kernel, stride, dilation, causal)
    N = mask.shape[0]
    if source == "q":
        bad = numpy.zeros(N, dtype=bool)
        bad[token] = True
    elif source in ("k", "v"):
        bad = mask[:, token]
    else:
        raise ValueError(f"source must be q, k or v, got {source!r}")
    none = numpy.zeros(N, dtype=bool)
    reach = {"out": _rows(geom, HEAD_DIM, bad, element if source == "v" else None),
             "lse": _rows(geom, 1, none if source == "v" else bad)[..., 0]}
    if backward:
        keys = mask[bad].any(axis=0)
        reach["dq"] = _rows(geom, HEAD_DIM, bad)
        reach["dk"] = _rows(geom, HEAD_DIM, keys)
        reach["dv"] = _rows(geom, HEAD_DIM, none if source == "v" else keys)
    return reach


def unfused_reach(geom, kind, source, token, slot=None, element=E0):
    """Outputs of one unfused op a NaN ``source`` element reaches (stride 1 slot tables).

    qk: q (row ``token``) -> its non-empty slots; k (key ``token``) -> the slots holding it;
    rpb (entry ``slot``, an rpb offset) -> the slots at that offset, every batch. av: v ->
    column ``element`` of the rows seeing the key; attn (row ``token``, slot) -> that row.
    qk_backward: d_attn (row, slot) -> dq of the row, dk of the slot's key, d_rpb at the
    slot's offset. av_backward: d_out (row, element) -> d_attn of the row's non-empty slots,
    column ``element`` of dv of its keys; attn (row, slot) -> dv of the slot's key.
    """
    spatial, kernel, _, dilation, causal = geom
    key, rel = oracle.slot_table(spatial, kernel, dilation, causal)
    N, K = key.shape
    one = numpy.zeros(N, dtype=bool)
    one[token] = True
    attn = numpy.zeros((BATCH, N, HEADS, K), dtype=bool)
    wshape = (BATCH,) + spatial + (HEADS, K)
    if kind == "qk":
        if source == "q":
            attn[B0, token, H0] = key[token] >= 0
        elif source == "k":
            attn[B0, :, H0] = key == token
        elif source == "rpb":
            attn[:, :, H0] = (rel == slot)[None]
        return {"attn": attn.reshape(wshape)}
    if kind == "av":
        if source == "v":
            return {"out": _rows(geom, HEAD_DIM, (key == token).any(axis=1), element)}
        return {"out": _rows(geom, HEAD_DIM, one)}                     # attn
    if kind == "qk_backward":
        j = numpy.zeros(N, dtype=bool)
        j[key[token, slot]] = True
        reach = {"dq": _rows(geom, HEAD_DIM, one), "dk": _rows(geom, HEAD_DIM, j)}
        d_rpb = numpy.zeros((HEADS, math.prod(2 * k - 1 for k in kernel)), dtype=bool)
        d_rpb[H0, rel[token, slot]] = True
        reach["d_rpb"] = d_rpb.reshape((HEADS,) + tuple(2 * k - 1 for k in kernel))
        return reach
    if kind == "av_backward":
        if source == "d_out":
            attn[B0, token, H0] = key[token] >= 0
            keys = numpy.zeros(N, dtype=bool)
            keys[key[token][key[token] >= 0]] = True
            return {"d_attn": attn.reshape(wshape), "dv": _rows(geom, HEAD_DIM, keys, element)}
        j = numpy.zeros(N, dtype=bool)                                 # attn
        j[key[token, slot]] = True
        return {"d_attn": attn.reshape(wshape), "dv": _rows(geom, HEAD_DIM, j)}
    raise ValueError(f"unknown unfused kind {kind!r}")


def plant(x, name, index, value):
    """Put ``value`` at ``index`` of host array ``x[name]`` (in place)."""
    x[name][index] = numpy.array(value, dtype=x[name].dtype)


def fused_planted_inputs(rng, geom, dtype, source, value):
    """q, k, v, d_out with ``value`` at (B0, token, H0, E0) of ``source``. For an infinite
    value the partner column is made positive (k's for q, q's for k, d_out's for v), so every
    score or product it enters is +inf rather than a sign-dependent mix."""
    x = normal_inputs(rng, ("q", "k", "v", "d_out"), geom, dtype)
    token = planted_token(geom)
    if numpy.isinf(value):
        partner = {"q": "k", "k": "q", "v": "d_out"}[source]
        x[partner][..., E0] = numpy.abs(x[partner][..., E0])
    flat = flat_view(x[source], geom)
    flat[B0, token, H0, E0] = numpy.array(value, dtype=dtype)
    return x, token


def unfused_planted_inputs(rng, geom, dtype, kind, source):
    """Inputs of ``kind`` with one NaN in ``source``; returns (inputs, token, slot)."""
    names = {"qk": ("q", "k", "rpb"), "av": ("attn", "v"), "qk_backward": ("d_attn", "q", "k",
             "rpb"), "av_backward": ("d_out", "attn", "v")}[kind]
    x = normal_inputs(rng, names, geom, dtype)
    spatial, kernel, _, dilation, causal = geom
    key, rel = oracle.slot_table(spatial, kernel, dilation, causal)
    token = planted_token(geom)
    slot = int(numpy.flatnonzero(key[token] >= 0)[-1])     # a non-empty slot of the row
    if source == "rpb":
        r = int(rel[token, slot])
        x["rpb"].reshape(HEADS, -1)[H0, r] = numpy.nan
        return x, token, r
    if source in ("attn", "d_attn"):
        flat_view(x[source], geom)[B0, token, H0, slot] = numpy.nan
    else:
        flat_view(x[source], geom)[B0, token, H0, E0] = numpy.nan
    return x, token, slot


def own_slice(name, shape):
    """Boolean of ``shape``: the planted value's batch B0 and head H0 (d_rpb: head H0)."""
    m = numpy.zeros(shape, dtype=bool)
    if name == "d_rpb":
        m[H0] = True
    elif name == "lse":
        m[B0, ..., H0] = True
    else:
        m[B0, ..., H0, :] = True
    return m


# Backends whose tiles multiply masked weights (exact zeros) by the tile's values, so that
# 0 * NaN = NaN spreads a non-finite element to other rows of the same tile, never beyond
# its batch and head (H200: every source of the fused ops, all parts; tiled av's v and
# av_backward's d_out). (backend, op kind) -> the sources that spread.
SPREADS = {("fused", "fused"): ("q", "k", "v"), ("tiled", "av"): ("v",),
           ("tiled", "av_backward"): ("d_out",)}


def spreads(backend, kind, source):
    return source in SPREADS.get((backend, kind), ())


def check_reach(got, reach, where="", spread=False):
    """Non-finite wherever ``reach`` says and, unless ``spread``, nowhere else (qk: empty
    slots -inf); with ``spread``, non-finite elsewhere only in the planted batch and head."""
    for name, expect in reach.items():
        g = got[name]
        assert g.shape == expect.shape, f"{where}{name}: shape {g.shape} != {expect.shape}"
        bad = ~numpy.isfinite(g)
        if name == "attn":
            bad = numpy.isnan(g) | (g == numpy.inf)
        leaked = bad & ~expect
        missed = expect & ~bad
        if spread:
            leaked &= ~own_slice(name, g.shape)
        assert not leaked.any(), (
            f"{where}{name}: non-finite at {int(leaked.sum())} positions outside the windows "
            f"that read the planted value ({int((leaked & ~own_slice(name, g.shape)).sum())} "
            f"of them outside its batch and head), first "
            f"{numpy.argwhere(leaked)[0].tolist()}")
        assert not missed.any(), (
            f"{where}{name}: finite at {int(missed.sum())} positions that read the planted "
            f"value, first {numpy.argwhere(missed)[0].tolist()}")


def check_unfused_empty_slots(got, geom, where=""):
    """qk leaves exactly -inf in empty causal slots (whatever it read)."""
    if "attn" not in got:
        return
    spatial, kernel, _, dilation, causal = geom
    key, _ = oracle.slot_table(spatial, kernel, dilation, causal)
    a = flat_view(got["attn"], geom)
    empty = numpy.broadcast_to((key < 0)[None, :, None, :], a.shape)
    assert (a[empty] == -numpy.inf).all(), f"{where}attn: empty slots must be -inf"


# ---- the -inf chain ------------------------------------------------------------------------

CHAIN_GEOMS = {1: unit_stride(GEOMS[1]), 2: unit_stride(GEOMS[2]), 3: unit_stride(GEOMS[3]),
               "2-K121": ((13, 12), (11, 11), (1, 1), (1, 1), (True, False))}


def run_chain(name, xp, geom, dtype, rng):
    """qk (rpb -inf on head H0) -> softmax -> av, and back: av_backward -> softmax_backward
    -> qk_backward, on backend ``name``. Returns the host float64 results by name."""
    spatial, kernel, _, dilation, causal = geom
    r = len(spatial)
    x = normal_inputs(rng, ("q", "k", "v", "d_out", "rpb"), geom, dtype)
    x["rpb"][H0] = -numpy.inf
    xd = to_device(xp, x)
    kw = dict(dilation=dilation, is_causal=causal, backend=name)
    backend_or_skip(name, "qk", _args.check_qk(r, xd["q"], xd["k"], kernel, dilation, causal,
                                               xd["rpb"], name))
    fn = {op: getattr(natten_cupy, f"na{r}d_{op}") for op in
          ("qk", "av", "qk_backward", "av_backward")}
    y = {}
    y["logits"] = fn["qk"](xd["q"], xd["k"], kernel, rpb=xd["rpb"], **kw)
    y["probs"] = natten_cupy.softmax(y["logits"], 0.5)
    y["out"] = fn["av"](y["probs"], xd["v"], kernel, **kw)
    y["d_probs"], y["dv"] = fn["av_backward"](xd["d_out"], y["probs"], xd["v"], kernel, **kw)
    y["d_logits"] = natten_cupy.softmax_backward(y["probs"], y["d_probs"], 0.5)
    y["dq"], y["dk"], y["d_rpb"] = fn["qk_backward"](y["d_logits"], xd["q"], xd["k"], kernel,
                                                      rpb=xd["rpb"], **kw)
    return host(y)


def check_chain(y, geom, where=""):
    """Head H0 (all logits -inf): probs, out, dv, d_logits, dq, dk, d_rpb exactly 0; the
    other heads finite, their probs summing to 1 and their gradients not all zero."""
    for name, g in y.items():
        if name == "d_rpb":
            dead, live = g[H0], numpy.delete(g, H0, axis=0)
        else:
            dead, live = g[..., H0, :], numpy.delete(g, H0, axis=-2)
        if name == "logits":
            assert (dead == -numpy.inf).all(), f"{where}logits of head {H0} must be -inf"
            continue
        assert numpy.isfinite(g).all(), (
            f"{where}{name}: {int((~numpy.isfinite(g)).sum())} non-finite elements")
        if name != "d_probs":
            assert (dead == 0).all(), (
                f"{where}{name}: head {H0} (only -inf logits) must be exactly 0, max "
                f"|value| {numpy.abs(dead).max():.3g}")
        if name != "probs":
            assert numpy.abs(live).max() > 0, f"{where}{name}: live heads are all zero"
    sums = numpy.delete(y["probs"], H0, axis=-2).sum(axis=-1)
    numpy.testing.assert_allclose(sums, 1, rtol=0, atol=1e-2, err_msg=f"{where}probs")


# ---- CPU tests: the reference backend on NumPy -------------------------------------------

VALUES = {"nan": numpy.nan, "inf": numpy.inf}


@QUIET
@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("source", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_fused_nonfinite_reaches_only_its_windows(rng, rank, source, value):
    geom = GEOMS[rank]
    x, token = fused_planted_inputs(rng, geom, numpy.float32, source, VALUES[value])
    got = host(run_fused("reference", numpy, x, geom))
    check_reach(got, fused_reach(geom, source, token), f"[reference {source}={value}] ")


UNFUSED_SOURCES = [("qk", "q"), ("qk", "k"), ("qk", "rpb"), ("av", "v"), ("av", "attn"),
                   ("qk_backward", "d_attn"), ("av_backward", "d_out"),
                   ("av_backward", "attn")]


@QUIET
@pytest.mark.parametrize("kind,source", UNFUSED_SOURCES, ids=[f"{k}-{s}" for k, s in
                                                               UNFUSED_SOURCES])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_unfused_nan_reaches_only_its_slots(rng, rank, kind, source):
    geom = unit_stride(GEOMS[rank])
    x, token, slot = unfused_planted_inputs(rng, geom, numpy.float32, kind, source)
    got = host(run_unfused("reference", numpy, kind, x, geom))
    check_reach(got, unfused_reach(geom, kind, source, token, slot), f"[reference {kind}] ")
    check_unfused_empty_slots(got, geom)


@QUIET
@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
@pytest.mark.parametrize("which", sorted(CHAIN_GEOMS, key=str))
def test_minus_inf_rows_of_the_unfused_chain_give_zeros(rng, which, dtype):
    geom = CHAIN_GEOMS[which]
    check_chain(run_chain("reference", numpy, geom, dtype, rng), geom, f"[reference {which}] ")


def test_reach_predictions_are_not_trivial():
    """The expected sets are proper: some rows reached, most not (else the checks are weak)."""
    for rank, geom in GEOMS.items():
        for source in ("q", "k", "v"):
            r = fused_reach(geom, source, planted_token(geom))
            for name, m in r.items():
                if name == "dv" and source == "v" or name == "lse" and source == "v":
                    assert not m.any()
                    continue
                assert 0 < m.sum() < m.size / 4, (rank, source, name)
        # The backward spreads from the spoilt rows to every key of their windows.
        rk = fused_reach(geom, "k", planted_token(geom))
        assert rk["dk"].sum() > rk["dq"].sum(), rank


# ---- float64 exactness ---------------------------------------------------------------------

PRECISION_HEAD_DIMS = (8, 24, 32)     # D ** -0.5 is not a power of two
PRECISION_KINDS = ("fused", "fused_rpb", "qk", "qk_rpb", "av", "qk_backward_rpb", "av_backward")
FLOAT64_RTOL = 1e-12


def precision_cases():
    """float64 suite cases on head dims whose default scale is not a power of two."""
    cases = []
    for kind in PRECISION_KINDS:
        for rank in (1, 2, 3):
            for i, d in enumerate(PRECISION_HEAD_DIMS):
                spatial, kernel, stride, dilation, causal = gpu_cases.GEOMETRIES[rank][i % 4]
                if kind != "fused":
                    stride = (1,) * rank
                cases.append(gpu_cases.Case(kind, rank, "float64", spatial, kernel, stride,
                                            dilation, causal, d))
    return cases


def relative_error(got, truth):
    """max |got - truth| / max |truth| over finite truth; non-finite entries must agree."""
    fin = numpy.isfinite(truth)
    assert (numpy.isfinite(got) == fin).all(), "finite/non-finite positions differ"
    assert (got[~fin] == truth[~fin]).all(), "non-finite values differ"
    scale = float(numpy.abs(truth[fin]).max(initial=0.0))
    err = float(numpy.abs(got[fin] - truth[fin]).max(initial=0.0))
    return err / scale if scale > 0 else err


def check_float64(case, got, truth, where=""):
    for name, t in truth.items():
        g = got[name]
        assert not numpy.isnan(g).any(), f"{where}{name}: elements left unwritten (NaN)"
        err = relative_error(g, t)
        assert err <= FLOAT64_RTOL, (f"{where}{name}: relative error {err:.3g} > "
                                     f"{FLOAT64_RTOL:g} against the float64 reference")


@pytest.fixture(scope="module")
def emulated_naive(tmp_path_factory):
    import emulator
    why = emulator.unbuildable_reason()
    if why:
        pytest.skip(why)
    src = os.environ.get("NATTEN_CUPY_EMULATED_SRC")
    return emulator.build(tmp_path_factory.mktemp("robust_emulator"), cuda_src=src)


PCASES = precision_cases()


@pytest.mark.parametrize("index", range(len(PCASES)), ids=[c.id for c in PCASES])
def test_float64_naive_kernels_emulated_match_the_reference(index, emulated_naive,
                                                            monkeypatch):
    """The naive kernels' CUDA source on the CPU (tests/emulator) in float64 agrees with the
    float64 reference at 1e-12: no float32 scalar on the path (a float32 scale gave 1e-8)."""
    import emulator
    naive = get_backend("naive")
    e = emulator.Emulator(emulated_naive, block=naive.BLOCK, max_blocks=naive.MAX_BLOCKS)
    monkeypatch.setattr(naive, "get_kernel", e.get_kernel)
    monkeypatch.setattr(naive, "launch", e.launch)
    case = PCASES[index]
    x, truth, _ = gpu_cases.references(case)
    got = host(gpu_cases.run(case, naive, dict(x), numpy))
    check_float64(case, got, truth, f"[emulated naive {case.id}] ")


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("head_dim", PRECISION_HEAD_DIMS)
def test_float64_reference_matches_the_oracle(rng, rank, head_dim):
    """The reference backend in float64 against the dense float64 oracle at 1e-12."""
    geom = GEOMS[rank]
    spatial, kernel, stride, dilation, causal = geom
    x = normal_inputs(rng, ("q", "k", "v", "d_out"), geom, numpy.float64, head_dim=head_dim)
    got = host(run_fused("reference", numpy, x, geom))
    out, lse = oracle.fused_forward(x["q"], x["k"], x["v"], kernel, stride, dilation, causal)
    dq, dk, dv = oracle.fused_backward(x["d_out"], x["q"], x["k"], x["v"], kernel, stride,
                                       dilation, causal)
    for name, want in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        err = relative_error(got[name], want)
        assert err <= FLOAT64_RTOL, f"{name}: relative error {err:.3g}"


# ---- the random sweep's control flow -----------------------------------------------------

def test_sweep_runs_on_the_cpu(tmp_path):
    """bench/sweep.py on the reference backend (NumPy): cases run, none fail, summary
    written with its fields; a second run with the same seed draws the same configs."""
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(ROOT / "bench" / "sweep.py"), "--device", "cpu", "--backends",
           "reference", "--cases", "6", "--seed", "7", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads(out.read_text())
    assert s["seed"] == 7 and s["device"] == "cpu"
    assert s["failures"] == []
    runs = s["cases_run"]
    assert set(runs) == {f"reference/{d}" for d in ("float64", "float32", "float16",
                                                   "bfloat16")}
    assert all(n == 6 for n in runs.values())
    assert s["worst_ratio"] and all(0 <= v <= 1 for v in s["worst_ratio"].values())
    assert any(k.endswith("/fused_backward") for k in s["worst_ratio"])
    assert any(k.endswith("/qk_backward") for k in s["worst_ratio"])
    again = tmp_path / "again.json"
    cmd[cmd.index(str(out))] = str(again)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(again.read_text())["configs_digest"] == s["configs_digest"]


def test_sweep_stops_at_its_time_budget(tmp_path):
    out = tmp_path / "summary.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sweep.py"), "--device", "cpu", "--backends",
         "reference", "--dtypes", "float32", "--cases", "100000", "--time-budget-s", "3",
         "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads(out.read_text())
    assert s["out_of_time"] is True
    assert 0 < s["cases_run"]["reference/float32"] < 100000
    assert "out of time" in done.stdout


def test_sweep_refuses_bad_arguments():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sweep.py"), "--device", "cpu",
                           "--backends", "naive"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode != 0
    assert "cpu runs only the reference backend" in done.stderr


def _sweep_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "bench" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Spoilt:
    """The reference backend with one output element spoilt after each op (``how``: a
    relative error of 1e-3 on the largest element, or a NaN as if never written)."""

    def __init__(self, how, only=None):
        self.ref = get_backend("reference")
        self.NAME = "reference"
        self.how = how
        self.only = only   # spoil this op's output only
        self.refuse = self.ref.refuse

    def __getattr__(self, op):
        fn = getattr(self.ref, op)
        if self.only not in (None, op):
            return fn

        def spoil(problem, *arrays, **named):   # (a bias's d_rpb first, where there is one)
            fn(problem, *arrays, **named)
            last = named.get("d_rpb")
            if last is None:
                last = arrays[-1] if arrays[-1] is not None else arrays[-2]
            i = int(numpy.argmax(numpy.abs(numpy.nan_to_num(last.astype(numpy.float64),
                                                            neginf=0))))
            idx = numpy.unravel_index(i, last.shape)
            last[idx] = numpy.nan if self.how == "nan" else last[idx] * (1 + 1e-3)
        return spoil


def test_sweep_draws_fused_cases_with_a_bias():
    """A quarter of the sweep's fused cases of stride 1 carry a bias (read off their input
    seed, so the other fields of every case are drawn as before); such a case runs on the
    reference backend, and a d_rpb off by 1e-3 in one element fails it."""
    sweep = _sweep_module()
    cfgs = [sweep.draw_config(5, "reference", "float32", i) for i in range(300)]
    fused = [c for c in cfgs if c["kind"] == "fused"]
    biased = [c for c in fused if c["rpb"]]
    assert biased and len(biased) < len(fused)
    assert all(all(s == 1 for s in c["stride"]) and c["input_seed"] % 4 == 0 for c in biased)
    cpu = sweep.Device("cpu")
    for cfg in biased[:3]:
        assert sweep.run_case(cfg, get_backend("reference"), cpu) is not None
        with pytest.raises(AssertionError, match="d_rpb: max error"):
            sweep.run_case(cfg, _Spoilt("error", only="fused_backward"), cpu)


@pytest.mark.parametrize("how,message", [("nan", "unwritten"), ("error", "max error")])
def test_sweep_checks_catch_a_wrong_backend(how, message):
    """The sweep's check rejects a backend off by 1e-3 in one element, or one that leaves an
    element unwritten, on every op kind (float32)."""
    sweep = _sweep_module()
    cpu = sweep.Device("cpu")
    kinds = set()
    for i in range(40):
        cfg = sweep.draw_config(3, "reference", "float32", i)
        if cfg["kind"] in kinds:
            continue
        kinds.add(cfg["kind"])
        assert sweep.run_case(cfg, get_backend("reference"), cpu) is not None
        with pytest.raises(AssertionError, match=message):
            sweep.run_case(cfg, _Spoilt(how), cpu)
    assert kinds == set(sweep.KINDS["reference"])


def test_sweep_hopper_stream_holds_the_fused_backend_to_its_wgmma_parts():
    """The ``hopper`` stream draws fused cases at head dims 16-128, some of them 32 and under
    (padded to 64; larger windows than the fused stream's) and runs them on the fused backend with the internal tile that routes
    both ops to the Hopper parts, whatever the dispatch would pick; without a compute
    capability 9.0 GPU the parts refuse them (counted as refused, not run)."""
    from natten_cupy.backends import fused
    sweep = _sweep_module()
    cfgs = [sweep.draw_config(13, "hopper", "bfloat16", i) for i in range(200)]
    assert {c["kind"] for c in cfgs} == {"fused"}
    assert all(16 <= c["head_dim"] <= 128 and c["head_dim"] % 8 == 0 for c in cfgs)
    assert any(c["head_dim"] <= 32 for c in cfgs) and any(c["head_dim"] > 64 for c in cfgs)
    assert max(c["kernel"][0] for c in cfgs if c["rank"] == 1) > 33
    assert any(c["rpb"] for c in cfgs) and any(any(c["causal"]) for c in cfgs)
    for cfg in cfgs[:5]:
        x = sweep.make_inputs(cfg)
        for op, p in sweep.problems(cfg, x, "fused").items():
            assert p.tile == fused.HOPPER
            assert fused._parts_for(op, p) == fused._HOPPER_PART[op]
        if fused._part("wgmma_forward")._compute_capability() != (9, 0):
            assert sweep.refusal(cfg, get_backend("fused"), x) is not None
    # the other streams' draws do not move
    assert sweep.draw_config(13, "fused", "float16", 7) == sweep.draw_config(13, "fused",
                                                                             "float16", 7)


def test_sweep_head_dims_streams_draw_only_those_dims():
    """``--head-dims`` draws the head dim from the given ones alone, in streams of their own
    (the plain streams' cases do not move), and such a case runs on the reference backend."""
    sweep = _sweep_module()
    dims = (136, 160, 200)
    cfgs = [sweep.draw_config(13, "fused", "float16", i, dims) for i in range(200)]
    long_axis = [c for c in cfgs if max(c["spatial"]) > sweep.LONG_AXIS]
    assert {c["head_dim"] for c in cfgs if c not in long_axis} == set(dims)
    assert all(c["head_dims"] == list(dims) for c in cfgs)
    plain = [sweep.draw_config(13, "fused", "float16", i) for i in range(200)]
    assert "head_dims" not in plain[0] and plain != cfgs
    assert plain[5] == sweep.draw_config(13, "fused", "float16", 5)
    ref = [sweep.draw_config(3, "reference", "float32", i, (144,)) for i in range(3)]
    cpu = sweep.Device("cpu")
    for cfg in ref:
        assert sweep.run_case(cfg, get_backend("reference"), cpu) is not None
    a = sweep.parse_args(["--head-dims", "136,160", "--device", "cpu"])
    assert a.head_dims == (136, 160)
    with pytest.raises(SystemExit):
        sweep.parse_args(["--head-dims", "16,x"])
