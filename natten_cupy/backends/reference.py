"""Reference backend: neighborhood attention by gathering, in NumPy or CuPy.

Every op gathers, for a chunk of queries, the keys/values of each query's window through a
gather table built from the per-axis tables of ``_window`` (Cartesian product over axes, flat
spatial index), and reduces them with small batched matmuls. Backward passes never scatter:
gradients of keys and values gather, for a chunk of keys, the queries whose windows hold them
(inverse tables) and recompute the attention weights of each pair.

Chunks hold at most about ``CHUNK_BYTES`` of gathered operands, so memory stays bounded
whatever the problem size; full-size work arrays (inputs in the compute dtype, outputs
before the final cast) are the only allocations that grow with the problem. Small chunks are
faster on the CPU: they stay in cache and reuse the allocator's pages, where large ones fault
fresh pages in on every gather.

Precision: float64 computes in float64; float32, float16 and bfloat16 compute in float32 and
are cast to the output dtype at the end (lse is float32, float64 for float64 inputs).
"""

from __future__ import annotations

import functools
import math

import numpy

from .. import _window
from .._launch import region
from .._dtypes import DTYPE_NAMES, accumulator_dtype

try:
    import cupy
except ImportError:  # pragma: no cover - depends on the install
    cupy = None

NAME = "reference"
DTYPES = tuple(DTYPE_NAMES)

# Upper bound on the gathered operands alive at once in one chunk (bytes), per array module.
# On the CPU small chunks stay in cache (bench/probes/reference_w2.py times the sizes).
CHUNK_BYTES = {"numpy": 1 << 25, "cupy": 1 << 29}


def refuse(op, problem):
    """The reference backend runs every op, rank, dtype and geometry."""
    return None


def instantiations():
    return []


# ---- helpers ---------------------------------------------------------------------------

def _recorded(op):
    """On CuPy arrays, the op's array operations count as one profiler entry."""
    @functools.wraps(op)
    def run(problem, *arrays, **named):
        if cupy is None or not any(isinstance(a, cupy.ndarray) for a in arrays):
            return op(problem, *arrays, **named)
        with region(f"reference.{op.__name__} (CuPy array ops)", NAME):
            return op(problem, *arrays, **named)
    return run


def _xp(x):
    return numpy if cupy is None else cupy.get_array_module(x)


def _work(xp, x, problem, tail=None):
    """``x`` as a contiguous compute-dtype array ``[B, N, *tail]`` (copies only if needed;
    ``tail`` defaults to x's own trailing axes)."""
    ct = accumulator_dtype(problem.dtype)
    x = xp.ascontiguousarray(x.astype(ct, copy=False))
    if tail is None:
        tail = x.shape[1 + problem.rank:]
    return x.reshape((problem.batch, problem.num_tokens) + tuple(tail))


def _kv_work(xp, x, problem):
    """A key/value-side array ``[B, *spatial, H_kv, D]`` as ``[B, N, H, D]``: grouped-query
    attention written as plain multi-head attention, kv head h // heads_per_kv repeated for
    every query head h of its group (no copy beyond ``_work``'s without GQA)."""
    x = _work(xp, x, problem)
    if problem.heads_per_kv > 1:
        x = xp.repeat(x, problem.heads_per_kv, axis=2)
    return x


def _group_sum(xp, g, problem):
    """Per-query-head gradients ``[B, N, H, D]`` summed over each kv head's group of
    heads_per_kv query heads -> ``[B, N, H_kv, D]`` (the identity without GQA)."""
    if problem.heads_per_kv == 1:
        return g
    B, N, H, D = g.shape
    return g.reshape(B, N, problem.kv_heads, problem.heads_per_kv, D).sum(axis=3)


def _kv_buffer(xp, dst, problem):
    """Where a kv-side gradient is computed, ``[B, N, H, D]`` in the compute dtype: ``dst``'s
    own buffer without GQA, else a work array for ``_kv_store``."""
    if problem.heads_per_kv == 1:
        return _buffer(xp, dst, problem)
    ct = accumulator_dtype(problem.dtype)
    return xp.empty((problem.batch, problem.num_tokens, problem.heads, dst.shape[-1]), ct)


def _kv_store(xp, dst, g, problem):
    """Write the work of ``_kv_buffer`` into the kv-side gradient ``dst`` (group sums)."""
    if problem.heads_per_kv == 1:
        _store(dst, g)
        return
    dst[...] = _group_sum(xp, g, problem).reshape(dst.shape).astype(dst.dtype, copy=False)


def _buffer(xp, dst, problem):
    """Where an op computes output ``dst``, as ``[B, N, ...]`` in the compute dtype: ``dst``
    itself when it is contiguous in that dtype, else a work array for ``_store``."""
    ct = accumulator_dtype(problem.dtype)
    shape = (problem.batch, problem.num_tokens) + tuple(dst.shape[1 + problem.rank:])
    if dst.dtype == ct and dst.flags.c_contiguous:
        return dst.reshape(shape)
    return xp.empty(shape, dtype=ct)


def _store(dst, src):
    """Write ``_buffer(dst)`` into the caller's output (any strides, any dtype), unless it
    already is that output."""
    if dst.dtype == src.dtype and dst.flags.c_contiguous:
        return
    dst[...] = src.reshape(dst.shape).astype(dst.dtype, copy=False)


def _dots(gathered, x):
    """``<x_i, g_iw>`` per head: gathered ``[n, w, H, D]``, x ``[n, H, D]`` -> ``[n, H, w]``."""
    return (gathered.transpose(0, 2, 1, 3) @ x[..., None])[..., 0]


def _weighted(weights, gathered):
    """``sum_w weights_iw g_iw`` per head: ``[n, H, w]``, ``[n, w, H, D]`` -> ``[n, H, D]``."""
    return (weights[:, :, None, :] @ gathered.transpose(0, 2, 1, 3))[:, :, 0, :]


def _outer(tables, radices):
    """Row-major Cartesian product of per-axis index tables ``[n, w_a]`` -> ``[n, prod w_a]``.

    Entry ``(t_0, ..., t_{r-1})`` of the result is ``sum_a tables[a][:, t_a] * prod_{b>a}
    radices[b]``: the flat index over axes of extents ``radices``.
    """
    out = tables[0]
    for t, r in zip(tables[1:], radices[1:]):
        out = (out[:, :, None] * r + t[:, None, :]).reshape(out.shape[0], -1)
    return out


def _all(masks):
    """Cartesian AND of per-axis masks ``[n, w_a]`` -> ``[n, prod w_a]`` (row-major)."""
    out = masks[0]
    for m in masks[1:]:
        out = (out[:, :, None] & m[:, None, :]).reshape(out.shape[0], -1)
    return out


class _Tables:
    """Per-axis window tables of one problem, combined per chunk of flat spatial indices."""

    def __init__(self, problem, xp, inverse=False):
        self.xp = xp
        self.problem = problem
        self.fwd = []
        self.inv = []
        for L, k, s, d, c in zip(problem.spatial, problem.kernel_size, problem.stride,
                                 problem.dilation, problem.is_causal):
            keys, valid = _window.forward_table(L, k, s, d, c)
            rel = (keys - numpy.arange(L)[:, None]) // d + k - 1  # rpb index, valid slots
            self.fwd.append(tuple(xp.asarray(t) for t in (keys, valid, rel)))
            if inverse:
                self.inv.append(tuple(xp.asarray(t)
                                      for t in _window.inverse_table(L, k, s, d, c)))
        self.inverse_width = math.prod(t[0].shape[1] for t in self.inv) if inverse else 0

    def _coords(self, lo, hi):
        flat = self.xp.arange(lo, hi)
        return self.xp.unravel_index(flat, self.problem.spatial)

    def forward(self, lo, hi):
        """Keys of queries ``lo..hi-1``: (flat key index, valid, flat rpb index), ``[n, K]``."""
        coords = self._coords(lo, hi)
        rows = [tuple(t[c] for t in tabs) for c, tabs in zip(coords, self.fwd)]
        p = self.problem
        keys = _outer([r[0] for r in rows], p.spatial)
        valid = _all([r[1] for r in rows])
        rel = _outer([r[2] for r in rows], tuple(2 * k - 1 for k in p.kernel_size))
        return keys, valid, rel

    def inverse(self, lo, hi):
        """Queries holding keys ``lo..hi-1``: (flat query index, flat slot, valid), ``[n, M]``."""
        coords = self._coords(lo, hi)
        rows = [tuple(t[c] for t in tabs) for c, tabs in zip(coords, self.inv)]
        p = self.problem
        queries = _outer([r[0] for r in rows], p.spatial)
        slots = _outer([r[1] for r in rows], p.kernel_size)
        valid = _all([r[2] for r in rows])
        return queries, slots, valid


def _chunks(xp, problem, width, live):
    """``(lo, hi)`` ranges of flat indices so that ``live`` gathered ``[n, width, H, D]``
    operands fit in CHUNK_BYTES."""
    item = accumulator_dtype(problem.dtype).itemsize
    per_row = max(1, live * width * problem.heads * problem.head_dim * item)
    n = max(1, CHUNK_BYTES[xp.__name__] // per_row)
    N = problem.num_tokens
    for lo in range(0, N, n):
        yield lo, min(lo + n, N)


def _by_slot(xp, af):
    """Weights ``[B, N, H, K]`` as ``[B, N*K, H]``: row ``i*K + t`` is slot t of query i, so
    the inverse pass gathers (query, slot) pairs with one flat index."""
    B, N, H, K = af.shape
    return xp.ascontiguousarray(af.transpose(0, 1, 3, 2)).reshape(B, N * K, H)


def _masked(xp, valid, x, fill):
    """``x`` ``[n, H, w]`` where ``valid`` ``[n, w]`` holds, ``fill`` elsewhere."""
    return xp.where(valid[:, None, :], x, fill)


def _rel(xp, problem, queries, keys):
    """Flat rpb index (SPEC: per axis (key - query) / dilation + kernel - 1, row-major over
    [2k-1, ...]) of flat query and key indices (broadcast); meaningful where the key lies in
    the query's window, clipped into the table elsewhere (those entries are masked)."""
    qc = xp.unravel_index(queries, problem.spatial)
    kc = xp.unravel_index(keys, problem.spatial)
    flat = 0
    for a, (k, d) in enumerate(zip(problem.kernel_size, problem.dilation)):
        r = xp.clip((kc[a] - qc[a]) // d + k - 1, 0, 2 * k - 2)
        flat = flat * (2 * k - 1) + r
    return flat


def _bias_table(xp, rpb, problem, dtype):
    """rpb as ``[H, prod(2k-1)]`` in the working dtype, or None."""
    return None if rpb is None else xp.asarray(rpb).astype(dtype).reshape(problem.heads, -1)


# ---- fused -----------------------------------------------------------------------------

@_recorded
def fused_forward(problem, q, k, v, out, lse, rpb=None):
    xp = _xp(q)
    B, H, D, K = problem.batch, problem.heads, problem.head_dim, problem.num_neighbors
    qf = _work(xp, q, problem)
    kf, vf = (_kv_work(xp, x, problem) for x in (k, v))
    o, m_out = _buffer(xp, out, problem), _buffer(xp, lse, problem)
    bias = _bias_table(xp, rpb, problem, qf.dtype)
    tables = _Tables(problem, xp)
    for lo, hi in _chunks(xp, problem, K, 1):
        keys, valid, _ = tables.forward(lo, hi)
        # [n, H, K]: the bias of each query's slots (the tables' rel assumes stride 1).
        cb = None if bias is None else bias[:, _rel(xp, problem, xp.arange(lo, hi)[:, None],
                                                    keys)].transpose(1, 0, 2)
        for b in range(B):
            s = problem.scale * _dots(kf[b][keys], qf[b, lo:hi])
            if cb is not None:
                s = s + cb
            s = _masked(xp, valid, s, -xp.inf)
            m = s.max(axis=-1, keepdims=True)
            p = xp.exp(s - m)
            denom = p.sum(axis=-1, keepdims=True)
            o[b, lo:hi] = _weighted(p / denom, vf[b][keys])
            m_out[b, lo:hi] = (m + xp.log(denom))[..., 0]
    _store(out, o)
    _store(lse, m_out)


@_recorded
def fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None, d_rpb=None):
    xp = _xp(q)
    B, H, D, K = problem.batch, problem.heads, problem.head_dim, problem.num_neighbors
    scale = problem.scale
    qf, of, dof = (_work(xp, x, problem) for x in (q, out, d_out))
    kf, vf = (_kv_work(xp, x, problem) for x in (k, v))
    lf = _work(xp, lse, problem, (H,))
    delta = xp.einsum("bnhd,bnhd->bnh", dof, of)
    del of
    tables = _Tables(problem, xp, inverse=True)
    bias = _bias_table(xp, rpb, problem, qf.dtype)
    g_rpb = None if bias is None else xp.zeros_like(bias)

    # dq (and d_rpb, summed over queries): gather each query's keys and values.
    g = _buffer(xp, dq, problem)
    for lo, hi in _chunks(xp, problem, K, 1):
        keys, valid, _ = tables.forward(lo, hi)
        rel = None if bias is None else _rel(xp, problem, xp.arange(lo, hi)[:, None], keys)
        for b in range(B):
            dp = _dots(vf[b][keys], dof[b, lo:hi])
            kg = kf[b][keys]
            x = scale * _dots(kg, qf[b, lo:hi]) - lf[b, lo:hi, :, None]
            if rel is not None:
                x = x + bias[:, rel].transpose(1, 0, 2)
            p = xp.exp(_masked(xp, valid, x, -xp.inf))
            ds = p * (dp - delta[b, lo:hi, :, None])
            g[b, lo:hi] = scale * _weighted(ds, kg)
            if rel is not None:   # ds is 0 outside each window
                for h in range(H):
                    _add_at(xp, g_rpb[h], rel.ravel(), ds[:, h, :].ravel())
    _store(dq, g)
    if d_rpb is not None:
        d_rpb[...] = g_rpb.reshape(d_rpb.shape).astype(d_rpb.dtype)

    # dk, dv: gather each key's queries through the inverse table.
    gk, gv = _kv_buffer(xp, dk, problem), _kv_buffer(xp, dv, problem)
    for lo, hi in _chunks(xp, problem, tables.inverse_width, 2):
        qidx, _, valid = tables.inverse(lo, hi)
        for b in range(B):
            qg = qf[b][qidx]
            dog = dof[b][qidx]
            x = scale * _dots(qg, kf[b, lo:hi]) - lf[b][qidx].transpose(0, 2, 1)
            if bias is not None:
                x = x + bias[:, _rel(xp, problem, qidx, xp.arange(lo, hi)[:, None])
                             ].transpose(1, 0, 2)
            p = xp.exp(_masked(xp, valid, x, -xp.inf))
            ds = p * (_dots(dog, vf[b, lo:hi]) - delta[b][qidx].transpose(0, 2, 1))
            gv[b, lo:hi] = _weighted(p, dog)
            gk[b, lo:hi] = scale * _weighted(ds, qg)
    _kv_store(xp, dk, gk, problem)
    _kv_store(xp, dv, gv, problem)


def _add_at(xp, dst, index, values):
    """dst[index] += values with repeated indices summed (NumPy's ufunc.at; CuPy's
    scatter_add)."""
    if xp is numpy:
        numpy.add.at(dst, index, values)
    else:
        import cupyx
        cupyx.scatter_add(dst, index, values)


# ---- unfused ---------------------------------------------------------------------------

@_recorded
def qk(problem, q, k, rpb, attn):
    xp = _xp(q)
    B, H, D, K = problem.batch, problem.heads, problem.head_dim, problem.num_neighbors
    qf, kf = _work(xp, q, problem), _kv_work(xp, k, problem)
    bias = None
    if rpb is not None:
        bias = rpb.astype(qf.dtype).reshape(H, -1)
    a = _buffer(xp, attn, problem)
    tables = _Tables(problem, xp)
    for lo, hi in _chunks(xp, problem, K, 1):
        keys, valid, rel = tables.forward(lo, hi)
        chunk_bias = None if bias is None else bias[:, rel].transpose(1, 0, 2)
        for b in range(B):
            s = _dots(kf[b][keys], qf[b, lo:hi])
            if chunk_bias is not None:
                s = s + chunk_bias
            a[b, lo:hi] = _masked(xp, valid, s, -xp.inf)
    _store(attn, a)


@_recorded
def av(problem, attn, v, out):
    xp = _xp(v)
    B, H, D, K = problem.batch, problem.heads, problem.head_dim, problem.num_neighbors
    vf = _kv_work(xp, v, problem)
    af = _work(xp, attn, problem, (H, K))
    o = _buffer(xp, out, problem)
    tables = _Tables(problem, xp)
    for lo, hi in _chunks(xp, problem, K, 1):
        keys, valid, _ = tables.forward(lo, hi)
        for b in range(B):
            o[b, lo:hi] = _weighted(_masked(xp, valid, af[b, lo:hi], 0), vf[b][keys])
    _store(out, o)


@_recorded
def qk_backward(problem, d_attn, q, k, dq, dk, d_rpb):
    xp = _xp(q)
    B, H, D, K = problem.batch, problem.heads, problem.head_dim, problem.num_neighbors
    qf, kf = _work(xp, q, problem), _kv_work(xp, k, problem)
    daf = _work(xp, d_attn, problem, (H, K))
    tables = _Tables(problem, xp, inverse=True)
    rpb_size = math.prod(2 * kk - 1 for kk in problem.kernel_size)
    rpb_acc = None if d_rpb is None else xp.zeros(H * rpb_size, dtype=numpy.float64)
    heads = xp.arange(H)[None, :, None] * rpb_size

    g = _buffer(xp, dq, problem)
    for lo, hi in _chunks(xp, problem, K, 1):
        keys, valid, rel = tables.forward(lo, hi)
        da = _masked(xp, valid, daf[:, lo:hi], 0)  # valid [n, 1, K] broadcasts over B, H
        for b in range(B):
            g[b, lo:hi] = _weighted(da[b], kf[b][keys])
        if rpb_acc is not None:
            idx = (heads + rel[:, None, :]).ravel()
            rpb_acc += xp.bincount(idx, weights=da.sum(axis=0).ravel(),
                                   minlength=H * rpb_size)
    _store(dq, g)

    da_slots = _by_slot(xp, daf)
    del daf
    g = _kv_buffer(xp, dk, problem)
    for lo, hi in _chunks(xp, problem, tables.inverse_width, 1):
        qidx, slots, valid = tables.inverse(lo, hi)
        pairs = qidx * K + slots
        for b in range(B):
            dag = da_slots[b][pairs].transpose(0, 2, 1)
            g[b, lo:hi] = _weighted(_masked(xp, valid, dag, 0), qf[b][qidx])
    _kv_store(xp, dk, g, problem)
    if d_rpb is not None:
        d_rpb += rpb_acc.reshape(d_rpb.shape).astype(d_rpb.dtype)


@_recorded
def av_backward(problem, d_out, attn, v, d_attn, dv):
    xp = _xp(v)
    B, H, D, K = problem.batch, problem.heads, problem.head_dim, problem.num_neighbors
    vf, dof = _kv_work(xp, v, problem), _work(xp, d_out, problem)
    af = _work(xp, attn, problem, (H, K))
    tables = _Tables(problem, xp, inverse=True)

    da = _buffer(xp, d_attn, problem)
    for lo, hi in _chunks(xp, problem, K, 1):
        keys, valid, _ = tables.forward(lo, hi)
        for b in range(B):
            da[b, lo:hi] = _masked(xp, valid, _dots(vf[b][keys], dof[b, lo:hi]), 0)
    _store(d_attn, da)

    g = _kv_buffer(xp, dv, problem)
    a_slots = _by_slot(xp, af)
    del af
    for lo, hi in _chunks(xp, problem, tables.inverse_width, 1):
        qidx, slots, valid = tables.inverse(lo, hi)
        pairs = qidx * K + slots
        for b in range(B):
            ag = _masked(xp, valid, a_slots[b][pairs].transpose(0, 2, 1), 0)
            g[b, lo:hi] = _weighted(ag, dof[b][qidx])
    _kv_store(xp, dv, g, problem)
