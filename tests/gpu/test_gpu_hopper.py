"""Hopper fused forward (backends/wgmma_forward.py, sm_90a) against the float64 reference.

Each case runs the wgmma kernel on NaN-poisoned outputs and checks, against the reference in
float64, that its error is at most 2x the error of the reference run in the same precision
plus a small floor (FlashAttention's rule); every output element must be written. Skipped on
GPUs other than compute capability 9.0.
"""

import numpy
import pytest

from natten_cupy import _args
from natten_cupy._dtypes import BFLOAT16
from natten_cupy.backends import get_backend
from natten_cupy.backends.fused import wgmma_forward
from natten_cupy.ops import run_fused_forward
from gpu_cases import to_host, upload

pytestmark = pytest.mark.gpu

F16, BF16, F64 = numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float64)
OUT_FLOOR = {F16: 2e-3, BF16: 1.6e-2}
LSE_FLOOR = {F16: 2e-3, BF16: 2e-3}

# (spatial, kernel, stride, dilation, causal, heads, head_dim, dtype, scale)
CASES = [
    ((97,), 7, 1, 2, True, 2, 64, F16, None),
    ((200,), 33, 4, 1, False, 3, 40, BF16, None),       # head dim padded to 64
    ((300,), 300, 1, 1, False, 2, 128, F16, None),      # self-attention, partial last tile
    ((1500,), 511, 1, 1, False, 1, 64, F16, None),
    ((1500,), 512, 3, 1, True, 1, 64, BF16, None),      # even kernel, stride, causal
    ((1000,), 64, 1, 3, False, 2, 128, BF16, None),     # dilation groups of 334 / 333
    ((777,), 777, 1, 1, True, 1, 64, F16, None),        # causal self-attention
    ((129,), 2, 2, 1, False, 2, 128, F16, None),        # smallest kernel
    ((2053,), 1023, 5, 2, True, 1, 96, F16, None),      # head dim padded to 128
    ((513,), 100, 1, 1, False, 1, 64, F16, 0.3),        # explicit scale
    ((2048,), 2048, 1, 1, False, 1, 128, BF16, None),   # dense, whole tiles only
    ((64,), 64, 64, 1, False, 2, 64, BF16, None),       # stride == kernel: blocked attention
    # 2-D (8 x 16 query boxes) and 3-D (2 x 8 x 8)
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 2, 64, F16, None),
    ((24, 37), (4, 6), 1, 1, False, 1, 128, BF16, None),
    ((30, 29), 13, 1, 1, False, 1, 128, F16, None),
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 1, 64, BF16, None),
    ((45, 50), (45, 50), 1, 1, False, 1, 64, F16, None),   # 2-D self-attention
    ((7, 70), (3, 33), 1, 1, (True, True), 2, 128, F16, 0.2),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 2, 64, F16, None),
    ((8, 12, 12), 3, (1, 3, 2), 1, False, 1, 128, BF16, None),
    ((6, 10, 11), (3, 5, 5), 1, 1, (True, False, False), 1, 64, F16, None),
    ((5, 6, 7), (5, 6, 7), 1, 1, False, 1, 128, F16, None),  # 3-D self-attention
    ((10, 20, 21), (5, 9, 9), (2, 1, 3), (1, 2, 2), False, 1, 64, BF16, None),
    # head dims 32 and under, padded to 64 (the dispatch keeps them on mma.sync unless the
    # window is large: the Hopper forward must be right there too)
    ((201,), 65, 1, 1, False, 2, 32, F16, None),
    ((40, 37), (23, 21), 1, 1, False, 1, 32, BF16, None),
    ((17, 19), 5, (1, 2), 1, False, 2, 8, F16, None),
    ((6, 12, 13), (3, 5, 5), 1, 1, (True, False, False), 1, 16, F16, None),
]


# Head dims 136-256 in 1-D and 2-D (the head-dim-256 tile).
WIDE_CASES = [
    ((97,), 7, 1, 2, True, 2, 256, F16, None),
    ((700,), 565, 1, 1, False, 2, 160, BF16, None),        # padded to 256
    ((1500,), 512, 3, 1, True, 1, 256, BF16, None),        # even kernel, stride, causal
    ((300,), 300, 1, 1, False, 1, 200, F16, None),         # self-attention, partial tile
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 2, 256, F16, None),
    ((30, 29), 13, 1, 1, False, 1, 160, BF16, None),
    ((45, 50), (45, 50), 1, 1, False, 1, 136, BF16, None),   # 2-D self-attention
]


def _skip_unless_hopper():
    if wgmma_forward._compute_capability() != (9, 0):
        pytest.skip("needs a compute capability 9.0 GPU")


def _problem(x, case, rpb=None):
    spatial, ks, st, dl, ca, _, _, _, scale = case
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, scale, "fused", rpb=rpb)


def _reference(problem, q, k, v, rpb=None):
    out = numpy.empty(q.shape, q.dtype)
    lse = numpy.empty(q.shape[:-1], F64 if q.dtype == F64 else numpy.float32)
    run_fused_forward(problem, get_backend("reference"), q, k, v, out, lse, rpb)
    return out.astype(F64), lse.astype(F64)


def check_case(case, rng, tile=None, layout="canonical", walk_boxes=None, bias=False, tma=None):
    """Run one case (with ``bias`` a random relative positional bias [H, 2k-1, ...]; ``tma``:
    the loader, as ``wgmma_forward.forward`` takes it); returns (out error, reference out
    error, lse error)."""
    import cupy as cp
    spatial, kernel, _, _, _, heads, dim, dtype, _ = case
    rank = len(spatial)
    shape = (2,) + tuple(spatial) + (heads, dim)
    host = [rng.standard_normal(shape).astype(dtype) for _ in range(3)]
    kernel = (kernel,) * rank if isinstance(kernel, int) else kernel
    rpb = (rng.standard_normal((heads, *(2 * x - 1 for x in kernel))) * 2).astype(dtype) \
        if bias else None
    if layout == "heads_first":  # [B, H, *spatial, D] buffers seen as canonical (no copy)
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        back = tuple(numpy.argsort(to_hf))
        dev = [upload(cp, x.transpose(to_hf)).transpose(back) for x in host]
    else:
        dev = [upload(cp, x) for x in host]
    prob = _problem(host[0], case, rpb)
    assert wgmma_forward.refuse(prob) is None, wgmma_forward.refuse(prob)
    out = upload(cp, numpy.full(shape, numpy.nan, dtype))
    lse = cp.full(shape[:-1], cp.nan, dtype=cp.float32)
    wgmma_forward.forward(prob, *dev, out, lse, None if rpb is None else upload(cp, rpb),
                          tile=tile, walk_boxes=walk_boxes, tma=tma)
    out, lse = to_host(out), to_host(lse)
    h64 = [x.astype(F64) for x in host]
    r64 = None if rpb is None else rpb.astype(F64)
    ref_out, ref_lse = _reference(_problem(h64[0], case, r64), *h64, r64)
    low_out, _ = _reference(prob, *host, rpb)
    assert not numpy.isnan(out).any(), "unwritten (NaN) elements in out"
    assert not numpy.isnan(lse).any(), "unwritten (NaN) elements in lse"
    err = float(numpy.abs(out.astype(F64) - ref_out).max())
    ref_err = float(numpy.abs(low_out - ref_out).max())
    lse_err = float(numpy.abs(lse - ref_lse).max())
    assert err <= 2 * ref_err + OUT_FLOOR[dtype], (err, ref_err)
    assert lse_err <= LSE_FLOOR[dtype], lse_err
    return err, ref_err, lse_err


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-s{c[2]}-"
                         f"d{c[3]}-c{c[4]}-D{c[6]}-{numpy.dtype(c[7]).name}")
def test_hopper_forward_matches_reference(case, rng):
    _skip_unless_hopper()
    check_case(case, rng)


@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-"
                         f"s{c[2]}-d{c[3]}-c{c[4]}-D{c[6]}-{numpy.dtype(c[7]).name}")
@pytest.mark.parametrize("tma", [None, False], ids=("default", "cp.async"))
def test_hopper_forward_head_dims_above_128(case, tma, rng):
    """The head-dim-256 tile, both loaders in 1-D."""
    _skip_unless_hopper()
    check_case(case, rng, tma=tma)


# The same tile in 3-D (WIDE_3D; the flat walk, cp.async).
WIDE_3D_CASES = [
    ((6, 12, 13), (3, 5, 5), 1, 1, (True, False, False), 1, 256, F16, None),
    ((5, 9, 10), (3, 3, 4), (1, 2, 1), (1, 1, 2), False, 2, 160, BF16, None),
]


@pytest.mark.parametrize("case", WIDE_3D_CASES, ids=lambda c: f"3d-{c[0]}-k{c[1]}-D{c[6]}")
def test_hopper_forward_3d_above_128(case, rng, monkeypatch):
    """The head-dim-256 tile in 3-D (WIDE_3D held on whatever its default): every output
    element against the float64 reference."""
    _skip_unless_hopper()
    monkeypatch.setattr(wgmma_forward, "WIDE_3D", True)
    check_case(case, rng)


@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) > 1],
                         ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}")
@pytest.mark.parametrize("walk_boxes", [False, True], ids=("flat", "boxes"))
def test_hopper_key_walks(case, walk_boxes, rng):
    _skip_unless_hopper()
    check_case(case, rng, walk_boxes=walk_boxes)


@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) > 1],
                         ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}")
@pytest.mark.parametrize("walk_boxes", [False, True], ids=("flat", "boxes"))
def test_hopper_small_box_tiles(case, walk_boxes, rng):
    """Rank 2 and 3 with one compute warpgroup (64-query boxes, two CTAs an SM)."""
    _skip_unless_hopper()
    check_case(case, rng, walk_boxes=walk_boxes,
               tile=wgmma_forward.SMALL_BOX[wgmma_forward._bucket(case[6])])


@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) == 1],
                         ids=lambda c: f"1d-{c[0]}-k{c[1]}-s{c[2]}-d{c[3]}-c{c[4]}-D{c[6]}")
@pytest.mark.parametrize("tma", [False, True], ids=("cp.async", "tma"))
def test_hopper_small_box_tiles_1d(case, tma, rng):
    """Rank 1 with one compute warpgroup (64 consecutive queries, 64-key tiles, two CTAs an
    SM), both loaders (TMA where its maps describe the operands)."""
    _skip_unless_hopper()
    tile = wgmma_forward.SMALL_BOX[wgmma_forward._bucket(case[6])]
    if tma and not _tma_runs(case):
        with pytest.raises(ValueError, match="TMA loader cannot run"):
            check_case(case, rng, tile=tile, tma=True)
        return
    check_case(case, rng, tile=tile, tma=tma)


def _tma_runs(case):
    """Where the TMA loader runs (the maps' limits, natten_cupy/_tma.py): rank 1 with dilation
    up to 4, rank 2 with dilation up to 8, rank 3 where the head dim is the kernel's 64 or 128
    (the tests' arrays are contiguous); rank 2 and 3 walking key boxes."""
    spatial, _, _, dil, _, _, dim, _, _ = case
    dil = (dil,) * len(spatial) if isinstance(dil, int) else dil
    if len(spatial) == 1:
        return dil[0] <= 4
    return max(dil) <= 8 and (len(spatial) == 2 or dim in (64, 128))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-s{c[2]}-"
                         f"d{c[3]}-c{c[4]}-D{c[6]}-{numpy.dtype(c[7]).name}")
@pytest.mark.parametrize("tma", [False, True], ids=("cp.async", "tma"))
def test_hopper_loaders(case, tma, rng):
    """Both loaders on every case: cp.async always, TMA wherever its maps describe the
    operands (a case outside them must be refused with the reason, not run the other loader)."""
    _skip_unless_hopper()
    walk = True if len(case[0]) > 1 else None
    if tma and not _tma_runs(case):
        with pytest.raises(ValueError, match="TMA loader cannot run"):
            check_case(case, rng, walk_boxes=walk, tma=True)
        return
    check_case(case, rng, walk_boxes=walk, tma=tma)
    if len(case[0]) > 1:   # and the 64-query box
        check_case(case, rng, walk_boxes=True, tma=tma,
                   tile=wgmma_forward.SMALL_BOX[wgmma_forward._bucket(case[6])])


@pytest.mark.parametrize("case", [c for c in CASES if c[2] in (1, (1,) * len(c[0]))
                                  and _tma_runs(c)][::2], ids=lambda c: f"{len(c[0])}d-{c[0]}")
def test_hopper_tma_with_bias(case, rng):
    _skip_unless_hopper()
    check_case(case, rng, bias=True, walk_boxes=True if len(case[0]) > 1 else None, tma=True)


@pytest.mark.parametrize("tile", [t for ts in wgmma_forward.ALTERNATIVES.values() for t in ts],
                         ids=str)
def test_hopper_alternative_tiles(tile, rng):
    _skip_unless_hopper()
    dim = 64 if tile in wgmma_forward.ALTERNATIVES[64] else 128
    check_case(((1100,), 300, 2, 1, True, 2, dim, F16, None), rng, tile=tile)
    check_case(((901,), 901, 1, 1, False, 1, dim, F16, None), rng, tile=tile)
    check_case(((1000,), 64, 1, 3, False, 2, dim, F16, None), rng, tile=tile)
    check_case(((70,), 9, 1, 1, False, 1, dim, F16, None), rng, tile=tile)   # one key tile


@pytest.mark.parametrize("case", [((333,), 65, 1, 2, False, 3, 64, F16, None),
                                  ((21, 18), (5, 7), 1, (2, 1), False, 3, 64, F16, None)],
                         ids=("1d", "2d"))
def test_hopper_heads_first_layout(case, rng):
    _skip_unless_hopper()
    check_case(case, rng, layout="heads_first")


def test_hopper_self_attention_equals_dense(rng):
    """kernel == extent, no stride/dilation/causality: plain softmax attention."""
    import cupy as cp
    _skip_unless_hopper()
    L, H, D = 650, 2, 128
    host = [rng.standard_normal((1, L, H, D)).astype(F16) for _ in range(3)]
    prob = _problem(host[0], ((L,), L, 1, 1, False, H, D, F16, None))
    out = upload(cp, numpy.full(host[0].shape, numpy.nan, F16))
    lse = cp.empty((1, L, H), cp.float32)
    wgmma_forward.forward(prob, *(upload(cp, x) for x in host), out, lse)
    qf, kf, vf = (x.astype(F64)[0].transpose(1, 0, 2) for x in host)
    s = qf @ kf.transpose(0, 2, 1) * D ** -0.5
    p = numpy.exp(s - s.max(-1, keepdims=True))
    dense = (p / p.sum(-1, keepdims=True)) @ vf
    assert float(numpy.abs(to_host(out)[0].transpose(1, 0, 2) - dense).max()) < 3e-3



# With a relative positional bias: the stride-1 cases above (1-D, 2-D, 3-D; causal, dilation,
# even kernels, odd extents, head dims 40 to 128, self-attention) and both key walks where
# they are built (rank 2, 3 at head dim 64; boxes only at 128).
BIAS_CASES = [c for c in CASES if c[2] in (1, (1,) * len(c[0]))]


@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-"
                         f"d{c[3]}-c{c[4]}-D{c[6]}-{numpy.dtype(c[7]).name}")
def test_hopper_forward_with_bias_matches_reference(case, rng):
    _skip_unless_hopper()
    check_case(case, rng, bias=True)
    if len(case[0]) > 1 and case[6] <= 64:   # the 128-query box's two walks
        for walk_boxes in (False, True):
            check_case(case, rng, tile=wgmma_forward.DEFAULT_ND, bias=True,
                       walk_boxes=walk_boxes)


@pytest.mark.parametrize("case", [c for c in BIAS_CASES if len(c[0]) > 1],
                         ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-d{c[3]}-c{c[4]}-D{c[6]}-"
                         f"{numpy.dtype(c[7]).name}")
def test_hopper_small_box_with_bias_matches_reference(case, rng):
    """The 64-query boxes (one compute warpgroup) with a bias: key boxes only, on either
    loader (TMA where the maps take the case)."""
    _skip_unless_hopper()
    tile = wgmma_forward.SMALL_BOX[wgmma_forward._bucket(case[6])]
    for tma in (False, None):
        check_case(case, rng, tile=tile, bias=True, walk_boxes=True, tma=tma)


@pytest.mark.parametrize("rank", (1, 2, 3))
def test_biased_calls_run_the_hopper_forward(rank, rng):
    """na{1,2,3}d with a bias in half precision at head dim 64, on windows where the Hopper
    forward pays, run the Hopper kernel and agree with the float64 reference."""
    import cupy as cp
    import natten_cupy
    _skip_unless_hopper()
    spatial, kernel = {1: ((700,), (255,)), 2: ((23, 30), (17, 17)),
                       3: ((6, 13, 12), (3, 7, 7))}[rank]
    shape = (2, *spatial, 4, 64)
    host = [rng.standard_normal(shape).astype(F16) for _ in range(3)]
    rpb = rng.standard_normal((4, *(2 * x - 1 for x in kernel))).astype(F16)
    call = getattr(natten_cupy, f"na{rank}d")
    with natten_cupy.profile() as prof:
        out, lse = call(*(upload(cp, x) for x in host), kernel, rpb=upload(cp, rpb),
                        return_lse=True)
        cp.cuda.runtime.deviceSynchronize()
    assert [r["name"] for r in prof.records] == ["na_fwd_hopper"]
    h64 = [x.astype(F64) for x in host]
    r64 = rpb.astype(F64)
    case = (spatial, kernel, 1, 1, False, 4, 64, F16, None)
    ref_out, ref_lse = _reference(_problem(h64[0], case, r64), *h64, r64)
    assert float(numpy.abs(to_host(out).astype(F64) - ref_out).max()) < 1e-2
    assert float(numpy.abs(to_host(lse) - ref_lse).max()) < 2e-3


def test_small_windows_run_the_mma_sync_forward(rng):
    """Below the measured break-even window (fused._hopper_fwd_pays) the default forward is
    the mma.sync kernel: 2-D 7x7 at head dim 64, with and without a bias."""
    import cupy as cp
    import natten_cupy
    _skip_unless_hopper()
    q = upload(cp, rng.standard_normal((2, 20, 21, 2, 64)).astype(F16))
    rpb = upload(cp, rng.standard_normal((2, 13, 13)).astype(F16))
    for kw in ({}, {"rpb": rpb}):
        with natten_cupy.profile() as prof:
            natten_cupy.na2d(q, q, q, 7, **kw)
            cp.cuda.runtime.deviceSynchronize()
        assert [r["name"] for r in prof.records] == ["na_fwd_fused"], kw
