"""Test oracle: dense neighborhood attention in float64 with an explicit boolean mask.

Written straight from SPEC section 1 with plain Python loops over coordinates; it does not
import ``natten_cupy._window`` (that module is what the oracle checks). Problems are small
(a few hundred tokens), so every op is a dense ``[N, N]`` computation per batch and head:
the mask, or the slot table of the unfused ops, is the only place the window rules enter.

Arrays are NumPy, canonical layout ``[B, *spatial, H, D]``; results are float64.
"""

from __future__ import annotations

import itertools
import math

import numpy

__all__ = ["axis_window", "axis_keys", "neighborhood_mask", "slot_table", "fused_forward",
           "fused_forward_rows", "fused_backward", "qk", "av", "qk_backward", "av_backward",
           "dense_attention"]


# ---- window rules (SPEC section 1), one axis, plain ints --------------------------------

def axis_window(i, L, k, s, d, causal):
    """Dilation group ``g`` of query ``i`` and its in-group window ``[start, end)``."""
    g, ip = i % d, i // d
    group_len = -(-(L - g) // d)          # ceil((L - g) / d)
    lam = k // 2
    if causal:
        leader = min((ip // s) * s + s - 1, group_len - 1)
        return g, max(leader - k + 1, 0), ip + 1
    leader = min((ip // s) * s + s // 2, group_len - 1)
    start = min(max(leader - lam, 0), group_len - k)
    return g, start, start + k


def axis_keys(i, L, k, s, d, causal):
    """Coordinates of the keys query ``i`` sees on one axis, ascending."""
    g, start, end = axis_window(i, L, k, s, d, causal)
    return [g + d * jp for jp in range(start, end)]


def axis_slots(i, L, k, d, causal):
    """Unfused slots of query ``i`` (stride 1): key coordinate per slot, None if empty."""
    g, start, end = axis_window(i, L, k, 1, d, causal)
    return [g + d * (start + t) if start + t < end else None for t in range(k)]


def _per_axis(value, rank):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * rank


def _flat(coord, spatial):
    f = 0
    for c, L in zip(coord, spatial):
        f = f * L + c
    return f


def neighborhood_mask(spatial, kernel, stride=1, dilation=1, causal=False):
    """``mask[i, j]``: flat query i sees flat key j (Cartesian product of per-axis keys)."""
    n = len(spatial)
    kernel, stride = _per_axis(kernel, n), _per_axis(stride, n)
    dilation, causal = _per_axis(dilation, n), _per_axis(causal, n)
    N = math.prod(spatial)
    mask = numpy.zeros((N, N), dtype=bool)
    for qc in itertools.product(*(range(L) for L in spatial)):
        per_axis = [axis_keys(i, L, k, s, d, c)
                    for i, L, k, s, d, c in zip(qc, spatial, kernel, stride, dilation, causal)]
        for kc in itertools.product(*per_axis):
            mask[_flat(qc, spatial), _flat(kc, spatial)] = True
    return mask


def slot_table(spatial, kernel, dilation=1, causal=False):
    """Unfused slot tables ``(key, rel)``, each ``[N, K]`` int.

    ``key[i, t]`` is the flat key in slot t (row-major over per-axis slots) or -1 if empty;
    ``rel[i, t]`` the flat index into ``rpb[h]`` of shape ``(2k_0-1, ...)`` (-1 if empty).
    """
    n = len(spatial)
    kernel, dilation, causal = (_per_axis(x, n) for x in (kernel, dilation, causal))
    N, K = math.prod(spatial), math.prod(kernel)
    key = numpy.full((N, K), -1, dtype=numpy.int64)
    rel = numpy.full((N, K), -1, dtype=numpy.int64)
    rpb_shape = tuple(2 * k - 1 for k in kernel)
    for qc in itertools.product(*(range(L) for L in spatial)):
        per_axis = [axis_slots(i, L, k, d, c)
                    for i, L, k, d, c in zip(qc, spatial, kernel, dilation, causal)]
        for t, kc in enumerate(itertools.product(*per_axis)):
            if any(c is None for c in kc):
                continue
            key[_flat(qc, spatial), t] = _flat(kc, spatial)
            offset = tuple((j - i) // d + k - 1
                           for i, j, d, k in zip(qc, kc, dilation, kernel))
            rel[_flat(qc, spatial), t] = _flat(offset, rpb_shape)
    return key, rel


# ---- dense helpers ---------------------------------------------------------------------

def _bnhd(x):
    """[B, *spatial, H, D] -> float64 [B, H, N, D]."""
    x = numpy.asarray(x, dtype=numpy.float64)
    B, H, D = x.shape[0], x.shape[-2], x.shape[-1]
    return x.reshape(B, -1, H, D).transpose(0, 2, 1, 3)


def _back(x, shape):
    """float64 [B, H, N, D] -> [B, *spatial, H, D] of ``shape``."""
    return numpy.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(shape)


def _softmax(logits, mask):
    s = numpy.where(mask, logits, -numpy.inf)
    m = s.max(axis=-1, keepdims=True)
    e = numpy.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    return e / z, (m + numpy.log(z))[..., 0]


def dense_attention(q, k, v, scale=None):
    """Plain softmax self-attention over all tokens: (out, lse)."""
    N = math.prod(q.shape[1:-2])
    return _fused(q, k, v, numpy.ones((N, N), dtype=bool), scale)


def _fused(q, k, v, mask, scale):
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    qh, kh, vh = _bnhd(q), _bnhd(k), _bnhd(v)
    p, lse = _softmax(scale * qh @ kh.transpose(0, 1, 3, 2), mask)
    out = _back(p @ vh, q.shape[:-1] + v.shape[-1:])   # values may have their own head dim
    return out, lse.transpose(0, 2, 1).reshape(q.shape[:-1])


# ---- fused ops -------------------------------------------------------------------------

def fused_forward(q, k, v, kernel, stride=1, dilation=1, causal=False, scale=None):
    """(out, lse) in float64; lse in natural log."""
    mask = neighborhood_mask(q.shape[1:-2], kernel, stride, dilation, causal)
    return _fused(q, k, v, mask, scale)


def fused_forward_rows(q, k, v, rows, kernel, stride=1, dilation=1, causal=False, scale=None):
    """(out, lse) in float64 of the flat queries ``rows`` alone: ``[B, len(rows), H, Dv]`` and
    ``[B, len(rows), H]``.

    For problems too large for ``fused_forward``'s dense ``[N, N]`` mask (the device probes
    check full-size problems on their first queries): the same window rules, per query the
    Cartesian product of ``axis_keys``, and the softmax over the keys those queries see.
    """
    spatial = q.shape[1:-2]
    n = len(spatial)
    kernel, stride = _per_axis(kernel, n), _per_axis(stride, n)
    dilation, causal = _per_axis(dilation, n), _per_axis(causal, n)
    rows = [int(r) for r in rows]
    seen = []
    for r in rows:
        qc = numpy.unravel_index(r, spatial)
        per_axis = [axis_keys(int(i), L, kk, s, d, c)
                    for i, L, kk, s, d, c in zip(qc, spatial, kernel, stride, dilation, causal)]
        grid = numpy.meshgrid(*per_axis, indexing="ij")
        seen.append(numpy.ravel_multi_index(grid, spatial).ravel())
    keys = numpy.unique(numpy.concatenate(seen))
    mask = numpy.zeros((len(rows), len(keys)), dtype=bool)
    for i, flat_keys in enumerate(seen):
        mask[i, numpy.searchsorted(keys, flat_keys)] = True

    def tokens(x, index):   # [B, *spatial, H, D] -> float64 [B, len(index), H, D]
        x = numpy.asarray(x)
        return x.reshape(x.shape[0], -1, *x.shape[-2:])[:, index].astype(numpy.float64)
    return _fused(tokens(q, rows), tokens(k, keys), tokens(v, keys), mask, scale)


def fused_backward(d_out, q, k, v, kernel, stride=1, dilation=1, causal=False, scale=None):
    """(dq, dk, dv) by the explicit softmax-attention gradient formulas, float64."""
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    mask = neighborhood_mask(q.shape[1:-2], kernel, stride, dilation, causal)
    qh, kh, vh, doh = _bnhd(q), _bnhd(k), _bnhd(v), _bnhd(d_out)
    p, _ = _softmax(scale * qh @ kh.transpose(0, 1, 3, 2), mask)
    out = p @ vh
    dp = doh @ vh.transpose(0, 1, 3, 2)
    ds = p * (dp - (doh * out).sum(axis=-1, keepdims=True))
    dq = scale * ds @ kh
    dk = scale * ds.transpose(0, 1, 3, 2) @ qh
    dv = p.transpose(0, 1, 3, 2) @ doh
    return _back(dq, q.shape), _back(dk, k.shape), _back(dv, v.shape)


def _dense_bias(spatial, kernel, dilation, causal, rpb):
    """[H, N, N] float64: rpb's entry for every (query, key) pair of a window, 0 elsewhere,
    and the ``(key, rel)`` slot tables it came from."""
    key, rel = slot_table(spatial, kernel, dilation, causal)
    r = numpy.asarray(rpb, dtype=numpy.float64).reshape(rpb.shape[0], -1)
    N = key.shape[0]
    dense = numpy.zeros((r.shape[0], N, N))
    rows, slots = numpy.nonzero(key >= 0)
    dense[:, rows, key[rows, slots]] = r[:, rel[rows, slots]]
    return dense, key, rel


def fused_forward_rpb(q, k, v, rpb, kernel, dilation=1, causal=False, scale=None):
    """(out, lse) in float64 with a relative positional bias (stride 1)."""
    spatial = q.shape[1:-2]
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    mask = neighborhood_mask(spatial, kernel, 1, dilation, causal)
    bias, _, _ = _dense_bias(spatial, kernel, dilation, causal, rpb)
    qh, kh, vh = _bnhd(q), _bnhd(k), _bnhd(v)
    p, lse = _softmax(scale * qh @ kh.transpose(0, 1, 3, 2) + bias, mask)
    return (_back(p @ vh, q.shape[:-1] + v.shape[-1:]),
            lse.transpose(0, 2, 1).reshape(q.shape[:-1]))


def fused_backward_rpb(d_out, q, k, v, rpb, kernel, dilation=1, causal=False, scale=None):
    """(dq, dk, dv, d_rpb) in float64 with a relative positional bias (stride 1); d_rpb
    sums dS over every (batch, query, key) pair at each offset."""
    spatial = q.shape[1:-2]
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    mask = neighborhood_mask(spatial, kernel, 1, dilation, causal)
    bias, key, rel = _dense_bias(spatial, kernel, dilation, causal, rpb)
    qh, kh, vh, doh = _bnhd(q), _bnhd(k), _bnhd(v), _bnhd(d_out)
    p, _ = _softmax(scale * qh @ kh.transpose(0, 1, 3, 2) + bias, mask)
    out = p @ vh
    ds = p * (doh @ vh.transpose(0, 1, 3, 2) - (doh * out).sum(axis=-1, keepdims=True))
    d_rpb = numpy.zeros((rpb.shape[0], math.prod(rpb.shape[1:])))
    rows, slots = numpy.nonzero(key >= 0)
    numpy.add.at(d_rpb.T, rel[rows, slots], ds.sum(axis=0)[:, rows, key[rows, slots]].T)
    return (_back(scale * ds @ kh, q.shape), _back(scale * ds.transpose(0, 1, 3, 2) @ qh, k.shape),
            _back(p.transpose(0, 1, 3, 2) @ doh, v.shape), d_rpb.reshape(rpb.shape))


def _repeat_heads(x, heads):
    """float64 [B, N, H_kv, D] (any leading token axes) repeated to ``heads`` heads."""
    x = numpy.asarray(x, dtype=numpy.float64)
    return numpy.repeat(x, heads // x.shape[-2], axis=-2)


def _sum_heads(g, heads_kv):
    """[..., H, D] gradients summed over each group of H / heads_kv query heads."""
    *lead, H, D = g.shape
    return g.reshape(*lead, heads_kv, H // heads_kv, D).sum(axis=-2)


def _with_extra(q, k, v, xk, xv, kernel, stride, dilation, causal):
    """Keys [B, N + T, H, D] (k's heads and xk's repeated to q's), values, and the mask
    [N, N + T] of every query's window plus the T extra tokens."""
    spatial, H = q.shape[1:-2], q.shape[-2]
    B, N = q.shape[0], math.prod(spatial)
    flat = lambda x: _repeat_heads(numpy.asarray(x).reshape(B, N, *x.shape[-2:]), H)
    keys = numpy.concatenate([flat(k), _repeat_heads(xk, H)], axis=1)
    values = numpy.concatenate([flat(v), _repeat_heads(xv, H)], axis=1)
    mask = numpy.concatenate([neighborhood_mask(spatial, kernel, stride, dilation, causal),
                              numpy.ones((N, xk.shape[1]), dtype=bool)], axis=1)
    return keys, values, mask


def fused_forward_extra(q, k, v, xk, xv, kernel, stride=1, dilation=1, causal=False,
                        scale=None):
    """(out, lse) in float64 of attention over each query's window and the additional
    tokens ``xk``, ``xv`` ``[B, T, H_x, D]`` (k, v and the extra heads may be fewer than q's:
    grouped-query attention)."""
    keys, values, mask = _with_extra(q, k, v, xk, xv, kernel, stride, dilation, causal)
    B, N = q.shape[0], mask.shape[0]
    out, lse = _fused(numpy.asarray(q).reshape(B, N, *q.shape[-2:]), keys, values, mask, scale)
    return out.reshape(q.shape[:-1] + xv.shape[-1:]), lse.reshape(q.shape[:-1])


def fused_backward_extra(d_out, q, k, v, xk, xv, kernel, stride=1, dilation=1, causal=False,
                         scale=None):
    """(dq, dk, dv, d_xk, d_xv) in float64 of ``fused_forward_extra``."""
    keys, values, mask = _with_extra(q, k, v, xk, xv, kernel, stride, dilation, causal)
    B, N, H, D = q.shape[0], mask.shape[0], q.shape[-2], q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    qh = _bnhd(numpy.asarray(q).reshape(B, N, H, D))
    doh = _bnhd(numpy.asarray(d_out).reshape(B, N, H, -1))
    kh, vh = _bnhd(keys), _bnhd(values)
    p, _ = _softmax(scale * qh @ kh.transpose(0, 1, 3, 2), mask)
    out = p @ vh
    ds = p * (doh @ vh.transpose(0, 1, 3, 2) - (doh * out).sum(axis=-1, keepdims=True))
    dq = _back(scale * ds @ kh, (B, N, H, D)).reshape(q.shape)
    dkeys = _back(scale * ds.transpose(0, 1, 3, 2) @ qh, keys.shape)
    dvals = _back(p.transpose(0, 1, 3, 2) @ doh, values.shape)
    dk = _sum_heads(dkeys[:, :N], k.shape[-2]).reshape(k.shape)
    dv = _sum_heads(dvals[:, :N], v.shape[-2]).reshape(v.shape)
    return (dq, dk, dv, _sum_heads(dkeys[:, N:], xk.shape[-2]),
            _sum_heads(dvals[:, N:], xv.shape[-2]))


# ---- unfused ops -----------------------------------------------------------------------

def _dense_from_slots(attn, key, N):
    """[B, *spatial, H, K] slot weights -> dense [B, H, N, N] (empty slots dropped)."""
    a = numpy.asarray(attn, dtype=numpy.float64)
    B, H, K = a.shape[0], a.shape[-2], a.shape[-1]
    a = a.reshape(B, N, H, K).transpose(0, 2, 1, 3)
    dense = numpy.zeros((B, H, N, N))
    for i in range(N):
        for t in range(K):
            if key[i, t] >= 0:
                dense[:, :, i, key[i, t]] = a[:, :, i, t]
    return dense


def _slots_from_dense(dense, key, shape):
    """Dense [B, H, N, N] -> [B, *spatial, H, K] at the slots; empty slots get 0."""
    B, H, N, _ = dense.shape
    K = key.shape[1]
    out = numpy.zeros((B, H, N, K))
    for i in range(N):
        for t in range(K):
            if key[i, t] >= 0:
                out[:, :, i, t] = dense[:, :, i, key[i, t]]
    return numpy.ascontiguousarray(out.transpose(0, 2, 1, 3)).reshape(shape)


def _attn_shape(x, K):
    return tuple(x.shape[:-1]) + (K,)


def qk(q, k, kernel, dilation=1, causal=False, rpb=None):
    """Unfused logits ``<q_i, k_j> + rpb`` per slot, -inf at empty slots, float64."""
    spatial = q.shape[1:-2]
    key, rel = slot_table(spatial, kernel, dilation, causal)
    N, K = key.shape
    qh, kh = _bnhd(q), _bnhd(k)
    dense = qh @ kh.transpose(0, 1, 3, 2)
    out = _slots_from_dense(dense, key, _attn_shape(q, K))
    B, H = q.shape[0], q.shape[-2]
    flat = out.reshape(B, N, H, K)
    if rpb is not None:
        r = numpy.asarray(rpb, dtype=numpy.float64).reshape(H, -1)
        for i in range(N):
            for t in range(K):
                if key[i, t] >= 0:
                    flat[:, i, :, t] += r[:, rel[i, t]]
    flat.transpose(0, 1, 3, 2)[:, key < 0] = -numpy.inf
    return out


def av(attn, v, kernel, dilation=1, causal=False):
    """``out_i = sum_t attn[i, t] v_{key(i, t)}`` over non-empty slots, float64."""
    key, _ = slot_table(v.shape[1:-2], kernel, dilation, causal)
    dense = _dense_from_slots(attn, key, key.shape[0])
    return _back(dense @ _bnhd(v), v.shape)


def qk_backward(d_attn, q, k, kernel, dilation=1, causal=False, with_rpb=False):
    """(dq, dk[, d_rpb]) of ``qk``: dq = A k, dk = A^T q with A the dense d_attn."""
    spatial = q.shape[1:-2]
    key, rel = slot_table(spatial, kernel, dilation, causal)
    N, K = key.shape
    dense = _dense_from_slots(d_attn, key, N)
    dq = _back(dense @ _bnhd(k), q.shape)
    dk = _back(dense.transpose(0, 1, 3, 2) @ _bnhd(q), k.shape)
    if not with_rpb:
        return dq, dk
    B, H = q.shape[0], q.shape[-2]
    kernel = _per_axis(kernel, len(spatial))
    rpb_shape = (H,) + tuple(2 * kk - 1 for kk in kernel)
    d_rpb = numpy.zeros((H, math.prod(rpb_shape[1:])))
    da = numpy.asarray(d_attn, dtype=numpy.float64).reshape(B, N, H, K)
    for i in range(N):
        for t in range(K):
            if key[i, t] >= 0:
                d_rpb[:, rel[i, t]] += da[:, i, :, t].sum(axis=0)
    return dq, dk, d_rpb.reshape(rpb_shape)


def av_backward(d_out, attn, v, kernel, dilation=1, causal=False):
    """(d_attn, dv) of ``av``: d_attn[i, t] = <dO_i, v_key(i,t)> (0 if empty), dv = A^T dO."""
    key, _ = slot_table(v.shape[1:-2], kernel, dilation, causal)
    N, K = key.shape
    doh, vh = _bnhd(d_out), _bnhd(v)
    d_attn = _slots_from_dense(doh @ vh.transpose(0, 1, 3, 2), key, _attn_shape(v, K))
    dense = _dense_from_slots(attn, key, N)
    dv = _back(dense.transpose(0, 1, 3, 2) @ doh, v.shape)
    return d_attn, dv
