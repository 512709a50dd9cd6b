"""Fused backward on tensor cores (float16, bfloat16; float32 as TF32 when the caller allows
it): launcher of ``cuda_src/fused/mma_backward.cu``.

Two launches, no atomics (so every run is bitwise reproducible, ``deterministic`` or not),
or on problems small enough that every CTA of both is resident at once one launch of both
(``na_bwd_fused_one``, ``one_launch``: the dK/dV CTAs sum their gathered rows' delta
themselves, so they need not wait for the dQ pass):

1. ``na_bwd_fused_q``: dQ, and delta = rowsum(dO * O) in float32 [B, *spatial, H]. A CTA
   owns a tile of queries of one dilation group; each warp owns 16 queries forming a compact
   patch (1-D 16, 2-D 4x4, 3-D 1x4x4) and walks only the keys its patch's windows reach, 32
   at a time, gathered from a shared-memory slab;
2. ``na_bwd_fused_kv``: dK, dV, the same walk with keys as owners and the queries whose
   windows reach them gathered (with the delta of pass 1); under grouped-query attention a
   CTA owns keys of one kv head and walks the queries of each head of its group in turn.

Window arithmetic comes from per-axis tables built here (``_axis_table``) and cached on the
device. Head dims are padded to a bucket (32, 64, 128, 160, 256) with zero columns; the
accumulated columns are split into chunks of at most 64 (dK/dV) or 128 (dQ) per CTA to
bound registers, 80 and 160 at 160, 128 and 256 at 256 (``_kv_chunk``, ``_q_chunk``).
``problem.tile`` is not used: the tiles are fixed per rank (``TILES``).
TF32 at head dim > 128 needs 171 KB of shared memory per CTA (sm_90 only).

With a relative positional bias (``problem.has_rpb``) both passes add it to the scores, and
the dQ pass also sums dS per bias-table entry over each CTA's queries: one shared-memory box
per warp (the offsets the CTA's queries reach, ``bias_geometry``), summed in warp order into
a float32 workspace of one box per CTA; ``na_bwd_rpb_boxes`` adds runs of boxes into partial
tables and ``na_bwd_rpb_sum`` those into d_rpb (``rpb_reduction``; where a box or the table
is too large for them, one launch, ``na_bwd_fused_rpb``), in a fixed order. So d_rpb is
reproducible run to run as well.

With additional tokens (``problem.has_extra``: every query also attends to T tokens ``[B,
T, H_x, D]``) the dQ pass walks them after its window, and ``na_bwd_extra_kv`` computes
their dK, dV: a CTA owns 64 of them and walks one split of the query tokens (for each query
head of its extra head), writing float32 partial sums that ``na_bwd_extra_sum`` adds in
split order (no atomics either). The splits are sized to fill the device about four times
over (``_extra_splits``).

``configure`` decides once per problem (cached): the Tiling (kernels, grids, shared memory,
geometry structs) or why this part refuses it; ``refuse`` returns that reason and
``plan_backward`` binds the arrays, the device's window tables (``_geometry``) and, with
additional tokens, the splits for the device's SM count (``_extra_tiling``).
Measurements and predictions: ``bench/results/NOTES-fused-bwd.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from ..._compile import get_kernel
from ..._dtypes import FLOAT32, HALF_TYPES, c_type
from ..._launch import KernelCall, Operand, Plan
from ..._operands import (Layout, current_limits, head_dim_bucket, rows_ready, run_backward,
                           smem_refusal)
from ..._params import make_params
from ..._window import group_size, inverse_bounds, window_bounds

SOURCE = "fused/mma_backward.cu"
D_BUCKETS = (32, 64, 128, 160, 256)
KV_CHUNK = 64
Q_CHUNK = 128
# Head dims 136-160 in the 160 bucket (False: padded to 256, as before it; a switch for probes,
# part of configure's cache key). Kernels alone on an H100 (bench/results/bwd_bucket160.json):
# R5-2-D160 (1-D 4096 tokens, window 565, H8 B7, fp16) backward 9.11 -> 2.87 ms, R5-14-D160
# (3-D 16x32x32, window 4x13x13 causal in time, H4 B10, bf16) 58.3 -> 13.3 ms.
BUCKET_160 = True
# Chunks of other widths per bucket ({bucket: columns}; ``_kv_chunk``, ``_q_chunk``). At 256
# the dK/dV pass in chunks of 128 (2 x 128 accumulators a thread: up to 172 bytes spilled, which
# test_compile allows) and the dQ pass in one of 256 recompute S and dP twice and once instead
# of four and two times: on an H100 (bwd_chunks256.json) R5-12-D256 (3-D 24x32x32, 7x9x9, H8,
# fp16) backward 21.35 -> 11.59 ms, R5-11-D256 (2-D 28x64, 5x5, H8 B94, bf16) 12.16 -> 7.14;
# chunks of 128 alone 14.53 and 8.91, the dQ chunk alone 18.38 and 10.42.
KV_CHUNKS = {160: 80, 256: 128}
Q_CHUNKS = {160: 160, 256: 256}
SMEM_PER_SM = 227 * 1024  # sm_90 (sm_80: 163 KB, where the budget below just fits fewer CTAs)
MAX_GRID_Y = 65535
EXTRA_MAX_DIM = 128   # additional tokens in the kernels up to this head dim (as the forward)
ONE_MAX_DIM = 128     # both passes in one launch up to this head dim (small problems)
ONE_RESIDENT = 2      # CTAs an SM of that launch (__launch_bounds__ of na_bwd_fused_one)
# Whether plans run both passes in one launch: None where ``one_launch`` says so, True
# wherever the kernel may (``Tiling.one``), False never. Measured on an H100
# (bench/results/one_launch.json, kernels alone from graph replay): 22.0 -> 17.8 us on a
# 1-D 512-token window-63 D64 backward, 20.7 -> 18.7 us on 2x14x14 7x7 D32, equal on the
# smallest problem (one CTA a pass) and within noise on the 512-CTA problems it leaves to two
# launches; every fused-backward GPU test passes both ways (tests/gpu/test_gpu_fused_bwd.py).
ONE_LAUNCH = None

# (CTA tile, warp patch) per rank, in in-group coordinates over the padded axes. Every tile
# holds exactly 4 patches of 16 rows (kWarps in fused/mma_backward.cu); all extents are powers of
# two (the kernels shift and mask instead of dividing).
TILES = {
    1: ((64, 1, 1), (16, 1, 1)),
    2: ((8, 8, 1), (4, 4, 1)),
    3: ((1, 8, 8), (1, 4, 4)),
}


# Shared memory a pass may give the bias: the head's table (float) and, in the dQ pass, the
# per-warp bias-gradient boxes (4 warps x box x 4 bytes).
BIAS_SMEM_BUDGET = 64 * 1024
# Copies of each warp's box in the dQ pass (bwd::BiasGeom.wcopies): with 4, owner row r adds
# into copy r % 4, four rows a turn with their loads together and one warp barrier a turn
# (else one add and one barrier per row, each add's load waiting on the last row's store),
# where the copies fit BIAS_SMEM_BUDGET. Built without a GPU and not yet measured: 1 (NOTES-
# fused-bwd.md, twentieth session).
BIAS_BOX_COPIES = 1
KWARPS, KNB = 4, 32   # kWarps, kNB of fused/mma_backward.cu

# bwd::PassGeom and bwd::BiasGeom of fused_bwd_tile.cuh, field for field (the launch
# geometry of one pass; the bias parts).
PASS_GEOM = numpy.dtype([("tile", numpy.int32, (3,)), ("patch", numpy.int32, (3,)),
                         ("lpatch", numpy.int32, (3,)), ("ntile", numpy.int32, (3,)),
                         ("tab_off", numpy.int32, (3,)), ("slab_rows", numpy.int32),
                         ("bh0", numpy.int32)], align=True)
BIAS_GEOM = numpy.dtype([("dim", numpy.int32, (3,)), ("bst", numpy.int32, (3,)),
                         ("tile", numpy.int32, (3,)), ("ntile", numpy.int32, (3,)),
                         ("tab_off", numpy.int32, (3,)), ("vol", numpy.int32),
                         ("ctas", numpy.int32), ("tst", numpy.int32, (3,)),
                         ("tvol", numpy.int32), ("wdim", numpy.int32, (3,)),
                         ("wbst", numpy.int32, (3,)), ("wvol", numpy.int32),
                         ("wcopies", numpy.int32)], align=True)
# bwd::ExtraGeom: the additional tokens' dK/dV launch and the sum of its splits.
EXTRA_GEOM = numpy.dtype([("split_rows", numpy.int32), ("slab_rows", numpy.int32),
                          ("bh0", numpy.int32), ("splits", numpy.int32), ("dp", numpy.int32)],
                         align=True)


# d_rpb from the dQ CTAs' boxes: in two launches (``na_bwd_rpb_boxes``, a CTA per
# RPB_BOXES_PER_PART boxes of a (batch, head) summing them into a table of the head's
# entries, then ``na_bwd_rpb_sum`` adding those tables in order) where a box fits the first
# kernel's registers (RPB_THREADS, kRpbThreads of the .cu, times the largest of its slot
# counts RPB_SLOTS) and the table its static shared-memory limit; else in one
# (``na_bwd_fused_rpb``: a CTA per entry and head, each walking every box of its head; 0.41
# ms of W2's backward, an H100, rpb_probe.json).
# Built without a GPU and not yet run on one: off (the one launch) until its GPU tests and
# bench/probes/rpb_probe.py have run (NOTES-fused-bwd.md, nineteenth session).
RPB_TWO_LAUNCH = False
RPB_THREADS, RPB_SLOTS = 256, (1, 2, 4, 8, 16, 32)
RPB_BOXES_PER_PART = 128
RPB_TABLE_SMEM = 44 * 1024   # (and 4 KiB of static memory: 48 KiB without opting in)


def rpb_parts(problem, bg):
    """CTAs per (batch, head) of ``na_bwd_rpb_boxes`` over the boxes of BiasGeom ``bg``, or 0
    where the one-launch reduction runs instead (``RPB_TWO_LAUNCH`` off, or a box or the
    table too large for it)."""
    vol, tvol, ctas = int(bg["vol"]), int(bg["tvol"]), int(bg["ctas"])
    if (not RPB_TWO_LAUNCH or ctas == 0 or vol > RPB_THREADS * RPB_SLOTS[-1]
            or 4 * tvol > RPB_TABLE_SMEM or problem.batch > MAX_GRID_Y):
        return 0
    return -(-ctas // RPB_BOXES_PER_PART)


def rpb_reduction(problem, bg, parts, tab, p, boxes, tables, d_rpb):
    """The launches that add the dQ CTAs' bias-gradient boxes (operand ``boxes``, [B, H,
    CTAs, box]) into d_rpb: with ``parts`` (``rpb_parts``) through the float32 workspace
    ``tables`` [B, H, parts, entries]; else (0, ``tables`` unused) in one launch. ``tab``:
    this backward's window tables (the ones ``bg`` indexes)."""
    ct, entries = c_type(problem.dtype), int(bg["tvol"])
    if not parts:
        return [KernelCall(get_kernel(SOURCE, f"na_bwd_fused_rpb<{ct}>"),
                           (entries, problem.heads, 1), (128, 1, 1), (boxes, d_rpb, tab, p, bg),
                           name="na_bwd_fused_rpb", backend="fused")]
    per = numpy.int32(-(-int(bg["ctas"]) // parts))
    slots = next(n for n in RPB_SLOTS if n * RPB_THREADS >= int(bg["vol"]))
    return [KernelCall(get_kernel(SOURCE, f"na_bwd_rpb_boxes<{slots}>"),
                       (parts, problem.heads, problem.batch),
                       (RPB_THREADS, 1, 1), (boxes, tables, tab, p, bg, per),
                       shared_mem=4 * entries, name="na_bwd_rpb_boxes", backend="fused"),
            rpb_sum(problem, p, tables, d_rpb, entries, parts)]


def rpb_tables(problem, parts, entries):
    """(shape, dtype) of the partial tables [B, H, parts, entries] that ``rpb_sum`` adds."""
    return (problem.batch * problem.heads * parts * entries,), numpy.dtype(numpy.float32)


def rpb_sum(problem, p, tables, d_rpb, entries, parts):
    """The launch that adds partial tables [B, H, parts, entries] of d_rpb (operand
    ``tables``) over batches and parts, in order, into d_rpb."""
    return KernelCall(get_kernel(SOURCE, f"na_bwd_rpb_sum<{c_type(problem.dtype)}>"),
                      (-(-entries // 128), problem.heads, 1), (128, 1, 1),
                      (tables, d_rpb, numpy.int32(entries), numpy.int32(parts), p),
                      name="na_bwd_rpb_sum", backend="fused")


def _bias_table_dims(problem):
    """[2k-1, ...] per padded axis (1 on inert axes)."""
    return tuple(2 * k - 1 for k in problem.kernel_size) + (1,) * (3 - problem.rank)


def _bias_smem(problem):
    """Shared memory of the bias parts per pass: {owners are keys: bytes}. The dK/dV pass
    holds a head's table, the dQ pass the CTA's box of it and per warp a box of its patch's
    offsets (an even count of words), a 16 x 40 dS tile, 16 owner-row parts and its box's
    shift."""
    table = _padded(math.prod(_bias_table_dims(problem)))
    return {True: table, False: _dq_bias_bytes(problem, _box_copies(problem))}


def _padded(n):
    """Bytes of n floats (the boxes start 8-aligned) and the step's gathered-row parts."""
    return 4 * (n + n % 2) + KWARPS * KNB * 8


def _warp_boxes(problem, copies):
    """Bytes of the dQ pass's per-warp bias parts with ``copies`` copies of each warp's box."""
    wvol = math.prod(_bias_box(problem, 1))
    return KWARPS * 4 * (copies * (wvol + wvol % 2) + 16 * (KNB + 8) + 16 + 4)


def _dq_bias_bytes(problem, copies):
    """Bytes of the dQ pass's bias parts: the CTA's box and the per-warp parts."""
    return _padded(math.prod(_bias_box(problem))) + _warp_boxes(problem, copies)


def _box_copies(problem):
    """Copies of each warp's box in the dQ pass (BIAS_BOX_COPIES where they fit, else 1)."""
    if BIAS_BOX_COPIES != 1 and _dq_bias_bytes(problem, BIAS_BOX_COPIES) <= BIAS_SMEM_BUDGET:
        return BIAS_BOX_COPIES
    return 1


def _bias_box(problem, level=0):
    """Per padded axis the offsets one dQ CTA's queries reach (``level`` 0; one warp's patch:
    ``level`` 1): min(2k - 1, k + extent - 1)."""
    tile = TILES[problem.rank][level]
    ks = tuple(problem.kernel_size) + (1,) * (3 - problem.rank)
    return tuple(min(2 * k - 1, k + t - 1) for k, t in zip(ks, tile))


def configure(problem):
    """The Tiling of ``problem`` (everything its launches need besides the device and the
    arrays), or a str saying why this part cannot run it: the one place the part decides,
    read by ``refuse`` and ``plan_backward``. Cached per problem and tiles (``TILES[rank]``
    is part of the key, so a probe that swaps a rank's tiles gets a fresh decision)."""
    return _configure(problem, TILES[problem.rank], BUCKET_160, BIAS_BOX_COPIES)


@functools.lru_cache(maxsize=512)
def _configure(problem, tiles, bucket_160, box_copies):   # (the last two: cache key only)
    if problem.dtype == FLOAT32 and not problem.allow_tf32:
        return "exact float32 runs in exact_fp32"
    bias_smem = _bias_smem(problem) if problem.has_rpb else {True: 0, False: 0}
    if max(bias_smem.values()) > BIAS_SMEM_BUDGET:
        return (f"the bias table and bias-gradient boxes of kernel {problem.kernel_size} "
                f"exceed {BIAS_SMEM_BUDGET // 1024} KB of shared memory (backend 'naive' "
                "runs it)")
    if problem.has_rpb and problem.heads > MAX_GRID_Y:
        return f"a bias needs at most {MAX_GRID_Y} heads, got {problem.heads}"
    if problem.dtype not in HALF_TYPES + (FLOAT32,):
        return f"dtype {problem.dtype_name} is not supported (float16, bfloat16, float32 as TF32)"
    if problem.batch * problem.heads >= 2 ** 31:
        return "batch * heads must be below 2**31"
    if problem.head_dim % 8 or problem.head_dim > D_BUCKETS[-1]:
        return f"head_dim {problem.head_dim} must be a multiple of 8 up to {D_BUCKETS[-1]}"
    return _tiling(problem, tiles, bias_smem)


def refuse(problem):
    """None if this part runs ``problem`` on the current device, else the reason: the
    problem's own (``configure``) or the device's shared memory per block (both passes)."""
    t = configure(problem)
    if isinstance(t, str):
        return t
    return smem_refusal(max(t.q.smem, t.kv.smem), "the mma.sync fused backward")


def _bucket(head_dim):
    return head_dim_bucket(head_dim, D_BUCKETS if BUCKET_160 else
                           tuple(d for d in D_BUCKETS if d != 160))


def _q_chunk(dp, bias=False):
    """Columns of dQ per CTA: up to Q_CHUNK (with a bias too: its dS tile goes to shared
    memory in 8-byte stores after the score loop, which keeps the pass free of spills); the
    whole head dim at 160 and 256 (80 and 128 accumulators a thread, none spilled on sm_90):
    ``Q_CHUNKS``."""
    return Q_CHUNKS.get(dp, min(dp, Q_CHUNK))


def _kv_chunk(dp):
    """Columns of dK and dV per CTA: up to KV_CHUNK, 80 at 160, 128 at 256. Every chunk's CTA
    recomputes S = Q K^T and dP = dO V^T over the whole padded head dim, so at 160 two chunks
    of 80 (2 x 80 accumulators, none spilled) do 2 x (2 x 160 + 2 x 80) units where padding
    to 256 in chunks of 64 did 4 x (2 x 256 + 2 x 64): 2.7x less work (``KV_CHUNKS``)."""
    return KV_CHUNKS.get(dp, min(dp, KV_CHUNK))


def _names(ctype, dp, grouped=False, bias=False, extra=False):
    """Kernel names of the dK/dV and dQ passes; ``grouped``: the dK/dV pass that loops over a
    kv head's query heads (grouped-query attention), its own instantiation so that the
    kernels without GQA keep their register budget; ``bias``: with a relative positional
    bias (and the dQ pass's bias-gradient boxes); ``extra``: the dQ pass that also walks the
    additional tokens."""
    flag = lambda x: "true" if x else "false"
    return (f"na_bwd_fused_kv<{ctype}, {dp}, {_kv_chunk(dp)}, {flag(grouped)}, "
            f"{flag(bias)}>",
            f"na_bwd_fused_q<{ctype}, {dp}, {_q_chunk(dp, bias)}, {flag(bias)}, {flag(extra)}>")


def _extra_names(ctype, dp):
    return (f"na_bwd_extra_kv<{ctype}, {dp}, {_kv_chunk(dp)}>",
            f"na_bwd_extra_sum<{ctype}>")


def instantiations():
    out = []
    for dt in HALF_TYPES + (FLOAT32,):
        ct = c_type(dt)
        for bias in (False, True):
            for dp in D_BUCKETS:
                out += [(SOURCE, name) for name in _names(ct, dp, bias=bias)]
                out.append((SOURCE, _names(ct, dp, grouped=True, bias=bias)[0]))
        for dp in (d for d in D_BUCKETS if d <= EXTRA_MAX_DIM):
            out.append((SOURCE, _names(ct, dp, extra=True)[1]))
            out.append((SOURCE, _extra_names(ct, dp)[0]))
        out.append((SOURCE, _extra_names(ct, 32)[1]))
        out.append((SOURCE, f"na_bwd_fused_rpb<{ct}>"))
        out.append((SOURCE, f"na_bwd_rpb_sum<{ct}>"))
        out += [(SOURCE, _one_name(ct, dp)) for dp in D_BUCKETS if dp <= ONE_MAX_DIM]
    out += [(SOURCE, f"na_bwd_rpb_boxes<{n}>") for n in RPB_SLOTS]
    return out


def takes_extra(problem):
    """Whether the kernels take ``problem``'s additional tokens (not with a bias)."""
    return (not problem.has_rpb and refuse(problem) is None
            and problem.head_dim <= EXTRA_MAX_DIM)


def _axis_table(extent, kernel, stride, dilation, causal):
    """[extent, 4] int32 per full-axis coordinate: in-group window [start, end) of it as a
    query, in-group inverse range [lo, hi) of it as a key (``fused_bwd_tile.cuh``)."""
    i = numpy.arange(extent, dtype=numpy.int64)
    g, ig = i % dilation, i // dilation
    glen = group_size(extent, dilation, g)
    start, end = window_bounds(ig, glen, kernel, stride, causal)
    lo, hi = inverse_bounds(ig, glen, kernel, stride, causal)
    return numpy.stack([start, end, lo, hi], axis=1).astype(numpy.int32)


def _axes(problem):
    """Per padded axis: (extent, kernel, stride, dilation, causal); inert axes pad rank 3."""
    out = [(problem.spatial[a], problem.kernel_size[a], problem.stride[a],
            problem.dilation[a], problem.is_causal[a]) for a in range(problem.rank)]
    return out + [(1, 1, 1, 1, False)] * (3 - problem.rank)


def _reach(table, extent, dilation, tile, owner_is_key):
    """Most common in-group span of gathered rows one CTA tile reaches on one axis.

    Tiles at the borders reach further (shifted windows); sizing the slab for the common
    span keeps shared memory, and so residency, at what interior tiles need: border tiles
    take two slabs.
    """
    spans = []
    for g in range(dilation):
        glen = group_size(extent, dilation, g)
        first = numpy.arange(0, glen, tile)
        last = numpy.minimum(first + tile - 1, glen - 1)
        rows_first, rows_last = table[g + dilation * first], table[g + dilation * last]
        lo = rows_first[:, 2] if owner_is_key else rows_first[:, 0]
        hi = rows_last[:, 3] if owner_is_key else rows_last[:, 1]
        spans.append(hi - lo)
    values, counts = numpy.unique(numpy.concatenate(spans), return_counts=True)
    return int(values[counts == counts.max()].max())


@functools.lru_cache(maxsize=512)
def _window_tables(axes, tile):
    """Window tables of the padded ``axes`` (``_axes``; all axes concatenated, host int32,
    read-only), their axis offsets, and the common reach volume of one CTA of ``tile`` per
    side ({owners are keys: rows})."""
    tabs = [_axis_table(*ax) for ax in axes]
    offsets = tuple(int(o) for o in numpy.cumsum([0] + [len(t) for t in tabs])[:3])
    vol = {side: math.prod(_reach(t, ax[0], ax[3], tl, side)
                           for t, ax, tl in zip(tabs, axes, tile))
           for side in (True, False)}
    table = numpy.concatenate(tabs)
    table.setflags(write=False)
    return table, offsets, vol


_device_tables = {}


def _geometry(problem, tile):
    """The window tables on the current device (uploaded once per device and geometry),
    their axis offsets, and the common reach volume of one CTA per pass."""
    import cupy

    axes = tuple(_axes(problem))
    table, offsets, vol = _window_tables(axes, tile)
    key = (axes, tile, cupy.cuda.Device().id)
    hit = _device_tables.get(key)
    if hit is None:
        hit = _device_tables[key] = cupy.asarray(table)
    return hit, offsets, vol


def _resident(dp, owner_is_key):
    """CTAs per SM that the kernels' register budget is cut for (MinBlocks in the .cu)."""
    if owner_is_key:
        return 3 if dp <= 32 else 2
    return 4 if dp <= 32 else 3 if dp <= 64 else 2


def _slab_rows(reach_volume, dp, itemsize, nwarps, owner_is_key, extra=0):
    """Rows of one gathered slab (the whole reach when it fits) and the bytes of dynamic
    shared memory: owner rows, two gathered tensors, step descriptors, lse/delta, and
    ``extra`` bytes after them (the bias parts). The budget leaves room for as many CTAs per
    SM as the registers allow (one CTA fewer with twice the slab rows measured slower:
    NOTES-fused-bwd.md, "Bias backward")."""
    budget = min(96 * 1024, SMEM_PER_SM // _resident(dp, owner_is_key) - 1024)
    row = (dp + 8) * itemsize * 2 + (8 if owner_is_key else 0)
    fixed = nwarps * 16 * (dp + 8) * itemsize * 2 + nwarps * 32 * 16 + extra
    cap = max((budget - fixed) // row, 16)
    rows = max(min(cap, reach_volume), 1)
    return int(rows), int(fixed + rows * row)


def tiles_per_axis(problem, tile):
    """CTA tiles per padded axis over the longest dilation group, ceil(ceil(L / d) / t)."""
    pad = (1,) * (3 - problem.rank)
    return [-(-(-(-L // d)) // t) for L, d, t in
            zip(problem.spatial + pad, problem.dilation + pad, tile)]


def bias_geometry(problem, tab_off, per_axis, tile=None):
    """The BiasGeom scalar of a problem with a bias: the dQ CTA's box (``_bias_box``), its
    strides, the dQ tile and tiles per axis, the window tables' axis offsets, and the dQ
    CTAs per (batch, head) of head-dim chunk 0. ``tile``: another dQ pass's query tile (the
    Hopper backward's, whose boxes ``na_bwd_fused_rpb`` reduces too; then only the fields
    that kernel reads are meaningful)."""
    g = numpy.zeros((), dtype=BIAS_GEOM)
    copies = 1 if tile else _box_copies(problem)   # (the Hopper dQ pass has no warp boxes)
    tile = tile or TILES[problem.rank][0]
    ks = tuple(problem.kernel_size) + (1,) * (3 - problem.rank)
    dim = tuple(min(2 * k - 1, k + t - 1) for k, t in zip(ks, tile))
    g["dim"] = dim
    g["bst"] = (dim[1] * dim[2], dim[2], 1)
    g["tile"] = tile
    g["ntile"] = per_axis
    g["tab_off"] = tab_off
    g["vol"] = math.prod(dim)
    g["ctas"] = math.prod(per_axis) * math.prod(problem.dilation)
    n = _bias_table_dims(problem)
    g["tst"] = (n[1] * n[2], n[2], 1)
    g["tvol"] = math.prod(n)
    wdim = _bias_box(problem, 1)
    g["wdim"] = wdim
    g["wbst"] = (wdim[1] * wdim[2], wdim[2], 1)
    g["wvol"] = math.prod(wdim)
    g["wcopies"] = copies
    return g[()]


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass (dQ, or dK/dV) of a problem: its kernel and launches besides the arrays."""
    name: str        # kernel name expression
    smem: int        # dynamic shared memory, bytes
    launches: tuple  # (grid, PassGeom) per at most MAX_GRID_Y (batch, owner head)s

    @property
    def label(self):
        return self.name.split("<")[0]


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one problem is cut (depends on the problem alone; the device adds its window
    tables, ``_geometry``, and with additional tokens ``_extra_tiling``)."""
    tile: tuple        # CTA tile per padded axis (in-group)
    dp: int            # head-dim bucket
    threads: int       # per CTA: 32 per warp
    q: Pass            # dQ (and delta, and with a bias the dQ CTAs' bias-gradient boxes)
    kv: Pass           # dK, dV
    grid_x: int        # the larger pass's grid x (2**31 and up cannot launch)
    bias: numpy.void   # BiasGeom (all zero without a bias)
    bias_boxes: int    # floats of the dQ CTAs' bias-gradient boxes (0 without a bias)
    entries: int       # bias-table entries (0 without a bias)
    rpb_parts: int     # na_bwd_rpb_boxes' CTAs per (batch, head) (``rpb_parts``; 0: one launch)
    one: Pass = None   # both passes in one launch (na_bwd_fused_one), where it may run:
    #                    its launch's geometry is (dQ PassGeom, dK/dV PassGeom, dQ CTAs)


def _tiling(problem, tiles, bias_smem):
    """The Tiling of ``tiles`` (``TILES[rank]``); ``bias_smem``: the bias parts' shared
    memory per pass (``_bias_smem``, zeros without a bias)."""
    tile, patch = tiles
    if any(x & (x - 1) for x in tile + patch):
        raise ValueError(f"tile {tile} and patch {patch} extents must be powers of two")
    bias = problem.has_rpb
    dp = _bucket(problem.head_dim)
    nwarps = math.prod(t // w for t, w in zip(tile, patch))
    per_axis = tiles_per_axis(problem, tile)
    ctas = math.prod(per_axis) * math.prod(problem.dilation)
    _, tab_off, reach = _window_tables(tuple(_axes(problem)), tile)
    geo = numpy.zeros((), dtype=PASS_GEOM)
    geo["tile"], geo["patch"], geo["ntile"] = tile, patch, per_axis
    geo["lpatch"] = tuple(int(x).bit_length() - 1 for x in patch)
    geo["tab_off"] = tab_off
    name_kv, name_q = _names(c_type(problem.dtype), dp, grouped=problem.heads_per_kv > 1,
                             bias=bias, extra=problem.has_extra)
    itemsize = numpy.dtype(problem.dtype).itemsize
    passes, grid_x = [], 0
    for name, chunk, owner_is_key in ((name_q, _q_chunk(dp, bias), False),
                                      (name_kv, _kv_chunk(dp), True)):
        # Bias parts: per gathered row, the head's table, and the dQ pass's per-warp boxes.
        slab, smem = _slab_rows(reach[owner_is_key], dp, itemsize, nwarps, owner_is_key,
                                bias_smem[owner_is_key])
        gx = ctas * (dp // chunk)
        grid_x = max(grid_x, gx)
        # Grid y: (batch, owner head): query heads for dQ, kv heads for dK/dV (each of those
        # CTAs walks its kv head's group of query heads).
        bh = problem.batch * (problem.kv_heads if owner_is_key else problem.heads)
        launches = []
        for bh0 in range(0, bh, MAX_GRID_Y):
            g = geo.copy()
            g["slab_rows"], g["bh0"] = slab, bh0
            launches.append(((gx, min(MAX_GRID_Y, bh - bh0), 1), g[()]))
        passes.append(Pass(name, smem, tuple(launches)))
    # BiasGeom's fields are int32: a launch too large to run (plan_backward says so) has none.
    bg, boxes, entries, parts = numpy.zeros((), BIAS_GEOM)[()], 0, 0, 0
    if bias and grid_x < 2 ** 31:
        bg = bias_geometry(problem, tab_off, per_axis)
        boxes = problem.batch * problem.heads * int(bg["ctas"]) * int(bg["vol"])
        entries = math.prod(2 * k - 1 for k in problem.kernel_size)
        parts = rpb_parts(problem, bg)
    return Tiling(tile, dp, 32 * nwarps, passes[0], passes[1], grid_x, bg, boxes, entries,
                  parts, _one_launch(problem, dp, passes))


def _one_name(ctype, dp):
    return f"na_bwd_fused_one<{ctype}, {dp}, {_q_chunk(dp)}, {_kv_chunk(dp)}>"


def _one_launch(problem, dp, passes):
    """The Pass of both passes in one launch, or None where that kernel does not run the
    problem: a bias, additional tokens, grouped-query heads, head dims above ONE_MAX_DIM,
    more than one launch a pass, or 2**31 CTAs and more."""
    q, kv = passes
    if (problem.has_rpb or problem.has_extra or problem.heads_per_kv > 1
            or dp > ONE_MAX_DIM or len(q.launches) != 1 or len(kv.launches) != 1):
        return None
    (gq_grid, gq), (gkv_grid, gkv) = q.launches[0], kv.launches[0]
    grid = (gq_grid[0] + gkv_grid[0], gq_grid[1], 1)
    if grid[0] >= 2 ** 31:
        return None
    return Pass(_one_name(c_type(problem.dtype), dp), max(q.smem, kv.smem),
                ((grid, (gq, gkv, numpy.uint32(gq_grid[0]))),))


def one_launch(t, limits):
    """Whether Tiling ``t`` runs as one launch on a device of ``limits`` (``DeviceLimits``):
    where its kernel may (``Tiling.one``) and every CTA of both passes is resident at once
    (the kernel's register budget and shared memory per SM). Then the dQ pass's launch and
    the dK/dV pass's wait for its last CTA (for the delta it writes) are saved; on larger
    problems the dK/dV pass's own sums of delta (o read again for every row it gathers)
    would cost more than that."""
    if t.one is None:
        return False
    (grid, _), = t.one.launches
    resident = min(ONE_RESIDENT, limits.smem_per_sm // (t.one.smem + 1024))  # (1 KB a CTA)
    return grid[0] * grid[1] <= limits.sm_count * resident


def _extra_splits(problem, dp, sms):
    """(splits, query tokens per split) of na_bwd_extra_kv: about four CTAs per SM, at least
    256 query tokens per split."""
    n = problem.num_tokens
    ctas = -(-problem.extra_tokens // (KWARPS * 16)) * (dp // _kv_chunk(dp))
    ctas *= problem.batch * problem.extra_heads
    splits = max(1, min(-(-4 * sms // ctas), n // 256, MAX_GRID_Y))
    rows = -(-n // splits)
    return -(-n // rows), rows


@dataclasses.dataclass(frozen=True)
class ExtraTiling:
    """The additional tokens' launches besides the arrays (they depend on the device's
    multiprocessor count): na_bwd_extra_kv per at most MAX_GRID_Y (batch, extra head)s,
    then na_bwd_extra_sum."""
    names: tuple     # (na_bwd_extra_kv, na_bwd_extra_sum) name expressions
    smem: int        # dynamic shared memory of na_bwd_extra_kv, bytes
    launches: tuple  # (grid, ExtraGeom) of na_bwd_extra_kv
    sum_grid: tuple
    sum_geo: numpy.void
    partials: int    # floats of the partial sums' workspace


@functools.lru_cache(maxsize=512)
def _extra_tiling(problem, sms):
    """The ExtraTiling of ``problem`` on a device of ``sms`` multiprocessors."""
    dp = _bucket(problem.head_dim)
    es = numpy.dtype(problem.dtype).itemsize
    splits, rows = _extra_splits(problem, dp, sms)
    slab, smem = _slab_rows(rows, dp, es, KWARPS, True)
    chunks = dp // _kv_chunk(dp)
    gx = -(-problem.extra_tokens // (KWARPS * 16)) * chunks
    bh = problem.batch * problem.extra_heads
    geo = numpy.zeros((), EXTRA_GEOM)
    geo["split_rows"], geo["slab_rows"], geo["splits"], geo["dp"] = rows, slab, splits, dp
    launches = []
    for bh0 in range(0, bh, MAX_GRID_Y):
        geo["bh0"] = bh0
        launches.append(((gx, min(MAX_GRID_Y, bh - bh0), splits), geo[()].copy()))
    plane = problem.batch * problem.extra_tokens * problem.extra_heads * dp
    return ExtraTiling(_extra_names(c_type(problem.dtype), dp), smem, tuple(launches),
                       (-(-2 * plane // 256), 1, 1), geo[()].copy(), 2 * splits * plane)


def _extra_calls(x, p, operands):
    """na_bwd_extra_kv and na_bwd_extra_sum of ExtraTiling ``x``, and the workspace of their
    partial sums."""
    Q, D_OUT, LSE, DELTA, XK, XV, DXK, DXV, XPART = operands
    fn = get_kernel(SOURCE, x.names[0])
    calls = [KernelCall(fn, grid, (32 * KWARPS, 1, 1),
                        (Q, D_OUT, LSE, DELTA, XK, XV, XPART, p, geo), shared_mem=x.smem,
                        name="na_bwd_extra_kv", backend="fused", tile=(KWARPS * 16,))
             for grid, geo in x.launches]
    calls.append(KernelCall(get_kernel(SOURCE, x.names[1]), x.sum_grid, (256, 1, 1),
                            (XPART, DXK, DXV, p, x.sum_geo), name="na_bwd_extra_sum",
                            backend="fused"))
    return calls, ((x.partials,), numpy.dtype(numpy.float32))


def plan_backward(problem, d_out, q, k, v, out, lse, dq, dk, dv, rpb=None, d_rpb=None,
                  xk=None, xv=None, dxk=None, dxv=None):
    """The Plan of one backward on the current device for operand layouts (in this order;
    with ``problem.has_rpb`` then rpb and d_rpb, element by element at any strides; with
    ``problem.has_extra`` (None in rpb's places) then xk, xv, dxk, dxv; then the workspaces:
    delta, with a bias the dQ CTAs' bias-gradient boxes (and where ``t.rpb_parts`` the
    partial tables of their two-launch reduction), with additional tokens the partial
    sums of their gradients), or None if an operand other than lse, rpb, d_rpb is not
    ``rows_ready``."""
    if not all(rows_ready(x) for x in (d_out, q, k, v, out, dq, dk, dv, xk, xv)
               if x is not None):
        return None
    t = configure(problem)
    if isinstance(t, str):
        raise ValueError(t)
    if t.grid_x >= 2 ** 31:
        raise ValueError(f"problem too large for one fused-backward launch ({t.grid_x} CTAs)")
    bias, tokens = problem.has_rpb, problem.has_extra
    delta = Layout.contiguous(lse.shape, numpy.float32)
    workspaces = [(delta.shape, delta.dtype)]   # delta (written by the dQ pass)
    p = make_params(problem, q=q, k=k, v=v, o=out, d_o=d_out, dq=dq, dk=dk, dv=dv, lse=lse,
                    delta=delta, rpb=rpb, d_rpb=d_rpb, xk=xk, xv=xv, dxk=dxk, dxv=dxv)
    D_OUT, Q, K, V, OUT, LSE, DQ, DK, DV = map(Operand, range(9))
    null = numpy.uint64(0)
    XK = XV = null
    if bias:
        RPB, D_RPB, DELTA, PART = map(Operand, range(9, 13))
    elif tokens:
        RPB, PART = null, null
        XK, XV, DXK, DXV, DELTA, XPART = map(Operand, range(11, 17))
    else:
        RPB, DELTA, PART = null, Operand(9), null
    tab = _geometry(problem, t.tile)[0]
    calls = []
    one = one_launch(t, _limits()) if ONE_LAUNCH is None else ONE_LAUNCH and t.one is not None
    if one:
        (grid, (gq, gkv, nq)), = t.one.launches
        call = KernelCall(get_kernel(SOURCE, t.one.name), grid, (t.threads, 1, 1),
                          (Q, K, V, D_OUT, OUT, LSE, DELTA, DQ, DK, DV, tab, p, gq, gkv, nq),
                          shared_mem=t.one.smem, name=t.one.label, backend="fused",
                          tile=t.tile)
        return Plan((call,), workspaces=tuple(workspaces))
    for ps, ptrs in ((t.q, (Q, K, V, D_OUT, OUT, LSE, DELTA, DQ, RPB, PART, t.bias, XK, XV)),
                     (t.kv, (Q, K, V, D_OUT, LSE, DELTA, DK, DV, RPB, t.bias))):
        fn = get_kernel(SOURCE, ps.name)
        calls += [KernelCall(fn, grid, (t.threads, 1, 1), (*ptrs, tab, p, geo),
                             shared_mem=ps.smem, name=ps.label, backend="fused", tile=t.tile)
                  for grid, geo in ps.launches]
    if bias:
        calls += rpb_reduction(problem, t.bias, t.rpb_parts, tab, p, PART, Operand(13), D_RPB)
        workspaces.append(((t.bias_boxes,), numpy.dtype(numpy.float32)))
        if t.rpb_parts:
            workspaces.append(rpb_tables(problem, t.rpb_parts, t.entries))
    if tokens:
        x = _extra_tiling(problem, _limits().sm_count)
        more, space = _extra_calls(x, p, (Q, D_OUT, LSE, DELTA, XK, XV, DXK, DXV, XPART))
        calls += more
        workspaces.append(space)
    return Plan(tuple(calls), workspaces=tuple(workspaces))


_limits = current_limits   # (a module name: the CPU tests stand a device in for it)


def backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None, d_rpb=None, extra=None,
             d_extra=None):
    run_backward(plan_backward, problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb, d_rpb,
                 extra, d_extra)
