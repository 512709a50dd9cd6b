"""Naive backend: plain CUDA kernels, one thread per output element, no shared memory.

Every kernel of ``cuda_src/na_naive.cu`` is templated on the element type and the rank and
reads all geometry (kernel size, stride, dilation, causality) and every tensor's strides from
one ``NAParams``, so any input layout works without copies. Kernels loop over int64 work
indices with a grid stride: the grid launched here is only a size hint, capped well inside
CUDA's limits, which makes tensors of more than 2**31 elements safe.

Grouped-query attention: query rows read their kv head (``NAParams.heads_per_kv``); the
kernels that write dk/dv run one thread per kv-side element and loop over the group's query
heads (deterministic, no atomics). The fused kernels take a value head dim of its own
(``NAParams.v_dim``: v, out, d_out, dv).

Unfused backward of the relative positional bias runs one warp per (head, bias entry) and is
deterministic (no atomics). The fused backward allocates one float32 (float64) buffer,
``delta = rowsum(d_out * out)``, shaped like lse.
"""

from __future__ import annotations

import math

import numpy

from .._compile import get_kernel
from .._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, accumulator_dtype, c_type
from .._launch import launch
from .._params import make_params
from . import OPS

NAME = "naive"
DTYPES = tuple(d for d in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16) if d is not None)

SOURCE = "na_naive.cu"
KERNELS = ("na_qk_naive", "na_av_naive", "na_qk_bwd_dq_naive", "na_qk_bwd_dk_naive",
           "na_qk_bwd_rpb_naive", "na_av_bwd_dattn_naive", "na_av_bwd_dv_naive",
           "na_fwd_naive", "na_bwd_delta_naive", "na_bwd_dq_naive", "na_bwd_dkdv_naive",
           "na_bwd_rpb_naive")

BLOCK = 256
# 2**20 blocks of 256 threads keep every SM busy; larger problems loop (grid stride).
MAX_BLOCKS = 1 << 20
WARP = 32
_NULL = numpy.uint64(0)  # a null device pointer (no rpb)


def _chunk(dtype):
    """Head-dim elements per thread in the fused kernels (Chunk<A> in na_naive.cu)."""
    return 16 if dtype == FLOAT64 else 32


def refuse(op, problem):
    if op not in OPS:
        return f"unknown op {op!r}"
    if problem.dtype not in DTYPES:
        return f"dtype {problem.dtype_name} is not supported"
    if max(problem.spatial) >= 2 ** 31:
        return "extents of 2**31 or more do not fit the kernels' int32 coordinates"
    return None


def name_expression(kernel, problem):
    return f"{kernel}<{c_type(problem.dtype)}, {problem.rank}>"


def grid_for(threads):
    """1-D grid of BLOCK-thread blocks covering ``threads`` (capped; kernels grid-stride)."""
    return (max(1, min(-(-int(threads) // BLOCK), MAX_BLOCKS)),)


def _run(kernel, problem, threads, args):
    expr = name_expression(kernel, problem)
    launch(get_kernel(SOURCE, expr), grid_for(threads), (BLOCK,), args, name=expr,
           backend=NAME)


def _rows(problem):
    return problem.batch * problem.num_tokens * problem.heads


def _kv_rows(problem):
    """Rows of the key/value side (k, v, dk, dv: H_kv heads under grouped-query attention)."""
    return problem.batch * problem.num_tokens * problem.kv_heads


def _fused_threads(problem, rows=_rows, dim=None):
    """Work items of a fused kernel: rows x chunks of the head dim it writes (``dim``)."""
    dim = problem.head_dim if dim is None else dim
    return rows(problem) * -(-dim // _chunk(problem.dtype))


def rpb_entries(problem):
    """Entries of one relative positional bias: H * prod(2k - 1)."""
    return problem.heads * math.prod(2 * k - 1 for k in problem.kernel_size)


# ---- fused ------------------------------------------------------------------------------

def fused_forward(problem, q, k, v, out, lse, rpb=None):
    p = make_params(problem, q=q, k=k, v=v, o=out, lse=lse, rpb=rpb)
    _run("na_fwd_naive", problem, _fused_threads(problem, dim=problem.v_dim),
         (q, k, v, out, lse, _NULL if rpb is None else rpb, p))


def fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None, d_rpb=None):
    """With ``rpb``, ``d_rpb`` (rpb's shape and dtype) receives its gradient, summed in a
    float32 (float64) buffer by ``na_bwd_rpb_naive``."""
    import cupy
    # Allocated by lse's array module: CuPy here, NumPy under the CPU kernel emulator.
    xp = cupy.get_array_module(lse)
    acc = accumulator_dtype(problem.dtype)
    delta = xp.empty(lse.shape, dtype=acc)
    g_rpb = None if rpb is None else xp.zeros(rpb.shape, dtype=acc)
    p = make_params(problem, q=q, k=k, v=v, o=out, lse=lse, d_o=d_out, dq=dq, dk=dk, dv=dv,
                    delta=delta, rpb=rpb, d_rpb=g_rpb)
    bias = _NULL if rpb is None else rpb
    _run("na_bwd_delta_naive", problem, _rows(problem), (out, d_out, delta, p))
    _run("na_bwd_dq_naive", problem, _fused_threads(problem),
         (q, k, v, d_out, lse, delta, dq, bias, p))
    _run("na_bwd_dkdv_naive", problem,
         _fused_threads(problem, _kv_rows, max(problem.head_dim, problem.v_dim)),
         (q, k, v, d_out, lse, delta, dk, dv, bias, p))
    if rpb is not None:
        _run("na_bwd_rpb_naive", problem, rpb_entries(problem) * WARP,
             (q, k, v, d_out, lse, delta, rpb, g_rpb, p))
        d_rpb[...] = g_rpb.astype(d_rpb.dtype)


# ---- unfused ----------------------------------------------------------------------------

def qk(problem, q, k, rpb, attn):
    p = make_params(problem, q=q, k=k, rpb=rpb, attn=attn)
    _run("na_qk_naive", problem, _rows(problem) * problem.num_neighbors,
         (q, k, _NULL if rpb is None else rpb, attn, p))


def av(problem, attn, v, out):
    p = make_params(problem, attn=attn, v=v, o=out)
    _run("na_av_naive", problem, _rows(problem) * problem.head_dim, (attn, v, out, p))


def qk_backward(problem, d_attn, q, k, dq, dk, d_rpb):
    p = make_params(problem, d_attn=d_attn, q=q, k=k, dq=dq, dk=dk, d_rpb=d_rpb)
    _run("na_qk_bwd_dq_naive", problem, _rows(problem) * problem.head_dim, (d_attn, k, dq, p))
    _run("na_qk_bwd_dk_naive", problem, _kv_rows(problem) * problem.head_dim, (d_attn, q, dk, p))
    if d_rpb is not None:
        _run("na_qk_bwd_rpb_naive", problem, rpb_entries(problem) * WARP, (d_attn, d_rpb, p))


def av_backward(problem, d_out, attn, v, d_attn, dv):
    p = make_params(problem, d_o=d_out, attn=attn, v=v, d_attn=d_attn, dv=dv)
    _run("na_av_bwd_dattn_naive", problem, _rows(problem) * problem.num_neighbors,
         (d_out, v, d_attn, p))
    _run("na_av_bwd_dv_naive", problem, _kv_rows(problem) * problem.head_dim,
         (attn, d_out, dv, p))


def instantiations():
    """Every (source, name_expression) this backend may compile: kernel x dtype x rank."""
    return [(SOURCE, f"{kernel}<{c_type(dtype)}, {rank}>")
            for kernel in KERNELS for dtype in DTYPES for rank in (1, 2, 3)]
