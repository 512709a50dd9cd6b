"""Relative positional bias (rpb) in the fused ops, without a GPU.

The reference backend against the float64 oracle (``oracle.fused_forward_rpb`` /
``fused_backward_rpb``: dense attention with the bias of each window pair, written apart from
the backend), every rank, causal mixes, dilation, GQA; the errors owed to a bad rpb (before
any work, naming the argument); which kernels take a bias and which refuse it by name; the
torch layer on CPU tensors (gradients through out and lse by gradcheck, opcheck of the biased
ops, torch.compile, the module on the fused op agreeing with its unfused chain). The naive
kernels with a bias run on the CPU emulator (``test_naive_emulated``, kind ``fused_rpb``);
the fused ones on the GPU (``tests/gpu/test_gpu_rpb.py``).
"""

import dataclasses
import math

import numpy
import pytest

import natten_cupy
import oracle
from natten_cupy import _args

GEOMS = [
    (1, (13,), (5,), (2,), (True,)),
    (1, (16,), (16,), (1,), (False,)),
    (2, (7, 11), (3, 4), (1, 2), (True, False)),
    (3, (4, 5, 6), (3, 2, 5), (1, 2, 1), (False, True, False)),
]


def _inputs(rng, rank, spatial, kernel, heads=3, kv_heads=3, d=4, dtype=numpy.float64):
    q, d_out = (rng.standard_normal((2, *spatial, heads, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((2, *spatial, kv_heads, d)).astype(dtype) for _ in range(2))
    rpb = rng.standard_normal((heads, *(2 * x - 1 for x in kernel))).astype(dtype)
    return q, k, v, d_out, rpb


def _repeat_kv(x, heads):
    return numpy.repeat(x, heads // x.shape[-2], axis=-2)


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{g[0]}d-k{g[2]}")
@pytest.mark.parametrize("kv_heads", (3, 1))
def test_reference_matches_the_oracle(rng, geom, kv_heads):
    rank, spatial, kernel, dilation, causal = geom
    q, k, v, d_out, rpb = _inputs(rng, rank, spatial, kernel, kv_heads=kv_heads)
    before = [x.copy() for x in (q, k, v, d_out, rpb)]
    fwd = getattr(natten_cupy, f"na{rank}d")
    bwd = getattr(natten_cupy, f"na{rank}d_backward")
    out, lse = fwd(q, k, v, kernel, dilation=dilation, is_causal=causal, rpb=rpb,
                   return_lse=True)
    kr, vr = _repeat_kv(k, 3), _repeat_kv(v, 3)
    want_out, want_lse = oracle.fused_forward_rpb(q, kr, vr, rpb, kernel, dilation, causal)
    numpy.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    grads = bwd(d_out, q, k, v, out, lse, kernel, dilation=dilation, is_causal=causal, rpb=rpb)
    assert len(grads) == 4
    dq, dk, dv, d_rpb = oracle.fused_backward_rpb(d_out, q, kr, vr, rpb, kernel, dilation,
                                                  causal)
    group = 3 // kv_heads   # dk, dv of a kv head sum its query heads
    dk = dk.reshape(*dk.shape[:-2], kv_heads, group, dk.shape[-1]).sum(-2)
    dv = dv.reshape(*dv.shape[:-2], kv_heads, group, dv.shape[-1]).sum(-2)
    for name, g, w in zip(("dq", "dk", "dv", "d_rpb"), grads, (dq, dk, dv, d_rpb)):
        assert g.shape == w.shape, name
        numpy.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11, err_msg=name)
    for x, y in zip(before, (q, k, v, d_out, rpb)):
        assert numpy.array_equal(x, y)   # nothing of the caller's is overwritten


def test_bias_changes_the_result_and_zero_bias_does_not(rng):
    q, k, v, d_out, rpb = _inputs(rng, 2, (7, 9), (3, 5))
    plain = natten_cupy.na2d(q, k, v, (3, 5))
    assert numpy.abs(natten_cupy.na2d(q, k, v, (3, 5), rpb=rpb) - plain).max() > 1e-3
    numpy.testing.assert_allclose(natten_cupy.na2d(q, k, v, (3, 5), rpb=0 * rpb), plain,
                                  rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", (numpy.float32, numpy.float16))
def test_reference_low_precision(rng, dtype):
    q, k, v, d_out, rpb = _inputs(rng, 2, (9, 8), (5, 3), dtype=dtype, d=8)
    out, lse = natten_cupy.na2d(q, k, v, (5, 3), rpb=rpb, return_lse=True)
    want, _ = oracle.fused_forward_rpb(q, k, v, rpb, (5, 3))
    assert out.dtype == dtype
    tol = 1e-5 if dtype == numpy.float32 else 1e-2
    assert numpy.abs(out - want).max() < tol
    g = natten_cupy.na2d_backward(d_out, q, k, v, out, lse, (5, 3), rpb=rpb)
    assert g[3].dtype == dtype and g[3].shape == rpb.shape
    want_rpb = oracle.fused_backward_rpb(d_out, q, k, v, rpb, (5, 3))[3]
    assert numpy.abs(g[3] - want_rpb).max() < 30 * tol * max(1.0, numpy.abs(want_rpb).max())


# ---- bad input ----------------------------------------------------------------------------

def test_bad_rpb_is_refused_by_name(rng):
    q, k, v, d_out, rpb = _inputs(rng, 2, (7, 9), (3, 5))
    with pytest.raises(ValueError, match=r"rpb shape \(3, 5, 8\) must be \[H, 2k-1, \.\.\.\]"):
        natten_cupy.na2d(q, k, v, (3, 5), rpb=rpb[:, :, :8])
    with pytest.raises(ValueError, match="rpb dtype float32 does not match q dtype"):
        natten_cupy.na2d(q, k, v, (3, 5), rpb=rpb.astype(numpy.float32))
    with pytest.raises(TypeError, match="rpb"):
        natten_cupy.na2d(q, k, v, (3, 5), rpb=rpb.tolist())
    with pytest.raises(ValueError, match=r"rpb needs stride 1 on every axis, got stride \(1, 2\)"):
        natten_cupy.na2d(q, k, v, (3, 5), stride=(1, 2), rpb=rpb)
    out, lse = natten_cupy.na2d(q, k, v, (3, 5), return_lse=True)
    with pytest.raises(ValueError, match="rpb shape"):
        natten_cupy.na2d_backward(d_out, q, k, v, out, lse, (3, 5), rpb=rpb[:2])


# ---- which kernels take a bias ------------------------------------------------------------

def _problem(dtype=numpy.float16, kernel=(7, 7), spatial=(40, 40), tf32=False, **kw):
    q = numpy.zeros((1, *spatial, 4, 64), dtype)
    rpb = numpy.zeros((4, *(2 * x - 1 for x in kernel)), dtype)
    return _args.check_fused(len(spatial), q, q, q, kernel, 1, 1, False, None, "auto", tf32,
                             rpb=rpb, **kw)


def test_the_problem_records_the_bias():
    p = _problem()
    assert p.has_rpb
    q = numpy.zeros((1, 40, 40, 4, 64), numpy.float16)
    assert not _args.check_fused(2, q, q, q, 7, 1, 1, False, None, "auto").has_rpb


def test_parts_that_take_a_bias_and_parts_that_refuse_it():
    from natten_cupy.backends import fused, naive, reference, tiled
    from natten_cupy.backends.fused import (exact_fp32, mma_backward, mma_forward,
                                            wgmma_backward, wgmma_forward)
    half, tf32, exact = _problem(), _problem(numpy.float32, tf32=True), _problem(numpy.float32)
    for p in (half, tf32):
        assert mma_forward.refuse(p) is None and mma_backward.refuse(p) is None
        assert fused.refuse("fused_forward", p) is None
        assert fused.refuse("fused_backward", p) is None
        # A 2-D 7x7 window at head dim 64 stays on the mma.sync backward, bias or not.
        assert fused._parts_for("fused_backward", p) == "mma_backward"
    # The Hopper forward takes it (where the device is one; the last reason is the GPU), and
    # runs it where the window pays (21x21 does, 7x7 does not).
    assert not fused._hopper_serves(half, "wgmma_backward")
    why = wgmma_forward.refuse(half)
    assert why is None or "compute capability" in why
    assert fused._parts_for("fused_forward", _problem(kernel=(21, 21))) == (
        "wgmma_forward" if why is None else "mma_forward")
    assert fused._parts_for("fused_forward", half) == "mma_forward"
    assert fused._parts_for("fused_forward", tf32) == "mma_forward"
    # The Hopper backward takes a bias (its gradient summed with shared-memory atomics)
    # where it takes the problem without one, except with deterministic=True: that runs the
    # mma.sync backward, whose d_rpb is reproducible.
    why = wgmma_backward.refuse(half)
    assert why is None or "compute capability" in why
    wide = _problem(kernel=(13, 13), spatial=(30, 30))
    wide = dataclasses.replace(wide, head_dim=128, v_dim=128)
    assert fused._parts_for("fused_backward", wide) == (
        "wgmma_backward" if why is None else "mma_backward")
    det = dataclasses.replace(wide, deterministic=True)
    assert "deterministic=True" in wgmma_backward.refuse(det)
    assert fused._parts_for("fused_backward", det) == "mma_backward"
    assert "exact-float32 kernels take no relative positional bias" in exact_fp32.refuse(exact)
    assert "exact-float32" in fused.refuse("fused_forward", exact)
    for p in (half, tf32, exact):
        assert naive.refuse("fused_backward", p) is None
        assert reference.refuse("fused_backward", p) is None
    assert "unfused" in tiled.refuse("fused_forward", half)
    # Non-default forward tiles are not built with a bias.
    other = mma_forward.CONFIGS[2][1].box[:2]
    assert "not built with a relative positional bias" in mma_forward.refuse(
        dataclasses.replace(half, tile=other))


def test_a_bias_too_large_for_the_fused_backward_is_refused_by_size():
    from natten_cupy.backends.fused import mma_backward, mma_forward
    big = _problem(kernel=(3001,), spatial=(3100,))
    assert "shared memory" in mma_backward.refuse(big)
    assert mma_forward.refuse(big) is None   # the forward reads the table from global memory
    assert mma_backward.refuse(_problem(kernel=(2047,), spatial=(4096,))) is None


def _hopper_problem(spatial, kernel, head_dim, bias=True):
    q = numpy.zeros((1, *spatial, 2, head_dim), numpy.float16)
    rpb = numpy.zeros((2, *(2 * x - 1 for x in kernel)), numpy.float16) if bias else None
    return _args.check_fused(len(spatial), q, q, q, kernel, 1, 1, False, None, "auto",
                             rpb=rpb)


def test_the_hopper_forward_stages_the_bias_box_it_reaches():
    """BiasBox in wgmma_forward.cu: per axis min(2k - 1, k + tile - 1) float32 entries of the
    table, within the shared memory of the tile that runs with a bias (two stages at head
    dim 128, whose three leave no room); a box too large for it is refused."""
    from natten_cupy.backends.fused import wgmma_forward as w

    def box(spatial, kernel, head_dim=64, bias=True):
        p = _hopper_problem(spatial, kernel, head_dim, bias)
        return w._bias_box(p, w._default_tile(p))
    assert box((40, 40), (7, 7)) == min(13, 7 + 7) * min(13, 7 + 15)      # 8 x 16 queries
    assert box((40, 40), (7, 5)) == 13 * 9
    assert box((16, 40, 64), (5, 9, 9)) == 6 * 12 * 16                    # 2 x 4 x 8
    assert box((16, 40, 64), (5, 9, 9), 128) == 6 * 16 * 16               # 2 x 8 x 8
    assert box((1000,), (255,)) == 255 + 127
    assert box((1000,), (255,), bias=False) == 0
    for spatial, kernel in (((9000,), (4095,)), ((90, 90), (33, 33)),
                            ((20, 30, 30), (9, 13, 13))):
        for d in (64, 128):
            p = _hopper_problem(spatial, kernel, d)
            tile = w._default_tile(p)
            assert (tile.stages == 2) == (d == 128)
            assert w._smem(p, tile) <= w.SMEM_LIMIT, (spatial, d)
    assert "bias box" in w.refuse(_hopper_problem((40000,), (30001,), 128))
    # 3-D at head dim 128 walks key boxes with a bias; 2-D both walks (the flat one with
    # each region key's index in shared memory), on the bias's tile only.
    p3 = _hopper_problem((8, 20, 20), (3, 5, 5), 128)
    assert w._plan(p3).name.endswith(", 2, true, true, 3, 2, 8, 8, true, true>")
    with pytest.raises(ValueError, match="key boxes only"):
        w._plan(p3, walk_boxes=False)
    p2 = _hopper_problem((64, 64), (21, 21), 128)
    flat = w._plan(p2, walk_boxes=False)
    assert flat.name.endswith(", 2, true, true, 2, 8, 16, 1, false, true>")
    assert flat.smem == w._plan(p2, walk_boxes=True).smem + 4 * (8 + 20) * (16 + 20)
    with pytest.raises(ValueError, match="runs"):
        w._plan(p2, tile=w.DEFAULT_ND)


def test_the_hopper_forward_runs_where_its_window_pays(monkeypatch):
    """fused._hopper_fwd_pays: from the measured break-even windows (HOPPER_FWD_FROM) per
    rank, head dim and bias; below, the mma.sync forward."""
    from natten_cupy.backends import fused
    monkeypatch.setattr(fused, "_hopper_serves", lambda p, name="wgmma_forward": True)

    def pays(spatial, kernel, d, bias=False):
        return fused._hopper_fwd_pays(_hopper_problem(spatial, kernel, d, bias))
    assert not pays((8192,), (63,), 64) and pays((8192,), (64,), 64)
    assert not pays((8192,), (127,), 64, True) and pays((8192,), (128,), 64, True)
    assert not pays((8192,), (55,), 128) and pays((8192,), (56,), 128)
    assert not pays((8192,), (63,), 128, True) and pays((8192,), (64,), 128, True)
    assert not pays((64, 64), (11, 11), 64) and pays((64, 64), (13, 13), 64)
    assert not pays((64, 64), (5, 5), 128) and pays((64, 64), (7, 7), 128)
    assert not pays((64, 64), (11, 11), 64, True) and pays((64, 64), (13, 13), 64, True)
    assert not pays((64, 64), (7, 7), 128, True) and pays((64, 64), (9, 9), 128, True)
    assert not pays((8, 32, 32), (3, 5, 5), 64) and pays((8, 32, 32), (3, 7, 7), 64)
    assert not pays((8, 32, 32), (3, 3, 7), 64, True) and pays((8, 32, 32), (3, 5, 5), 64, True)
    assert not pays((8, 32, 32), (3, 3, 2), 128) and pays((8, 32, 32), (3, 3, 3), 128)
    assert not pays((8, 32, 32), (3, 3, 5), 128, True) and pays((8, 32, 32), (3, 5, 5), 128, True)
    # head dim 32 (padded to 64 there): large windows only, never in 3-D
    assert not pays((8192,), (511,), 32, False) and pays((8192,), (1023,), 32, False)
    assert not pays((8192,), (255,), 32, True) and pays((8192,), (511,), 32, True)
    assert not pays((96, 96), (29, 29), 32, False) and pays((96, 96), (31, 31), 32, False)
    assert not pays((96, 96), (29, 29), 32, True) and pays((96, 96), (31, 31), 32, True)
    assert not pays((16, 32, 32), (15, 31, 31), 32, False)
    assert not pays((16, 32, 32), (15, 31, 31), 32, True)
    assert fused._parts_for("fused_forward", _hopper_problem((64, 64), (5, 5), 128, False)) == \
        "mma_forward"
    assert fused._parts_for("fused_forward", _hopper_problem((64, 64), (7, 7), 128, False)) == \
        "wgmma_forward"


def test_the_hopper_parts_serve_head_dims_from_32_forward_and_above_32_backward(monkeypatch):
    """fused._hopper_serves where the Hopper part accepts the problem (its own device checks
    replaced): the forward from head dim 32 (padded to 64 columns), the backward above 32;
    float32, a tile override and additional tokens stay off it."""
    import types
    from natten_cupy.backends import fused
    monkeypatch.setattr(fused, "_part", lambda name: types.SimpleNamespace(refuse=lambda p: None))
    for d, fwd, bwd in ((16, False, False), (31, False, False), (32, True, False),
                        (40, True, True), (64, True, True), (128, True, True)):
        p = _hopper_problem((8192,), (1023,), d, False)
        assert fused._hopper_serves(p, "wgmma_forward") is fwd, d
        assert fused._hopper_serves(p, "wgmma_backward") is bwd, d
    q = numpy.zeros((1, 64, 2, 32), numpy.float32)
    assert not fused._hopper_serves(_args.check_fused(1, q, q, q, (7,), 1, 1, False, None,
                                                      "auto"))


def test_bias_geometry_matches_the_c_struct():
    """bwd::BiasGeom: 29 int32s in these fields, in this order (fused_bwd_tile.cuh)."""
    from natten_cupy.backends.fused import mma_backward
    g = mma_backward.BIAS_GEOM
    assert g.itemsize == 29 * 4
    assert list(g.names) == ["dim", "bst", "tile", "ntile", "tab_off", "vol", "ctas", "tst",
                             "tvol", "wdim", "wbst", "wvol", "wcopies"]
    # The box of a 2-D 7x7 window over 8x8 dQ tiles: min(13, 7 + 8 - 1) = 13 per axis; a
    # warp's 4x4 patch: min(13, 7 + 4 - 1) = 10.
    assert mma_backward._bias_box(_problem()) == (13, 13, 1)
    assert mma_backward._bias_box(_problem(), 1) == (10, 10, 1)
    assert mma_backward._bias_box(_problem(kernel=(255,), spatial=(1000,))) == (255 + 63, 1, 1)
    assert mma_backward._bias_box(_problem(kernel=(255,), spatial=(1000,)), 1) == \
        (255 + 15, 1, 1)


@pytest.mark.parametrize("setting", [1, 4])
def test_the_dq_pass_box_copies_fit_the_bias_budget(setting, monkeypatch):
    """BIAS_BOX_COPIES copies of each warp's box where they fit BIAS_SMEM_BUDGET with the
    CTA's box, else one; the shared memory the plan asks for counts them; the Hopper dQ
    pass's geometry (a tile given) has none."""
    from natten_cupy.backends.fused import mma_backward as M
    monkeypatch.setattr(M, "BIAS_BOX_COPIES", setting)
    small = _problem(kernel=(9, 9), spatial=(64, 64))     # warp box 12 x 12
    big = _problem(kernel=(6, 9, 9), spatial=(12, 32, 32))   # 6 x 12 x 12: 4 copies too big
    wvol = {small: 144, big: 864}
    for p, fits in ((small, True), (big, False)):
        want = setting if fits else 1
        t = M.configure(p)
        assert isinstance(t, M.Tiling), t
        assert int(t.bias["wcopies"]) == want == M._box_copies(p)
        boxes = M._bias_smem(p)[False] - M._padded(math.prod(M._bias_box(p)))
        assert boxes == M.KWARPS * 4 * (want * wvol[p] + 16 * (M.KNB + 8) + 16 + 4)
        assert M._bias_smem(p)[False] <= M.BIAS_SMEM_BUDGET
        four = M._padded(math.prod(M._bias_box(p))) + M._warp_boxes(p, 4)
        assert (four <= M.BIAS_SMEM_BUDGET) is fits
    hopper = M.bias_geometry(small, (0, 0, 0), [8, 8, 1], (8, 16, 1))
    assert int(hopper["wcopies"]) == 1


def test_kernel_instantiations_with_a_bias_are_listed():
    from natten_cupy.backends.fused import mma_backward, mma_forward
    fwd = {n for _, n in mma_forward.instantiations()}
    bwd = {n for _, n in mma_backward.instantiations()}
    assert sum(n.endswith(", true, false>") for n in fwd) == 3 * 3 * 4   # dtype x rank x dim
    assert "na_bwd_fused_rpb<__half>" in bwd
    assert "na_bwd_fused_q<__nv_bfloat16, 64, 64, true, false>" in bwd
    assert "na_bwd_fused_kv<float, 128, 64, true, true>" in bwd


# ---- the torch layer on CPU tensors -------------------------------------------------------

torch = pytest.importorskip("torch")
import natten_cupy.torch as nt  # noqa: E402


@pytest.mark.parametrize("geom", GEOMS[::2] + GEOMS[3:], ids=lambda g: f"{g[0]}d")
def test_torch_gradcheck_through_out_and_lse(geom):
    rank, spatial, kernel, dilation, causal = geom
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, *spatial, 2, 4, generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    rpb = torch.randn(2, *(2 * x - 1 for x in kernel), generator=gen, dtype=torch.float64,
                      requires_grad=True)

    def f(q, k, v, rpb):
        return getattr(nt, f"na{rank}d")(q, k, v, kernel, dilation=dilation, is_causal=causal,
                                         rpb=rpb, return_lse=True)
    assert torch.autograd.gradcheck(f, (q, k, v, rpb), eps=1e-6, atol=1e-6)


def test_torch_matches_the_oracle_and_opcheck():
    gen = torch.Generator().manual_seed(2)
    q, k, v, d_out = (torch.randn(2, 6, 7, 3, 8, generator=gen, dtype=torch.float64)
                      for _ in range(4))
    rpb = torch.randn(3, 5, 3, generator=gen, dtype=torch.float64)
    args = ([3, 2], [1, 1], [1, 2], [True, False], None, "auto", False, False)
    out, lse = torch.ops.natten_cupy.na_fused_forward_ext(q, k, v, rpb, None, None, *args)
    want, want_lse = oracle.fused_forward_rpb(q.numpy(), k.numpy(), v.numpy(), rpb.numpy(),
                                              (3, 2), (1, 2), (True, False))
    numpy.testing.assert_allclose(out.numpy(), want, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-12, atol=1e-12)
    torch.library.opcheck(torch.ops.natten_cupy.na_fused_forward_ext.default,
                          (q, k, v, rpb, None, None, *args))
    torch.library.opcheck(torch.ops.natten_cupy.na_fused_backward_ext.default,
                          (d_out, q, k, v, out, lse, rpb, None, None, *args))


def test_torch_compile_fullgraph_with_a_bias():
    try:
        import torch._inductor  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        pytest.skip(f"torch.compile unavailable: {e}")
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 7, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    rpb = torch.randn(2, 5, 5, generator=gen, requires_grad=True)

    def f(q, k, v, rpb):
        return nt.na2d(q, k, v, 3, dilation=(1, 2), rpb=rpb) * 2

    eager = f(q, k, v, rpb)
    want = torch.autograd.grad(eager.square().sum(), (q, k, v, rpb))
    out = torch.compile(f, fullgraph=True)(q, k, v, rpb)
    got = torch.autograd.grad(out.square().sum(), (q, k, v, rpb))
    torch.testing.assert_close(out, eager)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()


def test_module_with_rel_pos_bias_uses_the_fused_op_and_matches_its_chain():
    torch.manual_seed(0)
    m = nt.NeighborhoodAttention2D(dim=24, num_heads=3, kernel_size=3, dilation=2,
                                   rel_pos_bias=True).double().eval()
    with torch.no_grad():
        m.rpb.normal_(0, 0.5)
    x = torch.randn(2, 9, 8, 24, dtype=torch.float64)
    calls = []
    real = nt._fused_forward_ext

    def spy(*a):
        calls.append(a)
        return real(*a)
    nt._fused_forward_ext = spy
    try:
        y = m(x)
    finally:
        nt._fused_forward_ext = real
    assert len(calls) == 1
    q, k, v = m.qkv(x).unflatten(-1, (3, 3, 8)).unbind(-3)
    logits = nt.na2d_qk(q * 8 ** -0.5, k, 3, dilation=2, rpb=m.rpb)
    attn = torch.softmax(logits, -1)
    ref = m.proj(nt.na2d_av(attn, v, 3, dilation=2).flatten(-2))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    y.square().sum().backward()
    assert m.rpb.grad is not None and float(m.rpb.grad.abs().max()) > 0


def test_biased_backward_dispatch_on_hopper(monkeypatch):
    """On a compute capability 9.0 device (faked here), a biased backward goes to the Hopper
    part where it measured faster than the mma.sync one: 1-D head dim 64 from window 96 (the
    unbiased rule starts at 48), every rank above head dim 64; 2-D/3-D at 64 and
    deterministic=True stay on mma.sync."""
    from natten_cupy.backends import fused
    from natten_cupy.backends.fused import wgmma_forward
    monkeypatch.setattr(wgmma_forward, "_compute_capability", lambda: (9, 0))
    part = lambda p: fused._parts_for("fused_backward", p)
    one_d = lambda k, **kw: _problem(kernel=(k,), spatial=(4096,), **kw)
    assert part(one_d(63)) == "mma_backward"
    assert part(one_d(127)) == "wgmma_backward"
    assert part(dataclasses.replace(one_d(47), has_rpb=False)) == "mma_backward"
    assert part(dataclasses.replace(one_d(63), has_rpb=False)) == "wgmma_backward"
    assert part(one_d(127, deterministic=True)) == "mma_backward"
    assert part(_problem(kernel=(15, 15), spatial=(96, 96))) == "mma_backward"
    wide = dataclasses.replace(_problem(kernel=(13, 13), spatial=(30, 30)), head_dim=128,
                               v_dim=128)
    assert part(wide) == "wgmma_backward"
    # Where the dS-workspace variant is switched on at head dim 64 (BIAS_DS_BUCKETS), a
    # biased 2-D or 3-D problem there goes to the Hopper part as that variant; the 1-D rule,
    # head dim 32 and deterministic=True stay as they were.
    from natten_cupy.backends.fused import wgmma_backward as H
    monkeypatch.setattr(H, "BIAS_DS", True)
    monkeypatch.setattr(H, "BIAS_DS_BUCKETS", (64, 128))
    H._configure.cache_clear()
    video = _problem(kernel=(5, 9, 9), spatial=(8, 20, 20))
    image = _problem(kernel=(15, 15), spatial=(96, 96))
    for p in (video, image):
        assert part(p) == "wgmma_backward" and H.configure(p).dq_atomic
        assert part(dataclasses.replace(p, deterministic=True)) == "mma_backward"
    assert part(dataclasses.replace(image, head_dim=32, v_dim=32)) == "mma_backward"
    assert part(one_d(63)) == "mma_backward" and part(one_d(127)) == "wgmma_backward"
    monkeypatch.setattr(H, "BIAS_DS_BUCKETS", (128,))
    assert part(video) == "mma_backward" and part(image) == "mma_backward"
    H._configure.cache_clear()
