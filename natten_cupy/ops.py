"""Public array-level calls (no autograd): validate, select, launch, hand back.

A warm call (a signature seen before, on CuPy arrays or CUDA torch tensors) is served by
``_fast``: one lookup, then allocation and launch. Otherwise every call takes the same four
steps: validate and normalize the arguments (``_args``), select the backend for where the
arrays live (``select_backend``, from ``_selection``: a ``Selection`` of op, backend and
problem, logging why the backends tried before it refused), gather the arrays as NumPy/CuPy
(``_arrays``; the first step that may touch a GPU), and let the selected backend launch its
kernels into freshly allocated outputs. The ``run_*`` functions are that last step on
already-gathered arrays with caller-allocated outputs, for a problem and a backend module (a
selection's, or one a test or benchmark names); the PyTorch layer uses them so that torch
allocates every output.
"""

from __future__ import annotations

from . import _args, _extra, _fast
from ._arrays import Inputs, place
from ._dtypes import accumulator_dtype
from ._selection import select_backend

__all__ = ["select_backend", "fused_forward", "fused_backward", "qk", "av", "qk_backward",
           "av_backward", "run_fused_forward", "run_fused_backward", "run_qk", "run_av",
           "run_qk_backward", "run_av_backward"]


def _empty(xp, shape, dtype):
    return xp.empty(tuple(shape), dtype=dtype)


# ---- runs on gathered arrays, outputs given --------------------------------------------

def _extra_in_kernel(backend, op, problem):
    """Whether ``backend``'s kernels attend to the additional tokens themselves (else
    ``_extra`` merges them in array math)."""
    runs = getattr(backend, "runs_extra", None)
    return runs is not None and runs(op, problem)


def run_fused_forward(problem, backend, q, k, v, out, lse, rpb=None, extra=None):
    """``extra``: (additional_keys, additional_values) when ``problem.has_extra``."""
    if problem.is_empty:
        return
    kwargs = {} if rpb is None else {"rpb": rpb}
    if problem.has_extra and problem.num_tokens:
        if _extra_in_kernel(backend, "fused_forward", problem):
            backend.fused_forward(problem, q, k, v, out, lse, extra=extra, **kwargs)
            return
        backend.fused_forward(problem.without_extra(), q, k, v, out, lse, **kwargs)
        _extra.merge_into(problem, q, *extra, out, lse)
        return
    backend.fused_forward(problem, q, k, v, out, lse, **kwargs)   # no tokens to take


def run_fused_backward(problem, backend, d_out, q, k, v, out, lse, dq, dk, dv, rpb=None,
                       d_rpb=None, extra=None, d_extra=None):
    """With ``rpb``, ``d_rpb`` (rpb's shape and dtype) receives its gradient; with
    ``extra`` (additional keys and values), ``d_extra`` (two arrays of their shapes)
    theirs. out and lse are the forward's: over the windows and the extra tokens."""
    if d_rpb is not None and (problem.is_empty or problem.num_tokens == 0):
        d_rpb[...] = 0
    if d_extra is not None and not (problem.has_extra and problem.num_tokens):
        for g in d_extra:
            g[...] = 0
    if problem.is_empty:
        return
    kwargs = {} if rpb is None else {"rpb": rpb, "d_rpb": d_rpb}
    if problem.has_extra and problem.num_tokens:
        if _extra_in_kernel(backend, "fused_backward", problem):
            backend.fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, extra=extra,
                                   d_extra=d_extra, **kwargs)
            return
        backend.fused_backward(problem.without_extra(), q, k, v, out, lse, d_out, dq, dk, dv,
                               **kwargs)
        _extra.add_grads(problem, d_out, q, *extra, out, lse, dq, *d_extra)
        return
    backend.fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, **kwargs)


def run_qk(problem, backend, q, k, rpb, attn):
    if not problem.is_empty:
        backend.qk(problem, q, k, rpb, attn)


def run_av(problem, backend, attn, v, out):
    if not problem.is_empty:
        backend.av(problem, attn, v, out)


def run_qk_backward(problem, backend, d_attn, q, k, dq, dk, d_rpb):
    if d_rpb is not None:
        d_rpb[...] = 0
    if not problem.is_empty:
        backend.qk_backward(problem, d_attn, q, k, dq, dk, d_rpb)


def run_av_backward(problem, backend, d_out, attn, v, d_attn, dv):
    if not problem.is_empty:
        backend.av_backward(problem, d_out, attn, v, d_attn, dv)


# ---- public calls ----------------------------------------------------------------------

def fused_forward(rank, q, k, v, kernel_size, *, stride=1, dilation=1, is_causal=False,
                  scale=None, backend="auto", return_lse=False, allow_tf32=False,
                  deterministic=False, tile=None, rpb=None, additional_keys=None,
                  additional_values=None):
    if rpb is None and additional_keys is None and additional_values is None:
        hit = _fast.fused_forward(rank, q, k, v, kernel_size, stride, dilation, is_causal,
                                  scale, backend, return_lse, allow_tf32, deterministic, tile)
    else:
        hit = _fast.fused_forward_ext(rank, q, k, v, rpb, additional_keys, additional_values,
                                      kernel_size, stride, dilation, is_causal, scale, backend,
                                      return_lse, allow_tf32, deterministic, tile)
    if hit is not None:
        return hit
    problem = _args.check_fused(rank, q, k, v, kernel_size, stride, dilation, is_causal, scale,
                                backend, allow_tf32, deterministic, tile, rpb,
                                additional_keys, additional_values)
    named = [("q", q), ("k", k), ("v", v), ("rpb", rpb), ("additional_keys", additional_keys),
             ("additional_values", additional_values)]
    where = place(named)
    sel = select_backend("fused_forward", problem, where.xp, backend)
    ins = Inputs.gather(named, where)
    xp = ins.xp
    with ins.on_device():
        qa, ka, va, ra, xka, xva = ins.arrays
        out = _empty(xp, tuple(qa.shape[:-1]) + (va.shape[-1],), qa.dtype)  # v's head dim
        lse = _empty(xp, qa.shape[:-1], accumulator_dtype(qa.dtype))
        run_fused_forward(sel.problem, sel.backend, qa, ka, va, out, lse, ra,
                          None if xka is None else (xka, xva))
    if return_lse:
        return ins.give_back(out), ins.give_back(lse)
    return ins.give_back(out)


def fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, *, stride=1, dilation=1,
                   is_causal=False, scale=None, backend="auto", allow_tf32=False,
                   deterministic=False, tile=None, rpb=None, additional_keys=None,
                   additional_values=None):
    if rpb is None and additional_keys is None and additional_values is None:
        hit = _fast.fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride,
                                   dilation, is_causal, scale, backend, allow_tf32,
                                   deterministic, tile)
    else:
        hit = _fast.fused_backward_ext(rank, d_out, q, k, v, out, lse, rpb, additional_keys,
                                       additional_values, kernel_size, stride, dilation,
                                       is_causal, scale, backend, allow_tf32, deterministic,
                                       tile)
    if hit is not None:
        return hit
    problem = _args.check_fused_backward(rank, d_out, q, k, v, out, lse, kernel_size, stride,
                                         dilation, is_causal, scale, backend, allow_tf32,
                                         deterministic, tile, rpb, additional_keys,
                                         additional_values)
    named = [("d_out", d_out), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse),
             ("rpb", rpb), ("additional_keys", additional_keys),
             ("additional_values", additional_values)]
    where = place(named)
    sel = select_backend("fused_backward", problem, where.xp, backend)
    ins = Inputs.gather(named, where)
    xp = ins.xp
    with ins.on_device():
        do_a, qa, ka, va, oa, la, ra, xka, xva = ins.arrays
        grads = [_empty(xp, x.shape, qa.dtype) for x in (qa, ka, va)]  # dk, dv: H_kv heads
        d_rpb = None if ra is None else _empty(xp, ra.shape, ra.dtype)
        extra = d_extra = None
        if xka is not None:
            extra = (xka, xva)
            d_extra = (_empty(xp, xka.shape, qa.dtype), _empty(xp, xva.shape, qa.dtype))
        run_fused_backward(sel.problem, sel.backend, do_a, qa, ka, va, oa, la, *grads, ra,
                           d_rpb, extra, d_extra)
        grads += [g for g in (d_rpb,) if g is not None] + list(d_extra or ())
    return tuple(ins.give_back(g) for g in grads)


def qk(rank, q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None, backend="auto",
       allow_tf32=False):
    hit = _fast.qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend, allow_tf32)
    if hit is not None:
        return hit
    problem = _args.check_qk(rank, q, k, kernel_size, dilation, is_causal, rpb, backend,
                             allow_tf32)
    named = [("q", q), ("k", k), ("rpb", rpb)]
    where = place(named)
    sel = select_backend("qk", problem, where.xp, backend)
    ins = Inputs.gather(named, where)
    with ins.on_device():
        qa, ka, ra = ins.arrays
        attn = _empty(ins.xp, tuple(qa.shape[:-1]) + (problem.num_neighbors,), qa.dtype)
        run_qk(sel.problem, sel.backend, qa, ka, ra, attn)
    return ins.give_back(attn)


def av(rank, attn, v, kernel_size, *, dilation=1, is_causal=False, backend="auto",
       allow_tf32=False):
    hit = _fast.av(rank, attn, v, kernel_size, dilation, is_causal, backend, allow_tf32)
    if hit is not None:
        return hit
    problem = _args.check_av(rank, attn, v, kernel_size, dilation, is_causal, backend,
                             allow_tf32)
    named = [("attn", attn), ("v", v)]
    where = place(named)
    sel = select_backend("av", problem, where.xp, backend)
    ins = Inputs.gather(named, where)
    with ins.on_device():
        aa, va = ins.arrays
        out = _empty(ins.xp, tuple(aa.shape[:-1]) + (va.shape[-1],), va.dtype)  # H, not H_kv
        run_av(sel.problem, sel.backend, aa, va, out)
    return ins.give_back(out)


def qk_backward(rank, d_attn, q, k, kernel_size, *, dilation=1, is_causal=False, rpb=None,
                backend="auto", allow_tf32=False):
    if rpb is None:
        hit = _fast.qk_backward(rank, d_attn, q, k, kernel_size, dilation, is_causal, backend,
                                allow_tf32)
        if hit is not None:
            return hit
    problem = _args.check_qk_backward(rank, d_attn, q, k, kernel_size, dilation, is_causal,
                                      rpb, backend, allow_tf32)
    named = [("d_attn", d_attn), ("q", q), ("k", k), ("rpb", rpb)]
    where = place(named)
    sel = select_backend("qk_backward", problem, where.xp, backend)
    ins = Inputs.gather(named, where)
    with ins.on_device():
        da, qa, ka, ra = ins.arrays
        dq = _empty(ins.xp, qa.shape, qa.dtype)
        dk = _empty(ins.xp, ka.shape, ka.dtype)
        d_rpb = None if ra is None else _empty(ins.xp, ra.shape, accumulator_dtype(ra.dtype))
        run_qk_backward(sel.problem, sel.backend, da, qa, ka, dq, dk, d_rpb)
        if d_rpb is not None:
            d_rpb = d_rpb.astype(ra.dtype, copy=False)
    if d_rpb is None:
        return ins.give_back(dq), ins.give_back(dk)
    return ins.give_back(dq), ins.give_back(dk), ins.give_back(d_rpb)


def av_backward(rank, d_out, attn, v, kernel_size, *, dilation=1, is_causal=False,
                backend="auto", allow_tf32=False):
    hit = _fast.av_backward(rank, d_out, attn, v, kernel_size, dilation, is_causal, backend,
                            allow_tf32)
    if hit is not None:
        return hit
    problem = _args.check_av_backward(rank, d_out, attn, v, kernel_size, dilation, is_causal,
                                      backend, allow_tf32)
    named = [("d_out", d_out), ("attn", attn), ("v", v)]
    where = place(named)
    sel = select_backend("av_backward", problem, where.xp, backend)
    ins = Inputs.gather(named, where)
    with ins.on_device():
        do_a, aa, va = ins.arrays
        d_attn = _empty(ins.xp, aa.shape, aa.dtype)
        dv = _empty(ins.xp, va.shape, va.dtype)
        run_av_backward(sel.problem, sel.backend, do_a, aa, va, d_attn, dv)
    return ins.give_back(d_attn), ins.give_back(dv)
