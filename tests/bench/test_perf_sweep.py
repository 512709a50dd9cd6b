"""bench/perf_sweep.py without a GPU: its draws are reproducible, valid problems within the
FLOP bound, and cover every rank, causal and dilated axes."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import perf_sweep  # noqa: E402



def test_draws_reproduce_alone():
    assert perf_sweep.draw(3, 17) == perf_sweep.draw(3, 17)
    assert perf_sweep.draw(3, 17) != perf_sweep.draw(3, 18)
    assert perf_sweep.draw(3, 17) != perf_sweep.draw(4, 17)


def test_draws_are_valid_and_bounded():
    draws = [perf_sweep.draw(1, i) for i in range(200)]
    ranks, causal, dilated = set(), False, False
    for w, dtype in draws:
        assert dtype in ("bf16", "fp16")
        assert w.batch >= 1 and w.heads >= 1 and w.dim % 8 == 0
        # every axis's window (dilated) fits its extent, as the library requires
        for n, k, d in zip(w.spatial, w.kernel, w.dilation):
            assert 1 <= k and k * d <= n, (w.id, w.spatial, w.kernel, w.dilation)
        assert w.flops() <= perf_sweep.MAX_FLOPS or w.batch == 1, w.id
        ranks.add(w.rank)
        causal |= any(w.causal)
        dilated |= any(d > 1 for d in w.dilation)
    assert ranks == {1, 2, 3} and causal and dilated


def test_summary_ratio_is_flex_over_ours():
    rec = dict(ours_eager=dict(fwd=1.0, fwd_bwd=4.0), flex_eager=dict(fwd=2.0, fwd_bwd=2.0))
    got = perf_sweep.summarize(rec)
    assert got["fwd"] == 2.0 and got["fwd_bwd"] == 0.5 and got["fwd_kernels"] is None


def test_dtypes_choose_only_the_dtype():
    """--dtypes changes each problem's dtype and nothing else of the layer but the batch of an
    fp32/tf32 draw, held to an eighth of the FLOP bound."""
    for i in range(60):
        (w, dt), (w32, dt32) = perf_sweep.draw(2, i), perf_sweep.draw(2, i, ("fp32", "tf32"))
        assert dt in ("bf16", "fp16") and dt32 in ("fp32", "tf32")
        assert (w.spatial, w.kernel, w.heads, w.dim, w.dilation, w.causal) == \
            (w32.spatial, w32.kernel, w32.heads, w32.dim, w32.dilation, w32.causal)
        assert w32.batch <= w.batch
        assert w32.flops() <= perf_sweep.MAX_FLOPS / 8 or w32.batch == 1
    assert perf_sweep.draw(1, 5, perf_sweep.DTYPES) == perf_sweep.draw(1, 5)


def test_head_dims_choose_only_the_head_dim():
    """--head-dims draws each problem's head dim from the given ones and leaves the rest of
    the layer as drawn without it, but the batch (held to the FLOP bound)."""
    dims = (40, 72, 80, 160, 256)
    seen = set()
    for i in range(80):
        (w, dt), (wd, dtd) = perf_sweep.draw(4, i), perf_sweep.draw(4, i, head_dims=dims)
        assert wd.dim in dims and dtd == dt
        assert (w.spatial, w.kernel, w.heads, w.dilation, w.causal) == \
            (wd.spatial, wd.kernel, wd.heads, wd.dilation, wd.causal)
        assert wd.flops() <= perf_sweep.MAX_FLOPS or wd.batch == 1
        seen.add(wd.dim)
    assert seen == set(dims)
    assert perf_sweep.draw(4, 3, head_dims=dims) == perf_sweep.draw(4, 3, head_dims=dims)
    assert perf_sweep.draw(4, 3, head_dims=None) == perf_sweep.draw(4, 3)
    # named with its head dim, which the probes' workload lookup resolves back to the draw
    w, _ = perf_sweep.draw(4, 7, head_dims=dims)
    assert w.id == f"R4-7-D{w.dim}"
    assert perf_sweep.wl.model_workload(w.id) == w
    assert perf_sweep.wl.model_workload("R4-7") == perf_sweep.draw(4, 7)[0]


def test_readme_block_names_the_least_ratio_and_the_closest(tmp_path):
    """calls_report's perf-sweep block: per measure the least Flex/ours ratio and its problem,
    problems Flex did not run left out of the ratios, and the closest problems named."""
    import calls_report

    def rec(i, ratios, **over):
        w, dt = perf_sweep.draw(9, i)
        r = {"workload": w.id, "dtype": dt, "shape": [w.batch, *w.spatial, w.heads, w.dim],
             "kernel": list(w.kernel),
             "problem": {"causal": list(w.causal), "dilation": list(w.dilation)},
             "flex_over_ours": dict(zip(("fwd", "fwd_bwd", "fwd_kernels", "fwd_bwd_kernels"),
                                        ratios))}
        r.update(over)
        return r

    data = {"device": "GPU", "torch": "t", "commit": "abc", "date": "d", "seed": 9,
            "dtypes": ["fp16"], "not_run": [], "losses": [],
            "results": [rec(0, (2.0, 3.0, 4.0, 5.0)), rec(1, (1.5, 0.9, 3.0, 2.0)),
                        rec(2, (None,) * 4)]}
    text = calls_report.perf_sweep_summary(data)
    ids = [r["workload"] for r in data["results"]]
    assert f"| forward + backward, eager | 0.90x ({ids[1]})" in text
    assert f"| forward, kernels | 3.00x ({ids[1]})" in text
    assert "FlexAttention ran 2 of them" in text
    assert text.index(ids[1]) < text.rindex(ids[0])   # the closest first
    assert "float16" in text and "bfloat16" not in text
