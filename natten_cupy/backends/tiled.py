"""Tiled backend: the unfused ops (qk, av and their backward) on tensor cores.

The kernels of ``cuda_src/na_tiled.cu`` give each warp a compact 16-row patch (1-D 16,
2-D 4x4, 3-D 1x4x4, in dilation-group coordinates) of one batch and several heads, and walk
the halo of columns its rows reach with ``mma.sync``; the window arithmetic of a block of
columns is done once and reused for every head. Four ops reduce to two kernels and a
reduction (the softmax between qk and av is ``natten_cupy.softmax``):

* scores ``out[i, t] = <A_i, B_j(i, t)>``: qk (q, k -> attn, + rpb, empty causal slots -inf)
  and av_backward's d_attn (d_out, v -> d_attn, empty slots 0);
* weighted sums ``out_r = sum_c W(r, c) X_c`` over the window (av: attn, v; dq: d_attn, k) or
  over the inverse window (dv: attn, d_out; dk: d_attn, q);
* the rpb gradient: per-CTA shared-memory partial sums, one float32 atomicAdd per (head,
  offset) and CTA (not bitwise deterministic).

float16/bfloat16 run on f16/bf16 tensor cores, float32 on TF32 tensor cores when the caller
allows TF32, otherwise in exact float32 with FMAs on the same tiles (``EXACT`` kernels).
Head dims: multiples of 8 up to 256. Grouped-query attention: k, v are read at each query
head's kv head; the inverse sums (dk, dv) run warps over kv heads that add up their group's
query heads in turn (deterministic).
q/k/v-like tensors are read and written with 16-byte accesses along the head dim: a tensor
whose head dim is not contiguous, or whose other strides break that alignment, goes through
a contiguous copy. attn, d_attn, rpb and d_rpb are accessed element-wise with any strides.
"""

from __future__ import annotations

import math

import numpy

from .._compile import get_kernel
from .._dtypes import FLOAT32, HALF_TYPES, c_type
from .._launch import KernelCall, Operand, Plan, launch, run_plan_on
from .._operands import (arch_refusal, copy_back, layout_of, ready_inputs, rows_ready,
                         writable_outputs)
from .._params import make_params
from . import OPS

NAME = "tiled"
DTYPES = HALF_TYPES + (FLOAT32,)

SOURCE = "na_tiled.cu"
WARPS = 4              # warps per CTA (kWarps in na_tiled.cu)
MAX_HEAD_DIM = 256
SCORE_CHUNKS = (1, 2, 4, 8)          # head dim in chunks of 32 (scores kernel)
SCORE_HEADS = 8                      # most heads per warp of the scores kernel
# Heads whose fragment loads the scores kernel issues together (HP), by "is float32" (TF32:
# one, since more cost a CTA per SM in registers). Timings: NOTES-tiled.md, "Constants".
SCORE_BATCH = {False: 2, True: 1}
STAGE_BYTES = 16384                  # shared memory per warp for staged scores
WEIGHT_STAGE_BYTES = 24576           # shared memory per warp for staged weights (av, dq)
SLICE_TILES = {True: (4, 8), False: (4, 8, 16)}   # n-tiles per head-dim slice, by "is float32"
# Heads per warp of the exact-fp32 weighted sums, by "inverse" (NOTES-tiled.md, "Constants").
EXACT_HEADS = {False: 1, True: 2}
# Accumulators a lane of the tensor-core weighted sums holds (HB * NT * 4), by (is float32,
# inverse). 32 leaves room for 3 CTAs an SM, which pays except for the f16 inverse sums
# (NOTES-tiled.md, "Constants").
TC_ACCUMULATORS = {(False, False): 32, (False, True): 64, (True, False): 32, (True, True): 32}
RPB_BLOCK = 256
RPB_SMEM_FLOATS = 12288              # 48 KiB of partial sums per pass
RPB_CTAS = 2048                      # CTAs of one rpb-gradient pass, over all heads
_NULL = numpy.uint64(0)              # a null device pointer (no rpb)
_UNFUSED = ("qk", "av", "qk_backward", "av_backward")

# tiled::ScoresArgs, tiled::WeightedArgs and tiled::RpbGradArgs of na_tiled.cu, field for
# field (the launch arguments of each kernel besides its pointers and NAParams).
SCORES_ARGS = numpy.dtype([("fill", numpy.float32), ("heads_per_warp", numpy.int32),
                           ("staged", numpy.int32)], align=True)
WEIGHTED_ARGS = numpy.dtype([("staged", numpy.int32)], align=True)
RPB_GRAD_ARGS = numpy.dtype([("rows_per_cta", numpy.int64), ("r_begin", numpy.int32),
                             ("r_count", numpy.int32)], align=True)


def refuse(op, problem):
    if op not in OPS:
        return f"unknown op {op!r}"
    if op not in _UNFUSED:
        return "the tiled backend runs only the unfused ops (qk, av and their backward)"
    if problem.dtype not in DTYPES:
        return f"dtype {problem.dtype_name} is not supported (float16, bfloat16, float32)"
    d = problem.head_dim
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head dim {d} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    if any(s != 1 for s in problem.stride):
        return f"unfused ops take stride 1, got {problem.stride}"
    if max(problem.spatial) >= 2 ** 31:
        return "extents of 2**31 or more do not fit the kernels' int32 coordinates"
    if op == "qk_backward" and problem.heads > 65535:
        return f"{problem.heads} heads exceed the rpb-gradient grid (65535)"
    return arch_refusal("the tiled backend")


# ---- configuration -----------------------------------------------------------------------

def _is_f32(problem):
    return problem.dtype == FLOAT32


def _exact(problem):
    """Exact float32 (FMA) kernels: float32 without TF32."""
    return _is_f32(problem) and not problem.allow_tf32


def _cbool(flag):
    return "true" if flag else "false"


def score_chunks(problem):
    """Chunks of 32 head-dim elements the scores kernel is compiled for (DC)."""
    need = _ceil_div(problem.head_dim, 32)
    return next(c for c in SCORE_CHUNKS if c >= need)


def slice_tiles(problem):
    """n-tiles per warp of the weighted-sum kernel (NT): 8 * NT head-dim elements a warp."""
    tiles = SLICE_TILES[_is_f32(problem)]
    return next((t for t in tiles if 8 * t >= problem.head_dim), tiles[-1])


def patch_shape(rank):
    """Rows of one warp per axis (product 16), matching setup_warp in na_tiled.cu."""
    return {1: (16,), 2: (4, 4), 3: (1, 4, 4)}[rank]


def _ceil_div(a, b):
    return -(-a // b)


def num_patches(problem):
    """Warp patches per (batch, head): per axis, dilation groups x patches of the longest."""
    total = 1
    for L, d, w in zip(problem.spatial, problem.dilation, patch_shape(problem.rank)):
        total *= d * _ceil_div(_ceil_div(L, d), w)
    return total


def _grid(problem, heads_per_warp, slices=1, heads=None):
    """CTAs covering every (batch, patch, head group, head-dim slice) warp; ``heads``: of the
    rows (default the query heads; the inverse sums' rows are kv heads)."""
    groups = _ceil_div(problem.heads if heads is None else heads, heads_per_warp)
    warps = problem.batch * num_patches(problem) * groups * slices
    return (_ceil_div(warps, WARPS),)


# ---- operands ----------------------------------------------------------------------------

# ---- kernels -----------------------------------------------------------------------------

def score_batch(problem):
    """HP of the scores kernel: heads whose fragment loads go out together (1 in exact fp32,
    whose FMA path runs one head at a time)."""
    return 1 if _exact(problem) else SCORE_BATCH[_is_f32(problem)]


def _scores_expr(problem):
    return (f"natten::tiled::na_tiled_scores<{c_type(problem.dtype)}, {score_chunks(problem)}, "
            f"{_cbool(_exact(problem))}, {score_batch(problem)}>")


def weighted_heads(problem, inverse):
    """Heads per warp of the weighted sums (HB): TC_ACCUMULATORS[...] // (4 * NT) on tensor
    cores (at least 1), EXACT_HEADS[inverse] in exact float32."""
    if _exact(problem):
        return EXACT_HEADS[inverse]
    return _tc_heads(slice_tiles(problem), _is_f32(problem), inverse)


def _tc_heads(nt, is_f32, inverse):
    return max(1, TC_ACCUMULATORS[is_f32, inverse] // (4 * nt))


def _weighted_expr(problem, inverse):
    return (f"natten::tiled::na_tiled_weighted<{c_type(problem.dtype)}, "
            f"{slice_tiles(problem)}, {_cbool(inverse)}, {_cbool(_exact(problem))}, "
            f"{weighted_heads(problem, inverse)}>")


def _rpb_expr(problem):
    return f"natten::tiled::na_tiled_rpb_grad<{c_type(problem.dtype)}>"


def score_heads(problem):
    """(heads per warp, staged) of the scores kernel.

    Staged scores need 16 rows x heads x K elements of shared memory per warp; when not even
    one head fits in STAGE_BYTES the kernel stores scores straight to attn instead.
    """
    per_head = 16 * problem.num_neighbors * problem.dtype.itemsize
    most = min(SCORE_HEADS, STAGE_BYTES // per_head) or SCORE_HEADS
    groups = _ceil_div(problem.heads, most)  # balanced: 8 heads, at most 6 -> 2 x 4
    return _ceil_div(problem.heads, groups), STAGE_BYTES >= per_head


def _scores_call(problem, a, b, rpb, out, fill, slots):
    """KernelCall of out[i, t] = <a_i, b_j(i, t)> (+ rpb) for layouts a, b, rpb (or None),
    out; ``slots``: their Operand indices (rpb's None when absent)."""
    p = make_params(problem, q=a, k=b, rpb=rpb, attn=out)
    heads, staged = score_heads(problem)
    smem = WARPS * 16 * heads * problem.num_neighbors * problem.dtype.itemsize if staged else 0
    expr = _scores_expr(problem)
    sa, sb, sr, so = (None if i is None else Operand(i) for i in slots)
    grid = _grid(problem, heads) + (1, 1)
    args = numpy.zeros((), SCORES_ARGS)[()]
    args["fill"], args["heads_per_warp"], args["staged"] = fill, heads, staged
    return KernelCall(get_kernel(SOURCE, expr), grid, (32 * WARPS, 1, 1),
                      (sa, sb, _NULL if sr is None else sr, so, args, p),
                      shared_mem=smem, name=expr, backend=NAME)


def weight_stage_bytes(problem):
    """Shared memory per warp of the forward weighted sums (0: gather from global memory).

    A warp runs weighted_heads() heads (HB in na_tiled.cu) and stages 16 rows of K weights
    each.
    """
    heads = weighted_heads(problem, False)
    size = 16 * heads * problem.num_neighbors * problem.dtype.itemsize
    return size if size <= WEIGHT_STAGE_BYTES else 0


def _weighted_call(problem, weights, x, out, inverse, slots):
    """KernelCall of out_r = sum of weights * x over the window (or inverse window) of r,
    for layouts weights, x, out at Operand indices ``slots``."""
    p = make_params(problem, attn=weights, v=x, o=out)
    tiles = slice_tiles(problem)
    slices = _ceil_div(problem.head_dim, 8 * tiles)
    stage = 0 if inverse else weight_stage_bytes(problem)
    expr = _weighted_expr(problem, inverse)
    grid = _grid(problem, weighted_heads(problem, inverse), slices,
                 problem.kv_heads if inverse else problem.heads) + (1, 1)
    sw, sx, so = map(Operand, slots)
    args = numpy.zeros((), WEIGHTED_ARGS)[()]
    args["staged"] = stage > 0
    return KernelCall(get_kernel(SOURCE, expr), grid, (32 * WARPS, 1, 1),
                      (sw, sx, so, args, p), shared_mem=WARPS * stage,
                      name=expr, backend=NAME)


def _rpb_grad(problem, d_attn, d_rpb):
    p = make_params(problem, d_attn=d_attn, d_rpb=d_rpb)
    offsets = math.prod(2 * k - 1 for k in problem.kernel_size)
    rows = problem.batch * problem.num_tokens
    ctas = max(1, min(_ceil_div(rows, 64), RPB_CTAS // problem.heads))
    rows_per_cta = _ceil_div(rows, ctas)
    grid = (_ceil_div(rows, rows_per_cta), problem.heads)
    expr = _rpb_expr(problem)
    fn = get_kernel(SOURCE, expr)
    for begin in range(0, offsets, RPB_SMEM_FLOATS):
        count = min(RPB_SMEM_FLOATS, offsets - begin)
        args = numpy.zeros((), RPB_GRAD_ARGS)[()]
        args["rows_per_cta"], args["r_begin"], args["r_count"] = rows_per_cta, begin, count
        launch(fn, grid, (RPB_BLOCK,), (d_attn, d_rpb, args, p),
               shared_mem=4 * count, name=expr, backend=NAME)


# ---- plans of the four unfused ops ---------------------------------------------------------

# Per op: the operands in call order (inputs, then outputs) and which inputs the kernels read
# by 16-byte rows (the others, attn / d_attn / rpb, are read element-wise with any strides).
OPERANDS = {"qk": ("q", "k", "rpb", "attn"), "av": ("attn", "v", "out"),
            "qk_backward": ("d_attn", "q", "k", "dq", "dk"),
            "av_backward": ("d_out", "attn", "v", "d_attn", "dv")}
ROW_INPUTS = {"qk": (0, 1), "av": (1,), "qk_backward": (1, 2), "av_backward": (0, 2)}
ROW_OUTPUTS = {"qk": (), "av": (2,), "qk_backward": (3, 4), "av_backward": (4,)}


def plan(op, problem, layouts):
    """The Plan of unfused ``op`` for operand layouts in ``OPERANDS[op]`` order (rpb may be
    None), or None if a row operand is not ``rows_ready`` (or, for qk_backward, the rpb
    gradient is asked for: it runs through ``qk_backward`` below)."""
    if not all(rows_ready(layouts[i]) for i in ROW_INPUTS[op] + ROW_OUTPUTS[op]):
        return None
    if op == "qk":
        q, k, rpb, attn = layouts
        slots = (0, 1, None if rpb is None else 2, 3)
        return Plan((_scores_call(problem, q, k, rpb, attn, -numpy.inf, slots),))
    if op == "av":
        attn, v, out = layouts
        return Plan((_weighted_call(problem, attn, v, out, False, (0, 1, 2)),))
    if op == "qk_backward":
        d_attn, q, k, dq, dk = layouts
        return Plan((_weighted_call(problem, d_attn, k, dq, False, (0, 2, 3)),
                     _weighted_call(problem, d_attn, q, dk, True, (0, 1, 4))))
    d_out, attn, v, d_attn, dv = layouts
    return Plan((_scores_call(problem, d_out, v, None, d_attn, 0.0, (0, 2, None, 3)),
                 _weighted_call(problem, attn, d_out, dv, True, (1, 0, 4))))


def _run(op, problem, arrays):
    """Run ``op`` on CuPy arrays (OPERANDS order): stand-ins for row operands that are not
    ready (contiguous copies in, temporaries out), then the plan."""
    arrays = list(arrays)
    for i in ROW_INPUTS[op]:
        (arrays[i],) = ready_inputs((arrays[i],))
    outputs = [arrays[i] for i in ROW_OUTPUTS[op]]
    written = writable_outputs(outputs)
    for i, w in zip(ROW_OUTPUTS[op], written):
        arrays[i] = w
    layouts = [None if x is None else layout_of(x) for x in arrays]
    run_plan_on(plan(op, problem, layouts), arrays)
    copy_back(outputs, written)


def qk(problem, q, k, rpb, attn):
    _run("qk", problem, (q, k, rpb, attn))


def av(problem, attn, v, out):
    _run("av", problem, (attn, v, out))


def qk_backward(problem, d_attn, q, k, dq, dk, d_rpb):
    _run("qk_backward", problem, (d_attn, q, k, dq, dk))
    if d_rpb is not None:
        _rpb_grad(problem, d_attn, d_rpb)


def av_backward(problem, d_out, attn, v, d_attn, dv):
    _run("av_backward", problem, (d_out, attn, v, d_attn, dv))


def instantiations():
    """Every (source, name_expression) this backend may compile."""
    out = []
    for dtype in DTYPES:
        ct = c_type(dtype)
        for exact in ((False, True) if dtype == FLOAT32 else (False,)):
            ex = _cbool(exact)
            hp = 1 if exact else SCORE_BATCH[dtype == FLOAT32]
            out += [(SOURCE, f"natten::tiled::na_tiled_scores<{ct}, {dc}, {ex}, {hp}>")
                    for dc in SCORE_CHUNKS]
            for nt in SLICE_TILES[dtype == FLOAT32]:
                for inv in (False, True):
                    hb = EXACT_HEADS[inv] if exact else _tc_heads(nt, dtype == FLOAT32, inv)
                    out.append((SOURCE, f"natten::tiled::na_tiled_weighted<{ct}, {nt}, "
                                        f"{_cbool(inv)}, {ex}, {hb}>"))
        out.append((SOURCE, f"natten::tiled::na_tiled_rpb_grad<{ct}>"))
    return out
