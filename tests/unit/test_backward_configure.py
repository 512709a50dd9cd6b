"""The fused backward parts decide once per problem, without a GPU.

``mma_backward.configure``, ``wgmma_backward.configure`` and
``exact_fp32.configure_backward`` return the launch geometry of a problem (a frozen Tiling)
or the reason the part refuses it, cached: ``refuse`` returns that reason, and
``plan_backward`` binds the arrays to the decision's kernels, grids, shared memory and
geometry structs without sizing anything again. Device-dependent inputs stay outside the
cached decision: the Hopper part's compute capability (read by ``refuse``), the exact-float32
part's shared-memory budget (part of its key), the mma.sync part's window tables on the
device and the SM count that splits the additional tokens (read by ``plan_backward``).
Kernel handles and the device tables are faked.
"""

import dataclasses
import math

import numpy
import pytest

from natten_cupy import _args
from natten_cupy._operands import DeviceLimits, Layout
from natten_cupy.backends.fused import exact_fp32 as E
from natten_cupy.backends.fused import mma_backward as M
from natten_cupy.backends.fused import wgmma_backward as H


def _problem(spatial, kernel, head_dim=64, dtype=numpy.float16, heads=2, kv_heads=None,
             stride=1, dilation=1, causal=False, rpb=False, **kw):
    rank = len(spatial)
    q = numpy.zeros((1, *spatial, heads, head_dim), dtype)
    kv = numpy.zeros((1, *spatial, kv_heads or heads, head_dim), dtype)
    ks = (kernel,) * rank if isinstance(kernel, int) else kernel
    bias = numpy.zeros((heads, *(2 * k - 1 for k in ks)), dtype) if rpb else None
    return _args.check_fused(rank, q, kv, kv, kernel, stride, dilation, causal, None, "fused",
                             rpb=bias, **kw)


def _layouts(p):
    """Contiguous operand layouts of plan_backward (d_out, q, k, v, out, lse, dq, dk, dv[,
    rpb, d_rpb])."""
    full = Layout.contiguous((p.batch, *p.spatial, p.heads, p.head_dim), p.dtype)
    kv = Layout.contiguous((p.batch, *p.spatial, p.kv_heads, p.head_dim), p.dtype)
    lse = Layout.contiguous((p.batch, *p.spatial, p.heads), numpy.float32)
    out = [full, full, kv, kv, full, lse, full, kv, kv]
    if p.has_rpb:
        table = Layout.contiguous((p.heads, *(2 * k - 1 for k in p.kernel_size)), p.dtype)
        out += [table, table]
    return out


class _FakeKernel:
    def __init__(self, expr):
        self.name = expr


@pytest.fixture
def fake_device(monkeypatch):
    """Kernel handles that record their name expression; the mma.sync part's device tables
    as a null pointer."""
    for part in (M, H, E):
        monkeypatch.setattr(part, "get_kernel", lambda src, expr, **kw: _FakeKernel(expr))
    monkeypatch.setattr(M, "_geometry", lambda p, tile: (numpy.uint64(0), (0, 0, 0), {}))
    monkeypatch.setattr(M, "_limits", lambda: H100)


H100 = DeviceLimits(227 * 1024, 228 * 1024, 132)


def _same_struct(a, b):
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ---- mma.sync backward -------------------------------------------------------------------

MMA_CASES = [
    dict(spatial=(97,), kernel=7, stride=2, dilation=2, causal=True, head_dim=40),
    dict(spatial=(300,), kernel=65, rpb=True, head_dim=128),
    dict(spatial=(33, 41), kernel=(7, 5), stride=(2, 1), dilation=(2, 3), heads=4, kv_heads=2),
    dict(spatial=(23, 29), kernel=(9, 9), rpb=True, dtype=numpy.float32, allow_tf32=True,
         head_dim=256),
    dict(spatial=(10, 20, 21), kernel=(5, 9, 9), dilation=(1, 2, 2), head_dim=72),
    dict(spatial=(17, 22), kernel=(5, 7), rpb=True, heads=4, kv_heads=2, head_dim=152),
]


def test_head_dim_chunks_tile_their_bucket(monkeypatch):
    """Every bucket splits into whole chunks of 16-column multiples (the kernels' ldmatrix
    and mma steps), so no column is computed twice or left out; 136-160 pad to 160 with
    BUCKET_160, else to 256, and the decision follows the switch (it keys the cache)."""
    for dp in M.D_BUCKETS:
        for chunk in (M._q_chunk(dp), M._kv_chunk(dp)):
            assert chunk % 16 == 0 and dp % chunk == 0, (dp, chunk)
    p = _problem((64,), 7, head_dim=144)
    monkeypatch.setattr(M, "BUCKET_160", False)
    assert [M._bucket(d) for d in (128, 136, 160, 168, 256)] == [128, 256, 256, 256, 256]
    assert M.configure(p).dp == 256
    monkeypatch.setattr(M, "BUCKET_160", True)
    assert [M._bucket(d) for d in (128, 136, 160, 168, 256)] == [128, 160, 160, 256, 256]
    assert M.configure(p).dp == 160
    names = [n for _, n in M.instantiations()]
    assert "na_bwd_fused_kv<__half, 160, 80, false, false>" in names
    assert "na_bwd_fused_q<__nv_bfloat16, 160, 160, true, false>" in names
    assert not any(n.startswith(("na_bwd_extra_kv", "na_bwd_fused_one")) and ", 160," in n
                   for n in names)


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{len(c['spatial'])}d-{c['spatial']}")
def test_mma_backward_plan_binds_the_decision(case, fake_device, rpb_reduction, monkeypatch):
    p = _problem(**case)
    t = M.configure(p)
    assert isinstance(t, M.Tiling) and M.refuse(p) is None
    assert M.configure(dataclasses.replace(p)) is t          # cached for an equal problem
    # The decision is what the pieces give: tiles, window reach, slab rows, bias parts.
    tile, patch = M.TILES[p.rank]
    dp = M._bucket(p.head_dim)
    nwarps = 4
    _, offsets, reach = M._window_tables(tuple(M._axes(p)), tile)
    bias_smem = M._bias_smem(p) if p.has_rpb else {True: 0, False: 0}
    itemsize = numpy.dtype(p.dtype).itemsize
    for ps, owner_is_key in ((t.q, False), (t.kv, True)):
        slab, smem = M._slab_rows(reach[owner_is_key], dp, itemsize, nwarps, owner_is_key,
                                  bias_smem[owner_is_key])
        assert ps.smem == smem
        assert [int(g["slab_rows"]) for _, g in ps.launches] == [slab] * len(ps.launches)
        assert all(tuple(g["tab_off"]) == offsets for _, g in ps.launches)
    per_axis = M.tiles_per_axis(p, tile)
    ctas = numpy.prod(per_axis) * numpy.prod(p.dilation)
    assert t.q.launches[0][0] == (ctas * (dp // M._q_chunk(dp)), p.heads, 1)
    assert t.kv.launches[0][0] == (ctas * (dp // M._kv_chunk(dp)), p.kv_heads, 1)
    if p.has_rpb:
        assert _same_struct(t.bias, M.bias_geometry(p, offsets, per_axis))
    # plan_backward launches exactly that (the passes one by one, ONE_LAUNCH False).
    monkeypatch.setattr(M, "ONE_LAUNCH", False)
    plan = M.plan_backward(p, *_layouts(p))
    calls = plan.calls
    assert [c.fn.name for c in calls[:2]] == [t.q.name, t.kv.name]
    for c, ps in zip(calls[:2], (t.q, t.kv)):
        (grid, geo), = ps.launches
        assert (c.grid, c.shared_mem, c.block) == (grid, ps.smem, (t.threads, 1, 1))
        assert c.args[-1] is geo and c.tile == t.tile
    if p.has_rpb and not rpb_reduction:   # the dQ CTAs' boxes -> d_rpb in one launch
        assert t.rpb_parts == 0 and [c.name for c in calls[2:]] == ["na_bwd_fused_rpb"]
        assert calls[2].args[-1] is t.bias and calls[2].grid == (t.entries, p.heads, 1)
        assert plan.workspaces[1:] == (((t.bias_boxes,), numpy.dtype(numpy.float32)),)
    elif p.has_rpb:
        # the dQ CTAs' boxes -> partial tables -> d_rpb, in two launches
        boxes, total = calls[2:]
        parts = -(-int(t.bias["ctas"]) // M.RPB_BOXES_PER_PART)
        assert t.rpb_parts == parts == M.rpb_parts(p, t.bias) > 0
        assert boxes.name == "na_bwd_rpb_boxes" and boxes.args[-2] is t.bias
        assert boxes.grid == (parts, p.heads, p.batch) and boxes.shared_mem == 4 * t.entries
        slots = int(boxes.fn.name.split("<")[1].rstrip(">"))
        assert slots * M.RPB_THREADS >= int(t.bias["vol"]) > slots // 2 * M.RPB_THREADS
        per = int(boxes.args[-1])
        assert (parts - 1) * per < int(t.bias["ctas"]) <= parts * per
        assert total.name == "na_bwd_rpb_sum" and total.grid == (-(-t.entries // 128), p.heads, 1)
        assert [int(a) for a in total.args[2:4]] == [t.entries, parts]
        assert [a.index for a in (boxes.args[0], boxes.args[1], total.args[0], total.args[1])] \
            == [12, 13, 13, 10]   # boxes -> tables -> d_rpb
        assert plan.workspaces[1:] == (((t.bias_boxes,), numpy.dtype(numpy.float32)),
                                       ((p.batch * p.heads * parts * t.entries,),
                                        numpy.dtype(numpy.float32)))
    else:
        assert len(calls) == 2 and len(plan.workspaces) == 1


def test_rpb_reduction_in_two_launches_where_it_fits(fake_device, monkeypatch):
    """``rpb_parts``: 0 (the one-launch reduction) with RPB_TWO_LAUNCH off; on, one CTA per
    RPB_BOXES_PER_PART boxes of a (batch, head), and 0 where a box exceeds the kernel's
    largest slot count, the table its shared memory, or the batch its grid z."""
    p = _problem((40, 40), (7, 7), rpb=True)
    bg = numpy.zeros((), M.BIAS_GEOM)
    bg["ctas"], bg["vol"], bg["tvol"] = 1000, 289, 1089

    def parts(batch=1, **fields):
        g = bg.copy()
        for name, value in fields.items():
            g[name] = value
        return M.rpb_parts(dataclasses.replace(p, batch=batch), g[()])

    monkeypatch.setattr(M, "RPB_TWO_LAUNCH", False)
    assert parts() == 0
    monkeypatch.setattr(M, "RPB_TWO_LAUNCH", True)
    assert parts() == -(-1000 // M.RPB_BOXES_PER_PART) == parts(ctas=1000, batch=65535)
    assert parts(ctas=M.RPB_BOXES_PER_PART) == 1 and parts(ctas=0) == 0
    most = M.RPB_THREADS * M.RPB_SLOTS[-1]
    assert parts(vol=most) > 0 and parts(vol=most + 1) == 0
    assert parts(tvol=M.RPB_TABLE_SMEM // 4) > 0 and parts(tvol=M.RPB_TABLE_SMEM // 4 + 1) == 0
    assert parts(batch=65536) == 0
    # the slot count a box takes: the fewest threads x slots holding it
    for vol, slots in ((1, 1), (256, 1), (257, 2), (1025, 8), (most, M.RPB_SLOTS[-1])):
        g = bg.copy()
        g["vol"] = vol
        null = numpy.uint64(0)
        calls = M.rpb_reduction(p, g[()], 4, null, numpy.zeros((), M.PASS_GEOM)[()], null,
                                null, null)
        assert calls[0].fn.name == f"na_bwd_rpb_boxes<{slots}>"


def test_mma_backward_one_launch(fake_device, monkeypatch):
    """Both passes in one launch where the kernel takes the problem (no bias, additional
    tokens or grouped heads; head dims up to 128) and every CTA of both is resident at once
    (2 an SM, or fewer by shared memory); the launch is the two passes' grids end to end."""
    small = _problem((40, 48), (7, 7), heads=4)
    t = M.configure(small)
    (gq, q_geo), (gkv, kv_geo) = t.q.launches[0], t.kv.launches[0]
    (grid, (a, b, nq)), = t.one.launches
    assert grid == (gq[0] + gkv[0], gq[1], 1) == (gq[0] + gkv[0], gkv[1], 1)
    assert a is q_geo and b is kv_geo and nq == gq[0] and nq.dtype == numpy.uint32
    assert t.one.smem == max(t.q.smem, t.kv.smem)
    assert t.one.name == "na_bwd_fused_one<__half, 64, 64, 64>"
    ctas = grid[0] * grid[1]
    assert M.one_launch(t, H100) == (ctas <= 132 * 2)
    assert M.one_launch(t, DeviceLimits(227 * 1024, 228 * 1024, -(-ctas // 2)))
    assert not M.one_launch(t, DeviceLimits(227 * 1024, 228 * 1024, -(-ctas // 2) - 1))
    # one CTA an SM where shared memory holds only one
    one_cta = DeviceLimits(227 * 1024, 2 * t.one.smem + 2047, ctas)
    assert M.one_launch(t, one_cta) and not M.one_launch(
        t, DeviceLimits(227 * 1024, 2 * t.one.smem + 2047, ctas - 1))
    # the plan: one call with both passes' geometry and the dQ CTAs, or the two passes
    for forced, want in ((None, M.one_launch(t, H100)), (True, True), (False, False)):
        monkeypatch.setattr(M, "ONE_LAUNCH", forced)
        calls = M.plan_backward(small, *_layouts(small)).calls
        if want:
            (c,), = [calls]
            assert c.fn.name == t.one.name and c.grid == grid and c.shared_mem == t.one.smem
            assert c.args[-3] is q_geo and c.args[-2] is kv_geo and c.args[-1] == nq
        else:
            assert [c.fn.name for c in calls] == [t.q.name, t.kv.name]
    monkeypatch.setattr(M, "ONE_LAUNCH", None)
    tiny = _problem((8, 8), (3, 3), head_dim=32, heads=1)
    assert M.one_launch(M.configure(tiny), H100)
    assert len(M.plan_backward(tiny, *_layouts(tiny)).calls) == 1
    large = _problem((128, 128), (7, 7), heads=8)
    assert M.configure(large).one is not None and not M.one_launch(M.configure(large), H100)
    # where the kernel does not run: bias, grouped heads, head dim 256, tokens
    monkeypatch.setattr(M, "ONE_LAUNCH", True)
    for p in (_problem((40, 48), (7, 7), rpb=True), _problem((40, 48), (7, 7), kv_heads=1),
              _problem((40, 48), (7, 7), head_dim=256)):
        assert M.configure(p).one is None and not M.one_launch(M.configure(p), H100)
        assert len(M.plan_backward(p, *_layouts(p)).calls) >= 2
    x = numpy.zeros((1, 10, 2, 64), numpy.float16)
    q = numpy.zeros((1, 40, 2, 64), numpy.float16)
    tokens = _args.check_fused(1, q, q, q, 7, 1, 1, False, None, "fused", additional_keys=x,
                               additional_values=x)
    assert M.configure(tokens).one is None


def test_mma_backward_refusals_are_the_decision():
    exact = _problem((64,), 7, dtype=numpy.float32)
    assert M.refuse(exact) == M.configure(exact) == "exact float32 runs in exact_fp32"
    odd = _problem((64,), 7, head_dim=20)
    assert M.refuse(odd) == M.configure(odd) == "head_dim 20 must be a multiple of 8 up to 256"
    # the bias table and boxes of a 1-D window of 12001 exceed the 64 KB the passes give it
    big = _problem((13000,), 12001, head_dim=128, heads=1, rpb=True)
    assert M.refuse(big) == (
        "the bias table and bias-gradient boxes of kernel (12001,) exceed 64 KB of shared "
        "memory (backend 'naive' runs it)")
    assert M.configure(big) is M.configure(dataclasses.replace(big))
    with pytest.raises(ValueError, match="exact float32 runs in exact_fp32"):
        M.plan_backward(exact, *_layouts(exact))


def test_mma_backward_decision_follows_the_tiles(monkeypatch):
    """A probe that swaps a rank's TILES entry gets a decision of those tiles."""
    p = _problem((40, 48), (7, 7))
    first = M.configure(p)
    monkeypatch.setitem(M.TILES, 2, ((16, 8, 1), (4, 4, 1)))
    swapped = M.configure(p)
    assert swapped.tile == (16, 8, 1) and swapped.threads == 32 * 8
    monkeypatch.undo()
    assert M.configure(p) is first


def test_mma_backward_extra_tokens_split_by_the_device():
    """The additional tokens' launches depend on the SM count: cached per (problem, SMs)."""
    q = numpy.zeros((2, 300, 4, 64), numpy.float16)
    x = numpy.zeros((2, 100, 2, 64), numpy.float16)
    p = _args.check_fused(1, q, q, q, 33, 1, 1, False, None, "fused", additional_keys=x,
                          additional_values=x)
    assert M.takes_extra(p)
    x132, x108 = M._extra_tiling(p, 132), M._extra_tiling(p, 108)
    assert M._extra_tiling(p, 132) is x132
    for x, sms in ((x132, 132), (x108, 108)):
        splits, rows = M._extra_splits(p, 64, sms)
        (grid, geo), = x.launches
        assert grid == (-(-100 // 64), 2 * 2, splits) and int(geo["split_rows"]) == rows
        assert x.partials == 2 * splits * 2 * 100 * 2 * 64


def test_mma_backward_plan_refuses_a_grid_too_large(fake_device):
    p = dataclasses.replace(_problem((16, 16, 16), 3), spatial=(8192, 8192, 8192))
    assert M.refuse(p) is None
    assert M.configure(p).grid_x >= 2 ** 31
    with pytest.raises(ValueError, match="too large for one fused-backward launch"):
        M.plan_backward(p, *_layouts(p))


# ---- Hopper backward ---------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True])
def test_hopper_backward_decision_without_the_device(bias, fake_device, rpb_reduction,
                                                     monkeypatch):
    """configure does not read the device: refuse adds the compute capability to it."""
    p = _problem((33, 41), (7, 5), head_dim=128, rpb=bias)
    t = H.configure(p)
    assert isinstance(t, H.Tiling) and H.configure(dataclasses.replace(p)) is t
    monkeypatch.setattr(H, "_compute_capability", lambda: (9, 0))
    assert H.refuse(p) is None
    monkeypatch.setattr(H, "_compute_capability", lambda: (8, 0))
    assert H.refuse(p) == ("the Hopper fused backward needs compute capability 9.0, this "
                           "device has 8.0")
    assert H.configure(p) is t
    # the decision is what the pieces give (head dim 128 on 2-D: dQ added in the dK/dV pass;
    # with a bias where BIAS_DS is on, d_rpb then from its dS workspace, else the dQ pass)
    assert t.dq_atomic == (H.BIAS_DS or not bias) and t.dq_atomic == H.atomic_pays(p)
    if t.dq_atomic:
        assert t.smem == ((H._ds_kv_smem(p, H.DEFAULT[128]) if bias else
                           H.smem_bytes(128, 64, 2, True, True)), H._pass_smem(p)[1])
    else:
        assert t.smem == H._pass_smem(p)
    assert t.ctas == H.owner_ctas(p)
    assert t.names == H._names(p.dtype, 128, 2, None, t.dq_atomic, bias)
    plan = H.plan_backward(p, *_layouts(p))
    delta, kv = plan.calls[:2]
    dq = next(c for c in plan.calls if c.name in ("na_bwd_hopper_dq", "na_bwd_hopper_q"))
    assert [c.fn.name for c in (delta, kv, dq)] == list(t.names)
    assert delta.grid == (t.delta_blocks, 1, 1)
    assert kv.grid == (t.kv_ctas, p.kv_heads, p.batch) and kv.shared_mem == t.smem[0]
    assert t.kv_ctas == t.ctas and t.kv_threads == H.THREADS   # (two warpgroups here)
    assert plan.workspaces[1:] == t.workspaces
    if bias and t.dq_atomic:
        assert [c.name for c in plan.calls] == ["na_bwd_hopper_delta", "na_bwd_hopper_kv",
                                                "na_bwd_ds_rpb", "na_bwd_hopper_dq",
                                                "na_bwd_rpb_sum"]
        assert t.bias is None and t.ds_parts == plan.calls[2].grid[0]
        assert plan.calls[4].grid == (-(-t.entries // 128), 2, 1)
    elif bias:
        assert dq.shared_mem == t.smem[1]
        if rpb_reduction:
            assert [c.name for c in plan.calls[3:]] == ["na_bwd_rpb_boxes", "na_bwd_rpb_sum"]
            assert plan.calls[3].args[-2] is t.bias
            assert plan.calls[3].grid == (t.rpb_parts, 2, 1) and t.rpb_parts > 0
        else:
            assert [c.name for c in plan.calls[3:]] == ["na_bwd_fused_rpb"]
            assert plan.calls[3].args[-1] is t.bias and plan.calls[3].grid == (t.entries, 2, 1)


def test_hopper_backward_bias_ds_default_switch(fake_device, monkeypatch):
    """BIAS_DS on: a biased 2-D problem at head dim 128 takes the dS-workspace variant by
    default (dq_atomic), off: the dQ pass; a 1-D one and one at head dim 64 the dQ pass
    either way; deterministic=True is refused by this part either way."""
    p2 = _problem((33, 41), (7, 5), head_dim=128, rpb=True)
    p1 = _problem((300,), 33, head_dim=128, rpb=True)
    p64 = _problem((33, 41), (7, 5), head_dim=64, rpb=True)
    for on in (False, True):
        monkeypatch.setattr(H, "BIAS_DS", on)
        H._configure.cache_clear()
        assert H.atomic_pays(p2) == on and not H.atomic_pays(p1) and not H.atomic_pays(p64)
        t = H.configure(p2)
        assert t.dq_atomic == on and ("na_bwd_hopper_kv_ds" in t.names[1]) == on
        names = [c.name for c in H.plan_backward(p2, *_layouts(p2)).calls]
        boxes = "na_bwd_fused_rpb" in names or "na_bwd_rpb_boxes" in names   # (either reduction)
        assert ("na_bwd_ds_rpb" in names) == on and boxes != on
        assert "deterministic=True" in H.configure(dataclasses.replace(p2, deterministic=True))
    H._configure.cache_clear()


def test_hopper_backward_overrides_are_their_own_decisions(fake_device):
    p = _problem((33, 41), (7, 5), head_dim=128)
    assert H.atomic_pays(p)   # head dim 128: the default adds dQ in the dK/dV pass
    default, atomic = H.configure(p), H.configure(p, dq_atomic=True)
    plain = H.configure(p, None, False)
    assert default is atomic and plain is not default and not plain.dq_atomic
    assert len(plain.workspaces) == 0 and len(atomic.workspaces) == 1
    tile = H.BwdTile(64, 3, 128, 2)
    other = H.configure(p, tile, False)
    assert other.smem == H._pass_smem(p, tile) and str(tile.bn) in other.names[2]
    assert H.plan_backward(p, *_layouts(p), tile=tile, dq_atomic=False).calls[1].shared_mem \
        == other.smem[0]


def _one_warpgroup(rank, head_dim, tiles):
    """(spatial, problem, tile, its Tiling) of a small window at ``rank`` with the tile of
    ``tiles`` (Q_ONE_WG or KV_ONE_WG) for ``head_dim``, deterministic passes."""
    spatial = {1: (300,), 2: (33, 41), 3: (9, 17, 13)}[rank]
    p = _problem(spatial, 3, head_dim=head_dim)
    tile = tiles[head_dim]
    t = H.configure(p, tile, False)
    assert isinstance(t, H.Tiling), t
    return spatial, p, tile, t


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_backward_one_warpgroup_dq_pass(rank, head_dim, fake_device, monkeypatch):
    """The dQ pass with one compute warpgroup (Q_ONE_WG): 64-query boxes, 256 threads, two
    CTAs' shared memory within an SM's, its kernel among the instantiations; the dK/dV pass
    as the two-warpgroup tile's; refused with a bias; the default only where
    Q_ONE_WG_UP_TO says (the dK/dV pass's own default off)."""
    monkeypatch.setattr(H, "KV_ONE_WG_UP_TO", {64: None, 128: None})
    spatial, p, tile, t = _one_warpgroup(rank, head_dim, H.Q_ONE_WG)
    assert t.q_box == H.Q_BOX_ONE_WG[rank][:rank] and math.prod(H.Q_BOX_ONE_WG[rank]) == 64
    assert t.q_threads == 256 and t.q_ctas == H.owner_ctas(p, H.Q_BOX_ONE_WG[rank])
    assert 2 * t.smem[1] <= 228 * 1024 - 2 * 1024   # two CTAs an SM (1 KiB reserved each)
    assert t.smem[1] == H.smem_bytes(head_dim, tile.bn, tile.q_stages, False, own=64)
    two = H.configure(p, H.DEFAULT[head_dim], False)
    assert t.names[:2] == two.names[:2] and t.smem[0] == two.smem[0]
    assert t.names[2].endswith(", false, 1>") and (H.SOURCE, t.names[2]) in H.instantiations()
    plan = H.plan_backward(p, *_layouts(p), tile=tile, dq_atomic=False)
    dq = plan.calls[2]
    assert dq.fn.name == t.names[2] and dq.block == (256, 1, 1)
    assert dq.grid == (t.q_ctas, p.heads, p.batch) and dq.shared_mem == t.smem[1]
    assert plan.calls[1].grid == (t.ctas, p.kv_heads, p.batch)
    biased = _problem(spatial, 3, head_dim=head_dim, rpb=True)
    assert "two compute warpgroups" in H.configure(biased, tile, False)
    # the default for windows up to Q_ONE_WG_UP_TO neighbors without a bias (never at None)
    assert H.Q_ONE_WG_UP_TO is None or H.default_tile(p) == tile
    monkeypatch.setattr(H, "Q_ONE_WG_UP_TO", None)
    assert H.default_tile(p) == H.DEFAULT[head_dim]
    monkeypatch.setattr(H, "Q_ONE_WG_UP_TO", 27)
    assert H.default_tile(p) == tile and H.default_tile(biased) == H.DEFAULT[head_dim]
    wide = _problem(spatial, 7 if rank > 1 else 29, head_dim=head_dim)
    assert H.default_tile(wide) == H.DEFAULT[head_dim]


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_backward_one_warpgroup_kv_pass(rank, head_dim, fake_device, monkeypatch):
    """The dK/dV pass with one compute warpgroup (KV_ONE_WG; 32-query tiles at head dim 128):
    64-key boxes (the one-warpgroup dQ pass's), 256 threads, two CTAs' shared memory within
    an SM's, its kernel among the instantiations; the dQ pass as the tile says; refused with
    64-query tiles at 128, with a bias and with dq_atomic; the default only where
    KV_ONE_WG_UP_TO says."""
    spatial, p, tile, t = _one_warpgroup(rank, head_dim, H.KV_ONE_WG)
    box = H.Q_BOX_ONE_WG[rank]
    assert t.box == box[:rank] and t.kv_threads == 256 and t.kv_ctas == H.owner_ctas(p, box)
    assert t.ctas == H.owner_ctas(p)   # (the 128-row boxes, the bias reduction's)
    assert 2 * t.smem[0] <= 228 * 1024 - 2 * 1024   # two CTAs an SM (1 KiB reserved each)
    assert t.smem[0] == H.smem_bytes(head_dim, tile.bq, tile.kv_stages, True, own=64)
    assert t.names[1].endswith(", false, false, 1>") and f", {rank}, " in t.names[1]
    assert f", {head_dim}, {tile.bq}, {tile.kv_stages}, " in t.names[1]
    assert (H.SOURCE, t.names[1]) in H.instantiations()
    assert H.kv_one_wg(H.DEFAULT[head_dim], head_dim) == dataclasses.replace(
        H.DEFAULT[head_dim], kv_wg=1, bq=tile.bq, kv_stages=tile.kv_stages)
    assert t.kv_tma_refusal and not t.kv_tma_name
    plan = H.plan_backward(p, *_layouts(p), tile=tile, dq_atomic=False)
    kv = plan.calls[1]
    assert kv.fn.name == t.names[1] and kv.block == (256, 1, 1) and kv.tile == t.box
    assert kv.grid == (t.kv_ctas, p.kv_heads, p.batch) and kv.shared_mem == t.smem[0]
    if head_dim == 128:
        wide = dataclasses.replace(tile, bq=64)
        assert "query tiles of 32" in H.configure(p, wide, False)
    biased = _problem(spatial, 3, head_dim=head_dim, rpb=True)
    assert "without a bias" in H.configure(biased, dataclasses.replace(tile, q_wg=2), False)
    assert "without dq_atomic" in H.configure(p, tile, True)
    # the default for windows up to KV_ONE_WG_UP_TO neighbors, deterministic passes only
    monkeypatch.setattr(H, "KV_ONE_WG_UP_TO", {64: None, 128: None})
    assert H.default_tile(p).kv_wg == 2
    monkeypatch.setattr(H, "KV_ONE_WG_UP_TO", {64: 27, 128: 27})
    assert H.default_tile(biased).kv_wg == 2
    assert H.default_tile(_problem(spatial, 7 if rank > 1 else 29, head_dim=head_dim)).kv_wg == 2
    if H.atomic_pays(p):   # (head dim 128, ranks 2 and 3: the atomic dQ variant)
        assert H.default_tile(p).kv_wg == 2
    else:
        got = H.default_tile(p)
        assert (got.kv_wg, got.bq, got.kv_stages) == (1, tile.bq, tile.kv_stages)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_backward_explicit_loads_take_the_two_warpgroup_kv_pass(head_dim, fake_device,
                                                                       monkeypatch):
    """Where the default dK/dV pass has one compute warpgroup, an explicit dq_atomic=True or
    tma=True (which it does not run) takes the two-warpgroup pass instead of failing."""
    monkeypatch.setattr(H, "KV_ONE_WG_UP_TO", {64: 27, 128: 27})
    p = _problem((300,), 3, head_dim=head_dim)
    assert H.default_tile(p).kv_wg == 1
    names = [c.fn.name for c in H.plan_backward(p, *_layouts(p), dq_atomic=False).calls]
    assert names[1].endswith(", false, false, 1>")
    plan = H.plan_backward(p, *_layouts(p), dq_atomic=True)
    kv = plan.calls[1]
    assert kv.fn.name.endswith(", true, false>") and kv.block == (384, 1, 1)
    asked = []   # the Tiling the TMA maps are asked for (no driver here: no maps made)
    monkeypatch.setattr(H, "kv_tma_maps", lambda problem, t, *ops: asked.append(t) or ())
    kv = H.plan_backward(p, *_layouts(p), dq_atomic=False, tma=True).calls[1]
    assert asked[-1].kv_threads == 384 and not asked[-1].kv_tma_refusal
    assert kv.fn.name.endswith(", false, false>") and kv.block == (384, 1, 1)


def test_hopper_backward_refusals_are_the_decision(fake_device):
    half = _problem((300,), 65, rpb=True)
    det = dataclasses.replace(half, deterministic=True)
    assert H.refuse(det) == H.configure(det)
    assert "deterministic=True" in H.refuse(det)
    huge = _problem((13000,), 12001, head_dim=128, heads=1, rpb=True)
    assert H.refuse(huge) == H.configure(huge) == (
        "the bias boxes of kernel (12001,) do not fit the Hopper fused backward's shared memory")
    # dQ added in the dK/dV pass needs the dS workspace for the bias gradient: refused where
    # one kv head's would be larger than the gradients (255 slots a query against 3 x 64)
    wide = _problem((600,), 255, heads=1, rpb=True)
    assert "larger than the gradients" in H.configure(wide, dq_atomic=True)
    assert isinstance(H.configure(wide), H.Tiling) and not H.configure(wide).dq_atomic
    with pytest.raises(ValueError, match="dq_atomic off"):
        H.plan_backward(wide, *_layouts(wide), dq_atomic=True)
    with pytest.raises(ValueError, match="deterministic=True"):
        H.plan_backward(det, *_layouts(det))
    big = dataclasses.replace(_problem((16, 16, 16), 3), spatial=(8192, 8192, 8192))
    assert isinstance(H.configure(big), H.Tiling)
    with pytest.raises(ValueError, match="too large for one Hopper fused-backward launch"):
        H.plan_backward(big, *_layouts(big))


# ---- exact float32 -----------------------------------------------------------------------

@pytest.mark.parametrize("budget", [E.SMEM_BUDGET, 115712])
def test_exact_fp32_decision_per_budget(budget, fake_device, monkeypatch):
    """configure_backward is keyed by the device's budget; plan_backward launches it."""
    p = _problem((31, 30), 9, head_dim=36, dtype=numpy.float32, heads=4, kv_heads=2)
    t = E.configure_backward(p, budget)
    assert E.configure_backward(dataclasses.replace(p), budget) is t
    assert E.configure_backward(p, budget // 2) is not t
    assert t.dkv.grid[1] == p.kv_heads and t.dq.grid[1] == p.heads
    for launch, micro, columns, inverse, extra in (
            (t.dq, E.MICRO_DQ, E.DQ_COLUMNS, False, 0),
            (t.dkv, E.MICRO[2], E.DKV_COLUMNS, True, 8)):
        lanes = E._lanes(36, columns)
        cell = 2 * 4 * E._row_floats(lanes, columns, micro) + extra
        front, smem, grid = E._plan_for(E._padded(p), micro, lanes, inverse, cell, budget)
        assert launch.smem == smem and launch.grid[0] == grid[0]
        assert _same_struct(launch.plan, E._in_problem_order(front, 2))
    monkeypatch.setattr(E, "_budget", lambda: budget)
    delta, dq, dkv = E.plan_backward(p, *_layouts(p)).calls
    assert delta.grid == (t.delta_blocks, 1, 1)
    for c, launch in ((dq, t.dq), (dkv, t.dkv)):
        assert (c.fn.name, c.grid, c.shared_mem, c.tile) == (launch.name, launch.grid,
                                                             launch.smem, launch.tile)
        assert c.args[-1] is launch.plan
    fwd = E.configure_forward(p, budget)
    (call,) = E.plan_forward(p, *_layouts(p)[1:4], _layouts(p)[0], _layouts(p)[5]).calls
    assert (call.grid, call.shared_mem, call.args[-1]) == (fwd.grid, fwd.smem, fwd.plan)


def test_exact_fp32_refusals_are_the_decision(fake_device):
    half = _problem((64,), 7, head_dim=32)
    assert E.refuse(half) == E.configure_backward(half, E.SMEM_BUDGET) == (
        "exact-float32 kernels take float32 only, got float16")
    with pytest.raises(ValueError, match="float32 only"):
        E.plan_backward(half, *_layouts(half))
    big = dataclasses.replace(_problem((16, 16, 16), 3, dtype=numpy.float32),
                              spatial=(8192, 8192, 8192))
    assert E.refuse(big) is None
    with pytest.raises(ValueError, match="too large for one launch"):
        E.plan_backward(big, *_layouts(big))
