"""Additional tokens (``additional_keys`` / ``additional_values``) in the fused ops on the GPU.

The main suite (``gpu_cases``, kind ``fused_extra``) runs small geometries on naive and fused;
here larger ones: many CTAs, key halos streamed in chunks, hundreds of extra tokens (several
64-token dK/dV tiles, several query splits), GQA on k/v and on the tokens, head dims 32 to
128 in the kernels and 256 / exact float32 through the array-math merge, against the float64
reference with NaN-poisoned outputs. Further: the kernels themselves take the tokens where
they should (launch names), the backward is bitwise reproducible, the public calls on CuPy
arrays agree, and the torch layer's gradients (from out and lse) match float64.
"""

import pytest

import natten_cupy
from natten_cupy.backends import get_backend

import gpu_cases
from gpu_cases import Case

# (rank, spatial, kernel, stride, dilation, causal, head_dim, heads, kv_heads, batch,
#  tokens, extra heads)
GEOMETRIES = [
    (1, (700,), (129,), (1,), (1,), (False,), 64, 2, None, 2, 256, None),
    (1, (333,), (31,), (1,), (2,), (True,), 32, 4, 2, 1, 70, 1),
    (1, (2100,), (1023,), (1,), (1,), (False,), 64, 1, None, 1, 300, None),
    (2, (24, 20), (7, 7), (1, 1), (1, 1), (False, False), 32, 3, None, 4, 100, None),
    (2, (30, 19), (9, 5), (1, 1), (2, 1), (True, False), 64, 4, 1, 1, 33, 2),
    (2, (17, 15), (5, 5), (2, 3), (1, 1), (False, False), 64, 2, None, 2, 40, 1),
    (2, (20, 22), (13, 13), (1, 1), (1, 1), (False, False), 128, 2, None, 1, 130, None),
    (3, (6, 12, 14), (3, 5, 5), (1, 1, 1), (1, 1, 2), (True, False, False), 64, 2, None, 2,
     64, None),
    (3, (5, 9, 10), (5, 5, 7), (1, 1, 1), (1, 1, 1), (False, False, False), 128, 4, 2, 1, 17, 2),
]
DTYPES = ("float16", "bfloat16", "tf32")


def _case(geom, dtype, permuted=False):
    rank, spatial, kernel, stride, dilation, causal, d, heads, kv, batch, t, hx = geom
    return Case("fused_extra", rank, "float32" if dtype in ("tf32", "float32") else dtype,
                spatial, kernel, stride, dilation, causal, d, batch=batch, heads=heads,
                kv_heads=kv, tf32=dtype == "tf32", extra_tokens=t, extra_heads=hx,
                permuted=permuted)


CASES = [_case(g, dt, permuted=(i + j) % 3 == 1) for i, g in enumerate(GEOMETRIES)
         for j, dt in enumerate(DTYPES) if (i + j) % 2 == 0 or dt == "float16"]
# Through the array-math merge: exact float32 (no kernel takes the tokens) and head dim 256.
MERGED = [_case(GEOMETRIES[3], "float32"), _case(GEOMETRIES[4], "float32"),
          _case((2, (12, 11), (5, 5), (1, 1), (1, 1), (False, True), 256, 2, None, 1, 24, 1),
                "float16")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + MERGED, ids=[c.id for c in CASES + MERGED])
def test_fused_extra_against_reference(case):
    assert gpu_cases.check_backend(case, "fused") is None


def _launched(case):
    import cupy
    x, _, _ = gpu_cases.references(case)
    xd = gpu_cases.inputs_on_device(x, case)
    with natten_cupy.profile() as prof:
        gpu_cases.run(case, get_backend("fused"), xd, cupy)
        cupy.cuda.get_current_stream().synchronize()
    return [r["name"] for r in prof.records]


@pytest.mark.gpu
def test_the_kernels_take_the_tokens_where_they_should():
    """In-kernel: one forward launch, the dQ pass, the dK/dV pass, the tokens' dK/dV pass and
    its sum; merged (head dim 256): the plain kernels only."""
    names = _launched(CASES[0])
    assert names.count("na_fwd_fused") == 1, names
    for n in ("na_bwd_fused_q", "na_bwd_fused_kv", "na_bwd_extra_kv", "na_bwd_extra_sum"):
        assert n in names, names
    merged = _launched(MERGED[-1])
    assert not any("extra" in n for n in merged), merged


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[::4], ids=[c.id for c in CASES[::4]])
def test_fused_extra_backward_is_bitwise_reproducible(case):
    gpu_cases.assert_runs_repeat(case, "fused")


@pytest.mark.gpu
def test_public_calls_on_cupy_arrays():
    """na3d / na3d_backward with the tokens, auto backend: the reference's results."""
    case = CASES[-1]
    x, truth, yard = gpu_cases.references(case)
    xd = gpu_cases.inputs_on_device(x, case)
    opts = dict(stride=case.stride, dilation=case.dilation, is_causal=case.causal)
    out, lse = natten_cupy.na3d(xd["q"], xd["k"], xd["v"], case.kernel, return_lse=True,
                                additional_keys=xd["xk"], additional_values=xd["xv"], **opts)
    grads = natten_cupy.na3d_backward(xd["d_out"], xd["q"], xd["k"], xd["v"], out, lse,
                                      case.kernel, additional_keys=xd["xk"],
                                      additional_values=xd["xv"], **opts)
    got = dict(zip(("out", "lse", "dq", "dk", "dv", "d_xk", "d_xv"), (out, lse, *grads)))
    gpu_cases.compare(case, {n: gpu_cases.to_host(a) for n, a in got.items()}, truth, yard,
                      where="[public] ")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_torch_layer_extra_gradients_match_float64(dtype):
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(s, generator=gen, dtype=torch.float64)
            for s in [(2, 18, 15, 4, 64)] + [(2, 18, 15, 2, 64)] * 2 + [(2, 18, 15, 4, 64)]]
    extra = [torch.randn(2, 77, 2, 64, generator=gen, dtype=torch.float64) for _ in range(2)]
    ks, dl, ca = (5, 4), (1, 2), (False, True)

    def grads(device, dt):
        ins = [x.to(device, dt).clone().requires_grad_() for x in base[:3] + extra]
        q, k, v, xk, xv = ins
        out, lse = nt.na2d(q, k, v, ks, dilation=dl, is_causal=ca, additional_keys=xk,
                           additional_values=xv, return_lse=True)
        loss = (out.double() * base[3].to(device)).sum() + (lse.double() ** 2).sum() * 0.1
        loss.backward()
        return [t.detach().double().cpu() for t in (out, lse, *(x.grad for x in ins))]

    want = grads("cpu", torch.float64)
    got = grads("cuda", getattr(torch, dtype))
    tol = 2e-2 if dtype == "float16" else 8e-2
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "d_xk", "d_xv"), got, want):
        err = float((g - w).abs().max() / w.abs().max().clamp(min=1.0))
        assert err < tol, (name, err)


@pytest.mark.gpu
def test_torch_layer_with_tokens_captures_in_a_cuda_graph():
    """Forward and backward with additional tokens captured in a CUDA graph and replayed on
    new inputs: the eager results (workspaces come from torch's allocator)."""
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    gen = torch.Generator(device="cuda").manual_seed(11)

    def fresh():
        return [torch.randn(s, generator=gen, device="cuda", dtype=torch.float16)
                for s in [(2, 12, 10, 4, 64)] * 3 + [(2, 40, 2, 64)] * 2]
    static = [x.requires_grad_() for x in fresh()]

    def step():
        q, k, v, xk, xv = static
        out = nt.na2d(q, k, v, 5, additional_keys=xk, additional_values=xv)
        return torch.autograd.grad(out.float().square().sum(), static)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new = fresh()
    with torch.no_grad():
        for s, n in zip(static, new):
            s.copy_(n)
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    for g, w in zip(captured, want):
        assert torch.equal(g, w)
