"""Grouped-query / multi-query attention (GQA/MQA) on the CPU: k and v carry H_kv heads,
query head h reads kv head h // (H / H_kv), and dk, dv sum over each kv head's group.

The reference backend (NumPy) is checked against a brute force written apart from it: the
dense float64 oracle (``tests/oracle.py``) on k and v with every kv head repeated for its
query group, whose dk and dv are then summed over the group. Validation, the problem and
its launch struct, and the fast path's signatures are checked here too; the GPU backends
run the same cases in ``tests/gpu/test_gpu_gqa.py`` (and the naive kernels' source in the CPU
emulator, ``tests/unit/test_naive_emulated.py``).
"""

import re

import numpy
import pytest

import natten_cupy
from natten_cupy import _args, _fast
from natten_cupy._params import make_params

import oracle

# (spatial, kernel, stride, dilation, causal): odd extents, even kernels, dilation, stride
# and causal mixes per rank.
GEOMETRIES = [
    ((13,), (5,), (1,), (1,), (False,)),
    ((17,), (4,), (2,), (2,), (True,)),
    ((7, 9), (3, 4), (1, 2), (1, 2), (False, True)),
    ((9, 6), (5, 3), (2, 3), (1, 2), (True, True)),
    ((5, 6, 7), (3, 2, 4), (1, 2, 3), (1, 2, 1), (False, True, False)),
    ((6, 5, 5), (2, 3, 3), (1, 1, 1), (3, 1, 1), (True, False, True)),
]
HEADS = [(8, 2), (4, 1), (6, 3), (3, 3)]   # GQA, MQA, two per group, plain multi-head


def call(rank, suffix=""):
    return getattr(natten_cupy, f"na{rank}d{suffix}")


def repeat_kv(x, group):
    """Brute-force GQA: each kv head repeated for the ``group`` query heads that read it."""
    return numpy.repeat(x, group, axis=-2)


def group_sum(g, group):
    """A gradient over the repeated heads summed back onto its kv head."""
    shape = g.shape[:-2] + (g.shape[-2] // group, group, g.shape[-1])
    return g.reshape(shape).sum(axis=-2)


def close(got, want, rtol=1e-10, atol=1e-12):
    got, want = numpy.asarray(got, numpy.float64), numpy.asarray(want, numpy.float64)
    assert got.shape == want.shape
    numpy.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _arrays(rng, spatial, heads, kv_heads, D, B=2):
    q_shape = (B,) + spatial + (heads, D)
    kv_shape = (B,) + spatial + (kv_heads, D)
    return (rng.standard_normal(q_shape), rng.standard_normal(kv_shape),
            rng.standard_normal(kv_shape), rng.standard_normal(q_shape))


def _ids():
    return [f"{g[0]}k{g[1]}s{g[2]}d{g[3]}c{g[4]}-H{h}kv{hk}".replace(" ", "")
            for g in GEOMETRIES for h, hk in HEADS]


CASES = [(g, h) for g in GEOMETRIES for h in HEADS]


@pytest.mark.parametrize("geometry,heads", CASES, ids=_ids())
def test_fused_matches_repeated_kv(geometry, heads, rng):
    spatial, kernel, stride, dilation, causal = geometry
    H, Hkv = heads
    G = H // Hkv
    rank = len(spatial)
    q, k, v, d_out = _arrays(rng, spatial, H, Hkv, 5)
    kw = dict(stride=stride, dilation=dilation, is_causal=causal)
    out, lse = call(rank)(q, k, v, kernel, return_lse=True, **kw)
    want_out, want_lse = oracle.fused_forward(q, repeat_kv(k, G), repeat_kv(v, G), kernel,
                                              stride, dilation, causal)
    close(out, want_out)
    close(lse, want_lse)
    dq, dk, dv = call(rank, "_backward")(d_out, q, k, v, out, lse, kernel, **kw)
    assert dk.shape == k.shape and dv.shape == v.shape
    wq, wk, wv = oracle.fused_backward(d_out, q, repeat_kv(k, G), repeat_kv(v, G), kernel,
                                       stride, dilation, causal)
    close(dq, wq)
    close(dk, group_sum(wk, G))
    close(dv, group_sum(wv, G))


@pytest.mark.parametrize("geometry,heads", CASES, ids=_ids())
def test_unfused_matches_repeated_kv(geometry, heads, rng):
    spatial, kernel, _, dilation, causal = geometry
    H, Hkv = heads
    G = H // Hkv
    rank = len(spatial)
    q, k, v, d_out = _arrays(rng, spatial, H, Hkv, 4)
    rpb = rng.standard_normal((H,) + tuple(2 * x - 1 for x in kernel))
    kw = dict(dilation=dilation, is_causal=causal)
    okw = (kernel, dilation, causal)
    attn = call(rank, "_qk")(q, k, kernel, rpb=rpb, **kw)
    want = oracle.qk(q, repeat_kv(k, G), *okw, rpb=rpb)
    empty = numpy.isneginf(want)
    assert (numpy.isneginf(attn) == empty).all()
    close(numpy.where(empty, 0, attn), numpy.where(empty, 0, want))
    weights = numpy.where(empty, 0.0, rng.standard_normal(attn.shape))
    out = call(rank, "_av")(weights, v, kernel, **kw)
    assert out.shape == q.shape[:-1] + (v.shape[-1],)
    close(out, oracle.av(weights, repeat_kv(v, G), *okw))
    dq, dk, d_rpb = call(rank, "_qk_backward")(weights, q, k, kernel, rpb=rpb, **kw)
    wq, wk, w_rpb = oracle.qk_backward(weights, q, repeat_kv(k, G), *okw, with_rpb=True)
    assert dk.shape == k.shape
    close(dq, wq)
    close(dk, group_sum(wk, G))
    close(d_rpb, w_rpb)
    d_attn, dv = call(rank, "_av_backward")(d_out, weights, v, kernel, **kw)
    w_attn, w_v = oracle.av_backward(d_out, weights, repeat_kv(v, G), *okw)
    assert dv.shape == v.shape
    close(d_attn, w_attn)
    close(dv, group_sum(w_v, G))


def test_mqa_self_attention_is_dense_attention(rng):
    """kernel_size == extent: NA is plain attention; with one kv head, MQA."""
    q, k, v, _ = _arrays(rng, (5, 7), 4, 1, 8, B=1)
    out, lse = natten_cupy.na2d(q, k, v, (5, 7), return_lse=True)
    want_out, want_lse = oracle.dense_attention(q, repeat_kv(k, 4), repeat_kv(v, 4))
    close(out, want_out)
    close(lse, want_lse)


# ---- validation --------------------------------------------------------------------------

def _z(*shape, dtype=numpy.float32):
    return numpy.zeros(shape, dtype)


def test_kv_heads_must_divide_heads():
    q, k = _z(1, 9, 8, 4), _z(1, 9, 3, 4)
    with pytest.raises(ValueError, match=re.escape(
            "k has H_kv = 3 heads, which does not divide q's H = 8 heads")):
        natten_cupy.na1d(q, k, k, 3)
    with pytest.raises(ValueError, match="k has H_kv = 3 heads, which does not divide q's H"):
        natten_cupy.na1d_qk(q, k, 3)
    with pytest.raises(ValueError, match="k has H_kv = 0 heads, which does not divide"):
        natten_cupy.na1d(q, _z(1, 9, 0, 4), _z(1, 9, 0, 4), 3)
    with pytest.raises(ValueError, match="v has H_kv = 3 heads, which does not divide attn's "
                                         "H = 8 heads"):
        natten_cupy.na1d_av(_z(1, 9, 8, 3), k, 3)
    with pytest.raises(ValueError, match="v has H_kv = 3 heads, which does not divide d_out's"):
        natten_cupy.na1d_av_backward(_z(1, 9, 8, 4), _z(1, 9, 8, 3), k, 3)


def test_keys_and_values_need_the_same_heads():
    q = _z(1, 9, 8, 4)
    with pytest.raises(ValueError, match=re.escape(
            "v has 4 heads but k has 2: keys and values need the same number of heads H_kv")):
        natten_cupy.na1d(q, _z(1, 9, 2, 4), _z(1, 9, 4, 4), 3)


def test_kv_shapes_must_match_q_outside_the_heads():
    q = _z(1, 9, 8, 4)
    with pytest.raises(ValueError, match=re.escape(
            "k shape (1, 9, 2, 5) does not match q shape (1, 9, 8, 4)")):
        natten_cupy.na1d(q, _z(1, 9, 2, 5), _z(1, 9, 2, 4), 3)
    with pytest.raises(ValueError, match=re.escape(
            "v shape (2, 9, 2, 4) does not match q shape (1, 9, 8, 4)")):
        natten_cupy.na1d(q, _z(1, 9, 2, 4), _z(2, 9, 2, 4), 3)
    with pytest.raises(ValueError, match=re.escape(
            "attn shape (1, 8, 8, 3) does not match v shape (1, 9, 2, 4) in batch and "
            "extents")):
        natten_cupy.na1d_av(_z(1, 8, 8, 3), _z(1, 9, 2, 4), 3)
    with pytest.raises(ValueError, match="k dtype float64 does not match q dtype float32"):
        natten_cupy.na1d_qk(q, _z(1, 9, 2, 4, dtype=numpy.float64), 3)


def test_backward_checks_kv_and_query_sides():
    q, k = _z(1, 9, 8, 4), _z(1, 9, 2, 4)
    lse = _z(1, 9, 8)
    with pytest.raises(ValueError, match=re.escape(
            "out shape (1, 9, 2, 4) does not match q shape (1, 9, 8, 4)")):
        natten_cupy.na1d_backward(q, q, k, k, k, lse, 3)
    with pytest.raises(ValueError, match="k has H_kv = 3 heads, which does not divide"):
        natten_cupy.na1d_backward(q, q, _z(1, 9, 3, 4), _z(1, 9, 3, 4), q, lse, 3)
    with pytest.raises(ValueError, match=re.escape(
            "d_attn shape (1, 9, 2, 3) does not match the expected shape (1, 9, 8, 3)")):
        natten_cupy.na1d_qk_backward(_z(1, 9, 2, 3), q, k, 3)
    with pytest.raises(ValueError, match=re.escape("rpb shape (2, 5) must be [H, 2k-1, ...] "
                                                   "= (8, 5)")):
        natten_cupy.na1d_qk(q, k, 3, rpb=_z(2, 5))


def test_zero_query_heads_need_zero_kv_heads():
    """Zero heads on both sides is an empty call; kv heads without query heads are refused
    (their gradients would have no queries to come from)."""
    q, k = _z(1, 9, 0, 4), _z(1, 9, 0, 4)
    assert natten_cupy.na1d(q, k, k, 3).shape == (1, 9, 0, 4)
    with pytest.raises(ValueError, match="k has H_kv = 2 heads but q has none"):
        natten_cupy.na1d(q, _z(1, 9, 2, 4), _z(1, 9, 2, 4), 3)


# ---- the problem, its launch struct, signatures ------------------------------------------------

def test_problem_carries_kv_heads():
    q, k = _z(2, 9, 8, 4), _z(2, 9, 2, 4)
    p = _args.check_fused(1, q, k, k, 3, 1, 1, False, None, "auto")
    assert (p.heads, p.kv_heads, p.heads_per_kv, p.is_gqa) == (8, 2, 4, True)
    plain = _args.check_fused(1, q, q, q, 3, 1, 1, False, None, "auto")
    assert (plain.kv_heads, plain.heads_per_kv, plain.is_gqa) == (8, 1, False)
    assert p != plain and hash(p) != hash(plain)   # plan caches key on the problem
    built = _args.NAProblem(rank=1, batch=2, spatial=(9,), heads=8, head_dim=4,
                            kernel_size=(3,), stride=(1,), dilation=(1,), is_causal=(False,),
                            scale=0.5, dtype=numpy.dtype(numpy.float32))
    assert built.kv_heads == 8 and built.heads_per_kv == 1   # the default: no GQA
    params = make_params(p, q=q, k=k)
    assert params["kv_heads"] == 2 and params["heads_per_kv"] == 4
    assert list(params["k"]) == [72, 8, 0, 0, 4, 1] and list(params["q"])[4] == 4


def test_signatures_differ_in_kv_heads():
    """The fast path keys warm calls by every array's shape: calls that differ only in the
    kv heads get separate entries (and so separate plans)."""
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 9, 8, 4)
    sigs = {_fast._signature("fused_forward", 1, (q, k, k), (3,))[1]
            for k in (torch.zeros(1, 9, h, 4) for h in (1, 2, 4, 8))}
    assert len(sigs) == 4


# ---- torch layer (CPU) ---------------------------------------------------------------------

def test_torch_gqa_gradients_match_repeated_kv(rng):
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    q, k, v, d_out = (torch.tensor(x, requires_grad=True)
                      for x in _arrays(rng, (7, 6), 6, 2, 4, B=1))
    out = nt.na2d(q, k, v, 3, is_causal=(True, False))
    kr, vr = (x.repeat_interleave(3, dim=-2) for x in (k, v))
    want = nt.na2d(q, kr, vr, 3, is_causal=(True, False))
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    ref = torch.autograd.grad((want * d_out).sum(), (q, k, v))
    for g, r, x in zip(got, ref, (q, k, v)):
        assert g.shape == x.shape
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)
    attn = torch.softmax(nt.na2d_qk(q, k, 3), -1)
    out = nt.na2d_av(attn, v, 3)
    assert out.shape == q.shape
    dk, dv = torch.autograd.grad(out.square().sum(), (k, v))
    assert dk.shape == k.shape and dv.shape == v.shape


def test_torch_fake_shapes_have_kv_heads(rng):
    """The custom ops' fake implementations give dk, dv kv shapes and av the query heads."""
    torch = pytest.importorskip("torch")
    import natten_cupy.torch  # noqa: F401  (registers the custom ops)
    from torch._subclasses.fake_tensor import FakeTensorMode
    ops = torch.ops.natten_cupy
    with FakeTensorMode():
        q, k = torch.empty(1, 5, 7, 8, 4), torch.empty(1, 5, 7, 2, 4)
        lists = ([3, 3], [1, 1], [1, 1], [False, False])
        out, lse = ops.na_fused_forward(q, k, k, *lists, None, "auto", False, False)
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        dq, dk, dv = ops.na_fused_backward(out, q, k, k, out, lse, *lists, None, "auto",
                                           False, False)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
        attn = ops.na_qk(q, k, None, [3, 3], [1, 1], [False, False], "auto", False)
        assert attn.shape == (1, 5, 7, 8, 9)
        assert ops.na_av(attn, k, [3, 3], [1, 1], [False, False], "auto", False).shape == \
            q.shape
        _, dk, _ = ops.na_qk_backward(attn, q, k, False, [3, 3], [1, 1], [False, False],
                                      "auto", False)
        assert dk.shape == k.shape
        _, dv = ops.na_av_backward(q, attn, k, [3, 3], [1, 1], [False, False], "auto", False)
        assert dv.shape == k.shape


def test_torch_additional_keys_with_kv_heads(rng):
    """Extra tokens of H_kv heads serve each query group, as repeated heads would."""
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    q, k, v, _ = (torch.tensor(x) for x in _arrays(rng, (6, 5), 4, 2, 4, B=1))
    ek, ev = torch.randn(1, 3, 2, 4, dtype=torch.float64), torch.randn(1, 3, 2, 4,
                                                                     dtype=torch.float64)
    got = nt.na2d(q, k, v, 3, additional_keys=ek, additional_values=ev)
    rep = [x.repeat_interleave(2, dim=-2) for x in (k, v, ek, ev)]
    want = nt.na2d(q, rep[0], rep[1], 3, additional_keys=rep[2], additional_values=rep[3])
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


# ---- backends' refusals (CPU: refusals need no GPU) ----------------------------------------

def _problem(dtype, heads=8, kv_heads=2, D=64, allow_tf32=False):
    q = numpy.zeros((1, 9, 11, heads, D), dtype)
    k = numpy.zeros((1, 9, 11, kv_heads, D), dtype)
    return _args.check_fused(2, q, k, k, 3, 1, 1, False, None, "auto", allow_tf32)


def test_fused_and_tiled_parts_take_gqa():
    from natten_cupy.backends import fused, tiled
    from natten_cupy.backends.fused import mma_backward, exact_fp32, mma_forward
    p = _problem(numpy.float16)
    assert mma_forward.refuse(p) is None and mma_backward.refuse(p) is None
    assert fused.refuse("fused_forward", p) is None and fused.refuse("fused_backward", p) is None
    assert exact_fp32.refuse(_problem(numpy.float32)) is None
    assert mma_forward.refuse(_problem(numpy.float32, allow_tf32=True)) is None
    q = numpy.zeros((1, 9, 11, 8, 64), numpy.float16)
    k = numpy.zeros((1, 9, 11, 2, 64), numpy.float16)
    for op, problem in (("qk", _args.check_qk(2, q, k, 3, 1, False, None, "auto")),
                        ("av", _args.check_av(2, numpy.zeros((1, 9, 11, 8, 9), numpy.float16),
                                              k, 3, 1, False, "auto"))):
        assert tiled.refuse(op, problem) is None


def test_fused_backward_names_the_grouped_kernel():
    """The dK/dV pass of a GQA problem is its own instantiation (the loop over the group's
    query heads), listed for the compile test; without GQA the original kernel runs."""
    from natten_cupy.backends.fused import mma_backward
    grouped = mma_backward._names("__half", 64, grouped=True)[0]
    assert grouped == "na_bwd_fused_kv<__half, 64, 64, true, false>"
    listed = {name for _, name in mma_backward.instantiations()}
    assert {"na_bwd_fused_kv<__half, 64, 64, true, false>",
            "na_bwd_fused_kv<__half, 64, 64, false, false>"} <= listed


def test_gpu_gqa_capability_table_matches_the_backends_refusals():
    """The GPU suite's GQA cases: each backend refuses exactly what the main table says it
    refuses (GQA adds no refusal)."""
    import gpu_cases
    from natten_cupy.backends import get_backend
    for backend in gpu_cases.BACKENDS:
        mod = get_backend(backend)
        ran = 0
        for case in gpu_cases.gqa_cases() + gpu_cases.dv_cases():
            why = gpu_cases.refusal(case, mod)
            expected = gpu_cases.expected_refusal(case, backend)
            if expected is None:
                assert why is None, f"{backend} refuses {case.id}: {why}"
                ran += 1
            else:
                assert why is not None and expected in why, (case.id, expected, why)
        assert ran >= 10, f"{backend} runs only {ran} GQA cases"


# ---- values with their own head dim (Dv != D) -------------------------------------------------

@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[str(g[0]) for g in GEOMETRIES])
@pytest.mark.parametrize("dims", [(4, 7), (8, 3)])
def test_fused_value_head_dim_of_its_own(geometry, dims, rng):
    spatial, kernel, stride, dilation, causal = geometry
    D, Dv = dims
    rank = len(spatial)
    B, H, Hkv = 2, 4, 2
    q = rng.standard_normal((B,) + spatial + (H, D))
    k = rng.standard_normal((B,) + spatial + (Hkv, D))
    v = rng.standard_normal((B,) + spatial + (Hkv, Dv))
    d_out = rng.standard_normal((B,) + spatial + (H, Dv))
    kw = dict(stride=stride, dilation=dilation, is_causal=causal)
    out, lse = call(rank)(q, k, v, kernel, return_lse=True, **kw)
    assert out.shape == q.shape[:-1] + (Dv,)
    want_out, want_lse = oracle.fused_forward(q, repeat_kv(k, 2), repeat_kv(v, 2), kernel,
                                              stride, dilation, causal)
    close(out, want_out)
    close(lse, want_lse)
    dq, dk, dv = call(rank, "_backward")(d_out, q, k, v, out, lse, kernel, **kw)
    wq, wk, wv = oracle.fused_backward(d_out, q, repeat_kv(k, 2), repeat_kv(v, 2), kernel,
                                       stride, dilation, causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    close(dq, wq)
    close(dk, group_sum(wk, 2))
    close(dv, group_sum(wv, 2))


def test_value_head_dim_validation_and_refusals():
    q, k, v = _z(1, 9, 4, 8), _z(1, 9, 2, 8), _z(1, 9, 2, 5)
    p = _args.check_fused(1, q, k, v, 3, 1, 1, False, None, "auto")
    assert (p.head_dim, p.v_dim) == (8, 5) and make_params(p)["v_dim"] == 5
    assert _args.check_fused(1, q, k, k, 3, 1, 1, False, None, "auto").v_dim == 8
    out, lse = _z(1, 9, 4, 5), _z(1, 9, 4)
    with pytest.raises(ValueError, match=re.escape(
            "d_out shape (1, 9, 4, 8) does not match the expected shape (1, 9, 4, 5)")):
        natten_cupy.na1d_backward(q, q, k, v, out, lse, 3)
    with pytest.raises(ValueError, match=re.escape(
            "out shape (1, 9, 4, 8) does not match the expected shape (1, 9, 4, 5)")):
        natten_cupy.na1d_backward(out, q, k, v, q, lse, 3)
    with pytest.raises(ValueError, match=re.escape(
            "k shape (1, 9, 2, 5) does not match q shape (1, 9, 4, 8)")):
        natten_cupy.na1d(q, v, v, 3)   # keys keep the queries' head dim
    with pytest.raises(ValueError, match="head dim must be positive, got v with head dim 0"):
        natten_cupy.na1d(q, k, _z(1, 9, 2, 0), 3)
    from natten_cupy.backends import fused, naive
    half = _args.check_fused(1, q.astype(numpy.float16), k.astype(numpy.float16),
                             v.astype(numpy.float16), 3, 1, 1, False, None, "auto")
    for op in ("fused_forward", "fused_backward"):
        assert fused.refuse(op, half) == (
            "the fused kernels need the value head dim equal to the query/key head dim, got "
            "head dim 8 and value head dim 5 (naive and reference run it)")
        assert naive.refuse(op, half) is None


def test_torch_value_head_dim(rng):
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    q = torch.randn(1, 7, 6, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 7, 6, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 7, 6, 2, 5, dtype=torch.float64, requires_grad=True)
    out = nt.na2d(q, k, v, 3)
    assert out.shape == (1, 7, 6, 4, 5)
    kr, vr = (x.repeat_interleave(2, dim=-2) for x in (k, v))
    assert torch.allclose(out, nt.na2d(q, kr, vr, 3), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert torch.autograd.gradcheck(lambda a, b, c: nt.na2d(a, b, c, 3),
                                    (q.detach()[..., :2, :].requires_grad_(),
                                     k.detach()[..., :1, :].requires_grad_(),
                                     v.detach()[..., :1, :].requires_grad_()))
