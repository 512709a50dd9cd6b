"""Every Hopper fused-backward instantiation (backends/wgmma_backward.py) compiles for
sm_90a without a GPU, with no spills, no stack and no wgmma serialization; its plan builds
on operand layouts alone (kernel handles faked), with the grids, shared memory and argument
order the kernels expect. Registers per kernel go to the log (the compute warpgroups' budget
is set in the .cu with setmaxnreg; ptxas reports the entry cap). Not yet run on a GPU.
"""

import dataclasses

import numpy
import pytest

from natten_cupy import _args, _compile
from natten_cupy._operands import Layout
from natten_cupy._params import PARAMS_DTYPE
from natten_cupy.backends.fused import wgmma_backward as H

NAMES = [expr for _, expr in H.instantiations()]
# The atomic dK/dV pass with a bias at head dim 128 (na_bwd_hopper_kv_ds: dQ's tiles, the bias
# box and the dS workspace's stores beside dK and dV) spills 44 / 68 / 64 bytes at ranks
# 1 / 2 / 3 (NVRTC 13.0; three or four local loads a thread and query tile, from L1, against
# some 3000 instructions a tile); twice that for other versions' allocators. Every other
# kernel: none, and no stack.
DS_SPILLS = {(128, 1): 88, (128, 2): 136, (128, 3): 128}


def _ds_key(name):
    if "na_bwd_hopper_kv_ds<" not in name:
        return None
    args = [a.strip() for a in name.split("<", 1)[1].rstrip(">").split(",")]
    return int(args[1]), int(args[4])


@pytest.mark.skipif(not _compile.cuda_include_dirs(), reason="no CUDA headers (pip install "
                    "nvidia-cuda-runtime, or a CUDA toolkit)")
def test_hopper_bwd_kernels_compile_for_sm90a(capsys):
    reports = _compile.nvrtc_check_many(H.SOURCE, NAMES, "sm_90a")
    with capsys.disabled():
        print(f"\n{H.SOURCE} [sm_90a]: {len(reports)} kernels")
        for r in reports:
            print(f"  {r.name:<70} regs {r.registers:>3}  stack {r.stack_bytes:>4}  "
                  f"spill {r.spill_bytes}")
    # per dtype: delta and the dq store per head dim, two passes per rank and head dim, the
    # atomic dK/dV kernels (every rank and head dim), both passes with a bias, the rank-1
    # dK/dV passes (both dQ variants) with TMA loads, the one-warpgroup dQ passes (every rank
    # and head dim) and dK/dV passes (every rank and head dim), the atomic dK/dV passes with
    # a bias (every rank and head dim) and the kernel that reduces their dS workspace into
    # partial tables (the mma.sync backward's na_bwd_rpb_sum adds those)
    assert len(reports) == 2 * (2 * 2 + 2 * 3 * 2 + 3 * 2 + 2 * 3 * 2 + 2 * 2 + 3 * 2 + 3 * 2
                                + 3 * 2 + 1)
    over = [f"{r.name}: {r.spill_bytes} bytes" for r in reports
            if r.spill_bytes > DS_SPILLS.get(_ds_key(r.name), 0)
            or (r.stack_bytes and _ds_key(r.name) not in DS_SPILLS)]
    assert not over, over
    assert not [r.name for r in reports if "serialized" in r.log]
    assert not [r.name for r in reports if "C7508" in r.log or "setmaxnreg" in r.log.lower()]
    assert not [r.name for r in reports if "warning" in r.log.lower()]


def _problem(shape, rank, kernel, stride=1, dilation=1, causal=False, scale=None,
             dtype=numpy.float16, rpb=False):
    x = numpy.zeros(shape, dtype)
    bias = None
    if rpb:
        ks = (kernel,) * rank if isinstance(kernel, int) else kernel
        bias = numpy.zeros((shape[-2],) + tuple(2 * k - 1 for k in ks), dtype)
    return _args.check_fused(rank, x, x, x, kernel, stride, dilation, causal, scale, "fused",
                             rpb=bias)


def test_hopper_bwd_refusals():
    """Reasons that do not depend on the device (CI has none: the last reason is the GPU)."""
    assert "float16" in H.refuse(_problem((1, 16, 1, 32), 1, 3, dtype=numpy.float32))
    assert "multiple of 8" in H.refuse(_problem((1, 16, 1, 20), 1, 3))
    assert "up to 128" in H.refuse(_problem((1, 16, 1, 256), 1, 3))
    assert "positive scale" in H.refuse(_problem((1, 16, 1, 64), 1, 3, scale=-1.0))
    assert "compute capability" in H.refuse(_problem((1, 4, 4, 1, 64), 2, 3))
    biased = _problem((1, 300, 2, 64), 1, 65, rpb=True)
    assert "compute capability" in H.refuse(biased)
    assert "deterministic=True" in H.refuse(dataclasses.replace(biased, deterministic=True))
    # a 1-D window of 12001 at head dim 128: the bias boxes exceed shared memory
    huge = _problem((1, 13000, 1, 128), 1, 12001, rpb=True)
    assert "shared memory" in H.refuse(huge)


def test_hopper_bwd_instantiations_cover_every_plan():
    from natten_cupy._dtypes import HALF_TYPES
    names = set(NAMES)
    for dtype in HALF_TYPES:
        for dp in H.BUCKETS:
            for rank in (1, 2, 3):
                assert set(H._names(dtype, dp, rank)) <= names
                assert set(H._names(dtype, dp, rank, dq_atomic=True)) <= names
                assert set(H._names(dtype, dp, rank, bias=True)) <= names
                if rank == 1:
                    for atomic in (False, True):
                        assert H._names(dtype, dp, 1, dq_atomic=atomic, tma=True)[1] in names
                assert H._names(dtype, dp, rank, H.Q_ONE_WG[dp])[2] in names
                assert H._names(dtype, dp, rank, H.KV_ONE_WG[dp])[1] in names


class _FakeKernel:
    name = "fake"

    class kernel:  # noqa: N801 - mimics RawKernel.kernel.ptr
        ptr = 0xDEAD

    max_dynamic_shared_size_bytes = 0


PLAN_CASES = [
    # (shape [B, *spatial, H, D], kernel, stride, dilation, causal)
    ((2, 1000, 3, 64), 64, 1, 3, False),
    ((1, 16384, 16, 128), 16384, 1, 1, False),
    ((1, 97, 2, 40), 7, 2, 2, True),
    ((2, 33, 41, 2, 64), (7, 5), (2, 1), (2, 3), (True, False)),
    ((1, 10, 20, 21, 1, 72), (5, 9, 9), (2, 1, 3), (1, 2, 2), False),
]


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: f"{len(c[0]) - 3}d-{c[0]}")
def test_hopper_bwd_plan_on_layouts(case, monkeypatch):
    """plan_backward on Layouts: three calls (delta, dK/dV, dQ), the delta workspace, owner
    grids of 128-row boxes per dilation group (the dQ pass's of 64 on small windows), shared
    memory within sm_90's 227 KB, and the operand order of each kernel's signature."""
    from natten_cupy._launch import Operand
    shape, ks, st, dl, ca = case
    rank = len(shape) - 3
    prob = _problem(shape, rank, ks, st, dl, ca)
    monkeypatch.setattr(H, "get_kernel", lambda *a, **k: _FakeKernel())
    H._geometry.cache_clear()
    lay = Layout.contiguous(shape, numpy.float16)
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    plan = H.plan_backward(prob, lay, lay, lay, lay, lay, lse, lay, lay, lay, dq_atomic=False)
    assert plan.workspaces == ((tuple(shape[:-1]), numpy.dtype(numpy.float32)),)
    delta, kv, q = plan.calls
    ops = lambda c: tuple(a.index for a in c.args if isinstance(a, Operand))
    assert ops(delta) == (0, 4, 9)              # d_out, out -> delta
    assert ops(kv) == (1, 2, 3, 0, 5, 9, 7, 8)  # q, k, v, d_out, lse, delta -> dk, dv
    assert ops(q) == (1, 2, 3, 0, 5, 9, 6)      # q, k, v, d_out, lse, delta -> dq
    for c in plan.calls:
        p = c.args[-1]
        assert p.dtype == PARAMS_DTYPE
    spatial, B, heads, D = shape[1:-2], shape[0], shape[-2], shape[-1]

    def ctas(box):
        n = 1
        for a in range(rank):
            group = -(-spatial[a] // prob.dilation[a])
            n *= prob.dilation[a] * -(-group // box[a])
        return n
    # the dQ pass's box: 64 queries (one compute warpgroup) up to Q_ONE_WG_UP_TO neighbors
    one = H.Q_ONE_WG_UP_TO is not None and prob.num_neighbors <= H.Q_ONE_WG_UP_TO
    qbox = H.Q_BOX_ONE_WG[rank] if one else H.OWNER_BOX[rank]
    # the dK/dV pass's: 64 keys up to its bucket's KV_ONE_WG_UP_TO neighbors (deterministic)
    kv1 = H.one_wg_kv(prob)
    kbox = H.Q_BOX_ONE_WG[rank] if kv1 else H.OWNER_BOX[rank]
    assert kv.grid == (ctas(kbox), heads, B) and q.grid == (ctas(qbox), heads, B)
    assert kv.block == (256 if kv1 else H.THREADS, 1, 1)
    assert q.block == (256 if one else H.THREADS, 1, 1)
    assert max(kv.shared_mem, q.shared_mem) <= 227 * 1024
    assert not one or 2 * q.shared_mem <= 226 * 1024   # two CTAs an SM
    assert not kv1 or 2 * kv.shared_mem <= 226 * 1024
    dp = H._bucket(D)
    rows = B * heads * int(numpy.prod(spatial))
    assert delta.grid[0] * H.DELTA_THREADS >= rows * dp // 8
    assert delta.block == (H.DELTA_THREADS, 1, 1)


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: f"{len(c[0]) - 3}d-{c[0]}")
def test_hopper_bwd_atomic_plan_on_layouts(case, monkeypatch):
    """The atomic dQ variant: delta (zeroing the float32 dQ workspace), dK/dV adding dQ, the
    workspace stored as dq; two workspaces; shared memory as the .cu lays it out."""
    from natten_cupy._launch import Operand
    shape, ks, st, dl, ca = case
    rank = len(shape) - 3
    prob = _problem(shape, rank, ks, st, dl, ca)
    monkeypatch.setattr(H, "get_kernel", lambda *a, **k: _FakeKernel())
    H._geometry.cache_clear()
    lay = Layout.contiguous(shape, numpy.float16)
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    args = (prob, lay, lay, lay, lay, lay, lse, lay, lay, lay)
    plan = H.plan_backward(*args, dq_atomic=True)
    ws_shape, ws_dtype = H.dq_workspace(prob, H._bucket(shape[-1]))
    assert plan.workspaces == ((tuple(shape[:-1]), numpy.dtype(numpy.float32)),
                               (ws_shape, ws_dtype))
    assert ws_dtype == numpy.float32 and numpy.prod(ws_shape) >= numpy.prod(shape)
    # every in-group query of every dilation group has a row of each 64-column chunk
    dp = H._bucket(shape[-1])
    groups = tuple(-(-L // d) for L, d in zip(shape[1:-2], prob.dilation))
    assert ws_shape == (shape[0], shape[-2], *prob.dilation, dp // 64, *groups, 64)
    delta, kv, dq = plan.calls
    ops = lambda c: tuple(a.index for a in c.args if isinstance(a, Operand))
    assert ops(delta) == (0, 4, 9, 10)
    assert ops(kv) == (1, 2, 3, 0, 5, 9, 7, 8, 10)
    assert ops(dq) == (10, 6)
    assert dq.grid == delta.grid and kv.shared_mem <= 227 * 1024
    # (against the deterministic two-warpgroup pass: small windows default to one)
    plain = H.plan_backward(*args, dq_atomic=False, tile=H.default_tile(prob, kv_wg1=False))
    assert kv.grid == plain.calls[1].grid
    dp = H._bucket(shape[-1])
    # the dS^T tiles (two sets at head dim 128) and the float32 staging tiles
    ds = (2 if dp == 128 else 1) * 2 * 64 * 64 * 2
    assert kv.shared_mem == plain.calls[1].shared_mem + ds + 2 * 64 * 64 * 4
    assert plain.calls[0].args[3] == numpy.uint64(0)  # no workspace to zero: a null pointer


# stride 1 (a bias takes no other); not dense 16K (its boxes exceed shared memory: refused)
BIAS_PLAN_CASES = [c for c in PLAN_CASES if c[2] == 1 and c[1] != 16384] + [
    ((1, 32768, 16, 64), 2047, 1, 1, False),
    ((2, 40, 48, 3, 128), 33, 1, 1, False),
    ((1, 7, 30, 31, 2, 64), (5, 9, 9), 1, (1, 2, 1), (True, False, False)),
]


@pytest.mark.parametrize("case", BIAS_PLAN_CASES, ids=lambda c: f"{len(c[0]) - 3}d-{c[0]}")
def test_hopper_bwd_bias_plan_on_layouts(case, rpb_reduction, monkeypatch):
    """With a bias and the dQ pass (dq_atomic=False): the bias in both passes, the dQ pass
    writing its CTAs' gradient boxes to a workspace that the mma.sync backward's reduction
    (told the Hopper owner boxes) adds into partial tables and those into d_rpb (one launch
    where a box or the table is too large for that); shared memory with the bias parts,
    within sm_90's 227 KB; the atomic variant refused where its dS workspace would be larger
    than the gradients."""
    from natten_cupy._launch import Operand
    from natten_cupy.backends.fused import mma_backward
    shape, ks, st, dl, ca = case
    rank = len(shape) - 3
    prob = _problem(shape, rank, ks, st, dl, ca, rpb=True)
    monkeypatch.setattr(H, "get_kernel", lambda *a, **k: _FakeKernel())
    monkeypatch.setattr(mma_backward, "get_kernel", lambda *a, **k: _FakeKernel())
    monkeypatch.setattr(mma_backward, "_geometry", lambda p, t: (numpy.uint64(0), [0, 0, 0], {}))
    H._geometry.cache_clear()
    lay = Layout.contiguous(shape, numpy.float16)
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    kern = (ks,) * rank if isinstance(ks, int) else ks
    rpb = Layout.contiguous((shape[-2],) + tuple(2 * k - 1 for k in kern), numpy.float16)
    args = (prob, lay, lay, lay, lay, lay, lse, lay, lay, lay, rpb, rpb)
    plan = H.plan_backward(*args, dq_atomic=False)
    delta, kv, q, red, *total = plan.calls
    ops = lambda c: tuple(a.index for a in c.args if isinstance(a, Operand))
    assert ops(delta) == (0, 4, 11)
    assert ops(kv) == (1, 2, 3, 0, 5, 11, 7, 8, 9)   # ..., dk, dv, rpb
    assert ops(q) == (1, 2, 3, 0, 5, 11, 6, 9, 12)   # ..., dq, rpb -> the boxes
    entries = int(numpy.prod([2 * k - 1 for k in kern]))
    t = H.configure(prob, None, False)
    if rpb_reduction:   # boxes -> partial tables -> d_rpb
        total, = total
        assert ops(red) == (12, 13) and ops(total) == (13, 10)
        assert (red.name, total.name) == ("na_bwd_rpb_boxes", "na_bwd_rpb_sum")
        assert red.grid == (t.rpb_parts, shape[-2], shape[0]) and red.shared_mem == 4 * entries
        assert total.grid == (-(-entries // 128), shape[-2], 1)
        assert [int(a) for a in total.args[2:4]] == [entries, t.rpb_parts]
        assert t.rpb_parts == -(-H.owner_ctas(prob) // mma_backward.RPB_BOXES_PER_PART)
        bg = red.args[-2]
    else:               # boxes -> d_rpb
        assert not total and ops(red) == (12, 10) and red.name == "na_bwd_fused_rpb"
        assert red.grid == (entries, shape[-2], 1) and t.rpb_parts == 0
        bg = red.args[-1]
    box = H.OWNER_BOX[rank]
    ctas = H.owner_ctas(prob)
    assert int(bg["ctas"]) == ctas == q.grid[0]
    assert tuple(bg["tile"]) == box
    dim = tuple(min(2 * k - 1, k + t - 1) for k, t in zip(kern + (1,) * (3 - rank), box))
    assert tuple(bg["dim"]) == dim and int(bg["vol"]) == numpy.prod(dim)
    tables = (((shape[0] * shape[-2] * t.rpb_parts * entries,), numpy.dtype(numpy.float32)),)
    assert plan.workspaces == ((tuple(shape[:-1]), numpy.dtype(numpy.float32)),
                               ((shape[0] * shape[-2] * ctas * int(numpy.prod(dim)),),
                                numpy.dtype(numpy.float32))) + (tables if t.rpb_parts else ())
    assert (kv.shared_mem, q.shared_mem) == H._pass_smem(prob)
    assert max(kv.shared_mem, q.shared_mem) <= 227 * 1024
    plain = H.plan_backward(dataclasses.replace(prob, has_rpb=False), *args[1:10],
                            dq_atomic=False)
    assert kv.shared_mem > plain.calls[1].shared_mem and q.shared_mem > plain.calls[2].shared_mem
    if H.ds_refusal(prob):
        with pytest.raises(ValueError, match="dq_atomic"):
            H.plan_backward(*args, dq_atomic=True)


# (shape, kernel, dilation, causal): with a bias, dQ added in the dK/dV pass and d_rpb from
# its dS workspace; M5's 16 heads in two runs of 8, GQA (4 on 2) in one run per kv head.
DS_PLAN_CASES = [
    ((1, 128, 128, 16, 128), 21, 1, False, 16),
    ((2, 40, 48, 3, 128), 13, (1, 2), (True, False), 3),
    ((1, 16, 32, 32, 8, 128), (5, 7, 7), 1, False, 8),
    ((2, 300, 4, 64), 61, 2, True, 4),
    ((1, 40, 36, 4, 64), 15, 1, False, 2),
]


@pytest.mark.parametrize("case", DS_PLAN_CASES, ids=lambda c: f"{len(c[0]) - 3}d-{c[0]}-kv{c[4]}")
def test_hopper_bwd_bias_ds_workspace_plan(case, monkeypatch):
    """dq_atomic with a bias: delta (zeroing dQ's float32 workspace), per run of kv heads
    the dK/dV pass writing dS into the workspace and its reduction into partial tables, then
    dq = scale * workspace and the tables' sum into d_rpb; the workspace of one run no larger
    than the gradients; shared memory within sm_90's 227 KB."""
    from natten_cupy import _args
    from natten_cupy._launch import Operand
    from natten_cupy.backends.fused import mma_backward
    shape, ks, dl, ca, kv_heads = case
    rank = len(shape) - 3
    kern = (ks,) * rank if isinstance(ks, int) else ks
    x = numpy.zeros(shape, numpy.float16)
    kx = numpy.zeros(shape[:-2] + (kv_heads, shape[-1]), numpy.float16)
    bias = numpy.zeros((shape[-2],) + tuple(2 * k - 1 for k in kern), numpy.float16)
    prob = _args.check_fused(rank, x, kx, kx, ks, 1, dl, ca, None, "fused", rpb=bias)
    assert H.ds_refusal(prob) is None
    monkeypatch.setattr(H, "get_kernel", lambda *a, **k: _FakeKernel())
    monkeypatch.setattr(mma_backward, "get_kernel", lambda *a, **k: _FakeKernel())
    lay, kl = (Layout.contiguous(a.shape, numpy.float16) for a in (x, kx))
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    rpb = Layout.contiguous(bias.shape, numpy.float16)
    plan = H.plan_backward(prob, lay, lay, kl, kl, lay, lse, lay, kl, kl, rpb, rpb,
                           dq_atomic=True)
    runs = H.ds_head_groups(prob)
    group = shape[-2] // kv_heads
    assert sum(n for _, n in runs) == kv_heads and [h for h, _ in runs] == sorted(
        {h for h, _ in runs})
    names = [c.name for c in plan.calls]
    assert names == (["na_bwd_hopper_delta"] + ["na_bwd_hopper_kv", "na_bwd_ds_rpb"] * len(runs)
                     + ["na_bwd_hopper_dq", "na_bwd_rpb_sum"])
    ops = lambda c: tuple(a.index for a in c.args if isinstance(a, Operand))
    ints = lambda c: [int(a) for a in c.args if isinstance(a, numpy.int32)]
    assert ops(plan.calls[0]) == (0, 4, 11, 12)          # delta zeroes the dQ workspace
    entries = int(numpy.prod([2 * k - 1 for k in kern]))
    tokens = int(numpy.prod(shape[1:-2]))
    parts = -(-tokens // H.DS_CHUNK) * -(-prob.num_neighbors // H.DS_SLOTS)
    for i, (h, n) in enumerate(runs):
        kv, red = plan.calls[1 + 2 * i], plan.calls[2 + 2 * i]
        assert ops(kv) == (1, 2, 3, 0, 5, 11, 7, 8, 12, 9, 13)   # ..., dq_ws, rpb, dS
        assert ints(kv) == [h] and kv.grid[1:] == (n, shape[0])
        assert ops(red) == (13, 14) and ints(red) == [entries, h * group]
        assert red.grid == (parts, n * group, shape[0])
        assert kv.shared_mem <= 227 * 1024 and red.shared_mem <= H.DS_SMEM_LIMIT
    dq, total = plan.calls[-2:]
    assert ops(dq) == (12, 6) and ops(total) == (14, 10)
    assert ints(total) == [entries, parts] and total.grid == (-(-entries // 128), shape[-2], 1)
    ws = dict(zip(("delta", "dq", "ds", "parts"), plan.workspaces))
    biggest = max(n for _, n in runs) * group
    assert ws["ds"] == ((shape[0], biggest, tokens, prob.num_neighbors), prob.dtype)
    assert ws["parts"] == ((shape[0] * shape[-2] * parts * entries,), numpy.dtype(numpy.float32))
    grads = 2 * shape[0] * tokens * (shape[-2] + 2 * kv_heads) * shape[-1]
    assert 2 * numpy.prod(ws["ds"][0]) <= grads
    # the default takes it at head dim 128 on 2-D and 3-D windows (once BIAS_DS is on)
    assert H.atomic_pays(prob) == (H.BIAS_DS and rank > 1 and shape[-1] == 128)


def test_hopper_bwd_plan_refuses_unreadable_rows(monkeypatch):
    monkeypatch.setattr(H, "get_kernel", lambda *a, **k: _FakeKernel())
    shape = (1, 64, 2, 64)
    prob = _problem(shape, 1, 7)
    lay = Layout.contiguous(shape, numpy.float16)
    strided = Layout(shape, lay.strides[:-1] + (4,), lay.dtype, True)
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    assert H.plan_backward(prob, lay, strided, lay, lay, lay, lse, lay, lay, lay) is None


@pytest.mark.parametrize("case", PLAN_CASES, ids=lambda c: f"{len(c[0]) - 3}d-{c[0]}")
def test_hopper_bwd_default_plan_follows_determinism(case, monkeypatch):
    """Without ``dq_atomic``: deterministic=True always plans the three deterministic
    launches (the dQ pass, one workspace); deterministic=False the atomic variant exactly
    where ``atomic_pays`` says so (its float32 dQ workspace and store launch)."""
    import dataclasses
    shape, ks, st, dl, ca = case
    rank = len(shape) - 3
    monkeypatch.setattr(H, "get_kernel", lambda *a, **k: _FakeKernel())
    H._geometry.cache_clear()
    lay = Layout.contiguous(shape, numpy.float16)
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    for det in (True, False):
        prob = dataclasses.replace(_problem(shape, rank, ks, st, dl, ca), deterministic=det)
        plan = H.plan_backward(prob, lay, lay, lay, lay, lay, lse, lay, lay, lay)
        atomic = H.atomic_pays(prob)
        assert not (det and atomic)
        assert len(plan.workspaces) == (2 if atomic else 1)
        assert plan.calls[-1].name == ("na_bwd_hopper_dq" if atomic else "na_bwd_hopper_q")


def test_hopper_bwd_atomic_dq_where_it_measured_faster():
    """``atomic_pays``: never with deterministic=True; by default at head dim 128 only, on
    1-D windows from ATOMIC_1D_FROM."""
    import dataclasses
    big = H.ATOMIC_1D_FROM
    for shape, rank, ks, want in (((1, 3000, 2, 64), 1, big, False),
                                  ((1, 3000, 2, 40), 1, big, False),
                                  ((1, 3000, 2, 72), 1, big, True),
                                  ((1, 3000, 2, 128), 1, big, True),
                                  ((1, 3000, 2, 128), 1, big - 1, False),
                                  ((1, 300, 2, 128), 1, 65, False),
                                  ((1, 30, 20, 2, 128), 2, 7, True),
                                  ((1, 30, 20, 2, 72), 2, 3, True),
                                  ((1, 6, 30, 20, 2, 128), 3, 3, True)):
        prob = _problem(shape, rank, ks)
        assert H.atomic_pays(prob) is want, (shape, ks)
        assert H.atomic_pays(dataclasses.replace(prob, deterministic=True)) is False
