"""Additional tokens for backends whose kernels do not take them, in array math (NumPy or
CuPy): every query also attends to the same T tokens ``[B, T, H_x, D]``.

Forward: the backend's neighborhood attention gives (out, lse) over the windows; the
attention over the extra tokens is merged into them through the log-sum-exp.

Backward: the backend's backward, given the merged out and lse, already returns the
windows' part of every gradient (its probabilities ``exp(score - lse)`` and
``delta = rowsum(d_out * out)`` are those of the union); the extra tokens' part of dq and
their own gradients come from the same formulas here.

Scores are built in the accumulation dtype (float32; float64 for float64 inputs) a chunk
of query tokens at a time, so that no more than ``CHUNK_SCORES`` of them exist at once.
"""

from __future__ import annotations

from ._arrays import array_module
from ._dtypes import accumulator_dtype

__all__ = ["merge_into", "add_grads"]

CHUNK_SCORES = 1 << 25


def _grouped(x, problem):
    """``[B, *spatial, H, D]`` as ``[B, N, H_x, G, D]`` (G query heads per extra head)."""
    B, N, hx = problem.batch, problem.num_tokens, problem.extra_heads
    return x.reshape(B, N, hx, problem.heads_per_extra, x.shape[-1])


def _rows(x, problem):   # [B, *spatial, H] -> [B, N, H_x, G]
    return x.reshape(problem.batch, problem.num_tokens, problem.extra_heads,
                     problem.heads_per_extra)


def _chunks(problem):
    per_token = max(1, problem.batch * problem.heads * problem.extra_tokens)
    step = max(1, CHUNK_SCORES // per_token)
    for lo in range(0, problem.num_tokens, step):
        yield slice(lo, min(lo + step, problem.num_tokens))


def _probs(xp, qc, xk, lse_c, scale):
    """exp(scale * q . xk - lse): [B, H_x, G, n, T] for a chunk of queries."""
    s = xp.einsum("bnxgd,btxd->bxgnt", qc, xk) * scale
    return xp.exp(s - lse_c.transpose(0, 2, 3, 1)[..., None])


def merge_into(problem, q, xk, xv, out, lse):
    """Merge the attention over the extra tokens into (out, lse) in place, which hold the
    neighborhoods' attention."""
    xp = array_module([("q", q)])
    acc = accumulator_dtype(q.dtype)
    xkf, xvf = xk.astype(acc), xv.astype(acc)
    qg = _grouped(q, problem)
    og = xp.ascontiguousarray(_grouped(out, problem))   # written back whole below
    lg = xp.ascontiguousarray(_rows(lse, problem))
    for c in _chunks(problem):
        qc = qg[:, c].astype(acc)
        s = xp.einsum("bnxgd,btxd->bxgnt", qc, xkf) * problem.scale
        top = s.max(axis=-1, keepdims=True)
        w = xp.exp(s - top)
        total = w.sum(axis=-1)
        lse_x = (xp.log(total) + top[..., 0]).transpose(0, 3, 1, 2)      # [B, n, H_x, G]
        o_x = xp.einsum("bxgnt,btxd->bnxgd", w, xvf) / total.transpose(0, 3, 1, 2)[..., None]
        lse_n = lg[:, c].astype(acc)
        merged = xp.logaddexp(lse_n, lse_x)
        a, b = xp.exp(lse_n - merged), xp.exp(lse_x - merged)
        og[:, c] = (a[..., None] * og[:, c].astype(acc) + b[..., None] * o_x).astype(out.dtype)
        lg[:, c] = merged.astype(lse.dtype)
    out[...] = og.reshape(out.shape)
    lse[...] = lg.reshape(lse.shape)


def add_grads(problem, d_out, q, xk, xv, out, lse, dq, dxk, dxv):
    """Add the extra tokens' part of dq into dq (in place) and write dxk, dxv; (out, lse)
    are the merged ones."""
    xp = array_module([("q", q)])
    acc = accumulator_dtype(q.dtype)
    xkf, xvf = xk.astype(acc), xv.astype(acc)
    gk = xp.zeros(xk.shape, dtype=acc)
    gv = xp.zeros(xv.shape, dtype=acc)
    qg, og, dog, lg = (_grouped(q, problem), _grouped(out, problem),
                       _grouped(d_out, problem), _rows(lse, problem))
    dqg = _grouped(dq, problem).astype(acc)   # a copy, written back whole below
    for c in _chunks(problem):
        qc, doc = qg[:, c].astype(acc), dog[:, c].astype(acc)
        p = _probs(xp, qc, xkf, lg[:, c].astype(acc), problem.scale)      # [B, x, g, n, T]
        delta = (doc * og[:, c].astype(acc)).sum(axis=-1).transpose(0, 2, 3, 1)
        dp = xp.einsum("bnxgd,btxd->bxgnt", doc, xvf)
        ds = p * (dp - delta[..., None])
        dqg[:, c] += problem.scale * xp.einsum("bxgnt,btxd->bnxgd", ds, xkf)
        gk += problem.scale * xp.einsum("bxgnt,bnxgd->btxd", ds, qc)
        gv += xp.einsum("bxgnt,bnxgd->btxd", p, doc)
    dq[...] = dqg.reshape(dq.shape).astype(dq.dtype)
    dxk[...] = gk.astype(dxk.dtype)
    dxv[...] = gv.astype(dxv.dtype)
