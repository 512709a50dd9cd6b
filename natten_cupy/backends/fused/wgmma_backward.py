"""Fused backward for Hopper (compute capability 9.0, ``cuda_src/fused/wgmma_backward.cu``):
float16 and bfloat16 on warpgroup MMA (wgmma), 1-D, 2-D and 3-D.

Deterministic (bitwise reproducible; ``deterministic=True`` always runs it), three launches:

1. ``na_bwd_hopper_delta``: delta = rowsum(dO * O), float32 [B, *spatial, H] (a workspace);
2. ``na_bwd_hopper_kv``: dK, dV. A CTA owns 128 in-group keys of one dilation group (1-D
   consecutive, 2-D 8 x 16, 3-D 2 x 8 x 8), its two compute warpgroups 64 keys each; it walks
   the queries whose windows hold its keys (the box of per-axis inverse ranges) in 64-query
   tiles, recomputing P^T from q, k and the saved lse, dP^T from v and dO, and accumulates
   dV += P^T dO, dK += dS^T Q in registers (on windows up to ``KV_ONE_WG_UP_TO`` neighbors
   without a bias, ``kv_wg`` 1: 64 keys, the boxes of the one-warpgroup dQ pass, one compute
   warpgroup, two CTAs an SM; 32-query tiles at head dim 128);
3. ``na_bwd_hopper_q``: dQ, the forward's query boxes walking their windows' keys (128
   queries, two compute warpgroups; on windows up to ``Q_ONE_WG_UP_TO`` neighbors without a
   bias 64 queries, one compute warpgroup, two CTAs an SM).

With dQ added in the dK/dV pass (``dq_atomic``; where ``atomic_pays``, for
``deterministic=False``): the delta launch also zeroes a float32 dQ workspace, the dK/dV pass
adds each query tile's dS K into it by bulk reductions (``cp.reduce.async.bulk``), and
``na_bwd_hopper_dq`` writes dq = scale * workspace: five GEMMs per tile pair instead of seven.

With a relative positional bias (``problem.has_rpb``) both passes add it to the scores (a
CTA stages the part of its head's table that its scores reach, as the Hopper forward does),
and the dQ pass also sums dS per table entry into a float32 box per CTA (shared-memory
atomics, so the sums' order varies from run to run: ``deterministic=True`` takes the
mma.sync backward, whose bias gradient is reproducible), written to a workspace [B, H, CTAs,
box]; the mma.sync backward's bias reduction (``rpb_reduction``) then adds the boxes into
d_rpb in a fixed order. With ``dq_atomic`` and a bias there is no dQ pass: the dK/dV pass
(``na_bwd_hopper_kv_ds``) also writes each score's dS (16-bit, as its GEMMs take it) into a
workspace [B, H, tokens, kernel volume] laid out as the unfused chain's attention weights
(every slot of every window written once, by the CTA owning its key), and ``na_bwd_ds_rpb``
and the mma.sync backward's ``na_bwd_rpb_sum`` reduce it into d_rpb in a fixed order
(``ds_workspace``; the kv heads in runs, ``ds_head_groups``, so that the workspace is no
larger than the gradients).
The default takes it only with ``BIAS_DS`` (off: it measured slower than the dQ pass).

``configure`` decides once per problem, tile and dQ variant (cached): the Tiling or why this
part refuses the problem on any device; ``refuse`` adds the device's compute capability and
``plan_backward`` binds the arrays.

A loader warpgroup stages the tiles (cp.async into 128-byte-swizzled shared memory,
mbarriers, STAGES deep) in both passes; at rank 1 and head dim 128 the dK/dV pass's query
tiles (Q, dO) come by TMA from tensor maps where they describe the arrays (``kv_tma_maps``).
``fused.py`` dispatches it where it measured faster than the mma.sync backward; design and
measurements: ``bench/results/NOTES-hopper-bwd.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from ..._compile import get_kernel
from ..._dtypes import HALF_TYPES, c_type
from ..._launch import KernelCall, Operand, Plan
from ..._operands import SM90_SMEM_PER_BLOCK, Layout, head_dim_bucket, rows_ready, run_backward
from ..._params import make_params
from ..._tma import maps_of
from ..._window import box_ranges, group_size

SOURCE = "fused/wgmma_backward.cu"
OPTIONS = ("-arch=sm_90a",)
BUCKETS = (64, 128)
THREADS = 384          # the loader warpgroup and two compute warpgroups
OWNER_ROWS = 128       # keys (dK/dV pass) or queries (dQ pass) per CTA
DELTA_THREADS = 256
MAX_GRID_YZ = 65535


@dataclasses.dataclass(frozen=True)
class BwdTile:
    bq: int        # queries per tile of the dK/dV pass
    kv_stages: int
    bn: int        # keys per tile of the dQ pass
    q_stages: int
    q_wg: int = 2  # compute warpgroups of the dQ pass (its owner box: 64 queries each)
    kv_wg: int = 2  # compute warpgroups of the dK/dV pass (its owner box: 64 keys each)


# Register budget per compute thread: dK, dV (D each) + S^T, dP^T (bq / 2 each); dQ (D / 2)
# + S, dP (bn / 2 each). Shared memory: owners 2 x 128 x D, STAGES x 2 tiles.
DEFAULT = {64: BwdTile(64, 3, 128, 2), 128: BwdTile(64, 2, 64, 3)}
# The owner box per rank (128 rows), the forward's query boxes.
OWNER_BOX = {1: (128, 1, 1), 2: (8, 16, 1), 3: (2, 8, 8)}
# The dQ pass with one compute warpgroup (``q_wg`` 1, no bias): 64-query boxes, as the
# forward's (1-D 64, 2-D 8 x 8, 3-D 2 x 4 x 8), two CTAs an SM: at head dim 128 in two
# stages (three would hold 130 KB, one CTA an SM). Compiled without spills (NVRTC 13.0, 128
# registers at entry, 40 / 216 after setmaxnreg). The default without a bias up to windows of
# Q_ONE_WG_UP_TO neighbors (None: never): measured on an H100 (NOTES-hopper-bwd.md, kernels
# alone, bench/results/hopper_bwd_q1_ab.json), whole backward with it / without: 1-D at head
# dim 128 windows 15-119 -6 to -7%, 511 -2%, 1013 +3%; 2-D 7x7 at 64 -11%; 1-D 511 at 64 -2%.
Q_BOX_ONE_WG = {1: (64, 1, 1), 2: (8, 8, 1), 3: (2, 4, 8)}
Q_ONE_WG = {64: BwdTile(64, 3, 128, 2, 1), 128: BwdTile(64, 2, 64, 2, 1)}
Q_ONE_WG_UP_TO = 767   # largest window (neighbors) the default takes it for; None: never
# The dK/dV pass with one compute warpgroup (``kv_wg`` 1: deterministic, no bias, cp.async
# loads): 64-key owner boxes (the same boxes), two CTAs an SM (loader 40, compute 216
# registers: dK, dV, S^T and dP^T take 128 of them at head dim 64 with 64-query tiles, 160
# at 128 with 32-query tiles, wgmma m64n32). A small window's inverse region is then fewer
# query tiles a key, and one CTA's prologue, loads and epilogue run under the other's GEMMs
# (Nsight Compute on 1-D small windows: 8% of the pass's samples at the CTA-start barrier,
# 13% waiting on stages, 12 warps an SM). Compiled without spills (NVRTC 13.0).
KV_ONE_WG = {64: BwdTile(64, 3, 128, 2, 1, 1), 128: BwdTile(32, 4, 64, 2, 1, 1)}
# Per head-dim bucket: the largest window (neighbors) the default takes it for; None: never.
# Measured on an H100 (kernels alone, bench/results/hopper_bwd_kv1_ab.json), whole backward
# with it / without: head dim 128 1-D windows 15-63 -5 to -9%, 119 -2%, 219-327 +2 to +4%, 511
# and up +8 to +18%; head dim 64 1-D 31-63 -8 to -9%, 255-1023 -5 to -1.5%, 2047 +4%; 2-D/3-D
# at 64 -10 to -12% (where the Hopper backward runs there).
KV_ONE_WG_UP_TO = {64: 1023, 128: 127}
SMEM_LIMIT = SM90_SMEM_PER_BLOCK
# The rank-1 dK/dV pass stages its query tiles' Q and dO by TMA (one thread, tensor maps:
# natten_cupy/_tma.py) at the head dims of TMA_HEAD_DIMS wherever the maps describe them:
# measured 2-4% faster at 128 and 4% slower at 64 (H100, kernels by events, medians of three
# interleaved rounds: M6 6.24 -> 6.14 ms, dense 16K D128 13.10 -> 12.62, W1 2.57 -> 2.66;
# bench/results/hopper_bwd_tma_rounds.json). USE_TMA = False switches it off (the probes).
USE_TMA = True
TMA_HEAD_DIMS = (128,)


def _bucket(head_dim):
    return head_dim_bucket(head_dim, BUCKETS)


def owner_box(rank, wg):
    """The owner box of a pass with ``wg`` compute warpgroups (``BwdTile.q_wg``, ``kv_wg``)."""
    return OWNER_BOX[rank] if wg == 2 else Q_BOX_ONE_WG[rank]


def default_tile(problem, kv_wg1=True):
    """The BwdTile a problem runs without an override (``kv_wg1`` False: with the dK/dV pass
    of two compute warpgroups, which an explicit dq_atomic or TMA request needs)."""
    dp = _bucket(problem.head_dim)
    tile = Q_ONE_WG[dp] if one_wg_q(problem) else DEFAULT[dp]
    return kv_one_wg(tile, dp) if kv_wg1 and one_wg_kv(problem) else tile


def kv_one_wg(tile, dp):
    """``tile`` with the dK/dV pass of ``KV_ONE_WG`` (its query tiles and stages), the dQ
    pass's as it was."""
    one = KV_ONE_WG[dp]
    return dataclasses.replace(tile, kv_wg=1, bq=one.bq, kv_stages=one.kv_stages)


def one_wg_kv(problem):
    """Whether the default dK/dV pass of ``problem`` takes one compute warpgroup (never while
    the bucket's ``KV_ONE_WG_UP_TO`` is None; deterministic passes only, so not where
    ``atomic_pays``)."""
    up_to = KV_ONE_WG_UP_TO.get(_bucket(problem.head_dim))
    return (up_to is not None and not problem.has_rpb and problem.num_neighbors <= up_to
            and not atomic_pays(problem))


def one_wg_q(problem):
    """Whether the default dQ pass of ``problem`` takes one compute warpgroup (never while
    ``Q_ONE_WG_UP_TO`` is None)."""
    return (Q_ONE_WG_UP_TO is not None and not problem.has_rpb
            and problem.num_neighbors <= Q_ONE_WG_UP_TO)


def _compute_capability():
    from . import wgmma_forward
    return wgmma_forward._compute_capability()


def refuse(problem):
    """None if this part runs ``problem`` on the current device, else the reason."""
    t = configure(problem)
    if isinstance(t, str):
        return t
    cc = _compute_capability()
    if cc != (9, 0):
        return ("the Hopper fused backward needs compute capability 9.0, "
                + ("no GPU here" if cc is None else f"this device has {cc[0]}.{cc[1]}"))
    return None


def configure(problem, tile=None, dq_atomic=None):
    """The Tiling of ``problem`` (everything its launches need besides the device and the
    arrays; ``tile``, ``dq_atomic``: plan_backward's overrides, None for the defaults), or a
    str saying why this part cannot run it on any device: the one place the part decides,
    read by ``refuse`` (which adds the device's compute capability) and ``plan_backward``.
    Cached per problem, tile and dQ variant (``atomic_pays`` where None)."""
    atomic = atomic_pays(problem) if dq_atomic is None else dq_atomic
    if tile is None and atomic and one_wg_kv(problem):   # (the one-warpgroup pass is not atomic)
        tile = default_tile(problem, kv_wg1=False)
    return _configure(problem, tile, atomic)


@functools.lru_cache(maxsize=512)
def _configure(problem, tile, dq_atomic):
    if problem.dtype not in HALF_TYPES:
        return f"the Hopper fused backward runs float16 and bfloat16, not {problem.dtype_name}"
    if problem.has_rpb and problem.deterministic:
        return ("the Hopper fused backward sums the bias gradient with atomics; "
                "deterministic=True runs the mma.sync backward (reproducible d_rpb)")
    if problem.v_dim != problem.head_dim:
        return (f"the Hopper fused backward takes one head dim for q, k and v, got "
                f"{problem.head_dim} and {problem.v_dim}")
    if problem.head_dim % 8 or problem.head_dim > BUCKETS[-1]:
        return f"head dim {problem.head_dim} is not a multiple of 8 up to {BUCKETS[-1]}"
    if not problem.scale > 0:
        return f"the Hopper fused backward needs a positive scale, got {problem.scale}"
    if problem.heads > MAX_GRID_YZ or problem.batch > MAX_GRID_YZ:
        return f"heads {problem.heads} or batch {problem.batch} over {MAX_GRID_YZ}"
    fit = _pass_smem(problem)
    if problem.has_rpb and max(fit) > SMEM_LIMIT:
        return (f"the bias boxes of kernel {problem.kernel_size} do not fit the Hopper fused "
                "backward's shared memory")
    if problem.has_rpb and dq_atomic:
        why = ds_refusal(problem)
        if why:
            return why
    if problem.has_rpb and tile is not None and tile.q_wg != 2:
        return "with a bias the dQ pass takes two compute warpgroups (q_wg=2)"
    if tile is not None and tile.kv_wg != 2:
        if _bucket(problem.head_dim) > 64 and tile.bq > 32:
            return ("the dK/dV pass with one compute warpgroup takes query tiles of 32 above "
                    f"head dim 64 (got bq={tile.bq})")
        if problem.has_rpb or dq_atomic:
            return ("the dK/dV pass with one compute warpgroup runs without a bias and "
                    "without dq_atomic (kv_wg=2)")
    return _tiling(problem, tile, dq_atomic, fit if tile is None else _pass_smem(problem, tile))


def _names(dtype, dp, rank, tile=None, dq_atomic=False, bias=False, tma=False):
    """(delta, dK/dV, dQ) kernels; with dq_atomic the third is the workspace store; with
    ``tma`` the dK/dV pass loads its query tiles by tensor maps."""
    tile = tile or DEFAULT[dp]
    ct = c_type(dtype)
    box = ", ".join(str(t) for t in owner_box(rank, tile.kv_wg))
    qbox = ", ".join(str(t) for t in owner_box(rank, tile.q_wg))
    flag = lambda x: "true" if x else "false"
    if dq_atomic and bias:
        kv = (f"natten::na_bwd_hopper_kv_ds<{ct}, {dp}, {tile.bq}, {tile.kv_stages}, {rank}, "
              f"{box}>")
    else:
        kv = (f"natten::na_bwd_hopper_kv{'_tma' if tma else ''}<{ct}, {dp}, {tile.bq}, "
              f"{tile.kv_stages}, {rank}, {box}, {flag(dq_atomic)}, {flag(bias)}"
              f"{', 1' if tile.kv_wg == 1 else ''}>")
    dq = (f"natten::na_bwd_hopper_dq<{ct}, {dp}>" if dq_atomic else
          f"natten::na_bwd_hopper_q<{ct}, {dp}, {tile.bn}, {tile.q_stages}, {rank}, {qbox}, "
          f"{flag(bias)}{', 1' if tile.q_wg == 1 else ''}>")
    return f"natten::na_bwd_hopper_delta<{ct}, {dp}>", kv, dq


def instantiations():
    out = []
    for dtype in HALF_TYPES:
        for dp in BUCKETS:
            for rank in (1, 2, 3):
                for atomic, bias in ((False, False), (True, False), (False, True),
                                     (True, True)):
                    out += [(SOURCE, n) for n in _names(dtype, dp, rank, dq_atomic=atomic,
                                                        bias=bias)]
                    if rank == 1 and not bias:
                        out.append((SOURCE, _names(dtype, dp, rank, dq_atomic=atomic,
                                                   tma=True)[1]))
                out.append((SOURCE, _names(dtype, dp, rank, Q_ONE_WG[dp])[2]))
                out.append((SOURCE, _names(dtype, dp, rank, KV_ONE_WG[dp])[1]))
        out.append((SOURCE, _ds_name(dtype)))
    return sorted(set(out))


def _ds_name(dtype):
    """The bias-gradient reduction of the dS workspace per chunk (the sum of its partial
    tables: the mma.sync backward's ``na_bwd_rpb_sum``)."""
    return f"natten::na_bwd_ds_rpb<{c_type(dtype)}>"


@functools.lru_cache(maxsize=512)
def _bias_extents(problem):
    """Per axis over every owner box of both passes: (largest key region of a dQ CTA, its
    bias box (``BiasBox``), largest query region of a dK/dV CTA, its bias box
    (``KeyBiasBox``)), as the kernels' geometry computes them."""
    out = []
    for a in range(problem.rank):
        L, k, st, d, causal = (problem.spatial[a], problem.kernel_size[a], problem.stride[a],
                               problem.dilation[a], problem.is_causal[a])
        t = OWNER_BOX[problem.rank][a]
        keys = queries = kv_box = 1
        for g in range(d):
            glen = group_size(L, d, g)
            _, _, fs, le = box_ranges(glen, k, st, causal, t)
            keys = max(keys, int((le - fs).max()))
            o0, last, lo, hi = box_ranges(glen, k, st, causal, t, inverse=True)
            rk = numpy.maximum(hi - lo, 0)
            org = numpy.maximum(o0 - (lo + rk - 1) + k - 1, 0)
            dim = numpy.maximum(numpy.minimum(2 * k - 2, last - lo + k - 1) - org + 1, 1)
            queries = max(queries, int(rk.max()))
            kv_box = max(kv_box, int(dim.max()))
        out.append((keys, min(2 * k - 1, k + t - 1), queries, kv_box))
    return tuple(out)


def _pass_smem(problem, tile=None):
    """Dynamic shared memory of the (dK/dV, dQ) passes, with a bias its parts after the
    mbarriers: the dK/dV pass's box and (rank 2, 3) each region query's place in it; the dQ
    pass's box, its gradient box, each region key's place, and per compute warp a float32
    scratch tile of 16 x (bn + 8) dS and its 16 row terms (16-byte aligned)."""
    dp = _bucket(problem.head_dim)
    tile = tile or default_tile(problem)
    kv = smem_bytes(dp, tile.bq, tile.kv_stages, True, own=64 * tile.kv_wg)
    dq = smem_bytes(dp, tile.bn, tile.q_stages, False, own=64 * tile.q_wg)
    if problem.has_rpb:
        ext = _bias_extents(problem)
        nd = problem.rank > 1
        kv += 4 * math.prod(e[3] for e in ext) + (4 * math.prod(e[2] for e in ext) if nd else 0)
        dq += 8 * math.prod(e[1] for e in ext) + (4 * math.prod(e[0] for e in ext) if nd else 0)
        dq += 15 + 8 * (16 * (tile.bn + 8) * 4 + 64)
    return kv, dq


def _ds_kv_smem(problem, tile):
    """Dynamic shared memory of ``na_bwd_hopper_kv_ds``: the atomic variant's (dS^T and
    staging tiles), its bias box and (rank 2, 3) the region queries' places after the
    mbarriers, then each region query's workspace row (int32, 64 past the region: a tile's
    columns past it read one)."""
    dp = _bucket(problem.head_dim)
    ext = _bias_extents(problem)
    region = math.prod(e[2] for e in ext)
    return (smem_bytes(dp, tile.bq, tile.kv_stages, True, True)
            + 4 * math.prod(e[3] for e in ext) + (4 * region if problem.rank > 1 else 0)
            + 4 * (region + 64))


# na_bwd_ds_rpb (the .cu's DS_CHUNK, DS_THREADS, DS_SLOTS): tokens, threads and slots a CTA.
DS_CHUNK, DS_THREADS, DS_SLOTS = 256, 256, 1024
DS_SMEM_LIMIT = 48 * 1024


def _tokens(problem):
    return math.prod(problem.spatial)


def _table_entries(problem):
    """Entries of the bias table [H, 2k-1, ...] per head."""
    return math.prod(2 * k - 1 for k in problem.kernel_size)


def ds_head_groups(problem):
    """The runs of kv heads (first, count) that ``na_bwd_hopper_kv_ds`` takes one launch
    each, so that the dS workspace of one run's query heads is no larger than the
    gradients dq, dk, dv (it is reused run after run); () where one kv head's query heads
    alone would exceed that."""
    grads = problem.heads * problem.head_dim + 2 * problem.kv_heads * problem.head_dim
    per_kv = problem.heads_per_kv * problem.num_neighbors   # slots a token, per kv head
    most = min(grads // per_kv, problem.kv_heads)
    if most < 1:
        return ()
    runs = -(-problem.kv_heads // most)
    size = -(-problem.kv_heads // runs)
    return tuple((h, min(size, problem.kv_heads - h)) for h in range(0, problem.kv_heads, size))


def ds_workspace(problem):
    """(shape, dtype) of the dS workspace of ``na_bwd_hopper_kv_ds``: [B, heads, tokens,
    kernel volume] in the problem's dtype, heads those of the largest run of
    ``ds_head_groups``."""
    heads = max(n for _, n in ds_head_groups(problem)) * problem.heads_per_kv
    return ((problem.batch, heads, _tokens(problem), problem.num_neighbors), problem.dtype)


def _ds_smem(problem):
    """Dynamic shared memory of ``na_bwd_ds_rpb``: the bias table (float32, padded to 16
    bytes) and a 16-byte record per token of its chunk."""
    return 4 * (-(-_table_entries(problem) // 4) * 4) + 16 * DS_CHUNK


def ds_refusal(problem, tile=None):
    """Why the dK/dV pass cannot give the bias gradient through the dS workspace (dq_atomic
    with a bias), or None: the workspace of one kv head's query heads larger than the
    gradients, a head's rows past 2^31 slots, the reduction's table or the pass's shared
    memory too large. (Larger workspaces than that are taken in runs of heads,
    ``ds_head_groups``.)"""
    tokens, kvol = _tokens(problem), problem.num_neighbors
    if not ds_head_groups(problem):
        return (f"the dS workspace ({kvol} slots a query) of one kv head's query heads would "
                "be larger than the gradients: the bias gradient comes from the dQ pass "
                "(dq_atomic off)")
    if tokens * kvol >= 2 ** 31:
        return f"the dS workspace's rows of one head hold {tokens * kvol} slots (2^31 at most)"
    if _ds_smem(problem) > DS_SMEM_LIMIT:
        return f"the bias table of kernel {problem.kernel_size} is too large for its reduction"
    if _ds_kv_smem(problem, tile or DEFAULT[_bucket(problem.head_dim)]) > SMEM_LIMIT:
        return (f"the bias boxes of kernel {problem.kernel_size} do not fit the dK/dV pass's "
                "shared memory beside the dQ tiles")
    return None


def smem_bytes(dp, rows, stages, values, ds=False, own=OWNER_ROWS):
    """Dynamic shared memory of a pass (``BwdSmem`` in the .cu): owners (``own`` rows each),
    stages, the atomic variant's dS^T tiles (two sets at head dim 128) and dQ staging tiles,
    lse/delta vectors, mbarriers, 1 KiB to align the tiles."""
    vec = rows * 4 if values else 0
    ds_tiles = (2 if dp > 64 else 1) * 2 * 64 * rows * 2 if ds else 0
    staging = 2 * 64 * 64 * 4 if ds else 0
    return (2 * own * dp * 2 + stages * (2 * rows * dp * 2 + 2 * vec) + ds_tiles
            + staging + 16 * stages + 1024)


def owner_ctas(problem, box=None):
    """CTAs per (batch, head) of a pass: dilation groups x owner boxes (default: both passes'
    128-row boxes) of the longest."""
    box = box or OWNER_BOX[problem.rank]
    n = 1
    for a in range(problem.rank):
        L, d = problem.spatial[a], problem.dilation[a]
        n *= d * -(-(-(-L // d)) // box[a])
    return n


@functools.lru_cache(maxsize=512)
def _geometry(problem, tile):
    """(head-dim bucket, tile, owner boxes per (batch, head), delta blocks) of ``tile`` (None:
    the default), shared by the decisions of both dQ variants."""
    dp = _bucket(problem.head_dim)
    tile = tile or default_tile(problem)
    rows = problem.batch * problem.heads * int(numpy.prod(problem.spatial))
    delta_blocks = -(-rows * (dp // 8) // DELTA_THREADS)
    return dp, tile, owner_ctas(problem), delta_blocks


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one problem is cut (depends on the problem alone; the device adds the window
    tables of the bias reduction)."""
    names: tuple        # (delta, dK/dV, dQ pass or with dq_atomic the dQ store) expressions
    dq_atomic: bool     # dQ added in the dK/dV pass into a float32 workspace
    ctas: int           # 128-row owner boxes per (batch, head) (the bias reduction's)
    delta_blocks: int   # grid x of the delta launch and of the dQ store
    smem: tuple         # dynamic shared memory of the (dK/dV, dQ) passes, bytes
    box: tuple          # the dK/dV pass's owner box per axis (what its launch records)
    workspaces: tuple   # after delta: with dq_atomic the float32 dQ, with a bias the boxes
    #                     and their reduction's partial tables, or the dS workspace and
    #                     its partial tables
    bias: numpy.void    # with a bias and the dQ pass: the BiasGeom of its boxes, else None
    entries: int        # bias-table entries (0 without a bias)
    kv_tma_name: str    # the dK/dV pass loading its query tiles by TMA ("": none)
    kv_tma_refusal: str  # why there is none (None: there is one, kv_tma_maps)
    q_ctas: int         # the dQ pass's owner boxes per (batch, head) (its grid x)
    q_box: tuple        # its owner box per axis
    q_threads: int      # its threads (the loader and q_wg compute warpgroups)
    kv_ctas: int        # the dK/dV pass's owner boxes per (batch, kv head) (its grid x)
    kv_threads: int     # its threads (the loader and kv_wg compute warpgroups)
    ds_parts: int = 0   # dq_atomic with a bias: na_bwd_ds_rpb's CTAs per (batch, head)
    rpb_parts: int = 0  # with a bias otherwise: na_bwd_rpb_boxes' (mma_backward.rpb_parts)


def _tiling(problem, tile, dq_atomic, smem):
    """The Tiling of ``tile`` (None: the default) and the dQ variant; ``smem``: the passes'
    shared memory (``_pass_smem``)."""
    dp, tile, ctas, delta_blocks = _geometry(problem, tile)
    names = _names(problem.dtype, dp, problem.rank, tile, dq_atomic, problem.has_rpb)
    if dq_atomic:
        smem = (_ds_kv_smem(problem, tile) if problem.has_rpb else
                smem_bytes(dp, tile.bq, tile.kv_stages, True, True), smem[1])
    workspaces = (dq_workspace(problem, dp),) if dq_atomic else ()
    bias, entries, ds_parts, rpb_parts = None, 0, 0, 0
    if problem.has_rpb and dq_atomic:
        # The dS workspace and the reduction's partial tables [B, H, CTAs, entries].
        entries = _table_entries(problem)
        ds_parts = (-(-_tokens(problem) // DS_CHUNK)
                    * -(-problem.num_neighbors // DS_SLOTS))
        workspaces += (ds_workspace(problem),
                       _mma_backward().rpb_tables(problem, ds_parts, entries))
    # BiasGeom's fields are int32: a launch too large to run (plan_backward says so) has none.
    elif problem.has_rpb and ctas < 2 ** 31:
        bias = _bias_geometry(problem)
        assert int(bias["ctas"]) == ctas
        size = problem.batch * problem.heads * ctas * int(bias["vol"])
        workspaces += (((size,), numpy.dtype(numpy.float32)),)
        entries = _table_entries(problem)
        rpb_parts = _mma_backward().rpb_parts(problem, bias)
        if rpb_parts:   # and the partial tables of their reduction
            workspaces += (_mma_backward().rpb_tables(problem, rpb_parts, entries),)
    kv_tma_refusal = _kv_tma_refusal(problem, tile)
    kv_tma = "" if kv_tma_refusal else _names(problem.dtype, dp, 1, tile, dq_atomic, tma=True)[1]
    qb, kb = owner_box(problem.rank, tile.q_wg), owner_box(problem.rank, tile.kv_wg)
    return Tiling(names, dq_atomic, ctas, delta_blocks, smem, kb[:problem.rank], workspaces,
                  bias, entries, kv_tma, kv_tma_refusal, owner_ctas(problem, qb),
                  qb[:problem.rank], 128 * (tile.q_wg + 1), owner_ctas(problem, kb),
                  128 * (tile.kv_wg + 1), ds_parts, rpb_parts)


def _kv_tma_refusal(problem, tile):
    """Why the dK/dV pass of ``tile`` cannot load its query tiles by TMA whatever the arrays
    (None: it can where the maps describe them, ``kv_tma_maps``)."""
    if problem.rank > 1:
        return "rank 2 and 3 walk their query regions flat (no box shape)"
    if problem.has_rpb:
        return "with a bias the dK/dV pass loads by cp.async"
    if tile.bq != 64:
        return f"query tiles of {tile.bq} rows (the maps' boxes are 64)"
    if tile.kv_wg != 2:
        return "the dK/dV pass with one compute warpgroup loads by cp.async"
    return None


def kv_tma_maps(problem, t, d_out, q):
    """The tensor maps of q and d_out (plan operands 1 and 0) for the dK/dV pass of Tiling
    ``t`` with TMA loads, or the reason it cannot run: rank 2 or 3, a bias, or an operand
    the maps cannot describe (``natten_cupy._tma.operand_map``: e.g. dilation over 4)."""
    if t.kv_tma_refusal:
        return t.kv_tma_refusal
    return maps_of(((1, "q", q), (0, "d_out", d_out)), 1, (64,), problem.dilation,
                   _bucket(problem.head_dim))


# 1-D windows from which the atomic dQ variant pays at head dim 128 (below, the dQ pass).
ATOMIC_1D_FROM = 1024
# With a bias, where ``atomic_pays`` would take the atomic variant: dQ added in the dK/dV pass
# and d_rpb from its dS workspace (``na_bwd_hopper_kv_ds``), instead of the dQ pass summing
# d_rpb. Correct on the GPU (tests/gpu/test_gpu_hopper_bwd.py), but slower than the default
# biased backward on every workload but one (H100, bench/results/rpb_probe_reductions.json:
# M5 2.88 against 2.17 ms, W2b 1.61 against 1.36; 3D-D128 1.39 against 1.44): off
# (``dq_atomic=True`` asks for it; NOTES-hopper-bwd.md).
BIAS_DS = False
# The head-dim buckets where it does (with ``BIAS_DS``). At 64 the mma.sync backward takes
# biased 2-D and 3-D problems unless this holds 64 (``fused._hopper_bwd_pays``): the Hopper
# dQ pass summing d_rpb measured far slower there (M4 13.8 ms against 9.07, rpb_probe.json),
# and the dS-workspace variant too (M4 14.5, M7 4.73 against 2.60, 2D-D64 0.97 against 0.52).
BIAS_DS_BUCKETS = (128,)


def atomic_pays(problem):
    """Whether a backward that need not be reproducible (``deterministic=False``, the
    default) adds dQ in the dK/dV pass (``dq_atomic``) instead of running the dQ pass: at
    head dim 128, where it measured faster (H200, bench/probes/hopper_bwd_dq.py: 2-D 21x21
    1.54 vs 1.84 ms, dense 16K 13.6 vs 14.1, 1-D 16K window 4096 6.59 vs 6.65), but not on
    1-D windows under ATOMIC_1D_FROM, where the dQ pass measured as fast or faster (H100,
    bench/results/dispatch_r1_1d_d128.json, causal windows: 63 2.77 vs 3.01 ms, 119 1.50 vs
    1.49, 327 3.64 vs 3.75); at 64 it measured slower (dense 16K 9.97 vs 8.12 ms, 1-D window
    2047 3.38 vs 2.83, 3-D 5x9x9 8.20 vs 7.80). With a bias: only with ``BIAS_DS``, at the
    head-dim buckets of ``BIAS_DS_BUCKETS`` on 2-D and 3-D windows, where the dS workspace
    fits (``ds_refusal``; the bias gradient then comes from it, not from the dQ pass)."""
    if problem.deterministic:
        return False
    bucket = _bucket(problem.head_dim)
    if problem.has_rpb:
        return (BIAS_DS and bucket in BIAS_DS_BUCKETS and problem.rank > 1
                and ds_refusal(problem) is None)
    if bucket != 128:
        return False
    return problem.rank > 1 or problem.kernel_size[0] >= ATOMIC_1D_FROM


def plan_backward(problem, d_out, q, k, v, out, lse, dq, dk, dv, rpb=None, d_rpb=None,
                  tile=None, dq_atomic=None, tma=None):
    """The Plan of one backward on the current device for operand layouts (in this order;
    with ``problem.has_rpb`` then rpb and d_rpb, element by element at any strides; then the
    workspaces: delta, with ``dq_atomic`` the float32 dQ (and with a bias then the dS
    workspace and the reduction's partial tables), with a bias otherwise the dQ CTAs'
    bias-gradient boxes), or None if an operand other than lse, rpb, d_rpb is not
    ``rows_ready`` (the plan contract of ``natten_cupy._launch``).

    Deterministic: delta, dK/dV, dQ passes. ``dq_atomic``: delta (zeroing the dQ workspace),
    dK/dV adding dQ into it (bulk float32 reductions), dq = scale * workspace; five GEMMs
    where the deterministic passes run seven, not bitwise reproducible. None: where
    ``atomic_pays``. ``tma``: the rank-1 dK/dV pass loads its query tiles by tensor maps
    (True: always, ValueError where it cannot; False: never; None: at the head dims of
    ``TMA_HEAD_DIMS`` where the maps describe q and d_out)."""
    if not all(rows_ready(x) for x in (d_out, q, k, v, out, dq, dk, dv)):
        return None
    if tile is None and tma and one_wg_kv(problem):   # (the one-warpgroup pass loads by cp.async)
        tile = default_tile(problem, kv_wg1=False)
    t = configure(problem, tile, dq_atomic)
    if isinstance(t, str):
        raise ValueError(t)
    if max(t.ctas, t.q_ctas, t.kv_ctas) >= 2 ** 31:
        raise ValueError(f"problem too large for one Hopper fused-backward launch "
                         f"({max(t.ctas, t.q_ctas, t.kv_ctas)} tiles)")
    delta = Layout.contiguous(lse.shape, numpy.float32)
    p = make_params(problem, q=q, k=k, v=v, o=out, d_o=d_out, dq=dq, dk=dk, dv=dv, lse=lse,
                    delta=delta, rpb=rpb, d_rpb=d_rpb)
    D_OUT, Q, K, V, OUT, LSE, DQ, DK, DV = map(Operand, range(9))
    no_ws = numpy.uint64(0)  # a null pointer
    # The float32 dQ workspace (dq_atomic), else a null pointer; with a bias and dq_atomic
    # the dS workspace and the reduction's partial tables, without dq_atomic the dQ CTAs'
    # bias-gradient boxes.
    if problem.has_rpb:
        RPB, D_RPB, DELTA = map(Operand, range(9, 12))
        if t.dq_atomic:
            ws, DSW, PART = map(Operand, range(12, 15))
        else:
            ws, PART = no_ws, Operand(12)
    else:
        RPB, PART, DELTA = no_ws, no_ws, Operand(9)
        ws = Operand(10) if t.dq_atomic else no_ws
    fn_delta, fn_kv, fn_dq = (get_kernel(SOURCE, n, extra_options=OPTIONS) for n in t.names)
    smem_kv, smem_dq = t.smem
    # dK/dV: a CTA per kv head (it walks the queries of each of the kv head's query heads);
    # dQ: a CTA per query head.
    kv_grid = (t.kv_ctas, problem.kv_heads, problem.batch)
    grid = (t.q_ctas, problem.heads, problem.batch)
    kv_args = (Q, K, V, D_OUT, LSE, DELTA, DK, DV, ws, RPB, p)
    want = (USE_TMA and _bucket(problem.head_dim) in TMA_HEAD_DIMS) if tma is None else tma
    maps = kv_tma_maps(problem, t, d_out, q) if want else ()
    if tma and isinstance(maps, str):   # asked for, not possible
        raise ValueError(f"the TMA loads cannot run this backward: {maps}")
    if isinstance(maps, tuple) and maps:
        fn_kv = get_kernel(SOURCE, t.kv_tma_name, extra_options=OPTIONS)
        kv_args += maps
    calls = [KernelCall(fn_delta, (t.delta_blocks, 1, 1), (DELTA_THREADS, 1, 1),
                        (D_OUT, OUT, DELTA, ws, p), name="na_bwd_hopper_delta", backend="fused")]
    if problem.has_rpb and t.dq_atomic:
        # A run of kv heads at a time: its dK/dV pass fills the dS workspace, the first
        # reduction empties it into the run's partial tables.
        ds_rpb = get_kernel(SOURCE, _ds_name(problem.dtype), extra_options=OPTIONS)
        for h, n in ds_head_groups(problem):
            calls += [
                KernelCall(fn_kv, (t.kv_ctas, n, problem.batch), (t.kv_threads, 1, 1),
                           (Q, K, V, D_OUT, LSE, DELTA, DK, DV, ws, RPB, DSW,
                            numpy.int32(h), p), shared_mem=smem_kv,
                           name="na_bwd_hopper_kv", backend="fused", tile=t.box),
                KernelCall(ds_rpb, (t.ds_parts, n * problem.heads_per_kv, problem.batch),
                           (DS_THREADS, 1, 1),
                           (DSW, PART, numpy.int32(t.entries),
                            numpy.int32(h * problem.heads_per_kv), p),
                           shared_mem=_ds_smem(problem), name="na_bwd_ds_rpb", backend="fused")]
    else:
        calls.append(KernelCall(fn_kv, kv_grid, (t.kv_threads, 1, 1), kv_args,
                                shared_mem=smem_kv, name="na_bwd_hopper_kv", backend="fused",
                                tile=t.box))
    if t.dq_atomic:
        calls.append(KernelCall(fn_dq, (t.delta_blocks, 1, 1), (DELTA_THREADS, 1, 1),
                                (ws, DQ, p), name="na_bwd_hopper_dq", backend="fused"))
    else:
        calls.append(KernelCall(fn_dq, grid, (t.q_threads, 1, 1),
                                (Q, K, V, D_OUT, LSE, DELTA, DQ, RPB, PART, p),
                                shared_mem=smem_dq, name="na_bwd_hopper_q", backend="fused",
                                tile=t.q_box))
    if problem.has_rpb and t.dq_atomic:
        calls.append(_ds_sum(problem, t, p, PART, D_RPB))
    elif t.bias is not None:
        calls += _bias_reduction(problem, t, p, PART, Operand(13), D_RPB)
    return Plan(tuple(calls),
                workspaces=((tuple(lse.shape), numpy.dtype(numpy.float32)), *t.workspaces))


def _bias_geometry(problem):
    """The BiasGeom that the mma.sync backward's bias reduction (``rpb_reduction``) reduces
    this part's dQ CTAs' bias-gradient boxes by: told this part's owner boxes."""
    mb = _mma_backward()
    box = OWNER_BOX[problem.rank]
    _, tab_off, _ = mb._window_tables(tuple(mb._axes(problem)), box)
    return mb.bias_geometry(problem, tab_off, mb.tiles_per_axis(problem, box), box)


def _mma_backward():
    from . import mma_backward
    return mma_backward


def _bias_reduction(problem, t, p, boxes, tables, d_rpb):
    """The launches that add the dQ CTAs' bias-gradient boxes into d_rpb (the mma.sync
    backward's ``rpb_reduction``, with its window tables on the current device)."""
    mb = _mma_backward()
    tab = mb._geometry(problem, OWNER_BOX[problem.rank])[0]
    return mb.rpb_reduction(problem, t.bias, t.rpb_parts, tab, p, boxes, tables, d_rpb)


def _ds_sum(problem, t, p, part, d_rpb):
    """The launch that sums the partial tables of ``na_bwd_ds_rpb`` into d_rpb, in a fixed
    order (the mma.sync backward's ``rpb_sum``)."""
    return _mma_backward().rpb_sum(problem, p, part, d_rpb, t.entries, t.ds_parts)


def dq_workspace(problem, dp):
    """(shape, dtype) of the atomic variant's float32 dQ workspace (``dq_ws_row`` in the
    .cu): [B, H, *dilation, dp / 64, *longest group's extents, 64], queries consecutive along
    the last axis in consecutive rows of a column chunk."""
    groups = tuple(-(-L // d) for L, d in zip(problem.spatial, problem.dilation))
    return ((problem.batch, problem.heads, *problem.dilation, dp // 64, *groups, 64),
            numpy.dtype(numpy.float32))


def backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None, d_rpb=None, tile=None,
             dq_atomic=None, tma=None):
    """dq, dk, dv (CuPy arrays, preallocated, every element written) of the NA forward that
    gave out and lse (natural log), for the upstream gradient d_out; with ``rpb`` (a bias)
    also d_rpb. ``dq_atomic``: dQ added in the dK/dV pass (not bitwise reproducible; see
    plan_backward; ``tma``: the dK/dV pass's loads, as there)."""
    if problem.is_empty:
        return
    run_backward(functools.partial(plan_backward, tile=tile, dq_atomic=dq_atomic, tma=tma),
                 problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb, d_rpb)
