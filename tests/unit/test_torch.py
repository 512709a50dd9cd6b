"""natten_cupy.torch: autograd custom ops, public functions and modules.

CPU tests run on the reference backend; GPU tests (``@pytest.mark.gpu``) run the naive and
fused backends on CUDA tensors.
"""

import math
import re

import numpy
import pytest

torch = pytest.importorskip("torch")

import natten_cupy  # noqa: E402
import natten_cupy.torch as nt  # noqa: E402
from natten_cupy import _torch_common, _torch_eager, _torch_ext  # noqa: E402

NA = {1: nt.na1d, 2: nt.na2d, 3: nt.na3d}
QK = {1: nt.na1d_qk, 2: nt.na2d_qk, 3: nt.na3d_qk}
AV = {1: nt.na1d_av, 2: nt.na2d_av, 3: nt.na3d_av}
MODULES = {1: nt.NeighborhoodAttention1D, 2: nt.NeighborhoodAttention2D,
           3: nt.NeighborhoodAttention3D}


def _tensor(rng, shape, dtype=torch.float64, device="cpu", requires_grad=False):
    t = torch.from_numpy(rng.standard_normal(shape)).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _qkv(rng, spatial, heads=2, dim=3, batch=1, **kw):
    shape = (batch,) + tuple(spatial) + (heads, dim)
    return tuple(_tensor(rng, shape, **kw) for _ in range(3))


def _np(t):
    """A torch tensor as a NumPy array (bfloat16 through ml_dtypes)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(natten_cupy._dtypes.BFLOAT16)
    return t.numpy()


# Tiny geometries with odd extents, one per option worth covering:
# (rank, spatial, kernel_size, options)
GEOMETRIES = [
    (1, (7,), 3, {}),
    (1, (9,), 4, {"stride": 2}),
    (1, (7,), 3, {"dilation": 2}),
    (1, (6,), 3, {"is_causal": True}),
    (2, (5, 6), 3, {}),
    (2, (6, 5), (3, 2), {"stride": (2, 1), "dilation": (1, 2)}),
    (2, (5, 5), 3, {"is_causal": (True, False)}),
    (3, (3, 4, 5), (2, 3, 3), {}),
    (3, (4, 3, 5), (2, 2, 3), {"stride": (1, 2, 3), "dilation": (2, 1, 1),
                               "is_causal": (False, True, True)}),
]
GEOMETRY_IDS = [f"{r}d-{s}-k{k}-{'-'.join(f'{a}{b}' for a, b in o.items()) or 'plain'}"
                for r, s, k, o in GEOMETRIES]

# The unfused ops take stride 1 only: the same geometries without it.
UNFUSED = [(r, s, k, {n: v for n, v in o.items() if n != "stride"}) for r, s, k, o in GEOMETRIES]
UNFUSED_IDS = [re.sub(r"-stride(\d|\([^)]*\))", "", i) for i in GEOMETRY_IDS]


# ---- forward agrees with the array-level calls -------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank,spatial,ks,opts", GEOMETRIES, ids=GEOMETRY_IDS)
def test_forward_matches_array_api(rng, rank, spatial, ks, opts, dtype):
    q, k, v = _qkv(rng, spatial, dtype=dtype)
    out = NA[rank](q, k, v, ks, **opts)
    want = getattr(natten_cupy, f"na{rank}d")(_np(q), _np(k), _np(v), ks, **opts)
    assert out.dtype == dtype and out.shape == q.shape
    numpy.testing.assert_array_equal(_np(out).astype(numpy.float64),
                                     want.astype(numpy.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank,spatial,ks,opts", [GEOMETRIES[2], GEOMETRIES[5], GEOMETRIES[8]],
                         ids=[GEOMETRY_IDS[2], GEOMETRY_IDS[5], GEOMETRY_IDS[8]])
def test_backward_matches_array_api(rng, rank, spatial, ks, opts, dtype):
    q, k, v = _qkv(rng, spatial, dtype=dtype, requires_grad=True)
    d_out = _tensor(rng, q.shape, dtype=dtype)
    grads = torch.autograd.grad(NA[rank](q, k, v, ks, **opts), (q, k, v), d_out)
    arrays = [_np(x) for x in (q, k, v)]
    out, lse = getattr(natten_cupy, f"na{rank}d")(*arrays, ks, return_lse=True, **opts)
    want = getattr(natten_cupy, f"na{rank}d_backward")(_np(d_out), *arrays, out, lse, ks, **opts)
    for g, w in zip(grads, want):
        assert g.dtype == dtype
        numpy.testing.assert_array_equal(_np(g).astype(numpy.float64), w.astype(numpy.float64))


def test_forward_accepts_strided_inputs(rng):
    """Heads-first tensors permuted to [B, X, Y, H, D] give the contiguous result."""
    q, k, v = (_tensor(rng, (2, 3, 5, 6, 4)).permute(0, 2, 3, 1, 4) for _ in range(3))
    assert not q.is_contiguous()
    out = nt.na2d(q, k, v, 3, dilation=(1, 2))
    want = nt.na2d(q.contiguous(), k.contiguous(), v.contiguous(), 3, dilation=(1, 2))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_scale_is_used(rng):
    q, k, v = _qkv(rng, (7,))
    out = nt.na1d(q, k, v, 3, scale=0.25)
    want = natten_cupy.na1d(_np(q), _np(k), _np(v), 3, scale=0.25)
    numpy.testing.assert_array_equal(_np(out), want)
    assert not torch.equal(out, nt.na1d(q, k, v, 3))


@pytest.mark.parametrize("rank,spatial,ks,opts", UNFUSED, ids=UNFUSED_IDS)
def test_unfused_match_array_api(rng, rank, spatial, ks, opts):
    q, k, v = _qkv(rng, spatial, dtype=torch.float32)
    heads = q.shape[-2]
    ks_t = _torch_common.per_axis(rank, ks, 1, False)[0]
    rpb = _tensor(rng, (heads,) + tuple(2 * x - 1 for x in ks_t), dtype=torch.float32)
    attn = QK[rank](q, k, ks, rpb=rpb, **opts)
    want = getattr(natten_cupy, f"na{rank}d_qk")(_np(q), _np(k), ks, rpb=_np(rpb), **opts)
    numpy.testing.assert_array_equal(_np(attn), want)
    probs = torch.softmax(attn, dim=-1)
    out = AV[rank](probs, v, ks, **opts)
    want = getattr(natten_cupy, f"na{rank}d_av")(_np(probs), _np(v), ks, **opts)
    numpy.testing.assert_array_equal(_np(out), want)


def test_unfused_composition_equals_fused(rng):
    """softmax(scale * qk) then av is the fused op (causal, dilated, 2-D)."""
    q, k, v = _qkv(rng, (6, 7), heads=3, dim=4)
    opts = {"dilation": (2, 1), "is_causal": (False, True)}
    attn = torch.softmax(nt.na2d_qk(q * 4 ** -0.5, k, 3, **opts), dim=-1)
    torch.testing.assert_close(nt.na2d_av(attn, v, 3, **opts), nt.na2d(q, k, v, 3, **opts))


def test_self_attention_limit(rng):
    """kernel_size == extent on every axis is plain softmax attention."""
    q, k, v = _qkv(rng, (4, 5), heads=2, dim=3)
    out = nt.na2d(q, k, v, (4, 5))
    flat = [x.flatten(1, 2).transpose(1, 2) for x in (q, k, v)]  # [B, H, N, D]
    want = torch.softmax(flat[0] @ flat[1].transpose(-1, -2) * 3 ** -0.5, -1) @ flat[2]
    torch.testing.assert_close(out, want.transpose(1, 2).unflatten(1, (4, 5)))


def test_zero_batch_is_empty(rng):
    q, k, v = _qkv(rng, (5, 5), batch=0, requires_grad=True)
    out = nt.na2d(q, k, v, 3)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape


# ---- gradients ---------------------------------------------------------------------------

@pytest.mark.parametrize("rank,spatial,ks,opts", GEOMETRIES, ids=GEOMETRY_IDS)
def test_gradcheck_fused(rng, rank, spatial, ks, opts):
    inputs = _qkv(rng, spatial, heads=1, dim=2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: NA[rank](q, k, v, ks, **opts), inputs)


@pytest.mark.parametrize("rank,spatial,ks,opts", UNFUSED[:7] + UNFUSED[8:],
                         ids=UNFUSED_IDS[:7] + UNFUSED_IDS[8:])
def test_gradcheck_unfused(rng, rank, spatial, ks, opts):
    """qk (with rpb) -> softmax -> av: softmax turns causal -inf slots into exact zeros.

    One 3-D case only (dilated, partly causal): a full 3-D Jacobian takes long on the CPU.
    """
    q, k, v = _qkv(rng, spatial, heads=1, dim=2, requires_grad=True)
    ks_t = _torch_common.per_axis(rank, ks, 1, False)[0]
    rpb = _tensor(rng, (1,) + tuple(2 * x - 1 for x in ks_t), requires_grad=True)

    def f(q, k, v, rpb):
        return AV[rank](torch.softmax(QK[rank](q, k, ks, rpb=rpb, **opts), -1), v, ks, **opts)
    assert torch.autograd.gradcheck(f, (q, k, v, rpb))


def test_gradcheck_qk_and_av_alone(rng):
    q, k = _qkv(rng, (7,), heads=2, dim=2, requires_grad=True)[:2]
    rpb = _tensor(rng, (2, 5), requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, r: nt.na1d_qk(q, k, 3, rpb=r, dilation=2),
                                    (q, k, rpb))
    attn = _tensor(rng, (1, 7, 2, 3), requires_grad=True)
    v = _tensor(rng, (1, 7, 2, 2), requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, v: nt.na1d_av(a, v, 3, is_causal=True), (attn, v))


def test_qk_without_rpb_has_no_rpb_grad(rng):
    q, k = _qkv(rng, (6, 5), requires_grad=True)[:2]
    rpb = _tensor(rng, (2, 5, 5), requires_grad=True)
    nt.na2d_qk(q, k, 3, rpb=rpb).sum().backward()
    assert rpb.grad is not None and rpb.grad.dtype == rpb.dtype
    # every logit carries its bias once: the bias gradient sums to the number of logits
    assert rpb.grad.sum().item() == pytest.approx(q.shape[0] * 6 * 5 * 2 * 9)
    q.grad = None
    nt.na2d_qk(q, k, 3).sum().backward()
    assert q.grad is not None


def test_causal_av_ignores_empty_slots(rng):
    """Whatever the empty slots of a causal window hold, av ignores them."""
    attn = _tensor(rng, (1, 5, 1, 3), requires_grad=True)
    v = _tensor(rng, (1, 5, 1, 2))
    out = nt.na1d_av(attn, v, 3, is_causal=True)
    poisoned = attn.detach().clone()
    poisoned[0, 0, 0, 1:] = float("nan")   # query 0 sees one key
    poisoned[0, 1, 0, 2] = float("nan")    # query 1 sees two
    torch.testing.assert_close(nt.na1d_av(poisoned, v, 3, is_causal=True), out.detach())
    out.sum().backward()
    assert (attn.grad[0, 0, 0, 1:] == 0).all() and attn.grad[0, 1, 0, 2] == 0


# ---- saved tensors ------------------------------------------------------------------------

def _packed(fn):
    """Run fn() under a saved-tensor hook; the number of tensors it packed."""
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                  lambda t: t):
        fn()
    return len(packed)


def test_saved_tensors_go_through_save_for_backward(rng):
    q, k, v = _qkv(rng, (5, 5), requires_grad=True)
    rpb = _tensor(rng, (2, 5, 5), requires_grad=True)
    attn = _tensor(rng, (1, 5, 5, 2, 9), requires_grad=True)
    assert _packed(lambda: nt.na2d(q, k, v, 3)) == 5            # q, k, v, out, lse
    assert _packed(lambda: nt.na2d_qk(q, k, 3, rpb=rpb)) == 2   # q, k
    assert _packed(lambda: nt.na2d_av(attn, v, 3)) == 2         # attn, v


def test_applier_is_apply_without_the_python_wrapper():
    """``_applier(F)`` runs F's forward and backward as ``F.apply`` does (the C apply where
    torch wraps it in Python), outputs and gradients alike."""
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, factor):
            ctx.factor = factor
            return x * factor

        @staticmethod
        def backward(ctx, g):
            return g * ctx.factor, None

    apply = _torch_eager._applier(Twice)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = apply(x, 3.0)
    assert type(y.grad_fn).__name__ == "TwiceBackward"
    y.sum().backward()
    assert torch.equal(y.detach(), x.detach() * 3)
    assert torch.equal(x.grad, torch.full((5,), 3.0, dtype=torch.float64))
    assert callable(_torch_eager.fused_na_apply) and callable(_torch_ext.fused_ext_apply)


def test_save_on_cpu(rng):
    inputs = _qkv(rng, (6, 5), requires_grad=True)
    opts = {"dilation": (2, 1), "is_causal": (True, False)}
    nt.na2d(*inputs, 3, **opts).pow(2).sum().backward()
    want = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        out = nt.na2d(*inputs, 3, **opts)
    out.pow(2).sum().backward()
    for x, g in zip(inputs, want):
        torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


# ---- modules -------------------------------------------------------------------------------

@pytest.mark.parametrize("rank,spatial,ks,opts", [GEOMETRIES[1], GEOMETRIES[5], GEOMETRIES[8]],
                         ids=[GEOMETRY_IDS[1], GEOMETRY_IDS[5], GEOMETRY_IDS[8]])
def test_module_forward_and_grads(rng, rank, spatial, ks, opts):
    torch.manual_seed(0)
    mod = MODULES[rank](8, 2, ks, **opts).double()
    x = _tensor(rng, (2,) + spatial + (8,), requires_grad=True)
    y = mod(x)
    assert y.shape == x.shape
    # the same computation spelled out with the functional call
    q, k, v = mod.qkv(x).unflatten(-1, (3, 2, 4)).unbind(-3)
    want = mod.proj(NA[rank](q, k, v, ks, **opts).flatten(-2))
    torch.testing.assert_close(y, want)
    y.square().mean().backward()
    for name, p in [("x", x)] + list(mod.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_module_options_and_errors():
    mod = nt.NeighborhoodAttention2D(6, 3, 3, dilation=(1, 2), qkv_bias=False, proj_bias=False)
    assert mod.qkv.bias is None and mod.proj.bias is None
    assert mod.kernel_size == (3, 3) and mod.dilation == (1, 2) and mod.is_causal == (False,) * 2
    assert "kernel_size=(3, 3)" in repr(mod)
    with pytest.raises(ValueError, match="dim must be a positive multiple of num_heads"):
        nt.NeighborhoodAttention1D(6, 4, 3)
    with pytest.raises(ValueError, match="kernel_size must have 3 entries"):
        nt.NeighborhoodAttention3D(6, 3, (3, 3))
    with pytest.raises(TypeError, match="has no rank"):
        nt.NeighborhoodAttention(6, 3, 3)
    with pytest.raises(ValueError, match=re.escape("x must be [B, X, Y, 6]")):
        mod(torch.zeros(1, 5, 5, 4))
    with pytest.raises(ValueError, match="kernel_size \\* dilation must not exceed"):
        mod(torch.zeros(1, 5, 5, 6))


# ---- torch.library / torch.compile ---------------------------------------------------------

def _op_samples(rng, dim=3, **kw):
    """One call of every custom op; ``kw`` (device, dtype) goes to the tensors."""
    q, k, v = _qkv(rng, (5, 7), dim=dim, requires_grad=True, **kw)
    rpb = _tensor(rng, (2, 5, 5), requires_grad=True, **kw)
    attn = _tensor(rng, (1, 5, 7, 2, 9), requires_grad=True, **kw)
    lists = ([3, 3], [1, 1], [1, 1], [False, True])
    out, lse = torch.ops.natten_cupy.na_fused_forward(q, k, v, *lists, None, "auto", False,
                                                      False)
    d = [t.detach() for t in (q, k, v, out, lse)]
    ops = torch.ops.natten_cupy
    return [
        (ops.na_fused_forward.default, (q, k, v, *lists, 0.5, "auto", False, False)),
        (ops.na_fused_backward.default, (d[3].clone(), *d, *lists, None, "auto", False, False)),
        (ops.na_qk.default, (q, k, rpb, [3, 3], [1, 2], [False, True], "auto", False)),
        (ops.na_qk.default, (q, k, None, [3, 3], [1, 1], [True, True], "auto", False)),
        (ops.na_qk_backward.default, (attn.detach(), d[0], d[1], True, [3, 3], [1, 1],
                                      [False, False], "auto", False)),
        (ops.na_av.default, (attn, v, [3, 3], [1, 1], [True, False], "auto", False)),
        (ops.na_av_backward.default, (d[0], attn.detach(), d[2], [3, 3], [1, 1],
                                      [False, False], "auto", False)),
    ]


def test_opcheck(rng):
    for op, args in _op_samples(rng):
        torch.library.opcheck(op, args)


def _compiled_matches_eager(rng, dim=3, **kw):
    """torch.compile(fullgraph=True) of fused and unfused calls: same values and gradients."""
    def f(q, k, v, rpb):
        attn = torch.softmax(nt.na2d_qk(q, k, 3, rpb=rpb, dilation=(1, 2)), -1)
        return nt.na2d(q, k, v, 3, is_causal=(True, False)) * 2 + nt.na2d_av(attn, v, 3,
                                                                             dilation=(1, 2))
    q, k, v = _qkv(rng, (5, 7), dim=dim, requires_grad=True, **kw)
    rpb = _tensor(rng, (2, 5, 5), requires_grad=True, **kw)
    eager = f(q, k, v, rpb)
    want = torch.autograd.grad(eager.square().sum(), (q, k, v, rpb))
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v, rpb)
    got = torch.autograd.grad(out.square().sum(), (q, k, v, rpb))
    torch.testing.assert_close(out, eager)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_torch_compile_fullgraph(rng):
    try:
        import torch._inductor  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        pytest.skip(f"torch.compile unavailable: {e}")
    _compiled_matches_eager(rng)


# ---- bad input: the same errors as the array API -------------------------------------------

def _bad_cases():
    """(name, rank, (q, k, v) shapes/dtypes and options) for the fused call."""
    ok = (1, 5, 6, 2, 3)
    f64 = numpy.float64
    return {
        "q-rank": (2, [(1, 5, 6, 3), ok, ok], [f64] * 3, {"kernel_size": 3}),
        "k-shape": (2, [ok, (1, 5, 5, 2, 3), ok], [f64] * 3, {"kernel_size": 3}),
        "v-dtype": (2, [ok, ok, ok], [f64, f64, numpy.float32], {"kernel_size": 3}),
        "q-int": (2, [ok, ok, ok], [numpy.int32] * 3, {"kernel_size": 3}),
        "kernel-1": (2, [ok] * 3, [f64] * 3, {"kernel_size": 1}),
        "kernel-axes": (2, [ok] * 3, [f64] * 3, {"kernel_size": (3, 3, 3)}),
        "kernel-str": (2, [ok] * 3, [f64] * 3, {"kernel_size": "3"}),
        "kernel-float": (2, [ok] * 3, [f64] * 3, {"kernel_size": (3, 2.0)}),
        "stride-big": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "stride": 4}),
        "dilation-0": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "dilation": (1, 0)}),
        "too-wide": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "dilation": 2}),
        "causal-int": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "is_causal": 1}),
        "zero-extent": (2, [(1, 0, 6, 2, 3)] * 3, [f64] * 3, {"kernel_size": 3}),
        "zero-head-dim": (2, [(1, 5, 6, 2, 0)] * 3, [f64] * 3, {"kernel_size": 3}),
        "scale-str": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "scale": "1"}),
        "scale-inf": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "scale": math.inf}),
        "backend-name": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "backend": "cuda"}),
        "backend-gpu-on-cpu": (2, [ok] * 3, [f64] * 3, {"kernel_size": 3, "backend": "naive"}),
        "1d-rank": (1, [ok] * 3, [f64] * 3, {"kernel_size": 3}),
    }


def _array_error(fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    return info.value


def _assert_same_error(expected, fn, *args, **kwargs):
    with pytest.raises(type(expected)) as info:
        fn(*args, **kwargs)
    assert str(info.value).replace("torch.", "") == str(expected)


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_same_error_as_array_api(case):
    rank, shapes, dtypes, opts = _bad_cases()[case]
    arrays = [numpy.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
    opts = dict(opts)
    ks = opts.pop("kernel_size")
    expected = _array_error(getattr(natten_cupy, f"na{rank}d"), *arrays, ks, **opts)
    tensors = [torch.from_numpy(a) for a in arrays]
    _assert_same_error(expected, NA[rank], *tensors, ks, **opts)


def test_bad_unfused_inputs_same_error_as_array_api():
    q = numpy.zeros((1, 5, 6, 2, 3))
    cases = [
        (natten_cupy.na2d_qk, nt.na2d_qk, (q, q, 3), {"rpb": numpy.zeros((2, 5, 4))}),
        (natten_cupy.na2d_qk, nt.na2d_qk, (q, q, 3), {"rpb": numpy.zeros((2, 5, 5), "f4")}),
        (natten_cupy.na2d_qk, nt.na2d_qk, (q, q, 3), {"dilation": 3}),
        (natten_cupy.na2d_av, nt.na2d_av, (numpy.zeros((1, 5, 6, 2, 8)), q, 3), {}),
        (natten_cupy.na2d_av, nt.na2d_av, (numpy.zeros((1, 5, 6, 2, 9), "f4"), q, 3), {}),
        (natten_cupy.na1d_av, nt.na1d_av, (q, q, 3), {}),
    ]
    for array_fn, torch_fn, args, kwargs in cases:
        expected = _array_error(array_fn, *args, **kwargs)
        to_t = {k: torch.from_numpy(x) for k, x in kwargs.items() if isinstance(x, numpy.ndarray)}
        _assert_same_error(expected, torch_fn, *[torch.from_numpy(a) if isinstance(a, numpy.ndarray)
                                                 else a for a in args], **{**kwargs, **to_t})


def test_non_tensor_inputs():
    q = torch.zeros(1, 5, 6, 2, 3)
    with pytest.raises(TypeError, match="v must be an array"):
        nt.na2d(q, q, [[1.0]], 3)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got ndarray"):
        nt.na2d(q, q.numpy(), q, 3)
    with pytest.raises(TypeError, match="q lives on device meta; only CPU and CUDA"):
        nt.na2d(q.to("meta"), q.to("meta"), q.to("meta"), 3)


def test_errors_raised_under_torch_compile(rng):
    """Compiled code skips the up-front checks; the op still validates when it runs."""
    q, k, v = _qkv(rng, (5, 7))
    compiled = torch.compile(lambda q, k, v: nt.na2d(q, k, v, 3, dilation=2), fullgraph=True,
                             backend="aot_eager")
    with pytest.raises(ValueError, match="kernel_size \\* dilation must not exceed"):
        compiled(q, k, v)


# ---- GPU -----------------------------------------------------------------------------------

def _cuda_qkv(rng, spatial, dtype, heads=2, dim=32, batch=2, requires_grad=False):
    return _qkv(rng, spatial, heads=heads, dim=dim, batch=batch, dtype=dtype, device="cuda",
                requires_grad=requires_grad)


def _grads(fn, inputs, d_out):
    out = fn(*inputs)
    return (out,) + torch.autograd.grad(out, inputs, d_out)


@pytest.mark.gpu
@pytest.mark.parametrize("rank,spatial,ks,opts", GEOMETRIES, ids=GEOMETRY_IDS)
def test_gpu_gradcheck_naive(rng, rank, spatial, ks, opts):
    inputs = _qkv(rng, spatial, heads=1, dim=2, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: NA[rank](q, k, v, ks, backend="naive", **opts), inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("rank,spatial,ks,opts", UNFUSED, ids=UNFUSED_IDS)
def test_gpu_gradcheck_unfused_naive(rng, rank, spatial, ks, opts):
    q, k, v = _qkv(rng, spatial, heads=2, dim=2, device="cuda", requires_grad=True)
    ks_t = _torch_common.per_axis(rank, ks, 1, False)[0]
    rpb = _tensor(rng, (2,) + tuple(2 * x - 1 for x in ks_t), device="cuda",
                  requires_grad=True)

    def f(q, k, v, rpb):
        attn = QK[rank](q, k, ks, rpb=rpb, backend="naive", **opts)
        return AV[rank](torch.softmax(attn, -1), v, ks, backend="naive", **opts)
    assert torch.autograd.gradcheck(f, (q, k, v, rpb))


@pytest.mark.gpu
@pytest.mark.parametrize("rank,spatial,ks,opts", [
    (1, (97,), 7, {"dilation": 2, "is_causal": True}),
    (2, (19, 23), (5, 7), {"stride": (2, 1)}),
    (2, (17, 18), 5, {"dilation": (2, 1), "is_causal": (True, False)}),
    (3, (7, 9, 10), (3, 3, 5), {"is_causal": (False, False, True)}),
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fused_agrees_with_naive(rng, rank, spatial, ks, opts, dtype):
    """Fused error vs float64 is at most 2x (3x for gradients) the naive backend's error."""
    inputs = _cuda_qkv(rng, spatial, torch.float64, requires_grad=True)
    d_out = _tensor(rng, inputs[0].shape, device="cuda")
    exact = _grads(lambda q, k, v: NA[rank](q, k, v, ks, backend="naive", **opts), inputs,
                   d_out)
    low = [x.detach().to(dtype).requires_grad_() for x in inputs]
    results = {}
    for backend in ("naive", "fused"):
        results[backend] = _grads(
            lambda q, k, v: NA[rank](q, k, v, ks, backend=backend, **opts), low,
            d_out.to(dtype))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        err = {b: (r[i].double() - exact[i]).abs().max().item() for b, r in results.items()}
        factor = 2 if name == "out" else 3
        floor = 1e-3 * exact[i].abs().max().item() + 1e-5
        assert torch.isfinite(results["fused"][i]).all(), name
        assert err["fused"] <= factor * err["naive"] + floor, (name, err)


@pytest.mark.gpu
def test_gpu_module_matches_cpu(rng):
    torch.manual_seed(0)
    mod = nt.NeighborhoodAttention2D(64, 2, 5, dilation=(1, 2), is_causal=(True, False))
    x = _tensor(rng, (2, 11, 13, 64), dtype=torch.float32)
    want = mod(x)
    mod_gpu = mod.cuda()
    x_gpu = x.cuda().requires_grad_()
    y = mod_gpu(x_gpu)
    torch.testing.assert_close(y.cpu(), want.detach(), rtol=1e-4, atol=1e-4)
    y.square().mean().backward()
    assert torch.isfinite(x_gpu.grad).all() and torch.isfinite(mod_gpu.qkv.weight.grad).all()
    mod_half = nt.NeighborhoodAttention3D(64, 4, 3).cuda().half()
    out = mod_half(torch.randn(1, 5, 6, 7, 64, device="cuda", dtype=torch.float16))
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


@pytest.mark.gpu
def test_gpu_non_default_stream(rng):
    q, k, v = _cuda_qkv(rng, (33, 35), torch.float16, requires_grad=True)
    d_out = torch.randn_like(q)
    want = _grads(lambda q, k, v: nt.na2d(q, k, v, 7, dilation=2), (q, k, v), d_out)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # a long kernel ahead of ours on the side stream: wrong-stream launches would race it
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big / 64
        q2 = q.detach() * 1  # produced on the side stream
        q2.requires_grad_()
        got = _grads(lambda q, k, v: nt.na2d(q, k, v, 7, dilation=2), (q2, k, v), d_out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1:], want[1:]):  # the backward may accumulate in any order
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["naive", "fused"])
def test_gpu_cuda_graph_capture(rng, backend):
    q, k, v = _cuda_qkv(rng, (17, 19), torch.float16)
    opts = {"dilation": (1, 2), "is_causal": (True, False), "backend": backend}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles and loads the kernels) off the graph
        nt.na2d(q, k, v, 5, **opts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nt.na2d(q, k, v, 5, **opts)
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, nt.na2d(q, k, v, 5, **opts), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_matches_cpu_and_dtypes(rng):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, k, v = _qkv(rng, (9, 10), dim=16, dtype=torch.float32)
        want = nt.na2d(q, k, v, 3, is_causal=(False, True))
        got = nt.na2d(*(x.to("cuda", dtype) for x in (q, k, v)), 3, is_causal=(False, True))
        assert got.dtype == dtype and got.device.type == "cuda"
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_unfused_matches_cpu(rng, dtype):
    """auto-selected unfused ops (and their gradients) on CUDA against the CPU reference."""
    q, k, v = _qkv(rng, (13, 14), heads=2, dim=32, dtype=torch.float32)
    rpb = _tensor(rng, (2, 9, 9), dtype=torch.float32)
    d_out = _tensor(rng, q.shape, dtype=torch.float32)
    opts = {"dilation": (1, 2), "is_causal": (False, True)}

    def run(q, k, v, rpb):
        attn = torch.softmax(nt.na2d_qk(q * 32 ** -0.5, k, 5, rpb=rpb, **opts).float(), -1)
        return nt.na2d_av(attn.to(v.dtype), v, 5, **opts)
    cpu = [x.clone().requires_grad_() for x in (q, k, v, rpb)]
    gpu = [x.to("cuda", dtype).requires_grad_() for x in (q, k, v, rpb)]
    want = _grads(run, cpu, d_out)
    got = _grads(run, gpu, d_out.to("cuda", dtype))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float().cpu(), w.detach(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gpu_opcheck_and_compile(rng):
    """The custom ops on CUDA tensors (fused and tiled backends in float32, head dim 32)."""
    for op, args in _op_samples(rng, dim=32, device="cuda", dtype=torch.float32):
        torch.library.opcheck(op, args)
    _compiled_matches_eager(rng, dim=32, device="cuda", dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_mixed_devices_rejected():
    q = torch.zeros(1, 5, 6, 2, 32, device="cuda")
    with pytest.raises(ValueError, match="all arrays must be on the same device, got q on GPU, "
                                         "k on CPU, v on GPU"):
        nt.na2d(q, q.cpu(), q, 3)


# ---- tile in the torch layer ----------------------------------------------------------------

@pytest.mark.parametrize("tile", [(8, 16), "autotune", [4, 4]])
def test_torch_layer_takes_tile(tile):
    """tile= reaches the fused op (as text in its schema) eagerly and under torch.compile;
    on CPU tensors (reference backend) it changes nothing; a bad tile names the argument."""
    from natten_cupy import torch as nt
    from natten_cupy._torch_common import _tile_value, tile_text
    gen = torch.Generator().manual_seed(5)
    q, k, v, d_out = (torch.randn(1, 9, 10, 2, 8, generator=gen, dtype=torch.float64)
                      for _ in range(4))

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        out.backward(d_out)
        return [out.detach()] + [x.grad for x in leaves]

    want = grads(lambda q, k, v: nt.na2d(q, k, v, 3))
    eager = grads(lambda q, k, v: nt.na2d(q, k, v, 3, tile=tile))
    torch._dynamo.reset()
    compiled = grads(torch.compile(lambda q, k, v: nt.na2d(q, k, v, 3, tile=tile),
                                   fullgraph=True, backend="aot_eager"))
    for a, b, c in zip(want, eager, compiled):
        assert torch.equal(a, b) and torch.equal(a, c)
    norm = tile if isinstance(tile, str) else tuple(tile)
    assert _tile_value(tile_text(norm)) == norm


@pytest.mark.parametrize("bad", ["fastest", (0, 4), (2.5, 4), ()])
def test_torch_layer_rejects_a_bad_tile(bad):
    from natten_cupy import torch as nt
    q = torch.zeros(1, 6, 6, 1, 8)
    with pytest.raises(ValueError, match="tile must be a tuple of positive ints or 'autotune'"):
        nt.na2d(q, q, q, 3, tile=bad)
