"""Relative positional bias (rpb) in the fused ops on the GPU.

The main suite (``gpu_cases``, kind ``fused_rpb``) runs small geometries on naive and fused;
here larger ones reach what small ones cannot: many CTAs per axis and batch (the bias-gradient
boxes of every CTA reduced into one table), border and interior tiles, key halos streamed in
chunks, head dims 32 to 256, GQA, causal mixes and dilation, against the float64 reference
with NaN-poisoned outputs. Further: the backward (d_rpb included) with deterministic=True is
bitwise reproducible (the bias-gradient boxes reduced in one launch or in two), a
bias too large for the fused kernels' shared memory runs on naive under ``auto``, autotune
with a bias equals the default, and the torch layer's gradients and modules agree with the
float64 CPU path.
"""

import dataclasses

import numpy
import pytest

import natten_cupy
from natten_cupy.backends import get_backend

import gpu_cases
from gpu_cases import Case

# (rank, spatial, kernel, dilation, causal, head_dim, heads, kv_heads, batch)
GEOMETRIES = [
    (1, (700,), (129,), (1,), (False,), 64, 2, None, 2),
    (1, (333,), (31,), (2,), (True,), 32, 4, 2, 1),
    (2, (24, 20), (7, 7), (1, 1), (False, False), 32, 3, None, 4),
    (2, (30, 19), (9, 5), (2, 1), (True, False), 64, 4, 1, 1),
    (2, (20, 22), (13, 13), (1, 1), (False, False), 128, 2, None, 1),
    (3, (6, 12, 14), (3, 5, 5), (1, 1, 2), (True, False, False), 64, 2, None, 2),
    (3, (5, 9, 10), (5, 5, 7), (1, 1, 1), (False, False, False), 128, 4, 2, 1),
    (1, (300,), (65,), (1,), (False,), 160, 2, 1, 1),   # the backward's 160 bucket
    (2, (17, 22), (5, 7), (2, 1), (False, True), 144, 4, 2, 1),
    (2, (13, 18), (5, 5), (1, 2), (True, False), 256, 4, 2, 1),   # dK/dV chunks of 128, GQA
]
DTYPES = ("float16", "bfloat16", "tf32")


def _case(geom, dtype):
    rank, spatial, kernel, dilation, causal, d, heads, kv, batch = geom
    return Case("fused_rpb", rank, "float32" if dtype == "tf32" else dtype, spatial, kernel,
                (1,) * rank, dilation, causal, d, batch=batch, heads=heads, kv_heads=kv,
                tf32=dtype == "tf32")


CASES = [_case(g, dt) for i, g in enumerate(GEOMETRIES) for j, dt in enumerate(DTYPES)
         if (i + j) % 2 == 0 or dt == "float16"]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fused_rpb_against_reference(case):
    assert gpu_cases.check_backend(case, "fused") is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[::3], ids=[c.id for c in CASES[::3]])
def test_fused_rpb_backward_is_bitwise_reproducible(case):
    """With deterministic=True (the default sums the Hopper backward's d_rpb with atomics)."""
    gpu_cases.assert_runs_repeat(dataclasses.replace(case, deterministic=True), "fused")


# The bias-gradient boxes reduced in two launches (mma_backward.RPB_TWO_LAUNCH): geometries
# with more dQ CTAs per (batch, head) than one part of na_bwd_rpb_boxes takes, so that several
# parts, runs of boxes and the border boxes' flushes all occur (2-D and 3-D on mma.sync, 1-D
# at head dim 64 and 2-D at 128 on the Hopper dQ pass where the GPU has one), then every other
# case above.
TWO_LAUNCH = [
    _case((2, (130, 100), (9, 9), (2, 1), (True, False), 32, 2, None, 2), "float16"),
    _case((3, (6, 40, 44), (3, 7, 5), (1, 1, 2), (False, True, False), 64, 2, None, 1),
          "bfloat16"),
    _case((1, (20000,), (127,), (1,), (False,), 64, 2, 1, 1), "bfloat16"),
    _case((2, (70, 90), (13, 11), (1, 1), (False, False), 128, 2, None, 1), "float16"),
] + CASES[::2]


@pytest.mark.gpu
@pytest.mark.parametrize("rpb_reduction", [True], indirect=True)
@pytest.mark.parametrize("case", TWO_LAUNCH, ids=[c.id for c in TWO_LAUNCH])
def test_fused_rpb_boxes_reduced_in_two_launches(case, rpb_reduction):
    """Against the float64 reference (NaN-poisoned outputs) with the boxes reduced by
    na_bwd_rpb_boxes and na_bwd_rpb_sum (which the profile must show), and with
    deterministic=True bitwise the same in three runs."""
    with natten_cupy.profile() as prof:
        assert gpu_cases.check_backend(case, "fused") is None
    names = {r["name"] for r in prof.records}
    assert {"na_bwd_rpb_boxes", "na_bwd_rpb_sum"} <= names and "na_bwd_fused_rpb" not in names
    gpu_cases.assert_runs_repeat(dataclasses.replace(case, deterministic=True), "fused")


@pytest.mark.gpu
@pytest.mark.parametrize("box_copies", [4], indirect=True)
@pytest.mark.parametrize("case", TWO_LAUNCH[:2] + CASES[1::2],
                         ids=[c.id for c in TWO_LAUNCH[:2] + CASES[1::2]])
def test_fused_rpb_dq_pass_with_four_box_copies(case, box_copies):
    """The mma.sync dQ pass adding four owner rows a turn into four copies of each warp's
    box (where they fit the bias budget, as the first two geometries' do): against the float64
    reference, and with deterministic=True bitwise the same in three runs."""
    from natten_cupy import _args
    from natten_cupy.backends.fused import mma_backward
    if case in TWO_LAUNCH[:2]:
        x = numpy.empty((case.batch, *case.spatial, case.heads, case.head_dim), case.np_dtype)
        rpb = numpy.empty((case.heads, *(2 * k - 1 for k in case.kernel)), case.np_dtype)
        problem = _args.check_fused(case.rank, x, x, x, case.kernel, 1, case.dilation,
                                    case.causal, None, "auto", rpb=rpb)
        assert mma_backward.configure(problem).bias["wcopies"] == 4
    assert gpu_cases.check_backend(case, "fused") is None
    gpu_cases.assert_runs_repeat(dataclasses.replace(case, deterministic=True), "fused")


@pytest.mark.gpu
def test_a_bias_too_large_for_the_fused_backward_runs_on_naive():
    """1-D window 3001: the bias table and the dQ pass's boxes exceed the fused backward's
    shared-memory budget; the fused backend says so and auto runs naive, correctly."""
    case = Case("fused_rpb", 1, "float16", (3100,), (3001,), (1,), (1,), (False,), 32,
                batch=1, heads=1)
    why = gpu_cases.refusal(case, get_backend("fused"))
    assert why is not None and "shared memory" in why
    x, truth, yard = gpu_cases.references(case)
    xd = gpu_cases.inputs_on_device(x, case)
    out, lse = natten_cupy.na1d(xd["q"], xd["k"], xd["v"], 3001, rpb=xd["rpb"], return_lse=True)
    grads = natten_cupy.na1d_backward(xd["d_out"], xd["q"], xd["k"], xd["v"], out, lse, 3001,
                                      rpb=xd["rpb"])
    got = dict(zip(("out", "lse", "dq", "dk", "dv", "d_rpb"), (out, lse, *grads)))
    gpu_cases.compare(case, {n: gpu_cases.to_host(a) for n, a in got.items()}, truth, yard,
                      where="[auto] ")


@pytest.mark.gpu
def test_autotune_with_a_bias_equals_the_default(tmp_path, monkeypatch):
    import cupy
    monkeypatch.setenv("NATTEN_CUPY_CACHE_DIR", str(tmp_path))
    rng = numpy.random.default_rng(3)
    q, k, v, do = (cupy.asarray(rng.standard_normal((2, 24, 20, 4, 64)), dtype=cupy.float16)
                   for _ in range(4))
    rpb = cupy.asarray(rng.standard_normal((4, 13, 13)), dtype=cupy.float16)
    res = {}
    for tile in (None, "autotune"):
        out, lse = natten_cupy.na2d(q, k, v, 7, rpb=rpb, return_lse=True, tile=tile)
        grads = natten_cupy.na2d_backward(do, q, k, v, out, lse, 7, rpb=rpb, tile=tile)
        res[tile] = [cupy.asnumpy(a.astype(cupy.float32)) for a in (out, *grads)]
    for a, b in zip(res[None], res["autotune"]):
        numpy.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_torch_layer_rpb_gradients_match_float64(dtype):
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    gen = torch.Generator().manual_seed(5)
    shapes = [(2, 18, 15, 3, 32)] * 4
    base = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    rpb = torch.randn(3, 9, 7, generator=gen, dtype=torch.float64)
    ks, dl, ca = (5, 4), (1, 2), (False, True)

    def grads(device, dt):
        ins = [x.to(device, dt).clone().requires_grad_() for x in base[:3]]
        r = rpb.to(device, dt).clone().requires_grad_()
        out, lse = nt.na2d(*ins, ks, dilation=dl, is_causal=ca, rpb=r, return_lse=True)
        loss = (out.double() * base[3].to(device)).sum() + (lse.double() ** 2).sum() * 0.1
        loss.backward()
        return [t.detach().double().cpu() for t in (out, lse, *(x.grad for x in ins), r.grad)]

    want = grads("cpu", torch.float64)
    got = grads("cuda", getattr(torch, dtype))
    tol = 2e-2 if dtype == "float16" else 8e-2
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "d_rpb"), got, want):
        err = float((g - w).abs().max() / w.abs().max().clamp(min=1.0))
        assert err < tol, (name, err)


@pytest.mark.gpu
def test_module_with_rel_pos_bias_on_the_fused_kernels():
    """A half-precision module with rel_pos_bias runs the fused op (no attention weights in
    memory) and agrees with its unfused chain; the bias receives a gradient."""
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.manual_seed(0)
    m = nt.NeighborhoodAttention2D(dim=96, num_heads=3, kernel_size=7, rel_pos_bias=True)
    m = m.cuda().half().eval()
    with torch.no_grad():
        m.rpb.normal_(0, 0.5)
    x = torch.randn(2, 20, 21, 96, device="cuda", dtype=torch.float16, requires_grad=True)
    with natten_cupy.profile() as prof:
        y = m(x)
        torch.cuda.synchronize()
    names = {r["name"] for r in prof.records}
    assert any(n.startswith("na_fwd_fused") for n in names), names
    qkv = m.qkv(x).unflatten(-1, (3, 3, 32))
    ref = m.proj(m._unfused(*qkv.unbind(-3)).flatten(-2))
    assert float((y.float() - ref.float()).abs().max()) < 2e-2
    y.float().square().sum().backward()
    assert m.rpb.grad is not None and bool(torch.isfinite(m.rpb.grad).all())
    assert float(m.rpb.grad.abs().max()) > 0
