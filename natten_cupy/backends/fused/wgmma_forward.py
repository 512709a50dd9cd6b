"""Fused forward for Hopper (compute capability 9.0, ``cuda_src/fused/wgmma_forward.cu``):
float16 and bfloat16 on warpgroup MMA (wgmma), 1-D, 2-D and 3-D.

A CTA owns a box of 64 * WG in-group queries of one dilation group per axis (1-D: 128
consecutive, 2-D: 8 x 16, 3-D: 2 x 8 x 8; 2-D 8 x 8 and 3-D 2 x 4 x 8 where that box would walk
few key tiles, ``SMALL_BOX``; a dilation group is a strided sub-grid, addressed by strides,
never copied); its key region is the box of per-axis ranges [start(first query),
end(last query)) by the window arithmetic, walked row-major in BN-key tiles or in key boxes of
the query box's shape, that a STAGES-deep pipeline stages in 128-byte-swizzled shared memory
(TMA loads from tensor maps where they describe the operands, ``tma_maps``; else the loader
warpgroup's cp.async); only tiles not inside every window of the CTA are masked. Each warpgroup computes S = Q K^T (wgmma, both operands
from shared memory), an online softmax in exp2, and O += P V (wgmma, P from registers).
With a relative positional bias each CTA first stages the part of its head's table that
its scores reach (``_bias_box``) in shared memory; each score then adds its entry.

Tile configurations are data (``DEFAULT`` per head-dim bucket, ``ALTERNATIVES`` compiled
for float16 for the probe); predictions and measurements: ``bench/results/NOTES-hopper-fwd.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from ..._compile import get_kernel
from ..._dtypes import FLOAT16, HALF_TYPES, c_type
from ..._launch import KernelCall, Operand, Plan
from ..._operands import (SM90_SMEM_PER_BLOCK, compute_capability, head_dim_bucket, rows_ready,
                           run_forward)
from ..._params import make_params
from ..._tma import maps_of

SOURCE = "fused/wgmma_forward.cu"
OPTIONS = ("-arch=sm_90a",)
BUCKETS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class HopperTile:
    wg: int       # compute warpgroups per CTA (64 queries each)
    bn: int       # keys per tile
    stages: int   # shared-memory pipeline depth (K and V tiles)
    pipe: bool = False  # overlap a tile's softmax with the previous tile's P V
    pp: bool = False    # compute warpgroups take turns issuing their GEMMs (with pipe)

    @property
    def bm(self):
        return 64 * self.wg

    @property
    def threads(self):
        return 128 * (self.wg + 1)  # and the loader warpgroup


T = HopperTile
# By the H200 timings of NOTES-hopper-fwd.md (v2): 3 stages, the softmax of tile j under P V of
# tile j - 1, compute warpgroups taking turns.
# 1-D head dim 64 takes 3 compute warpgroups (192 queries): 2.29 vs 2.63 ms dense (v3). Rank
# 2 and 3 take query boxes of 128 (two compute warpgroups) whatever the head dim.
DEFAULT = {64: T(3, 128, 3, True, True), 128: T(2, 128, 3, True, True)}
DEFAULT_ND = T(2, 128, 3, True, True)
ALTERNATIVES = {  # 1-D, float16 (the probe's side-by-side timings)
    64: (T(2, 128, 3, True, True), T(3, 128, 2, True, True)),
    128: (T(2, 128, 3),),
}
# Rank 2 and 3 with one compute warpgroup: 64-query boxes (2-D 8 x 8, 3-D 2 x 4 x 8), two
# CTAs an SM with three stages of 64 keys (at head dim 128 they fit twice an SM only without
# the kernel's old 1 KiB alignment pad: 6-11% faster than two stages, NOTES-hopper-fwd.md,
# v12). A box's key region is smaller per query than the 128-query box's (2-D, window
# 21 x 21: 28 x 28 keys against 28 x 36), but each CTA stages its own and runs without a
# second warpgroup to hide its softmax. Taken without a bias where the 128-query box walks
# at most SMALL_BOX_UP_TO[rank] key tiles (an interior box): measured on an H100 (v8, v12),
# 5-36% faster up to 5 tiles (2-D windows 3 x 3 to 13 x 13, 3-D 3 x 3 x 3 to 3 x 5 x 5), in
# 3-D 10-16% from 7 to 10 tiles (3 x 7 x 7, 5 x 7 x 7); with TMA loads (v13) 2-3% faster at
# 8 tiles in 2-D (M5), 1-2% at 12 in 3-D (M4), 6% at 14 (M7), 10% slower at 15 in 2-D (33 x 33).
SMALL_BOX = {64: T(1, 64, 3, True), 128: T(1, 64, 3, True)}
SMALL_BOX_UP_TO = {2: 8, 3: 14}
# Rank 1 takes the same tile (64 consecutive queries, 64-key tiles) without a bias up to these
# windows per head-dim bucket: there its region (64 + k - 1 keys) wastes less of each tile
# and two CTAs share an SM. Forward kernels alone on an H100 (NOTES-hopper-fwd.md, v16,
# hopper_small_box_1d_kernels.json), 128-query (192 at head dim 64) box / 64-query box: head
# dim 128 1.24-1.26 at windows 15-63, 1.14-1.17 at 119-235, 1.03 at 511, 0.94 at 1013; head
# dim 64 1.23-1.30 at 31-127, 1.24 at 255, 1.15 at 511, 0.98 at 945.
SMALL_BOX_1D_UP_TO = {64: 767, 128: 511}
# Head dims 136-256 (padded to 256): two compute warpgroups of 64 queries against 64-key
# tiles, two stages (Q 64 KiB, a stage's K and V 64 KiB: 192 KiB), O += P V as two m64n128
# halves, the flat key walk (key boxes take tiles of the query box's 128 keys), no bias, no
# 64-query boxes, ranks 1 and 2 (3-D: WIDE_3D below). Compiles without spills (NVRTC 13.0,
# sm_90a). On an H100 (bench/results/hopper_dispatch_d256.json) 1.4-7.8x faster than the
# mma.sync forward padded to 256 on every 1-D and 2-D problem timed, head dims 160 and 256.
# HEAD_DIM_256 False makes the part refuse head dims above 128 (a switch for probes).
WIDE = T(2, 64, 2, True, True)
DEFAULT[256] = WIDE
HEAD_DIM_256 = True
# The same tile in 3-D (query box 2x8x8, the flat walk, cp.async: key boxes need BN = BM):
# its index math spills 84 bytes (NVRTC 13.0, tests/unit/test_compile_hopper.py allows it),
# and still 2.1-3.9x faster than the mma.sync forward padded to 256 on an H100 (8x32x32,
# windows 3x3x3 to 5x9x9, head dims 160 and 256: bench/results/hopper_dispatch_d256_3d.json).
# False: refused in 3-D above head dim 128 (a switch for probes).
WIDE_3D = True
# The query box per (rank, compute warpgroups): 64 * wg queries (rank 1 takes any wg).
QUERY_BOX = {(2, 2): (8, 16, 1), (3, 2): (2, 8, 8), (2, 1): (8, 8, 1), (3, 1): (2, 4, 8)}
# With a relative positional bias (compile checks, NVRTC 13.0): at head dim 128 two stages,
# since three fill the 227 KiB a CTA may hold and leave no room for the bias box, and in 3-D
# the key-box walk only (the flat walk spills there); 1-D at head dim 64 two compute
# warpgroups (three spill). Rank 2 and 3 at 64 keep the defaults.
BIAS_TILE = {(1, 64): T(2, 128, 3, True, True), (1, 128): T(2, 128, 2, True, True),
             (2, 128): T(2, 128, 2, True, True), (3, 128): T(2, 128, 2, True, True)}
SMEM_LIMIT = SM90_SMEM_PER_BLOCK
# Q, K and V staged by TMA (one loader thread, tensor maps: natten_cupy/_tma.py) wherever the
# maps can describe them (rank 1, and rank 2 and 3 walking key boxes) and the CTA has at most
# two compute warpgroups; the warpgroup's cp.async elsewhere. Measured on an H100
# (NOTES-hopper-fwd.md, v13): 2D-33 and M4 10-11% faster, 1-D at head dim 128 4%, equal on
# the 64-query boxes, 3-5% slower on 1-D at head dim 64 (three compute warpgroups).
# USE_TMA = False switches it off (the probes' side-by-side timings).
USE_TMA = True
TMA_UP_TO_WG = 2


def _bucket(head_dim):
    return head_dim_bucket(head_dim, BUCKETS)


def _compute_capability():
    """(major, minor) of the current device, or None without a usable GPU (read once per
    device by ``compute_capability``)."""
    return compute_capability()


def refuse(problem):
    if problem.dtype not in HALF_TYPES:
        return f"the Hopper fused forward runs float16 and bfloat16, not {problem.dtype_name}"
    if problem.v_dim != problem.head_dim:
        return (f"the Hopper fused forward takes one head dim for q, k and v, got "
                f"{problem.head_dim} and {problem.v_dim}")
    if problem.head_dim % 8 or problem.head_dim > 256:
        return f"head dim {problem.head_dim} is not a multiple of 8 up to 256"
    if problem.head_dim > 128 and not HEAD_DIM_256:
        return (f"head dim {problem.head_dim}: the Hopper fused forward runs head dims up to "
                "128 (above, the mma.sync kernels)")
    if problem.head_dim > 128 and problem.rank == 3 and not WIDE_3D:
        return (f"head dim {problem.head_dim} in 3-D: the Hopper fused forward takes 3-D up to "
                "head dim 128")
    if problem.head_dim > 128 and problem.has_rpb:
        return (f"head dim {problem.head_dim} with a relative positional bias: the Hopper "
                "fused forward takes a bias up to head dim 128")
    if not problem.scale > 0:
        return f"the Hopper fused forward needs a positive scale, got {problem.scale}"
    if problem.has_rpb and problem.scale < 2.0 ** -64:
        return (f"the Hopper fused forward adds the bias as rpb / scale, which could overflow "
                f"at scale {problem.scale} (below 2^-64)")
    if problem.heads > 65535 or problem.batch > 65535:
        return f"heads {problem.heads} or batch {problem.batch} over 65535"
    try:
        _plan(problem)   # the launch geometry, cached for plan_forward
    except ValueError as e:
        return str(e)
    cc = _compute_capability()
    if cc != (9, 0):
        return ("the Hopper fused forward needs compute capability 9.0, "
                + ("no GPU here" if cc is None else f"this device has {cc[0]}.{cc[1]}"))
    return None


def _box(rank, tile):
    return (tile.bm, 1, 1) if rank == 1 else QUERY_BOX[(rank, tile.wg)]


def _name(dtype, dp, tile, rank=1, walk_boxes=False, bias=False, tma=False):
    flags = ", ".join("true" if f else "false" for f in (tile.pipe, tile.pp))
    box = ", ".join(str(t) for t in _box(rank, tile))
    kernel = "na_fwd_hopper_tma" if tma else "na_fwd_hopper"
    return (f"natten::{kernel}<{c_type(dtype)}, {dp}, {tile.wg}, {tile.bn}, {tile.stages}, "
            f"{flags}, {rank}, {box}, {'true' if walk_boxes else 'false'}, "
            f"{'true' if bias else 'false'}>")


def _bias_tile(rank, dp):
    """The tile of rank ``rank`` with a bias, but for the 64-query boxes."""
    return BIAS_TILE.get((rank, dp), DEFAULT[dp] if rank == 1 else DEFAULT_ND)


def _default_tile(problem):
    dp = _bucket(problem.head_dim)
    if dp == 256:
        return WIDE
    if problem.rank == 1:
        small = not problem.has_rpb and problem.num_neighbors <= SMALL_BOX_1D_UP_TO[dp]
        return SMALL_BOX[dp] if small else (_bias_tile(1, dp) if problem.has_rpb
                                            else DEFAULT[dp])
    tile = DEFAULT_ND
    small = _key_tiles(problem, tile) <= SMALL_BOX_UP_TO[problem.rank]
    if problem.has_rpb:   # (64-query boxes at head dim 64 only: BIAS_BOX_MARGIN)
        return SMALL_BOX[dp] if small and dp == 64 else _bias_tile(problem.rank, dp)
    return SMALL_BOX[dp] if small else tile


def _bias_walks(rank, dp):
    """The key walks built with a bias (rank 2, 3): (False, True) = flat and boxes."""
    return (True,) if (rank, dp) == (3, 128) else (False, True)


def instantiations():
    out = []
    for dtype in HALF_TYPES:
        out += [(SOURCE, _name(dtype, 256, WIDE, tma=tma)) for tma in (False, True)]
        out += [(SOURCE, _name(dtype, 256, WIDE, rank)) for rank in (2, 3)]
        for dp in (64, 128):
            for tma in (False, True):   # (key boxes only with TMA at rank 2, 3)
                out.append((SOURCE, _name(dtype, dp, DEFAULT[dp], tma=tma)))
                out.append((SOURCE, _name(dtype, dp, _bias_tile(1, dp), bias=True, tma=tma)))
                out.append((SOURCE, _name(dtype, dp, SMALL_BOX[dp], tma=tma)))
                for rank in (2, 3):
                    out += [(SOURCE, _name(dtype, dp, tile, rank, walk, tma=tma))
                            for tile in (DEFAULT_ND, SMALL_BOX[dp]) for walk in (False, True)
                            if walk or not tma]
                    out += [(SOURCE, _name(dtype, dp, _bias_tile(rank, dp), rank, walk, True,
                                           tma))
                            for walk in _bias_walks(rank, dp) if walk or not tma]
                    out.append((SOURCE, _name(dtype, dp, SMALL_BOX[dp], rank, True, True, tma)))
            if dtype == FLOAT16:
                out += [(SOURCE, _name(dtype, dp, t)) for t in ALTERNATIVES[dp]]
    return sorted(set(out))


def _bias_box(problem, tile):
    """Entries of the bias box a CTA stages (per axis min(2k - 1, k + tile - 1)), 0 without
    a bias (the kernel's BiasBox)."""
    if not problem.has_rpb:
        return 0
    box = _box(problem.rank, tile)
    return math.prod(min(2 * k - 1, k + t - 1) for k, t in zip(problem.kernel_size, box))


def _region_max(problem, tile):
    """Keys in the largest key region of a CTA (per axis min(group, tile + k - 1))."""
    return math.prod(min(-(-L // d), t + k - 1) for L, d, t, k in
                     zip(problem.spatial, problem.dilation, _box(problem.rank, tile),
                         problem.kernel_size))


def _smem(problem, tile, walk_boxes=True):
    """Dynamic shared memory of a launch: Q and the stages' K and V tiles (the kernel declares
    the base 1024-byte aligned), the stages' mbarriers, the bias box (float32) and with the
    flat walk (rank 2, 3) each region key's index into it (int32)."""
    dp = _bucket(problem.head_dim)
    flat = problem.has_rpb and problem.rank > 1 and not walk_boxes
    return (2 * dp * (tile.bm + 2 * tile.stages * tile.bn) + 16 * tile.stages
            + 4 * _bias_box(problem, tile) + (4 * _region_max(problem, tile) if flat else 0))


def _interior_tiles(problem, box):
    """(flat, boxes): the key tiles of as many keys as ``box`` holds that an interior CTA
    walks, in the flat walk and in key boxes of the query box's shape (rank 2, 3; the region
    per axis min(group, box + k - 1))."""
    rk = [min(-(-L // d), t + k - 1) for L, d, t, k in
          zip(problem.spatial, problem.dilation, box, problem.kernel_size)]
    return (-(-math.prod(rk) // math.prod(box)), math.prod(-(-r // t) for r, t in zip(rk, box)))


# Key boxes load by TMA (the flat walk cannot), which pays for some more key tiles than the
# flat walk's: up to this fraction more per rank, where the box walk will load by TMA and
# runs without a bias. Measured on an H100 (NOTES-hopper-fwd.md, v14; forward kernels,
# medians of three interleaved rounds, hopper_walk_tma.json): 3-D 6x9x9 (M7) 14% more tiles,
# boxes 13% faster; 2-D 13x13 (W2b) 20% more, 8% slower; 2-D 21x21 on 64-query boxes (M5)
# 23% more, equal.
TMA_BOX_MARGIN = {2: 0.1, 3: 0.2}
# With a bias the flat walk reads each key's box index before its entry (two shared loads a
# score, one in boxes), so boxes loaded by TMA pay for more tiles: measured on an H100 (v15,
# hopper_fwd_bias_walks.json, 128-query boxes): 2-D 13 x 13 (W2b) boxes 5% faster at 20% more
# tiles, 2-D 21 x 21 (M5) 1% slower at 50% more, 3-D 6 x 9 x 9 (M7) 10% faster.
BIAS_BOX_MARGIN = 0.3
# And at head dim 64 the 64-query boxes where the unbiased forward takes them (SMALL_BOX_UP_TO;
# always key boxes): 3-D 6 x 9 x 9 (M7) 18% and 5 x 9 x 9 (M4) 11% faster than the 128-query
# box; at head dim 128 they were slower (M5 12%, 3-D 5 x 7 x 7 18%, W2b 9%).


def _tma_expected(problem, tile):
    """Whether the key-box walk of ``tile`` will load by TMA on contiguous operands (the maps'
    limits, natten_cupy/_tma.py: a rank-3 head dim equal to its bucket, dilation up to 8)."""
    return (USE_TMA and tile.wg <= TMA_UP_TO_WG and max(problem.dilation) <= 8
            and (problem.rank < 3 or problem.head_dim == _bucket(problem.head_dim)))


def _walk_boxes(problem, box, margin=0.0):
    """Rank 2, 3: walk the key region in boxes of the query box's shape (no per-key index
    math, boxes inside every window unmasked) when padding the region to whole boxes costs no
    more key tiles than the flat walk, or at most ``margin`` more (estimated on an interior
    query box). Measured with cp.async on the H200 (NOTES-hopper-fwd.md, v4): boxes faster at
    equal tile counts in 3-D (5x9x9 window: 3.00 vs 3.25 ms), equal in 2-D (33x33: 4.34 ms
    both), slower with more tiles (13x13: 6 vs 5 tiles, 0.52 vs 0.49 ms; 21x21: 12 vs 8
    tiles, 0.81 vs 0.67 ms); with TMA: ``TMA_BOX_MARGIN``."""
    flat, boxes = _interior_tiles(problem, box)
    return boxes <= flat * (1 + margin)


def _key_tiles(problem, tile):
    """Key tiles an interior CTA of ``tile`` walks (rank 2, 3), in the walk ``_plan`` picks
    without a bias (key boxes where they cost no more tiles)."""
    return min(_interior_tiles(problem, _box(problem.rank, tile)))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Everything a launch needs besides the arrays (computed once per problem)."""
    name: str       # kernel name expression (cp.async loader)
    tile: HopperTile
    grid: tuple
    block: tuple
    smem: int       # dynamic shared memory, bytes (with the stages' mbarriers)
    walk_boxes: bool
    tma_name: str   # the same kernel with the TMA loader


@functools.lru_cache(maxsize=512)
def _plan(problem, tile=None, walk_boxes=None):
    dp = _bucket(problem.head_dim)
    default = _default_tile(problem)
    tile = tile or default
    small = problem.rank > 1 and tile == SMALL_BOX.get(dp)
    biased = _bias_tile(problem.rank, dp)
    if problem.has_rpb and tile != biased and not small:
        raise ValueError(f"a bias runs {biased} or (rank 2, 3) {SMALL_BOX[dp]} only, "
                         f"not {tile}")
    if problem.rank > 1 and (problem.rank, tile.wg) not in QUERY_BOX:
        raise ValueError(f"rank {problem.rank} has no query box of {tile.bm} queries")
    box = _box(problem.rank, tile)
    walks = ((True,) if small else _bias_walks(problem.rank, dp)) if problem.has_rpb \
        else (False, True)
    if tile.bn != tile.bm:  # key boxes have the query box's shape
        walks = (False,)
    if walk_boxes is None:
        margin = 0.0 if not _tma_expected(problem, tile) else (
            BIAS_BOX_MARGIN if problem.has_rpb else TMA_BOX_MARGIN.get(problem.rank, 0.0))
        walk_boxes = problem.rank > 1 and True in walks and (
            walks == (True,) or _walk_boxes(problem, box, margin)
            or _smem(problem, tile, False) > SMEM_LIMIT)   # the key indices do not fit
    if problem.rank > 1 and walk_boxes not in walks:
        raise ValueError(f"rank {problem.rank} with a bias at head dim {problem.head_dim} "
                         "walks key boxes only")
    if _smem(problem, tile, walk_boxes) > SMEM_LIMIT:
        if _smem(problem, tile, True) > SMEM_LIMIT:   # without key indices: the bias box
            raise ValueError(f"the bias box of kernel {problem.kernel_size} does not fit the "
                             "Hopper fused forward's shared memory")
        raise ValueError(f"the flat walk's key indices for kernel {problem.kernel_size} do not "
                         "fit the Hopper fused forward's shared memory (walk key boxes)")
    ctas = 1
    for a in range(problem.rank):
        L, d = problem.spatial[a], problem.dilation[a]
        ctas *= d * -(-(-(-L // d)) // box[a])  # groups x tiles of the longest group
    walk_boxes = bool(walk_boxes) and problem.rank > 1
    return Tiling(_name(problem.dtype, dp, tile, problem.rank, walk_boxes, problem.has_rpb),
                  tile, (ctas, problem.heads, problem.batch), (tile.threads, 1, 1),
                  _smem(problem, tile, walk_boxes), walk_boxes,
                  _name(problem.dtype, dp, tile, problem.rank, walk_boxes, problem.has_rpb, True))


def forward(problem, q, k, v, out, lse, rpb=None, tile=None, walk_boxes=None, tma=None):
    """out, lse = NA forward of q, k, v (CuPy arrays; outputs preallocated, all written),
    with ``rpb`` (``problem.has_rpb``) the relative positional bias added to the scores.

    ``tile`` (a HopperTile among the instantiations, 1-D), ``walk_boxes`` (rank 2, 3: key
    boxes or the flat walk) and ``tma`` (the TMA loader: True always, ValueError where it
    cannot run; False never) override the defaults, for probing and tests.
    """
    run_forward(functools.partial(plan_forward, tile=tile, walk_boxes=walk_boxes, tma=tma),
                problem, q, k, v, out, lse, rpb)


def tma_maps(problem, plan, q, k, v):
    """The tensor maps of q, k and v (operands 0, 1, 2) for the TMA loader of ``plan`` (a
    Tiling), or the reason it cannot run: the rank 2 and 3 flat walk, or an operand the maps
    cannot describe (``natten_cupy._tma.operand_map``)."""
    if problem.rank > 1 and not plan.walk_boxes:
        return "the flat key walk has no box shape"
    box, dp = _box(problem.rank, plan.tile)[:problem.rank], _bucket(problem.head_dim)
    rows = (64,) if problem.rank == 1 else box   # (rank 1: tiles of 64-row boxes)
    return maps_of(((0, "q", q), (1, "k", k), (2, "v", v)), problem.rank, rows,
                   problem.dilation, dp)


def plan_forward(problem, q, k, v, out, lse, rpb=None, tile=None, walk_boxes=None, tma=None):
    """The launch Plan of one forward on the current device for operand layouts (q, k, v,
    out, lse [, rpb: with ``problem.has_rpb``, read element by element at any strides]), or
    None if one of q, k, v, out cannot be read as it is (the plan contract of
    ``natten_cupy._launch``; ``forward`` above takes arrays). ``tile`` / ``walk_boxes`` /
    ``tma``: as for ``forward``."""
    if not all(rows_ready(x) for x in (q, k, v, out)):
        return None
    plan = _plan(problem, tile, walk_boxes)
    if plan.grid[0] >= 2 ** 31:
        raise ValueError(f"problem too large for one Hopper fused-forward launch "
                         f"({plan.grid[0]} query tiles)")
    params = make_params(problem, q=q, k=k, v=v, o=out, lse=lse, rpb=rpb)
    bias = Operand(5) if problem.has_rpb else numpy.uint64(0)
    args = (*map(Operand, range(5)), bias, params)
    want = (USE_TMA and plan.tile.wg <= TMA_UP_TO_WG) if tma is None else tma
    maps = tma_maps(problem, plan, q, k, v) if want else ()
    if tma and isinstance(maps, str):   # asked for, not possible
        raise ValueError(f"the TMA loader cannot run this forward: {maps}")
    name = plan.name
    if isinstance(maps, tuple) and maps:
        name, args = plan.tma_name, args + maps
    call = KernelCall(get_kernel(SOURCE, name, extra_options=OPTIONS), plan.grid,
                      plan.block, args, shared_mem=plan.smem, name="na_fwd_hopper",
                      backend="fused", tile=_box(problem.rank, plan.tile)[:problem.rank])
    return Plan((call,))
