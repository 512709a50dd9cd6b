"""Every Hopper fused-forward instantiation compiles for sm_90a without a GPU, with no spills
and no wgmma serialization (ptxas warns "wgmma.mma_async instructions are serialized" when it
has to wait after each one). Registers per kernel are printed to the log; the HGMMA count of
the SASS is checked on the device by bench/probes/hopper_probe.py (CI has no disassembler).
"""

import dataclasses

import numpy
import pytest

from natten_cupy import _args, _compile
from natten_cupy._dtypes import HALF_TYPES
from natten_cupy.backends.fused import wgmma_forward

NAMES = [expr for _, expr in wgmma_forward.instantiations()]
# Spills allowed (bytes, stack too): the head-dim-256 tile in 3-D, whose flat walk's index
# math spills 84 bytes (NVRTC 13.0; twice that for other versions' allocators), measured
# 2.1-3.9x faster than the mma.sync forward all the same (wgmma_forward.WIDE_3D).
SPILLS = {wgmma_forward._name(dt, 256, wgmma_forward.WIDE, 3): 168 for dt in HALF_TYPES}


@pytest.mark.skipif(not _compile.cuda_include_dirs(), reason="no CUDA headers (pip install "
                    "nvidia-cuda-runtime, or a CUDA toolkit)")
def test_hopper_kernels_compile_for_sm90a(capsys):
    reports = _compile.nvrtc_check_many(wgmma_forward.SOURCE, NAMES, "sm_90a")
    with capsys.disabled():
        print(f"\n{wgmma_forward.SOURCE} [sm_90a]: {len(reports)} kernels")
        for r in reports:
            print(f"  {r.name:<60} regs {r.registers:>3}  stack {r.stack_bytes:>4}  "
                  f"spill {r.spill_bytes}")
    assert not [r.name for r in reports
                if r.spill_bytes > SPILLS.get(r.name, 0) or r.stack_bytes > SPILLS.get(r.name, 0)]
    assert not [r.name for r in reports if "serialized" in r.log]


def test_hopper_instantiations_cover_defaults():
    from natten_cupy._dtypes import HALF_TYPES
    for dtype in HALF_TYPES:
        for dp, tile in wgmma_forward.DEFAULT.items():
            assert (wgmma_forward.SOURCE, wgmma_forward._name(dtype, dp, tile)) in \
                wgmma_forward.instantiations()


def _problem(x, rank, kernel, scale=None, rpb=None):
    return _args.check_fused(rank, x, x, x, kernel, 1, 1, False, scale, "fused", rpb=rpb)


def test_head_dims_above_128_take_the_wide_tile(monkeypatch):
    """Head dims 136-256 pad to 256 and plan the head-dim-256 tile at every rank (two
    warpgroups, 64-key tiles, two stages, the flat walk, 192 KiB of shared memory); refused
    with HEAD_DIM_256 off, in 3-D with WIDE_3D off, and with a bias either way."""
    from natten_cupy.backends.fused import _hopper_fwd_pays
    monkeypatch.setattr(wgmma_forward, "HEAD_DIM_256", False)
    for d in (136, 160, 256):
        x = numpy.zeros((1, 40, 2, d), numpy.float16)
        assert "up to 128" in wgmma_forward.refuse(_problem(x, 1, 7))
    monkeypatch.setattr(wgmma_forward, "HEAD_DIM_256", True)
    monkeypatch.setattr(wgmma_forward, "_compute_capability", lambda: (9, 0))
    for shape, rank, kernel in (((1, 700, 2, 160), 1, 565), ((1, 30, 29, 1, 256), 2, 13),
                                ((1, 9, 17, 13, 2, 200), 3, (3, 5, 4))):
        x = numpy.zeros(shape, numpy.float16)
        p = _problem(x, rank, kernel)
        assert wgmma_forward.refuse(p) is None
        plan = wgmma_forward._plan(p)
        assert plan.tile == wgmma_forward.WIDE and not plan.walk_boxes
        assert plan.smem == 2 * 256 * (128 + 2 * 2 * 64) + 16 * 2
        assert plan.name.startswith("natten::na_fwd_hopper<__half, 256, 2, 64, 2, true, true")
        assert (wgmma_forward.SOURCE, plan.name) in wgmma_forward.instantiations()
        assert _hopper_fwd_pays(p) in (True, False)   # the dispatch has thresholds for it
    monkeypatch.setattr(wgmma_forward, "WIDE_3D", False)
    three = numpy.zeros((1, 9, 17, 13, 2, 200), numpy.float16)
    assert "3-D" in wgmma_forward.refuse(_problem(three, 3, (3, 5, 4)))
    bias = numpy.zeros((2, 13), numpy.float16)
    x = numpy.zeros((1, 40, 2, 256), numpy.float16)
    assert "bias" in wgmma_forward.refuse(_problem(x, 1, 7, rpb=bias))
    wide = numpy.zeros((1, 16, 1, 264), numpy.float16)
    assert "up to 256" in wgmma_forward.refuse(_problem(wide, 1, 3))


def test_hopper_refusals():
    """Reasons that do not depend on the device (CI has none: the last reason is the GPU)."""
    f32 = numpy.zeros((1, 16, 1, 32), numpy.float32)
    assert "float16" in wgmma_forward.refuse(_problem(f32, 1, 3))
    odd = numpy.zeros((1, 16, 1, 20), numpy.float16)
    assert "multiple of 8" in wgmma_forward.refuse(_problem(odd, 1, 3))
    wide = numpy.zeros((1, 4, 4, 4, 1, 256), numpy.float16)   # 3-D at 256: the device decides
    assert "compute capability" in wgmma_forward.refuse(_problem(wide, 3, 3))
    wider = numpy.zeros((1, 16, 1, 264), numpy.float16)
    assert "up to 256" in wgmma_forward.refuse(_problem(wider, 1, 3))
    two = numpy.zeros((1, 4, 4, 1, 64), numpy.float16)
    assert "compute capability" in wgmma_forward.refuse(_problem(two, 2, 3))
    ok = numpy.zeros((1, 16, 1, 64), numpy.float16)
    assert "positive scale" in wgmma_forward.refuse(_problem(ok, 1, 3, scale=-1.0))
    # the bias rides in the scores' accumulator as rpb / scale
    bias = numpy.ones((1, 5), numpy.float16)
    tiny = wgmma_forward.refuse(_problem(ok, 1, 3, scale=1e-30, rpb=bias))
    assert "rpb / scale" in tiny and "1e-30" in tiny
    assert "rpb / scale" not in wgmma_forward.refuse(_problem(ok, 1, 3, scale=1e-30))
    assert "rpb / scale" not in wgmma_forward.refuse(_problem(ok, 1, 3, scale=1e-3, rpb=bias))


@pytest.mark.parametrize("shape, kernel", [((2, 33, 41, 2, 64), (7, 5)),
                                           ((1, 30, 29, 1, 128), 13),
                                           ((1, 9, 17, 13, 2, 64), (3, 5, 4)),
                                           ((1, 16, 32, 32, 1, 128), (5, 7, 7))])
def test_hopper_small_box_plans(shape, kernel):
    """Rank 2 and 3 with one compute warpgroup: 64-query boxes (2-D 8 x 8, 3-D 2 x 4 x 8), a
    CTA per box of each dilation group, shared memory for two CTAs an SM (228 KiB, 1 KiB of
    it reserved per CTA), and every name it launches among the instantiations."""
    from math import ceil, prod
    x = numpy.zeros(shape, numpy.float16)
    rank = len(shape) - 3
    prob = _problem(x, rank, kernel)
    tile = wgmma_forward.SMALL_BOX[wgmma_forward._bucket(shape[-1])]
    box = wgmma_forward._box(rank, tile)
    assert prod(box) == tile.bm == 64
    for walk in (False, True):
        plan = wgmma_forward._plan(prob, tile, walk)
        assert plan.grid == (prod(ceil(L / t) for L, t in zip(shape[1:-2], box)), shape[-2],
                             shape[0])
        assert plan.block == (256, 1, 1)
        assert 2 * (plan.smem + 1024) <= 228 * 1024
        assert (wgmma_forward.SOURCE, plan.name) in wgmma_forward.instantiations()
    # the default walk takes key boxes only where a box is as long as a key tile
    assert not wgmma_forward._plan(prob, dataclasses.replace(tile, bn=128), None).name.endswith(
        "true, false>")


@pytest.mark.parametrize("shape, kernel, small", [
    ((1, 64, 64, 2, 128), (9, 9), True),        # 3 key tiles of the 128-query box
    ((1, 64, 64, 2, 64), (13, 13), True),       # 5
    ((1, 8, 32, 32, 2, 128), (3, 5, 5), True),  # 5
    ((1, 96, 96, 2, 64), (15, 15), True),       # 6
    ((1, 128, 128, 2, 128), (21, 21), True),    # 8
    ((1, 128, 128, 2, 128), (23, 23), False),   # 9
    ((1, 256, 256, 2, 128), (33, 33), False),   # 15
    ((1, 16, 32, 32, 2, 128), (5, 7, 7), True),   # 3-D: 10
    ((2, 16, 40, 64, 2, 64), (5, 9, 9), True),    # 12
    ((2, 16, 40, 64, 2, 64), (7, 11, 11), False)])  # 21
def test_hopper_small_box_dispatch(shape, kernel, small):
    """Rank 2 and 3 take the 64-query boxes where the 128-query box walks at most
    SMALL_BOX_UP_TO key tiles, with a bias at head dim 64 only; rank 1 keeps its own boxes."""
    x = numpy.zeros(shape, numpy.float16)
    rank = len(shape) - 3
    prob = _problem(x, rank, kernel)
    dp = wgmma_forward._bucket(shape[-1])
    assert (wgmma_forward._key_tiles(prob, wgmma_forward.DEFAULT_ND)
            <= wgmma_forward.SMALL_BOX_UP_TO[rank]) == small
    expect = wgmma_forward.SMALL_BOX[dp] if small else wgmma_forward.DEFAULT_ND
    assert wgmma_forward._default_tile(prob) == expect
    assert wgmma_forward._plan(prob).tile == expect
    assert (wgmma_forward.SOURCE, wgmma_forward._plan(prob).name) in \
        wgmma_forward.instantiations()
    rpb = numpy.zeros((shape[-2], *(2 * k - 1 for k in kernel)), numpy.float16)
    biased = _args.check_fused(rank, x, x, x, kernel, 1, 1, False, None, "fused", rpb=rpb)
    tile = wgmma_forward._default_tile(biased)
    assert tile == (wgmma_forward.SMALL_BOX[dp] if small and dp == 64
                    else wgmma_forward.BIAS_TILE.get((rank, dp), wgmma_forward.DEFAULT_ND))
    plan = wgmma_forward._plan(biased)
    assert plan.tile == tile and (wgmma_forward.SOURCE, plan.name) in \
        wgmma_forward.instantiations()
    assert plan.walk_boxes or tile.bm == 128   # (the 64-query box walks key boxes)
    one = _problem(numpy.zeros((1, 2048, 2, shape[-1]), numpy.float16), 1, 1023)
    assert wgmma_forward._default_tile(one) == wgmma_forward.DEFAULT[dp]


@pytest.mark.parametrize("dim, window, small", [
    (128, 15, True), (128, 511, True), (128, 512, False), (128, 2047, False),
    (64, 63, True), (64, 767, True), (64, 768, False), (64, 945, False),
    (96, 511, True), (40, 300, True), (40, 1023, False)])
def test_hopper_small_box_dispatch_1d(dim, window, small):
    """Rank 1 takes the 64-query box (one compute warpgroup, 64-key tiles) without a bias up
    to SMALL_BOX_1D_UP_TO[head-dim bucket], built with both loaders; with a bias the rank-1
    bias tile whatever the window."""
    x = numpy.zeros((1, 4096, 2, dim), numpy.float16)
    prob = _problem(x, 1, window)
    dp = wgmma_forward._bucket(dim)
    expect = wgmma_forward.SMALL_BOX[dp] if small else wgmma_forward.DEFAULT[dp]
    assert wgmma_forward._default_tile(prob) == expect
    plan = wgmma_forward._plan(prob)
    assert plan.tile == expect and plan.block == (128 * (expect.wg + 1), 1, 1)
    for name in (plan.name, plan.tma_name):
        assert (wgmma_forward.SOURCE, name) in wgmma_forward.instantiations()
    rpb = numpy.zeros((2, 2 * window - 1), numpy.float16)
    biased = _args.check_fused(1, x, x, x, window, 1, 1, False, None, "fused", rpb=rpb)
    assert wgmma_forward._default_tile(biased) == wgmma_forward.BIAS_TILE[(1, dp)]


@pytest.mark.parametrize("shape, kernel, boxes", [
    # (flat, box) key tiles of the 128-query box: 2-D 13x13 (W2b) 5 / 6: boxes; 2-D 21x21
    # (M5) 8 / 12: flat; 3-D at head dim 128: boxes only
    ((1, 256, 256, 4, 128), (13, 13), True),
    ((1, 128, 128, 16, 128), (21, 21), False),
    ((1, 16, 32, 32, 8, 128), (5, 7, 7), True),
])
def test_hopper_key_walk_with_bias(shape, kernel, boxes):
    """With a bias the key boxes pay for up to BIAS_BOX_MARGIN more key tiles (TMA loads)."""
    x = numpy.zeros(shape, numpy.float16)
    rank = len(shape) - 3
    rpb = numpy.zeros((shape[-2], *(2 * k - 1 for k in kernel)), numpy.float16)
    prob = _args.check_fused(rank, x, x, x, kernel, 1, 1, False, None, "fused", rpb=rpb)
    assert wgmma_forward._plan(prob).walk_boxes == boxes
    tile = wgmma_forward._default_tile(prob)
    flat, box = wgmma_forward._interior_tiles(prob, wgmma_forward._box(rank, tile))
    assert boxes == (box <= flat * (1 + wgmma_forward.BIAS_BOX_MARGIN)) or rank == 3


@pytest.mark.parametrize("shape, kernel, causal, boxes, boxes_without_tma", [
    # (flat, box) key tiles of the dispatched query box: 3-D 6x9x9 (M7's, 64-query box)
    # 21 / 24 (14% more): boxes under TMA only; 2-D 13x13 (64-query box) 5 / 6: flat;
    # 3-D 5x7x7 14 / 18 (29% more): flat; 2-D 33x33 (128-query box) 15 / 15: boxes either way
    ((4, 12, 32, 32, 2, 64), (6, 9, 9), (True, False, False), True, False),
    ((1, 256, 256, 2, 128), (13, 13), False, False, False),
    ((1, 16, 32, 32, 2, 128), (5, 7, 7), False, False, False),
    ((1, 256, 256, 2, 128), (33, 33), False, True, True),
])
def test_hopper_key_walk_counts_the_tma_gain(shape, kernel, causal, boxes, boxes_without_tma,
                                             monkeypatch):
    """Rank 2 and 3 walk key boxes where they cost at most TMA_BOX_MARGIN more key tiles
    than the flat walk and will load by TMA (no margin without TMA, or with a bias)."""
    x = numpy.zeros(shape, numpy.float16)
    rank = len(shape) - 3
    prob = _args.check_fused(rank, x, x, x, kernel, 1, 1, causal, None, "fused")
    assert wgmma_forward._plan(prob).walk_boxes == boxes
    monkeypatch.setattr(wgmma_forward, "USE_TMA", False)
    wgmma_forward._plan.cache_clear()
    try:
        assert wgmma_forward._plan(prob).walk_boxes == boxes_without_tma
    finally:
        wgmma_forward._plan.cache_clear()
