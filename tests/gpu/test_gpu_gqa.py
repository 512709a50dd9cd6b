"""Grouped-query / multi-query attention (GQA/MQA) on every GPU backend.

The cases of ``gpu_cases.gqa_cases`` (every op kind x rank x dtype, TF32 once per rank and
kind, odd extents, causal mixes, dilation, stride for the fused ops, permuted layouts,
8 query heads over 2 kv heads, 4 over 1 (MQA), 6 over 3) run on naive, tiled and fused
against the float64 reference with NaN-poisoned outputs that must be fully written, under
the same capability table as the main suite (GQA changes no backend's dtype or head-dim
rules). Fused cases whose values have a head dim of their own (Dv != D) run on naive; the
fused backend must refuse them by name. The float64 reference of GQA is itself checked against dense attention on repeated
kv heads in ``tests/unit/test_gqa.py``. Further: the fused backward is bitwise reproducible
(dK/dV sum a group's query heads in a fixed order, no atomics), warm calls of the fast path
equal the general path and keep separate entries per kv-head count, and the torch layer's
gradients equal those of repeated kv heads. On a Hopper GPU the fused float16/bfloat16 cases
with head dims above 32 run the Hopper parts, the others the mma.sync and exact-fp32 parts.
"""

import numpy
import pytest

import natten_cupy
from natten_cupy import _fast
from natten_cupy.backends import get_backend

import gpu_cases
from gpu_cases import BACKENDS, Case

CASES = gpu_cases.gqa_cases() + gpu_cases.dv_cases()  # and values with their own head dim


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_against_reference(backend, case):
    gpu_cases.check_backend(case, backend)


def _fused_case(dtype, rank=2, heads=8, kv_heads=2):
    geoms = {1: ((37,), (7,), (2,), (2,), (True,)),
             2: ((13, 11), (5, 4), (1, 2), (2, 1), (False, True)),
             3: ((5, 7, 6), (3, 3, 4), (1, 2, 1), (1, 1, 1), (True, False, False))}
    return Case("fused", rank, dtype, *geoms[rank], 64, batch=2, heads=heads,
                kv_heads=kv_heads, tf32=dtype == "tf32")


@pytest.mark.gpu
@pytest.mark.parametrize("rank", (1, 2, 3))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
def test_fused_gqa_backward_is_bitwise_reproducible(rank, dtype):
    import cupy
    case = _fused_case(dtype, rank)
    mod = get_backend("fused")
    x, truth, yard = gpu_cases.references(case)
    xd = gpu_cases.inputs_on_device(x, case)
    runs = [gpu_cases.run(case, mod, xd, cupy) for _ in range(3)]
    cupy.cuda.get_current_stream().synchronize()
    gpu_cases.compare(case, {n: gpu_cases.to_host(a) for n, a in runs[0].items()}, truth,
                      yard, where=f"[fused {case.id}] ")
    for other in runs[1:]:
        for name in ("dq", "dk", "dv"):
            bits = f"u{other[name].dtype.itemsize}"
            assert cupy.array_equal(runs[0][name].view(bits), other[name].view(bits)), name


def _cupy(rng, shape, dtype):
    import cupy
    return gpu_cases.upload(cupy, rng.standard_normal(shape).astype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("float16", "float32"))
def test_fast_path_gqa_equals_general_and_keys_kv_heads(rng, monkeypatch, dtype):
    """Warm calls (plans cached per signature) equal the general path bit for bit; calls
    that differ only in the kv heads take separate entries and give their own results."""
    import cupy
    _fast.clear()
    q, d_out = (_cupy(rng, (2, 9, 11, 8, 32), dtype) for _ in range(2))
    results = {}
    for kv_heads in (8, 2, 1):
        k, v = (_cupy(rng, (2, 9, 11, kv_heads, 32), dtype) for _ in range(2))
        before = _fast.entries()
        warm = [natten_cupy.na2d(q, k, v, 3, dilation=(1, 2), return_lse=True)
                for _ in range(2)]
        assert _fast.entries() == before + 1   # one new entry per kv-head count
        out, lse = warm[1]
        grads = natten_cupy.na2d_backward(d_out, q, k, v, out, lse, 3, dilation=(1, 2))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        with monkeypatch.context() as m:
            m.setattr(_fast, "enabled", False)
            g_out, g_lse = natten_cupy.na2d(q, k, v, 3, dilation=(1, 2), return_lse=True)
            g_grads = natten_cupy.na2d_backward(d_out, q, k, v, g_out, g_lse, 3,
                                                dilation=(1, 2))
        assert cupy.array_equal(out, g_out) and cupy.array_equal(lse, g_lse)
        for a, b in zip(grads, g_grads):
            assert cupy.array_equal(a, b)
        attn = natten_cupy.na2d_qk(q, k, 3)
        av = natten_cupy.na2d_av(attn, v, 3)
        assert attn.shape == q.shape[:-1] + (9,) and av.shape == q.shape
        results[kv_heads] = gpu_cases.to_host(out)
    assert not numpy.array_equal(results[8], results[2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
def test_torch_gqa_matches_repeated_kv(dtype):
    torch = pytest.importorskip("torch")
    import natten_cupy.torch as nt
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, dtype)

    def t(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(dt).requires_grad_()

    q, k, v = t(2, 9, 7, 6, 32), t(2, 9, 7, 2, 32), t(2, 9, 7, 2, 32)
    d_out = torch.randn(q.shape, device="cuda", generator=gen).to(dt)
    kr, vr = (x.detach().repeat_interleave(3, dim=-2).requires_grad_() for x in (k, v))
    out = nt.na2d(q, k, v, 3, is_causal=(True, False))
    want = nt.na2d(q, kr, vr, 3, is_causal=(True, False))
    got = torch.autograd.grad((out * d_out).float().sum(), (q, k, v))
    ref = torch.autograd.grad((want * d_out).float().sum(), (q, kr, vr))
    tol = {"float16": 2e-3, "bfloat16": 2e-2, "float32": 1e-5}[dtype]
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
    for g, r in zip(got[1:], ref[1:]):
        assert g.shape == (2, 9, 7, 2, 32)
        r = r.reshape(2, 9, 7, 2, 3, 32).float().sum(-2)
        torch.testing.assert_close(g.float(), r, rtol=4 * tol, atol=4 * tol)
