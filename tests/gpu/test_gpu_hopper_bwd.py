"""Hopper fused backward (backends/wgmma_backward.py, sm_90a) against the float64 reference.

Each case computes out and lse with the reference forward in float64 (rounded to the case's
dtype, as a real forward stores them), runs the wgmma backward on NaN-poisoned gradients and
checks dq, dk, dv against the reference backward in float64: the error must be at most 3x the
error of the reference backward run in the same precision plus a floor (FlashAttention's rule
for gradients, tests/gpu_cases.py); every element must be written. Without a bias and the
atomic dQ variant the part is deterministic (no atomics): three runs must agree bitwise.
With a relative positional bias d_rpb is checked too. Skipped on GPUs other than compute
capability 9.0. Called directly (fused.py dispatches to it only where it measured faster).
"""

import numpy
import pytest

from natten_cupy import _args
from natten_cupy._dtypes import BFLOAT16
from natten_cupy.backends.fused import wgmma_backward as H
from natten_cupy.backends import get_backend
from natten_cupy.ops import run_fused_backward, run_fused_forward
from gpu_cases import far_scores, to_host, upload

pytestmark = pytest.mark.gpu

F16, BF16, F32, F64 = (numpy.dtype(numpy.float16), BFLOAT16, numpy.dtype(numpy.float32),
                       numpy.dtype(numpy.float64))
FLOOR = {F16: 2e-3, BF16: 1.6e-2}  # relative to max(1, max |true gradient|)

# (spatial, kernel, stride, dilation, causal, heads, head_dim, dtype, scale)
CASES = [
    ((97,), 7, 1, 2, True, 2, 64, F16, None),
    ((200,), 33, 4, 1, False, 3, 40, BF16, None),       # head dim padded to 64
    ((300,), 300, 1, 1, False, 2, 128, F16, None),      # self-attention, partial last tiles
    ((700,), 127, 1, 1, False, 1, 64, F16, None),       # tiles ending one past the full rows
    ((1500,), 511, 1, 1, False, 1, 64, BF16, None),
    ((1500,), 512, 3, 1, True, 1, 128, F16, None),      # even kernel, stride, causal
    ((1000,), 64, 1, 3, False, 2, 128, BF16, None),     # dilation groups of 334 / 333
    ((777,), 777, 1, 1, True, 1, 64, F16, None),        # causal self-attention
    ((129,), 2, 2, 1, False, 2, 128, F16, None),        # smallest kernel
    ((2053,), 1023, 5, 2, True, 1, 96, F16, None),      # head dim padded to 128
    ((513,), 100, 1, 1, False, 1, 64, F16, 0.3),        # explicit scale
    ((64,), 64, 64, 1, False, 2, 64, BF16, None),       # stride == kernel: blocked attention
    ((260,), 10, 10, 1, False, 1, 128, F16, 1.5),       # blocked, scale > 1
    ((400,), 9, 2, 5, True, 2, 128, BF16, None),        # dilation 5: past the TMA maps' reach
    # 2-D (8 x 16 owner boxes) and 3-D (2 x 8 x 8)
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 2, 64, F16, None),
    ((24, 37), (4, 6), 1, 1, False, 1, 128, BF16, None),
    ((30, 29), 13, 1, 1, False, 1, 128, F16, None),
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 1, 64, BF16, None),
    ((45, 50), (45, 50), 1, 1, False, 1, 64, F16, None),   # 2-D self-attention
    ((7, 70), (3, 33), 1, 1, (True, True), 2, 128, F16, 0.2),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 2, 64, F16, None),
    ((8, 12, 12), 3, (1, 3, 2), 1, False, 1, 128, BF16, None),
    ((6, 10, 11), (3, 5, 5), 1, 1, (True, False, False), 1, 64, F16, None),
    ((5, 6, 7), (5, 6, 7), 1, 1, False, 1, 128, F16, None),  # 3-D self-attention
    ((10, 20, 21), (5, 9, 9), (2, 1, 3), (1, 2, 2), False, 1, 72, BF16, None),
]


def _skip_unless_hopper():
    from natten_cupy.backends.fused import wgmma_forward
    if wgmma_forward._compute_capability() != (9, 0):
        pytest.skip("needs a compute capability 9.0 GPU")


def _problem(x, case):
    spatial, ks, st, dl, ca = case[:5]
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, case[8], "fused",
                             deterministic=True)


def _reference_backward(problem, q, k, v, out, lse, d_out):
    grads = [numpy.empty(q.shape, q.dtype) for _ in range(3)]
    run_fused_backward(problem, get_backend("reference"), d_out, q, k, v, out, lse, *grads)
    return [g.astype(F64) for g in grads]


def _inputs(case, rng, batch=2, make=None):
    """Host q, k, v, d_out, out (case dtype; out from the float64 forward), lse (float32),
    and the float64 truth of dq, dk, dv. ``make(rng, shape)``: float64 q, k, v, d_out (default
    standard normal)."""
    spatial, heads, dim, dtype = case[0], case[5], case[6], case[7]
    shape = (batch,) + tuple(spatial) + (heads, dim)
    made = make(rng, shape) if make else [rng.standard_normal(shape) for _ in range(4)]
    q, k, v, d_out = (x.astype(dtype) for x in made)
    h64 = [x.astype(F64) for x in (q, k, v, d_out)]
    p64 = _problem(h64[0], case)
    out64 = numpy.empty(shape, F64)
    lse64 = numpy.empty(shape[:-1], F64)
    run_fused_forward(p64, get_backend("reference"), *h64[:3], out64, lse64)
    truth = _reference_backward(p64, h64[0], h64[1], h64[2], out64, lse64, h64[3])
    return q, k, v, d_out, out64.astype(dtype), lse64.astype(F32), truth


def _device(cp, host, layout="canonical"):
    if layout == "heads_first":  # [B, H, *spatial, D] buffers seen as canonical (no copy)
        rank = host.ndim - 3
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        return upload(cp, host.transpose(to_hf)).transpose(tuple(numpy.argsort(to_hf)))
    return upload(cp, host)


def _run(cp, problem, dev, shape, dtype, layout="canonical", dq_atomic=False, tma=None,
         tile=None):
    grads = [_device(cp, numpy.full(shape, numpy.nan, dtype), layout) for _ in range(3)]
    q, k, v, d_out, out, lse = dev
    H.backward(problem, q, k, v, out, lse, d_out, *grads, dq_atomic=dq_atomic, tma=tma,
               tile=tile)
    cp.cuda.get_current_stream().synchronize()
    return [to_host(g) for g in grads]


def check_case(case, rng, layout="canonical", dq_atomic=False, tma=None, make=None, tile=None):
    """Run one case (``tma``: the dK/dV pass's loads, ``plan_backward``; ``make``: the
    inputs, as ``_inputs`` takes it; ``tile``: a BwdTile); returns [(error, yardstick error)]
    for dq, dk, dv."""
    import cupy as cp
    q, k, v, d_out, out, lse, truth = _inputs(case, rng, make=make)
    problem = _problem(q, case)
    assert H.refuse(problem) is None, H.refuse(problem)
    dev = [_device(cp, x, layout) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
    got = _run(cp, problem, dev, q.shape, q.dtype, layout, dq_atomic, tma, tile)
    low = _reference_backward(problem, q, k, v, out, lse, d_out)
    result = []
    for name, g, t, y in zip(("dq", "dk", "dv"), got, truth, low):
        assert not numpy.isnan(g).any(), f"unwritten (NaN) elements in {name}"
        err = float(numpy.abs(g - t).max())
        ref_err = float(numpy.abs(y - t).max())
        floor = FLOOR[q.dtype] * max(1.0, float(numpy.abs(t).max()))
        assert err <= 3 * ref_err + floor, (name, err, ref_err, floor)
        result.append((err, ref_err))
    return result


def _case_id(c):
    return (f"{len(c[0])}d-{c[0]}-k{c[1]}-s{c[2]}-d{c[3]}-c{c[4]}-D{c[6]}-"
            f"{numpy.dtype(c[7]).name}" + (f"-scale{c[8]}" if c[8] else ""))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_hopper_backward_matches_reference(case, rng):
    _skip_unless_hopper()
    check_case(case, rng)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_hopper_backward_atomic_dq_matches_reference(case, rng):
    """The atomic dQ variant (dQ added in the dK/dV pass by bulk float32 reductions)."""
    _skip_unless_hopper()
    check_case(case, rng, dq_atomic=True)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_hopper_backward_one_warpgroup_dq_pass(case, rng):
    """The dQ pass with one compute warpgroup (wgmma_backward.Q_ONE_WG: 64-query boxes, two
    CTAs an SM) on every case, the dK/dV pass as the default's."""
    _skip_unless_hopper()
    check_case(case, rng, dq_atomic=False, tile=H.Q_ONE_WG[H._bucket(case[6])])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_hopper_backward_one_warpgroup_kv_pass(case, rng):
    """The dK/dV pass with one compute warpgroup (wgmma_backward.KV_ONE_WG: 64-key boxes, two
    CTAs an SM; 32-query tiles at head dim 128) on every case, with the one-warpgroup dQ
    pass."""
    _skip_unless_hopper()
    check_case(case, rng, dq_atomic=False, tile=H.KV_ONE_WG[H._bucket(case[6])])


def _anticorrelated(rng, shape):
    """q near a and k near -a (``gpu_cases.far_scores``): every score near -25, and so is
    each query's lse."""
    q, k = far_scores(rng, shape, shape, -1.0, 0.1)
    return q, k, rng.standard_normal(shape), rng.standard_normal(shape)


@pytest.mark.parametrize("case", [
    ((89,), 2, 1, 40, False, 4, 128, F16, None),        # groups of 3 and 2 keys (128-key boxes)
    ((70,), 5, 1, 1, False, 2, 128, F16, None),         # one partial box
    ((300,), 33, 1, 1, False, 2, 128, F16, None),       # the last box partial
    ((20, 21), 3, 1, (5, 7), False, 2, 128, F16, None),
    ((5, 9, 11), (3, 3, 5), 1, 1, False, 1, 128, F16, None),
], ids=_case_id)
@pytest.mark.parametrize("dq_atomic", [False, True], ids=("det", "atomic"))
def test_hopper_backward_with_very_negative_lse(case, dq_atomic, rng):
    """Both dQ variants where the dK/dV CTAs' key boxes reach past their group (small groups,
    partial last boxes) and every lse is very negative: the rows past the group have zero
    keys, and their scores' exp(-lse) overflows 16 bits; they must add nothing to dQ (the
    atomic variant's NaN rows in dq, found by the random sweep)."""
    _skip_unless_hopper()
    check_case(case, rng, dq_atomic=dq_atomic, make=_anticorrelated)


def _tma_runs(case):
    """Where the rank-1 dK/dV pass loads its query tiles by TMA (natten_cupy/_tma.py's maps:
    64-row boxes stepping the dilation, at most 256 elements): dilation up to 4."""
    return len(case[0]) == 1 and case[3] <= 4


@pytest.mark.parametrize("case", [c for c in CASES if len(c[0]) == 1]
                         + [c for c in CASES if len(c[0]) == 2][:1], ids=_case_id)
@pytest.mark.parametrize("dq_atomic", [False, True], ids=("det", "atomic"))
@pytest.mark.parametrize("tma", [False, True], ids=("cp.async", "tma"))
def test_hopper_backward_loaders(case, dq_atomic, tma, rng):
    """Both loaders of the dK/dV pass, both dQ variants: cp.async always, TMA wherever its
    maps describe the operands (a case outside them is refused with the reason)."""
    _skip_unless_hopper()
    if tma and not _tma_runs(case):
        with pytest.raises(ValueError, match="TMA loads cannot run"):
            check_case(case, rng, dq_atomic=dq_atomic, tma=True)
        return
    check_case(case, rng, dq_atomic=dq_atomic, tma=tma)


@pytest.mark.parametrize("case", [((333,), 65, 1, 2, False, 3, 64, F16, None),
                                  ((21, 18), (5, 7), 1, (2, 1), False, 3, 128, BF16, None)],
                         ids=("1d", "2d"))
def test_hopper_backward_heads_first_layout(case, rng):
    """[B, H, *spatial, D] inputs and gradients read and written in place through strides."""
    _skip_unless_hopper()
    check_case(case, rng, layout="heads_first")


def test_hopper_backward_is_bitwise_reproducible(rng):
    import cupy as cp
    _skip_unless_hopper()
    for case in (((1100,), 300, 2, 1, True, 2, 128, F16, None),
                 ((30, 29), (7, 5), 1, (1, 2), (False, True), 2, 64, BF16, None)):
        q, k, v, d_out, out, lse, _ = _inputs(case, rng)
        problem = _problem(q, case)
        dev = [upload(cp, x) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
        runs = [_run(cp, problem, dev, q.shape, q.dtype) for _ in range(3)]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert numpy.array_equal(a, b)


def test_hopper_backward_self_attention_equals_dense(rng):
    """kernel == extent, no stride/dilation/causality: plain softmax attention gradients."""
    import cupy as cp
    _skip_unless_hopper()
    L, Hh, D = 650, 2, 128
    case = ((L,), L, 1, 1, False, Hh, D, F16, None)
    q, k, v, d_out, out, lse, _ = _inputs(case, rng, batch=1)
    dev = [upload(cp, x) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
    dq, dk, dv = _run(cp, _problem(q, case), dev, q.shape, F16)
    qf, kf, vf, df = (x.astype(F64)[0].transpose(1, 0, 2) for x in (q, k, v, d_out))
    s = qf @ kf.transpose(0, 2, 1) * D ** -0.5
    p = numpy.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ vf
    dp = df @ vf.transpose(0, 2, 1)
    ds = p * (dp - (df * o).sum(-1, keepdims=True))
    dense = (ds @ kf * D ** -0.5, ds.transpose(0, 2, 1) @ qf * D ** -0.5,
             p.transpose(0, 2, 1) @ df)
    for got, want in zip((dq, dk, dv), dense):
        assert float(numpy.abs(got[0].transpose(1, 0, 2) - want).max()) < 5e-3


def test_hopper_backward_plan_replays(rng):
    """The plan of plan_backward, run twice through run_plan_on with its delta workspace,
    gives the same gradients as backward (the fast path's way in)."""
    import cupy as cp
    from natten_cupy._launch import run_plan_on
    from natten_cupy._operands import layout_of
    _skip_unless_hopper()
    case = ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 2, 64, F16, None)
    q, k, v, d_out, out, lse, _ = _inputs(case, rng)
    problem = _problem(q, case)
    dev = [upload(cp, x) for x in (q, k, v, d_out, out)] + [cp.asarray(lse)]
    want = _run(cp, problem, dev, q.shape, q.dtype)
    qd, kd, vd, dod, od, lsed = dev
    grads = [cp.full(q.shape, cp.nan, dtype=qd.dtype) for _ in range(3)]
    arrays = (dod, qd, kd, vd, od, lsed, *grads)
    plan = H.plan_backward(problem, *map(layout_of, arrays))
    ws = [cp.empty(s, d) for s, d in plan.workspaces]
    for _ in range(2):
        run_plan_on(plan, arrays + tuple(ws))
    for g, w in zip(grads, want):
        assert numpy.array_equal(to_host(g), w)


# ---- grouped-query attention (fewer kv heads) ----------------------------------------------

# (spatial, kernel, stride, dilation, causal, heads, kv heads, head_dim, dtype)
GQA_CASES = [
    ((300,), 33, 1, 2, True, 4, 2, 64, F16),
    ((1500,), 1024, 1, 1, False, 3, 1, 128, BF16),          # MQA
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False), 4, 1, 128, F16),
    ((24, 37), (4, 6), 1, 1, False, 6, 2, 64, BF16),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 4, 2, 128, F16),
]


def _gqa_id(c):
    return f"{len(c[0])}d-{c[0]}-H{c[5]}-kv{c[6]}-D{c[7]}-{numpy.dtype(c[8]).name}"


def _repeat_heads(x, group):
    """kv [B, *spatial, H_kv, D] seen by every query head: head h holds kv head h // group."""
    return numpy.repeat(x, group, axis=-2)


def _group_sum(g, group):
    """A repeated head's gradient summed back onto its kv head."""
    return g.reshape(g.shape[:-2] + (g.shape[-2] // group, group, g.shape[-1])).sum(-2)


@pytest.mark.parametrize("dq_atomic", [False, True], ids=("deterministic", "atomic_dq"))
@pytest.mark.parametrize("case", GQA_CASES, ids=_gqa_id)
def test_hopper_gqa_matches_repeated_heads(case, dq_atomic, rng):
    """Forward and backward with H_kv < H against the float64 reference of the same problem
    with each kv head repeated for its query heads (and dk, dv summed back over the group):
    the kernels index the shared kv head, no repeat copy."""
    import cupy as cp
    from natten_cupy.backends.fused import wgmma_forward
    _skip_unless_hopper()
    spatial, ks, st, dl, ca, heads, kv_heads, dim, dtype = case
    rank, group = len(spatial), heads // kv_heads
    qs, ks_ = (2,) + tuple(spatial) + (heads, dim), (2,) + tuple(spatial) + (kv_heads, dim)
    q, d_out = (rng.standard_normal(qs).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(ks_).astype(dtype) for _ in range(2))
    problem = _args.check_fused(rank, q, k, v, ks, st, dl, ca, None, "fused",
                                deterministic=True)
    assert problem.kv_heads == kv_heads
    assert H.refuse(problem) is None and wgmma_forward.refuse(problem) is None
    # the dense-heads problem in float64: the truth, and in the case's dtype: the yardstick
    dense = _args.check_fused(rank, q, q, q, ks, st, dl, ca, None, "fused")
    h64 = [x.astype(F64) for x in (q, _repeat_heads(k, group), _repeat_heads(v, group), d_out)]
    out64, lse64 = numpy.empty(qs, F64), numpy.empty(qs[:-1], F64)
    run_fused_forward(dense, get_backend("reference"), *h64[:3], out64, lse64)
    out, lse = out64.astype(dtype), lse64.astype(F32)
    truth = _reference_backward(dense, h64[0], h64[1], h64[2], out64, lse64, h64[3])
    low = _reference_backward(dense, q, _repeat_heads(k, group), _repeat_heads(v, group),
                              out, lse, d_out)
    truth[1:] = [_group_sum(t, group) for t in truth[1:]]
    low[1:] = [_group_sum(t, group) for t in low[1:]]

    dq_, dk_, dv_ = (upload(cp, x) for x in (q, k, v))
    got_out = cp.full(qs, cp.nan, dtype=dq_.dtype)
    got_lse = cp.full(qs[:-1], cp.nan, dtype=cp.float32)
    wgmma_forward.forward(problem, dq_, dk_, dv_, got_out, got_lse)
    out_h = to_host(got_out)
    assert not numpy.isnan(out_h).any() and not numpy.isnan(to_host(got_lse)).any()
    floor = FLOOR[q.dtype]
    assert float(numpy.abs(out_h - out64).max()) <= 3 * float(numpy.abs(out - out64).max()) \
        + floor * max(1.0, float(numpy.abs(out64).max()))

    grads = [upload(cp, numpy.full(s, numpy.nan, dtype)) for s in (qs, ks_, ks_)]
    H.backward(problem, dq_, dk_, dv_, upload(cp, out), cp.asarray(lse), upload(cp, d_out),
               *grads, dq_atomic=dq_atomic)
    for name, g, t, y in zip(("dq", "dk", "dv"), map(to_host, grads), truth, low):
        assert not numpy.isnan(g).any(), f"unwritten (NaN) elements in {name}"
        err, ref_err = float(numpy.abs(g - t).max()), float(numpy.abs(y - t).max())
        assert err <= 3 * ref_err + floor * max(1.0, float(numpy.abs(t).max())), \
            (name, err, ref_err)


# ---- relative positional bias ------------------------------------------------------------

# (spatial, kernel, dilation, causal, heads, head_dim, dtype): stride 1 (a bias takes no other)
BIAS_CASES = [
    ((700,), 127, 1, False, 2, 64, F16),
    ((1500,), 512, 1, True, 1, 128, F16),        # even kernel, causal
    ((1000,), 64, 3, False, 2, 128, BF16),       # dilation groups of 334 / 333
    ((2053,), 1023, 2, True, 1, 96, F16),        # head dim padded to 128
    ((300,), 300, 1, False, 2, 128, BF16),       # self-attention, partial last tiles
    ((129,), 2, 1, False, 2, 128, F16),          # smallest kernel
    ((33, 41), (7, 5), (2, 3), (True, False), 2, 64, F16),
    ((30, 29), 13, 1, False, 1, 128, BF16),
    ((45, 50), (45, 50), 1, False, 1, 64, F16),  # 2-D self-attention
    ((7, 70), (3, 33), 1, (True, True), 2, 128, F16),
    ((64, 48), 21, 1, False, 1, 128, BF16),      # M5-like: whole interior tiles
    ((48, 40), 21, 1, False, 4, 128, BF16),      # dS workspace in two runs of two heads
    ((40, 70), (9, 13), (1, 2), False, 2, 128, F16),   # dilation along the tile's long axis
    ((9, 17, 13), (3, 5, 4), (1, 2, 1), (False, False, True), 2, 64, F16),
    ((6, 10, 11), (3, 5, 5), 1, (True, False, False), 1, 64, BF16),
    ((5, 6, 7), (5, 6, 7), 1, False, 1, 128, F16),   # 3-D self-attention
    ((10, 20, 21), (5, 9, 9), (1, 2, 2), False, 1, 72, BF16),
]


def _bias_id(c):
    return (f"{len(c[0])}d-{c[0]}-k{c[1]}-d{c[2]}-c{c[3]}-H{c[4]}-D{c[5]}-"
            f"{numpy.dtype(c[6]).name}")


def _bias_check(case, rng, dq_atomic, kv_heads=None, repeats=1):
    """The Hopper backward of ``case`` with a bias (``dq_atomic``: False the dQ pass sums
    d_rpb, True the dK/dV pass writes the dS workspace and its reduction does; ``kv_heads``:
    grouped k, v) against the float64 reference, NaN-poisoned outputs, the error rule above;
    with ``repeats`` > 1 the later runs' d_rpb must equal the first's bitwise. Returns the
    problem."""
    import cupy as cp
    _skip_unless_hopper()
    spatial, ks, dl, ca, heads, dim, dtype = case
    rank = len(spatial)
    kern = (ks,) * rank if isinstance(ks, int) else ks
    shape = (2,) + tuple(spatial) + (heads, dim)
    kv_shape = shape[:-2] + (kv_heads or heads, dim)
    q, d_out = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(kv_shape).astype(dtype) for _ in range(2))
    rpb = (0.5 * rng.standard_normal((heads,) + tuple(2 * x - 1 for x in kern))).astype(dtype)
    ref = get_backend("reference")

    def prob(x, kx, r, det=False):
        return _args.check_fused(rank, x, kx, kx, ks, 1, dl, ca, None, "fused", rpb=r,
                                 deterministic=det)

    def backward(p, xs, out, lse, r):
        grads = [numpy.empty(x.shape, xs[0].dtype) for x in xs[:3]]
        d_rpb = numpy.empty(r.shape, xs[0].dtype)
        run_fused_backward(p, ref, xs[3], *xs[:3], out, lse, *grads, r, d_rpb)
        return [g.astype(F64) for g in (*grads, d_rpb)]

    h64 = [x.astype(F64) for x in (q, k, v, d_out)]
    r64 = rpb.astype(F64)
    p64 = prob(h64[0], h64[1], r64)
    out64, lse64 = numpy.empty(shape, F64), numpy.empty(shape[:-1], F64)
    run_fused_forward(p64, ref, *h64[:3], out64, lse64, r64)
    truth = backward(p64, h64, out64, lse64, r64)
    out, lse = out64.astype(dtype), lse64.astype(F32)
    low = backward(prob(q, k, rpb), (q, k, v, d_out), out, lse, rpb)

    problem = prob(q, k, rpb)
    assert H.refuse(problem) is None, H.refuse(problem)
    assert "deterministic" in H.refuse(prob(q, k, rpb, det=True))
    dev = [upload(cp, x) for x in (q, k, v, d_out, out)]
    first = None
    for _ in range(repeats):
        grads = [upload(cp, numpy.full(x.shape, numpy.nan, dtype)) for x in (q, k, v)]
        d_rpb = upload(cp, numpy.full(rpb.shape, numpy.nan, dtype))
        H.backward(problem, *dev[:3], dev[4], cp.asarray(lse), dev[3], *grads,
                   rpb=upload(cp, rpb), d_rpb=d_rpb, dq_atomic=dq_atomic)
        cp.cuda.get_current_stream().synchronize()
        for name, g, t, y in zip(("dq", "dk", "dv", "d_rpb"), map(to_host, (*grads, d_rpb)),
                                 truth, low):
            assert not numpy.isnan(g).any(), f"unwritten (NaN) elements in {name}"
            err, ref_err = float(numpy.abs(g - t).max()), float(numpy.abs(y - t).max())
            floor = FLOOR[q.dtype] * max(1.0, float(numpy.abs(t).max()))
            assert err <= 3 * ref_err + floor, (name, err, ref_err, floor)
        got = to_host(d_rpb)
        if first is None:
            first = got
        else:
            assert numpy.array_equal(got.view(numpy.uint16), first.view(numpy.uint16))
    return problem


@pytest.mark.parametrize("dq_atomic", [False, True], ids=["dq-pass", "ds-workspace"])
@pytest.mark.parametrize("case", BIAS_CASES, ids=_bias_id)
def test_hopper_backward_with_bias_matches_reference(case, dq_atomic, rng):
    """dq, dk, dv and d_rpb of the Hopper backward with a relative positional bias against
    the float64 reference of the biased forward and backward, NaN-poisoned outputs, the same
    error rule as above: both passes add the bias and the dQ pass sums d_rpb, or (dq_atomic)
    the dK/dV pass adds dQ and writes dS to the workspace that gives d_rpb, wherever the
    workspace fits (``ds_refusal``; else the refusal is checked)."""
    if dq_atomic:
        spatial, ks, dl, ca, heads, dim, dtype = case
        x = numpy.zeros((1,) + tuple(spatial) + (heads, dim), dtype)
        kern = (ks,) * len(spatial) if isinstance(ks, int) else ks
        r = numpy.zeros((heads,) + tuple(2 * k - 1 for k in kern), dtype)
        why = H.ds_refusal(_args.check_fused(len(spatial), x, x, x, ks, 1, dl, ca, None,
                                             "fused", rpb=r))
        if why:
            assert "larger than the gradients" in why or "shared memory" in why, why
            return
    _bias_check(case, rng, dq_atomic)


# GQA with the dS workspace: 15 x 15 windows at head dim 64 with 4 query heads on 2 kv heads
# take one kv head (two query heads) a run, two runs; 1-D and 3-D with one run.
DS_GQA_CASES = [
    ((40, 36), 15, 1, False, 4, 64, BF16),
    ((300,), 61, 1, True, 4, 128, F16),
    ((6, 12, 10), (3, 5, 5), 1, (True, False, False), 4, 128, BF16),
]


@pytest.mark.parametrize("case", DS_GQA_CASES, ids=_bias_id)
def test_hopper_backward_bias_ds_workspace_gqa_and_runs(case, rng):
    """The dS-workspace variant with grouped k, v (2 kv heads for 4 query heads), d_rpb
    the same bits in three runs (the workspace's slots are each written once and reduced
    in a fixed order, though dQ's adds vary)."""
    problem = _bias_check(case, rng, True, kv_heads=2, repeats=3)
    if len(case[0]) == 2:
        assert len(H.ds_head_groups(problem)) == 2
