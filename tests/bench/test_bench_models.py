"""bench/models.py without a GPU: its FlexAttention mask_mod is SPEC's neighborhood, and the
README table renders from its JSON."""

import os
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/bench/ -> repo
sys.path.insert(0, os.path.join(ROOT, "bench"))
import models  # noqa: E402
import peers  # noqa: E402
import workloads as wl  # noqa: E402

GEOMETRIES = [  # small stand-ins for the M set's option mixes, plus stride
    ((13, 11), (7, 5), (1, 1), (1, 1), (False, False)),
    ((17, 16), (3, 5), (1, 1), (4, 2), (False, False)),
    ((5, 9, 10), (3, 5, 5), (1, 1, 1), (1, 1, 1), (True, False, False)),
    ((40,), (9,), (1,), (1,), (True,)),
    ((19, 13), (4, 6), (2, 3), (2, 1), (True, False)),
    ((6, 7, 9), (2, 3, 4), (2, 1, 4), (1, 2, 2), (False, True, True)),
]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "x".join(map(str, g[0])))
def test_mask_mod_is_the_neighborhood(geom):
    spatial, kernel, stride, dilation, causal = geom
    w = wl.Workload("t", spatial, kernel, 1, 8, "test", stride=stride, dilation=dilation,
                    causal=causal)
    n = w.tokens
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    got = models._mask_mod(w)(0, 0, i, j)
    want = peers.dense_mask(peers.Geometry.of(w))
    assert torch.equal(got.expand(n, n), want)


# ---- M4's variants: extra key/value tokens and grouped-query attention (issue 14) ----------

import dataclasses  # noqa: E402
import json  # noqa: E402

import numpy  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests"))   # the shared float64 oracle, tests/oracle.py
import oracle  # noqa: E402
import calls_report  # noqa: E402
from natten_cupy import profiler  # noqa: E402


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: "x".join(map(str, g[0])))
def test_extra_tokens_mask_mod_is_neighborhood_or_extra(geom):
    """Over N + T kv indices: the oracle's neighborhood on the first N, every query sees the
    T extra tokens after them; the same for every head (GQA shares the mask)."""
    spatial, kernel, stride, dilation, causal = geom
    T = 5
    w = wl.Workload("t", spatial, kernel, 4, 8, "test", stride=stride, dilation=dilation,
                    causal=causal, kv_heads=2, extra_tokens=T)
    n = w.tokens
    want = numpy.concatenate([oracle.neighborhood_mask(spatial, kernel, stride, dilation,
                                                       causal),
                              numpy.ones((n, T), dtype=bool)], axis=1)
    i = torch.arange(n)[:, None]
    j = torch.arange(n + T)[None, :]
    for h in range(w.heads):
        got = models.flex_mask_mod(w)(0, torch.tensor(h), i, j)
        assert numpy.array_equal(got.expand(n, n + T).numpy(), want)
    plain = dataclasses.replace(w, extra_tokens=0, kv_heads=None)
    got = models.flex_mask_mod(plain)(0, 0, i, j[:, :n])
    assert numpy.array_equal(got.expand(n, n).numpy(), want[:, :n])


def test_variant_definitions():
    m4 = wl.WORKLOADS["M4"]
    kv, gqa = wl.MODEL_VARIANTS["M4+kv256"], wl.MODEL_VARIANTS["M4-gqa8/2"]
    for w in (kv, gqa):
        assert w.id not in wl.WORKLOADS   # suite.py cannot call them
        assert wl.model_workload(w.id) is w
        assert (w.spatial, w.kernel, w.stride, w.dilation, w.causal, w.batch, w.dim) == \
            (m4.spatial, m4.kernel, m4.stride, m4.dilation, m4.causal, m4.batch, m4.dim)
    assert wl.model_workload("M4") is m4
    assert (kv.heads, kv.kv_heads, kv.extra_tokens) == (16, 16, 256)
    assert kv.extra_shape == (2, 256, 16, 64) and kv.kv_shape == kv.shape
    assert (gqa.heads, gqa.kv_heads, gqa.extra_tokens) == (8, 2, 0)
    assert gqa.shape == (2, 16, 40, 64, 8, 64) and gqa.kv_shape == (2, 16, 40, 64, 2, 64)
    B, N, K, D = 2, 16 * 40 * 64, 5 * 9 * 9, 64
    # extra tokens add 4*B*N*H*T*D forward; GQA keeps the FLOPs per query head
    assert kv.flops() == m4.flops() + 4 * B * N * 16 * 256 * D
    assert gqa.flops() == 4 * B * N * 8 * K * D == m4.flops() // 2
    for w in (kv, gqa, m4):
        assert w.flops(True) == w.flops() * wl.BACKWARD_FLOP_FACTOR
    # bytes: q, out (and dO, dq) at H over N; k, v (and dk, dv) at H_kv over N + T; lse
    assert gqa.bytes_moved("bf16") == 2 * (2 * B * N * 8 * D + 2 * B * N * 2 * D) + 4 * B * N * 8
    assert kv.bytes_moved("bf16", True) == (4 * 2 * B * N * 16 * D
                                            + 4 * 2 * B * (N + 256) * 16 * D + 4 * B * N * 16)
    for w in (kv, gqa):   # compute-bound: the floor is FLOPs at the bf16 ceiling
        for bwd in (False, True):
            assert w.floor_ms("bf16", bwd) == pytest.approx(
                w.flops(bwd) / wl.CEILINGS["bfloat16"] * 1e3)
    assert "H_kv=2" in gqa.describe() and "+256 extra kv tokens" in kv.describe()
    assert {"kv_heads", "extra_tokens"} <= set(kv.as_dict())
    with pytest.raises(ValueError):
        wl.Workload("bad", (8,), (3,), 8, 16, "x", kv_heads=3)
    # the default list: the old rows first, unchanged, then the two variants
    assert wl.MODEL_WORKLOADS[:-2] == (
        ("M1", "fp16"), ("M2", "fp16"), ("M3", "fp16"), ("M4", "bf16"), ("M5", "bf16"),
        ("M6", "bf16"), ("M7", "bf16"), ("M1", "fp32"), ("M4", "fp32"), ("M1", "tf32"),
        ("M4", "tf32"))
    assert wl.MODEL_WORKLOADS[-2:] == (("M4+kv256", "bf16"), ("M4-gqa8/2", "bf16"))


def test_plain_workloads_unchanged():
    """Workloads without GQA or extra tokens: the profiler's formulas, the old as_dict keys."""
    for w in wl.WORKLOADS.values():
        assert w.plain and w.kv_shape == w.shape
        assert w.flops() == profiler.flops(w.batch, w.tokens, w.heads, w.neighbors, w.dim)
        for dt in wl.DTYPES:
            for bwd in (False, True):
                spec = wl.dtype_spec(dt)
                assert w.floor_ms(dt, bwd) == profiler.floor_ms(
                    w.batch, w.tokens, w.heads, w.neighbors, w.dim, spec["name"], bwd,
                    spec["tf32"])
                assert w.bytes_moved(dt, bwd) == profiler.bytes_moved(
                    w.batch, w.tokens, w.heads, w.dim, spec["itemsize"], bwd, 4)
        assert not {"kv_heads", "extra_tokens"} & set(w.as_dict())


def test_groups_parsing():
    default = ",".join(f"{w}:{d}" for w, d in wl.MODEL_WORKLOADS)
    assert models.parse_groups(default) == list(wl.MODEL_WORKLOADS)
    assert models.parse_groups("M4+kv256:bf16, M4-gqa8/2:fp16,") == [
        ("M4+kv256", "bf16"), ("M4-gqa8/2", "fp16")]
    for bad in ("M4+kv128:bf16", "M4-gqa8/2", "M4:fp64", "M4-gqa8/2:bf16:x"):
        with pytest.raises(ValueError, match="bad entries"):
            models.parse_groups(f"M1:fp16,{bad}")
    with pytest.raises(SystemExit):   # refused before any device work
        models.main(["--groups", "M4:fp16,nope:bf16"])


def _dense_reference(w, leaves, do):
    """float64 softmax attention over the spatial and extra kv tokens under flex_mask_mod's
    dense mask, kv heads repeated for GQA; (out, grads) in ours' layout."""
    xs = [x.detach().double().requires_grad_() for x in leaves]
    B, N, H, D, T = w.batch, w.tokens, w.heads, w.dim, w.extra_tokens
    q = xs[0].reshape(B, N, H, D).transpose(1, 2)
    k, v = (x.reshape(B, N, w.kv_heads, D).transpose(1, 2) for x in xs[1:3])
    if T:
        k = torch.cat([k, xs[3].transpose(1, 2)], 2)
        v = torch.cat([v, xs[4].transpose(1, 2)], 2)
    k, v = (x.repeat_interleave(H // w.kv_heads, 1) for x in (k, v))
    mask = models.flex_mask_mod(w)(0, 0, torch.arange(N)[:, None],
                                   torch.arange(N + T)[None, :])
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    out = (p @ v).transpose(1, 2).reshape(w.shape)
    return out, torch.autograd.grad(out, xs, do.double())


VARIANTS = [
    wl.Workload("t-kv", (4, 6, 8), (3, 3, 5), 4, 16, "test", batch=2, extra_tokens=7,
                causal=(True, False, False)),
    wl.Workload("t-gqa", (4, 6, 8), (3, 3, 5), 4, 16, "test", batch=2, kv_heads=2,
                dilation=(1, 2, 1)),
    wl.Workload("t-both", (5, 7), (3, 5), 6, 16, "test", kv_heads=2, extra_tokens=9,
                stride=(1, 2)),
    wl.Workload("t-plain", (4, 6, 8), (3, 3, 5), 4, 16, "test", batch=2),
]


@pytest.mark.parametrize("w", VARIANTS, ids=lambda w: w.id)
def test_ours_and_flex_calls_agree_on_cpu(w):
    """The calls models.py times, built by its own functions, on the CPU in float32: ours
    (reference backend) and Flex's forward (eager flex_attention, no backward on the CPU)
    agree; ours' out and every gradient (extra k/v included) match a float64 dense
    reference; rel_errors maps Flex's layout back to ours."""
    from torch.nn.attention.flex_attention import flex_attention
    gen = torch.Generator().manual_seed(0)
    leaves, do = models.make_inputs(w, torch.float32, "cpu", gen)
    assert [tuple(x.shape) for x in leaves] == [w.shape, w.kv_shape, w.kv_shape] + (
        [w.extra_shape] * 2 if w.extra_tokens else [])
    ours = models.make_ours(w, False)
    peer = models.make_peer(w, flex_attention, "cpu")
    mine = ours(*leaves)
    grads = torch.autograd.grad(mine, leaves, do)
    with torch.no_grad():
        ref = peer(*(models.to_flex(x) for x in leaves))
    err = models.rel_errors([mine], [ref])
    assert list(err) == ["out"] and err["out"] < 1e-5, err
    want, want_grads = _dense_reference(w, leaves, do)
    flex_layout = [models.to_flex(x) for x in (want, *want_grads)]
    err = models.rel_errors((mine, *grads), flex_layout)
    assert list(err) == list(models.ERROR_NAMES[:len(leaves) + 1])
    assert max(err.values()) < 1e-5, err


def _fake_rec(wid, dt, commit="abc1234", **kw):
    o = dict(fwd=1.0, fwd_bwd=3.0, fwd_kernels=0.9, fwd_bwd_kernels=2.8, tflops_fwd=200.0,
             tflops_fwd_bwd=250.0)
    f = dict(fwd=2.0, fwd_bwd=9.0, fwd_bwd_kernels=8.5, tflops_fwd=100.0, tflops_fwd_bwd=80.0)
    r = dict(workload=wid, dtype=dt, commit=commit, ours_eager=o, flex_eager=f,
             ours_compiled=dict(fwd=1.1, fwd_bwd=3.1),
             max_rel_error_vs_flex=dict(out=1e-3, dq=2e-3, dk=2e-3, dv=1e-3, d_extra_k=4e-3,
                                        d_extra_v=1e-3))
    r.update(kw)
    return r


def test_reports_render_the_variant_rows(tmp_path):
    data = dict(device="NVIDIA H200", torch="2.13", cupy="14.2", commit="abc1234",
                date="2026-12-02 00:00:00 UTC", not_run=[],
                results=[_fake_rec("M4", "bf16"), _fake_rec("M4+kv256", "bf16"),
                         _fake_rec("M4-gqa8/2", "bf16",
                                   ours_compiled=dict(error="Unsupported: x"))])
    text = calls_report.models_table(json.loads(json.dumps(data)))
    for wid in ("M4", "M4+kv256", "M4-gqa8/2"):
        assert (f"| {wid} | bf16 | 1 / 3 | 2 / 9 | 2.00x / 3.00x | 2.8 / 8.5 | 200 / 250 |"
                in text), text
    table = models.table(data)
    assert "| M4+kv256 | bf16 | 1 / 3 | 1.1 / 3.1 | 2 / 9 | 2.00x / 3.00x | 2.8 / 8.5 | " \
           "4.0e-03 |" in table, table
    assert "| M4-gqa8/2 | bf16 | 1 / 3 | error | 2 / 9 |" in table, table
    readme = tmp_path / "README.md"
    readme.write_text("x\n<!-- models-table:start -->\n<!-- models-table:end -->\ny\n")
    calls_report.update_readme({"models": text}, str(readme))
    assert "| M4-gqa8/2 | bf16 |" in readme.read_text()
