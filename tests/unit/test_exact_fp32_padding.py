"""The exact-float32 kernels take the common NAParams (inert axes at the back, ``make_params``
of the caller's problem and arrays) and a TilePlan in the problem's axis order, and derive at
entry the front-padded view their bodies work in (``front_padded`` in
``cuda_src/fused/exact_fp32.cu``). A Python mirror of that conversion, applied to what the
launcher passes, must give field for field what the launcher passed before the change
(``make_params`` of the front-padded problem on front-padded layouts, and the plan of the
front-padded problem): so the kernels see exactly what they saw before. No GPU: kernel
handles are faked."""


import numpy
import pytest

from natten_cupy import _args
from natten_cupy._launch import Operand
from natten_cupy._operands import Layout
from natten_cupy._params import PARAMS_DTYPE, TENSOR_FIELDS, make_params
from natten_cupy.backends.fused import exact_fp32 as E

F32 = numpy.float32


# ---- mirror of the device conversion (exact_fp32.cu: front_axis, front_padded) ----------

def _front_axis(x, a, rank, inert):
    return x[a - (3 - rank)] if a >= 3 - rank else inert


def front_padded_params(p, rank):
    """NAParams ``p`` (back-padded) as the kernels view it: axis a -> a + 3 - rank."""
    f = numpy.array(p, dtype=PARAMS_DTYPE)
    for field, inert in (("extent", 1), ("kernel", 1), ("stride", 1), ("dilation", 1),
                         ("causal", 0)):
        f[field] = [_front_axis(p[field], a, rank, inert) for a in range(3)]
    for t in TENSOR_FIELDS:
        f[t][1:4] = [_front_axis(p[t][1:4], a, rank, 0) for a in range(3)]
    return f[()]


def front_padded_plan(tp, rank):
    """TilePlan ``tp`` (problem order) as the kernels view it."""
    f = numpy.array(tp, dtype=E.PLAN_DTYPE)
    for field in ("cta", "slab", "tiles"):
        f[field] = [_front_axis(tp[field], a, rank, 1) for a in range(3)]
    return f[()]


# ---- the launcher before the change (test-only copies) ----------------------------------

def _old_plan(p3, micro, lanes, inverse, cell_bytes):
    return E._plan_for(p3, micro, lanes, inverse, cell_bytes, E._budget())


def _old_name(kernel, lanes, micro):
    return f"{kernel}<{lanes}, {micro[0]}, {micro[1]}>"


def old_forward(problem, q, k, v, out, lse):
    """[(kernel name, grid, shared bytes, tile, params, front-padded plan)] of the old
    plan_forward."""
    p3 = E._padded(problem)  # (planning still pads in front)
    pad = 3 - problem.rank
    q3, k3, v3, o3, l3 = (x.unsqueezed(pad) for x in (q, k, v, out, lse))
    params = make_params(p3, q=q3, k=k3, v=v3, o=o3, lse=l3)
    lanes = E._lanes(problem.head_dim, E.FWD_COLUMNS)
    micro = E.MICRO[problem.rank]
    row = E._row_floats(lanes, E.FWD_COLUMNS, micro)
    tiles, smem, grid = _old_plan(p3, micro, lanes, False, 2 * 4 * row)
    return [(_old_name("na_fwd_fp32", lanes, micro), grid, smem,
             tuple(int(c) for c in tiles["cta"]), params, tiles)]


def old_backward(problem, d_out, q, k, v, out, lse, dq, dk, dv):
    p3 = E._padded(problem)  # (planning still pads in front)
    pad = 3 - problem.rank
    delta = Layout.contiguous(lse.shape, numpy.float32)
    do3, q3, k3, v3, o3, l3, dq3, dk3, dv3, de3 = (
        x.unsqueezed(pad) for x in (d_out, q, k, v, out, lse, dq, dk, dv, delta))
    params = make_params(p3, q=q3, k=k3, v=v3, o=o3, d_o=do3, dq=dq3, dk=dk3, dv=dv3,
                         lse=l3, delta=de3)
    rows = problem.batch * problem.num_tokens * problem.heads
    calls = [("na_bwd_delta_fp32", (-(-rows * 8 // E.THREADS), 1, 1), 0, None, params, None)]
    micro = E.MICRO_DQ
    lanes = E._lanes(problem.head_dim, E.DQ_COLUMNS)
    row = E._row_floats(lanes, E.DQ_COLUMNS, micro)
    tiles, smem, grid = _old_plan(p3, micro, lanes, False, 2 * 4 * row)
    calls.append((_old_name("na_bwd_dq_fp32", lanes, micro), grid, smem,
                  tuple(int(c) for c in tiles["cta"]), params, tiles))
    micro = E.MICRO[problem.rank]
    lanes = E._lanes(problem.head_dim, E.DKV_COLUMNS)
    row = E._row_floats(lanes, E.DKV_COLUMNS, micro)
    tiles, smem, grid = _old_plan(p3, micro, lanes, True, 2 * 4 * row + 8)
    grid = (grid[0], problem.kv_heads, grid[2])
    calls.append((_old_name("na_bwd_dkv_fp32", lanes, micro), grid, smem,
                  tuple(int(c) for c in tiles["cta"]), params, tiles))
    return calls


# ---- cases ------------------------------------------------------------------------------

class _FakeKernel:
    def __init__(self, name):
        self.name = name


@pytest.fixture
def fake_kernels(monkeypatch):
    monkeypatch.setattr(E, "get_kernel", lambda source, expr, *a, **k: _FakeKernel(expr))


# (spatial, kernel, stride, dilation, causal, heads, kv_heads, head_dim, layout)
CASES = [
    ((37,), 5, 1, 1, False, 2, 2, 32, "canonical"),
    ((53,), 8, 3, 2, True, 2, 1, 64, "heads_first"),
    ((700,), 301, 1, 1, False, 1, 1, 64, "canonical"),
    ((300,), 64, 5, 1, True, 1, 1, 256, "padded_rows"),
    ((23, 29), (7, 5), (2, 1), (2, 3), (True, False), 2, 2, 32, "heads_first"),
    ((31, 30), 9, 1, 1, False, 4, 2, 36, "canonical"),
    ((40, 37), 13, 1, 1, False, 1, 1, 128, "padded_rows"),
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True), 1, 1, 100, "canonical"),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True), 2, 2, 64, "heads_first"),
    ((8, 12, 12), 3, (1, 3, 2), 1, False, 3, 1, 128, "canonical"),
    ((7, 13, 9), (3, 5, 3), (1, 2, 1), (2, 1, 1), (True, False, True), 2, 2, 20,
     "padded_rows"),
    ((5, 3, 11), (3, 2, 5), (2, 1, 1), (1, 1, 2), (False, True, False), 1, 1, 8, "canonical"),
]


def _layout(shape, layout):
    """A float32 Layout of ``shape`` [B, *spatial, H, D]: C-contiguous, heads before the
    spatial axes (a permuted buffer), or rows padded to a longer head dim."""
    if layout == "canonical":
        return Layout.contiguous(shape, F32)
    rank = len(shape) - 3
    if layout == "heads_first":
        to_hf = (0, rank + 1) + tuple(range(1, rank + 1)) + (rank + 2,)
        buf = numpy.zeros(tuple(shape[i] for i in to_hf), F32)
        x = buf.transpose(tuple(numpy.argsort(to_hf)))
    else:
        x = numpy.zeros(tuple(shape[:-1]) + (shape[-1] + 12,), F32)[..., :shape[-1]]
    return Layout(tuple(x.shape), tuple(x.strides), x.dtype, True)


def _operands(case):
    spatial, ks, st, dl, ca, heads, kv_heads, dim, layout = case
    shape = (2,) + tuple(spatial) + (heads, dim)
    kv_shape = (2,) + tuple(spatial) + (kv_heads, dim)
    q = numpy.zeros(shape, F32)
    kv = numpy.zeros(kv_shape, F32)
    problem = _args.check_fused(len(spatial), q, kv, kv, ks, st, dl, ca, None, "fused")
    full, kvl = _layout(shape, layout), _layout(kv_shape, layout)
    lse = Layout.contiguous(shape[:-1], F32)
    return problem, full, kvl, lse


def _ids(c):
    return f"{len(c[0])}d-{c[0]}-k{c[1]}-s{c[2]}-d{c[3]}-c{c[4]}-h{c[5]}/{c[6]}-D{c[7]}-{c[8]}"


def _assert_same_view(new_params, new_plan, old_params, old_plan, rank):
    """The kernels' view of the new arguments equals the old arguments, field by field."""
    assert new_params.dtype == PARAMS_DTYPE
    view = front_padded_params(new_params, rank)
    for name in PARAMS_DTYPE.names:
        assert numpy.array_equal(view[name], old_params[name]), (name, view[name],
                                                                 old_params[name])
    if old_plan is None:
        return
    assert new_plan.dtype == E.PLAN_DTYPE
    assert int(new_plan["rank"]) == rank
    view = front_padded_plan(new_plan, rank)
    for name in ("cta", "slab", "tiles"):
        assert numpy.array_equal(view[name], old_plan[name]), (name, view[name],
                                                               old_plan[name])
    # back-padded: inert axes at the back are all 1
    for name in ("cta", "slab", "tiles"):
        assert all(int(x) == 1 for x in new_plan[name][rank:])


def _delta_walk(p, limit=4096):
    """Offsets (out, d_out, delta) of the first ``limit`` rows, as na_bwd_delta_fp32 decodes
    row indices: a walk that reads NAParams in either padding."""
    e = [int(x) for x in p["extent"]]
    heads = int(p["heads"])
    rows = int(p["batch"]) * e[0] * e[1] * e[2] * heads
    out = []
    for row in range(min(rows, limit)):
        r, h = divmod(row, heads)
        r, x2 = divmod(r, e[2])
        r, x1 = divmod(r, e[1])
        b, x0 = divmod(r, e[0])
        out.append(tuple(int(numpy.dot(p[t][:5], (b, x0, x1, x2, h)))
                         for t in ("o", "d_o", "delta")))
    return rows, out


def _check_calls(new, old, rank):
    assert len(new) == len(old)
    for call, (name, grid, smem, tile, params, plan) in zip(new, old):
        if plan is None:   # the delta kernel: NAParams only, taken as it is (see the .cu)
            assert call.fn.name == name
            new_params, new_plan = call.args[-1], None
            assert _delta_walk(new_params) == _delta_walk(params)
        else:
            rank_name = name.replace("<", f"<{rank}, ", 1)
            assert call.fn.name == rank_name
            new_params, new_plan = call.args[-2], call.args[-1]
        assert call.grid == tuple(grid)
        assert call.shared_mem == smem
        assert call.tile == tile
        _assert_same_view(new_params, new_plan, params, plan, rank)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_kernels_see_what_they_saw(case, fake_kernels):
    problem, full, kvl, lse = _operands(case)
    new = E.plan_forward(problem, full, kvl, kvl, full, lse).calls
    _check_calls(new, old_forward(problem, full, kvl, kvl, full, lse), problem.rank)
    # the new NAParams is exactly the common one of every other family
    common = make_params(problem, q=full, k=kvl, v=kvl, o=full, lse=lse)
    assert new[0].args[-2].tobytes() == common.tobytes()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backward_kernels_see_what_they_saw(case, fake_kernels):
    problem, full, kvl, lse = _operands(case)
    args = (full, full, kvl, kvl, full, lse, full, kvl, kvl)  # d_out, q, k, v, out, lse, dq..
    new = E.plan_backward(problem, *args).calls
    _check_calls(new, old_backward(problem, *args), problem.rank)
    delta = Layout.contiguous(lse.shape, F32)
    common = make_params(problem, q=full, k=kvl, v=kvl, o=full, d_o=full, dq=full, dk=kvl,
                         dv=kvl, lse=lse, delta=delta)
    for call in new:
        params = call.args[-1] if call.fn.name == "na_bwd_delta_fp32" else call.args[-2]
        assert params.tobytes() == common.tobytes()


def test_rank3_view_is_the_identity():
    problem, full, kvl, lse = _operands(CASES[8])
    p = make_params(problem, q=full, k=kvl, v=kvl, o=full, lse=lse)
    assert front_padded_params(p, 3).tobytes() == p.tobytes()


def test_every_plan_names_an_instantiation(fake_kernels):
    names = {expr for _, expr in E.instantiations()}
    for case in CASES:
        for dim in range(4, 257, 4):
            problem, full, kvl, lse = _operands(case[:7] + (dim, "canonical"))
            calls = (E.plan_forward(problem, full, kvl, kvl, full, lse).calls
                     + E.plan_backward(problem, full, full, kvl, kvl, full, lse, full, kvl,
                                       kvl).calls)
            for call in calls:
                assert call.fn.name in names, call.fn.name
                assert all(isinstance(a, (Operand, numpy.void)) for a in call.args)
