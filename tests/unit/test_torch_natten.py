"""What NATTEN users reach for, in the torch layer (CPU, float64 through the reference
backend): lse as an output with its gradient, merge_attentions, additional keys/values,
NATTEN's calling convention, NATTEN's module arguments and state dicts. Each result is
checked against a dense float64 computation built from the oracle's neighborhood mask."""

import numpy
import pytest

torch = pytest.importorskip("torch")

import natten_cupy.torch as nt  # noqa: E402

import oracle  # noqa: E402

GEOMS = [  # rank, spatial, kernel, stride, dilation, causal
    (1, (13,), (5,), (1,), (2,), (True,)),
    (2, (7, 6), (3, 4), (2, 1), (1, 1), (False, True)),
    (3, (4, 5, 4), (2, 3, 3), (1, 1, 1), (1, 1, 1), (True, False, False)),
]


def _t(rng, shape, grad=True):
    return torch.tensor(rng.standard_normal(shape), dtype=torch.float64, requires_grad=grad)


def _dense(q, k, v, mask, extra_k=None, extra_v=None, scale=None):
    """Dense float64 attention in torch ops over the masked neighborhood (and every extra
    token): (out, lse), differentiable. q, k, v [B, *sp, H, D]; mask [N, N] bool."""
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    s = D ** -0.5 if scale is None else scale
    qf, kf, vf = (x.reshape(B, -1, H, x.shape[-1]) for x in (q, k, v))
    logits = torch.einsum("bnhd,bmhd->bhnm", qf, kf) * s
    logits = logits.masked_fill(~torch.as_tensor(mask), float("-inf"))
    values = vf
    if extra_k is not None:
        logits = torch.cat([logits, torch.einsum("bnhd,bthd->bhnt", qf, extra_k) * s], -1)
        values = torch.cat([vf, extra_v], 1)
    lse = torch.logsumexp(logits, -1)                          # [B, H, N]
    out = torch.einsum("bhnm,bmhd->bnhd", torch.exp(logits - lse[..., None]), values)
    return out.reshape(q.shape[:-1] + (v.shape[-1],)), lse.transpose(1, 2).reshape(q.shape[:-1])


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{g[0]}d")
def test_return_lse_and_its_gradient(rng, geom):
    rank, spatial, ks, st, dl, ca = geom
    q, k, v = (_t(rng, (2, *spatial, 2, 6)) for _ in range(3))
    mask = oracle.neighborhood_mask(spatial, ks, st, dl, ca)
    fn = getattr(nt, f"na{rank}d")
    out, lse = fn(q, k, v, ks, st, dl, ca, None, return_lse=True)
    want_out, want_lse = _dense(q, k, v, mask)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    want = torch.autograd.grad((want_out * d_out).sum() + (want_lse * d_lse).sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # lse alone (out unused): its gradient reaches q and k, not v
    _, lse = fn(q, k, v, ks, st, dl, ca, return_lse=True)
    got = torch.autograd.grad(lse.sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad(_dense(q, k, v, mask)[1].sum(), (q, k, v), allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.abs().max() > 0
        else:
            torch.testing.assert_close(g, w)


def test_gradcheck_through_lse(rng):
    q, k, v = (_t(rng, (1, 9, 2, 4)) for _ in range(3))

    def f(q, k, v):
        out, lse = nt.na1d(q, k, v, 4, is_causal=True, return_lse=True)
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{g[0]}d")
def test_additional_keys_values(rng, geom):
    rank, spatial, ks, st, dl, ca = geom
    q, k, v = (_t(rng, (2, *spatial, 2, 6)) for _ in range(3))
    ek, ev = _t(rng, (2, 5, 2, 6)), _t(rng, (2, 5, 2, 6))
    mask = oracle.neighborhood_mask(spatial, ks, st, dl, ca)
    fn = getattr(nt, f"na{rank}d")
    out, lse = fn(q, k, v, ks, st, dl, ca, additional_keys=ek, additional_values=ev,
                  return_lse=True)
    want_out, want_lse = _dense(q, k, v, mask, ek, ev)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v, ek, ev))
    want = torch.autograd.grad((want_out * d_out).sum(), (q, k, v, ek, ev))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_merge_attentions_is_attention_over_the_union(rng):
    q = _t(rng, (1, 6, 2, 4))
    parts = [(_t(rng, (1, n, 2, 4)), _t(rng, (1, n, 2, 4))) for n in (3, 5, 1)]

    def attend(keys, values):
        s = torch.einsum("bnhd,bthd->bnht", q, keys) * 0.5
        lse = torch.logsumexp(s, -1)
        return torch.einsum("bnht,bthd->bnhd", torch.softmax(s, -1), values), lse

    pieces = [attend(*p) for p in parts]
    out, lse = nt.merge_attentions([o for o, _ in pieces], [l for _, l in pieces])
    want_out, want_lse = attend(torch.cat([p[0] for p in parts], 1),
                                torch.cat([p[1] for p in parts], 1))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert torch.autograd.gradcheck(
        lambda a, b, la, lb: nt.merge_attentions([a, b], [la, lb]),
        (pieces[0][0].detach().requires_grad_(), pieces[1][0].detach().requires_grad_(),
         pieces[0][1].detach().requires_grad_(), pieces[1][1].detach().requires_grad_()))


def test_merge_under_save_on_cpu_and_errors(rng):
    q, k, v = (_t(rng, (1, 8, 8, 2, 4)) for _ in range(3))
    ek, ev = _t(rng, (1, 3, 2, 4)), _t(rng, (1, 3, 2, 4))

    def grads():
        out = nt.na2d(q, k, v, 3, additional_keys=ek, additional_values=ev)
        return torch.autograd.grad(out.square().sum(), (q, k, v, ek, ev))

    want = grads()
    with torch.autograd.graph.save_on_cpu():
        got = grads()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="together"):
        nt.na2d(q, k, v, 3, additional_keys=ek)
    with pytest.raises(ValueError, match="additional_keys has H_x = 3"):  # 3 heads: no GQA of 2
        nt.na2d(q, k, v, 3, additional_keys=torch.cat([ek, ek[:, :, :1]], 2),
                additional_values=torch.cat([ev, ev[:, :, :1]], 2))
    with pytest.raises(ValueError, match="one lse per output"):
        nt.merge_attentions([q], [])
    with pytest.raises(ValueError, match="lse_tensors\\[0\\] shape"):
        nt.merge_attentions([q], [q])


def test_nattens_calling_convention(rng):
    q, k, v = (_t(rng, (1, 9, 8, 2, 4), grad=False) for _ in range(3))
    want = nt.na2d(q, k, v, (3, 5), dilation=(2, 1), is_causal=(True, False), scale=0.3)
    got = nt.na2d(query=q, key=k, value=v, kernel_size=(3, 5), stride=None, dilation=(2, 1),
                  is_causal=(True, False), scale=0.3, backend=None, q_tile_shape=(8, 8),
                  kv_tile_shape=(8, 8), kernel_schedule="coop", torch_compile=False,
                  attention_kwargs={"backend": "cutlass-fmha"})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = nt.na2d(q, k, v, (3, 5), 1, (2, 1), (True, False), 0.3, backend="hopper-fna")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    plain = nt.na2d(q, k, v, 3, None, None, None)
    torch.testing.assert_close(plain, nt.na2d(q, k, v, 3))


def test_compile_with_lse_and_extra_tokens(rng):
    q, k, v = (_t(rng, (1, 10, 2, 4)) for _ in range(3))
    ek, ev = _t(rng, (1, 2, 2, 4)), _t(rng, (1, 2, 2, 4))

    def f(q, k, v, ek, ev):
        out, lse = nt.na1d(q, k, v, 3, additional_keys=ek, additional_values=ev,
                           return_lse=True)
        return out.sum() + lse.sum()

    want = torch.autograd.grad(f(q, k, v, ek, ev), (q, k, v, ek, ev))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, ek, ev), (q, k, v, ek, ev))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ---- modules -----------------------------------------------------------------------------

def _natten_state(rng, dim, heads, kernel, rank, rpb=True):
    """A state dict with NATTEN's parameter names and shapes."""
    sd = {"qkv.weight": torch.tensor(rng.standard_normal((3 * dim, dim)) * 0.2),
          "qkv.bias": torch.tensor(rng.standard_normal(3 * dim) * 0.1),
          "proj.weight": torch.tensor(rng.standard_normal((dim, dim)) * 0.2),
          "proj.bias": torch.tensor(rng.standard_normal(dim) * 0.1)}
    if rpb:
        sd["rpb"] = torch.tensor(rng.standard_normal((heads,) + (2 * kernel - 1,) * rank))
    return {n: t.to(torch.float64) for n, t in sd.items()}


def test_module_takes_nattens_arguments_and_state_dict(rng):
    dim, heads, kernel = 8, 2, 3
    sd = _natten_state(rng, dim, heads, kernel, 2)
    m = nt.NeighborhoodAttention2D(embed_dim=dim, num_heads=heads, kernel_size=kernel,
                                   qk_scale=0.4, rel_pos_bias=True, attn_drop=0.1,
                                   proj_drop=0.1).double().eval()
    m.load_state_dict(sd)
    x = _t(rng, (2, 7, 6, dim), grad=False)
    got = m(x)
    # the same by hand: NATTEN's module math with the oracle's slots
    qkv = (x @ sd["qkv.weight"].T + sd["qkv.bias"]).unflatten(-1, (3, heads, dim // heads))
    q, k, v = (t.numpy() for t in qkv.unbind(-3))
    logits = oracle.qk(q * 0.4, k, (kernel, kernel), rpb=sd["rpb"].numpy())
    attn = numpy.exp(logits - logits.max(-1, keepdims=True))
    attn /= attn.sum(-1, keepdims=True)
    out = torch.tensor(oracle.av(attn, v, (kernel, kernel))).flatten(-2)
    want = out @ sd["proj.weight"].T + sd["proj.bias"]
    torch.testing.assert_close(got, want)
    # embed_dim and dim name the same thing; without rpb the fused op runs
    a = nt.NeighborhoodAttention2D(embed_dim=dim, num_heads=heads, kernel_size=kernel).double()
    b = nt.NeighborhoodAttention2D(dim=dim, num_heads=heads, kernel_size=kernel).double()
    plain = {n: t for n, t in sd.items() if n != "rpb"}
    a.load_state_dict(plain)
    b.load_state_dict(plain)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    positional = nt.NeighborhoodAttention2D(dim, heads, kernel, 1, 1, False, True, None).double()
    positional.load_state_dict(plain)
    torch.testing.assert_close(positional(x), a(x), rtol=0, atol=0)


def test_module_dropout_trains_through_the_unfused_chain(rng):
    m = nt.NeighborhoodAttention1D(embed_dim=8, num_heads=2, kernel_size=5,
                                   attn_drop=0.5).double()
    x = _t(rng, (1, 12, 8))
    torch.manual_seed(0)
    y1 = m(x)
    torch.manual_seed(1)
    y2 = m(x)
    assert not torch.equal(y1, y2), "attention dropout is active in training"
    y1.sum().backward()
    assert m.qkv.weight.grad is not None and m.qkv.weight.grad.abs().max() > 0
    m.eval()
    torch.testing.assert_close(m(x), m(x), rtol=0, atol=0)


def test_module_argument_errors():
    with pytest.raises(TypeError, match="embed_dim or dim"):
        nt.NeighborhoodAttention2D(embed_dim=8, dim=8, num_heads=2, kernel_size=3)
    with pytest.raises(TypeError, match="qk_scale or scale"):
        nt.NeighborhoodAttention2D(8, 2, 3, qk_scale=0.1, scale=0.1)
    with pytest.raises(ValueError, match="stride 1"):
        nt.NeighborhoodAttention2D(8, 2, 3, stride=2, rel_pos_bias=True)
    with pytest.raises(ValueError, match="attn_drop must be in"):
        nt.NeighborhoodAttention2D(8, 2, 3, attn_drop=1.5)


def test_array_level_merge_matches_the_torch_one(rng):
    import natten_cupy
    outs = [rng.standard_normal((2, 5, 3, 4)) for _ in range(3)]
    lses = [rng.standard_normal((2, 5, 3)) for _ in range(3)]
    lses[1][0, 0, 0] = -numpy.inf     # one set saw nothing for this row
    out, lse = natten_cupy.merge_attentions(outs, lses)
    want_out, want_lse = nt.merge_attentions([torch.tensor(o) for o in outs],
                                             [torch.tensor(x) for x in lses])
    numpy.testing.assert_allclose(out, want_out.numpy(), rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, want_lse.numpy(), rtol=1e-12, atol=1e-12)
    f32, lse32 = natten_cupy.merge_attentions([o.astype("f2") for o in outs],
                                              [x.astype("f4") for x in lses])
    assert f32.dtype == numpy.float16 and lse32.dtype == numpy.float32
    with pytest.raises(TypeError, match="NumPy or CuPy"):
        natten_cupy.merge_attentions([torch.zeros(1, 2, 1, 1)], [torch.zeros(1, 2, 1)])
    with pytest.raises(ValueError, match="outputs\\[1\\]"):
        natten_cupy.merge_attentions([outs[0], outs[1][:1]], lses[:2])
