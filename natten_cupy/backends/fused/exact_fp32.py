"""Exact-float32 fused neighborhood attention (``cuda_src/fused/exact_fp32.cu``): FFMA only, no TF32.

The kernels take the NAParams every family takes (``make_params`` of the caller's problem and
arrays, inert axes padded at the back) and a TilePlan in the problem's axis order with its
rank; each derives at entry a front-padded view of both (``front_padded`` in the .cu, the rank
a template argument), in which every problem is 3-D with the inert axes in front, so axis 2 is
the innermost real axis. Planning works in that view too (``_padded``).

A CTA of 128 threads owns a box of rows of one (batch, head, dilation group): queries for the
forward and dQ, keys for dK/dV. Lanes form groups of G; a group owns a micro-tile of rows
(1 x 4 in 1-D, 2 x 2 on the two inner axes in 2-D and 3-D; 1 x 2 for dQ) and walks only the
union of its rows' windows (inverse windows for dK/dV), so little work goes to masked pairs;
the other operand streams through shared memory in slabs of the CTA's halo. Each lane holds
16 head-dim columns of its rows (8 in dK/dV, whose rows carry four operands).

Planning (``_plan_for``): the CTA's box of micro-tiles comes from a small cost model: every
slab ends at a barrier, so a slab costs its largest group walk; boxes whose halo fits one slab,
or whose groups need the same rows of each slab (W2 forward: 2 x 128 queries, slabs of 2 halo
rows), win. Shared memory per CTA is half a multiprocessor's (two CTAs per SM, which is also
what the registers allow). It runs once per problem and device budget (``configure_forward``,
``configure_backward``, cached); the plans only bind the arrays.

Backward: delta = rowsum(dO * O), then dQ (query-parallel) and dK/dV (key-parallel, P
recomputed from lse); no atomics, so results are deterministic. Grouped-query attention:
query CTAs read their head's kv head; a dK/dV CTA owns keys of one kv head and streams the
queries of each head of its group in turn.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from ... import _window
from ..._compile import get_kernel
from ..._dtypes import FLOAT32
from ..._launch import KernelCall, Operand, Plan
from ..._operands import Layout, device_limits, rows_ready, run_backward, run_forward
from ..._params import make_params

SOURCE = "fused/exact_fp32.cu"
THREADS = 128
# Head-dim columns per lane: 16 where a lane holds 2-3 row operands (forward: q, out; dQ: q,
# dO, dQ), 8 in dK/dV (k, v, dK, dV), which would spill with 16.
FWD_COLUMNS = DQ_COLUMNS = 16
DKV_COLUMNS = 8
# Micro-tile of a lane group on (axis1, axis2) of the front-padded problem, per rank. dQ holds
# three 16-column row operands (q, dO, dQ) and takes 2 rows; forward and dK/dV take 4.
MICRO = {1: (1, 4), 2: (2, 2), 3: (2, 2)}
MICRO_DQ = (1, 2)
SMEM_BUDGET = 72 * 1024   # per CTA, when no device says more (see _smem_budget)
MAX_GRID = 65535       # heads and batch ride on grid y and z

# TilePlan of the .cu: per axis in the problem's order (inert axes, all 1, at the back), and the
# problem's rank.
PLAN_DTYPE = numpy.dtype([("cta", numpy.int32, (3,)), ("slab", numpy.int32, (3,)),
                          ("tiles", numpy.int32, (3,)), ("rank", numpy.int32)], align=True)


def refuse(problem):
    if problem.dtype != FLOAT32:
        return f"exact-float32 kernels take float32 only, got {problem.dtype_name}"
    if problem.has_rpb:
        return ("the exact-float32 kernels take no relative positional bias (rpb); "
                "allow_tf32=True runs it on tensor cores, backend 'naive' in exact float32")
    D = problem.head_dim
    if D % 4 or D > 256:
        return f"head dim must be a multiple of 4 up to 256 for exact float32, got {D}"
    if problem.heads > MAX_GRID or problem.batch > MAX_GRID:
        return (f"batch and heads must be at most {MAX_GRID}, got batch {problem.batch}, "
                f"heads {problem.heads}")
    return None


def _lanes(head_dim, columns):
    g = 1
    while g * columns < head_dim:
        g *= 2
    return g


def _row_floats(lanes, columns, micro):
    """Shared-memory row of one cell: padded head dim plus the bank pad (RowPad in the .cu)."""
    return lanes * columns + (8 if lanes == 4 and micro[1] == 2 else 4)


def _name(kernel, rank, lanes, micro):
    return f"{kernel}<{rank}, {lanes}, {micro[0]}, {micro[1]}>"


def instantiations():
    out = [(SOURCE, "na_bwd_delta_fp32")]
    for rank in (1, 2, 3):
        for lanes in (1, 2, 4, 8, 16):
            out.append((SOURCE, _name("na_bwd_dq_fp32", rank, lanes, MICRO_DQ)))
        for lanes in (1, 2, 4, 8, 16):
            out.append((SOURCE, _name("na_fwd_fp32", rank, lanes, MICRO[rank])))
        for lanes in (1, 2, 4, 8, 16, 32):
            out.append((SOURCE, _name("na_bwd_dkv_fp32", rank, lanes, MICRO[rank])))
    return out


# ---- geometry --------------------------------------------------------------------------

def _padded(problem):
    """The same problem as 3-D, inert axes (extent 1, kernel 1) in front: the kernels' view,
    in which the plan is made."""
    pad = 3 - problem.rank
    one = (1,) * pad
    return dataclasses.replace(
        problem, rank=3, spatial=one + tuple(problem.spatial),
        kernel_size=one + tuple(problem.kernel_size), stride=one + tuple(problem.stride),
        dilation=one + tuple(problem.dilation),
        is_causal=(False,) * pad + tuple(problem.is_causal))


def _reach(p3, micro):
    """Rough per-axis extent of one group's walk: its rows' window union (at most the axis)."""
    return [min(m + k + st - 2, -(-L // d)) for m, k, st, L, d in
            zip(micro, p3.kernel_size, p3.stride, p3.spatial, p3.dilation)]


def _slab_walk(cta, micro, reach, halo, slab):
    """Per group, the sum over slabs of the largest walk of any group in the slab (cells):
    slabs end at barriers, so this is what a CTA's groups take, idling included. Groups are
    modelled as interior ones (group c starts at c * micro on each axis)."""
    total = 1
    for a in range(3):
        axis = 0
        for lo in range(0, halo[a], slab[a]):
            hi = min(lo + slab[a], halo[a])
            axis += max(max(0, min(hi, c * micro[a] + reach[a]) - max(lo, c * micro[a]))
                        for c in range(cta[a]))
        total *= axis
    return total


def _choose_cta(p3, micro, groups, cells):
    """Micro-tiles per CTA along each axis (product ``groups``), by a cost model: group walks
    with barrier idling (``_slab_walk``) and rows past the extents, plus slab loads and
    barriers. Candidates are the power-of-two splits whose box does not overshoot an axis."""
    longest = [-(-L // d) for L, d in zip(p3.spatial, p3.dilation)]
    reach = _reach(p3, micro)
    shift = groups.bit_length() - 1
    best = None
    for e0 in range(shift + 1):
        for e1 in range(shift + 1 - e0):
            cta = (1 << e0, 1 << e1, 1 << (shift - e0 - e1))
            rows = [c * m for c, m in zip(cta, micro)]
            if any(c > 1 and r - m >= n for c, r, m, n in zip(cta, rows, micro, longest)):
                continue
            halo = [min((c - 1) * m + e, n) for c, m, e, n in zip(cta, micro, reach, longest)]
            slab = _slab(halo, reach, cells)
            slabs = math.prod(-(-h // x) for h, x in zip(halo, slab))
            pad = math.prod(-(-n // r) * r / n for r, n in zip(rows, longest))
            cost = (3 * groups * _slab_walk(cta, micro, reach, halo, slab) * pad
                    + 2 * math.prod(halo) + 4 * groups * slabs)
            if best is None or cost < best[0]:
                best = (cost, cta)
    if best is None:  # every split overshoots (tiny problem): all along the innermost axis
        return (1, 1, groups)
    return best[1]


def _slab(halo, reach, cells):
    """Extents of one shared-memory slab of at most ``cells`` cells covering the halo.

    The whole halo when it fits. Otherwise the halo is cut along one axis: each slab ends at
    a barrier, so a slab costs about the largest walk of any group in it; the axis is the one
    where that wastes least (``reach``: a group's walk extent per axis). Failing that, slabs
    are rows of the innermost axes. Extents are evened out (no short last slab).
    """
    if math.prod(halo) <= cells:
        return list(halo)
    best = None
    for a in (2, 1, 0):
        others = math.prod(halo) // halo[a]
        if others > cells:
            continue
        count = -(-halo[a] // (cells // others))
        extent = -(-halo[a] // count)
        waste = count * min(extent, reach[a]) / min(reach[a], halo[a])
        if best is None or waste < best[0]:
            best = (waste, a, extent)
    if best is not None:
        slab = list(halo)
        slab[best[1]] = best[2]
        return slab
    slab = [1, 1, min(halo[2], cells)]
    if slab[2] == halo[2]:
        slab[1] = min(halo[1], cells // slab[2])
    return [-(-h // -(-h // s)) for h, s in zip(halo, slab)]


def _smem_budget(device_id):
    """Shared memory one CTA may take so that two fit on a multiprocessor (1 KiB of each
    CTA's share is reserved by the hardware)."""
    limits = device_limits(device_id)
    return min(limits.smem_per_block, limits.smem_per_sm // 2 - 1024)


def _budget():
    try:
        import cupy
        return _smem_budget(cupy.cuda.Device().id)
    except Exception:  # no device (planning on a CPU machine): a conservative default
        return SMEM_BUDGET


def _in_problem_order(front, rank):
    """The TilePlan the kernels take: plan ``front`` of the front-padded problem with its axes
    back in the problem's order (axis a + 3 - rank -> a), inert axes (all 1) at the back, and
    the rank. The kernels' ``front_padded`` undoes it."""
    pad = 3 - rank
    plan = numpy.zeros((), dtype=PLAN_DTYPE)
    for field in ("cta", "slab", "tiles"):
        plan[field] = [int(x) for x in front[field][pad:]] + [1] * pad
    plan["rank"] = rank
    return plan[()]


def _plan_for(p3, micro_2d, lanes, inverse, cell_bytes, budget):
    """(plan scalar in the front-padded frame, shared-memory bytes, grid) for padded ``p3``."""
    micro = (1,) + micro_2d
    cells = max(1, budget // cell_bytes)
    cta = _choose_cta(p3, micro, THREADS // lanes, cells)
    rows = [cta[a] * micro[a] for a in range(3)]
    halo = [_window.box_span(L, k, s, d, c, r, inverse) for L, k, s, d, c, r in
            zip(p3.spatial, p3.kernel_size, p3.stride, p3.dilation, p3.is_causal, rows)]
    slab = _slab(halo, _reach(p3, micro), cells)
    tiles = [-(-(-(-L // d)) // r) for L, d, r in zip(p3.spatial, p3.dilation, rows)]
    plan = numpy.zeros((), dtype=PLAN_DTYPE)
    plan["cta"] = cta
    plan["slab"] = slab
    plan["tiles"] = tiles
    grid_x = math.prod(tiles) * math.prod(p3.dilation)
    if grid_x >= 2 ** 31:
        raise ValueError(f"problem too large for one launch ({grid_x} CTAs)")
    grid = (grid_x, p3.heads, p3.batch)
    return plan[()], math.prod(slab) * cell_bytes, grid


# ---- decisions, plans and launches ------------------------------------------------------

def _tile(plan):
    """Micro-tiles per CTA along the axes of the front-padded view (what launches record)."""
    rank = int(plan["rank"])
    return (1,) * (3 - rank) + tuple(int(c) for c in plan["cta"][:rank])


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel of a problem: everything its launch needs besides the arrays."""
    name: str          # kernel name expression
    grid: tuple
    smem: int          # dynamic shared memory, bytes
    plan: numpy.void   # TilePlan, in the problem's axis order
    tile: tuple        # micro-tiles per CTA, front-padded (``_tile``)


def _launch(problem, kernel, micro, columns, inverse, cell_extra, budget):
    """The Launch of ``kernel`` (lanes of ``columns`` head-dim columns, ``micro`` rows per
    lane group; ``inverse``: keys own the rows), its shared-memory cells two rows of float32
    and ``cell_extra`` bytes: planned on the front-padded problem, the TilePlan in
    ``problem``'s axis order (``_in_problem_order``)."""
    lanes = _lanes(problem.head_dim, columns)
    cell_bytes = 2 * 4 * _row_floats(lanes, columns, micro) + cell_extra
    front, smem, grid = _plan_for(_padded(problem), micro, lanes, inverse, cell_bytes, budget)
    plan = _in_problem_order(front, problem.rank)
    return Launch(_name(kernel, problem.rank, lanes, micro), grid, smem, plan, _tile(plan))


@dataclasses.dataclass(frozen=True)
class BackwardTiling:
    """The backward's launches of one problem besides the arrays."""
    delta_blocks: int   # grid x of na_bwd_delta_fp32
    dq: Launch
    dkv: Launch         # a CTA per kv head (it walks its query group)


@functools.lru_cache(maxsize=512)
def configure_forward(problem, budget):
    """The forward's Launch of ``problem`` under ``budget`` bytes of shared memory per CTA
    (the current device's: ``_budget``), or ``refuse``'s reason: read by ``plan_forward``.
    Raises ValueError for a launch too large for one grid."""
    why = refuse(problem)
    if why is not None:
        return why
    return _launch(problem, "na_fwd_fp32", MICRO[problem.rank], FWD_COLUMNS, False, 0, budget)


@functools.lru_cache(maxsize=512)
def configure_backward(problem, budget):
    """The backward's launches of ``problem`` (a BackwardTiling) under ``budget`` bytes of
    shared memory per CTA (the current device's: ``_budget``), or ``refuse``'s reason: read
    by ``plan_backward``. Raises ValueError for a launch too large for one grid."""
    why = refuse(problem)
    if why is not None:
        return why
    rows = problem.batch * problem.num_tokens * problem.heads
    dq = _launch(problem, "na_bwd_dq_fp32", MICRO_DQ, DQ_COLUMNS, False, 0, budget)
    dkv = _launch(problem, "na_bwd_dkv_fp32", MICRO[problem.rank], DKV_COLUMNS, True, 8,
                  budget)
    dkv = dataclasses.replace(dkv, grid=(dkv.grid[0], problem.kv_heads, dkv.grid[2]))
    return BackwardTiling(-(-rows * 8 // THREADS), dq, dkv)


def _call(launch, args, name):
    return KernelCall(get_kernel(SOURCE, launch.name), launch.grid, (THREADS, 1, 1),
                      (*args, launch.plan), shared_mem=launch.smem, name=name,
                      backend="fused", tile=launch.tile)


def plan_forward(problem, q, k, v, out, lse):
    """Plan of one forward for operand layouts (q, k, v, out, lse), or None if one of q, k,
    v, out cannot be read with 16-byte accesses as it is."""
    if not all(rows_ready(x) for x in (q, k, v, out)):
        return None
    t = configure_forward(problem, _budget())
    if isinstance(t, str):
        raise ValueError(t)
    params = make_params(problem, q=q, k=k, v=v, o=out, lse=lse)
    return Plan((_call(t, (*map(Operand, range(5)), params), "na_fwd_fp32"),))


def plan_backward(problem, d_out, q, k, v, out, lse, dq, dk, dv):
    """Plan of one backward for operand layouts (in this order; then one workspace,
    delta), or None if an operand other than lse is not ready for 16-byte accesses."""
    if not all(rows_ready(x) for x in (d_out, q, k, v, out, dq, dk, dv)):
        return None
    t = configure_backward(problem, _budget())
    if isinstance(t, str):
        raise ValueError(t)
    delta = Layout.contiguous(lse.shape, numpy.float32)
    params = make_params(problem, q=q, k=k, v=v, o=out, d_o=d_out, dq=dq, dk=dk, dv=dv,
                         lse=lse, delta=delta)
    D_OUT, Q, K, V, OUT, LSE, DQ, DK, DV, DELTA = map(Operand, range(10))
    calls = (
        KernelCall(get_kernel(SOURCE, "na_bwd_delta_fp32"), (t.delta_blocks, 1, 1),
                   (THREADS, 1, 1), (OUT, D_OUT, DELTA, params), name="na_bwd_delta_fp32",
                   backend="fused"),
        _call(t.dq, (Q, K, V, D_OUT, LSE, DELTA, DQ, params), "na_bwd_dq_fp32"),
        _call(t.dkv, (Q, K, V, D_OUT, LSE, DELTA, DK, DV, params), "na_bwd_dkv_fp32"),
    )
    return Plan(calls, workspaces=((tuple(lse.shape), numpy.dtype(numpy.float32)),))


def forward(problem, q, k, v, out, lse):
    run_forward(plan_forward, problem, q, k, v, out, lse)


def backward(problem, q, k, v, out, lse, d_out, dq, dk, dv):
    run_backward(plan_backward, problem, q, k, v, out, lse, d_out, dq, dk, dv)
