"""Profiler, profiling CLI and benchmark tooling: CPU checks, plus one GPU check."""

import json
import math
import os
import subprocess
import sys

import numpy
import pytest

import natten_cupy
from natten_cupy import profile_cli
from natten_cupy import profiler
from natten_cupy._window import forward_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<kind>/
BENCH = os.path.join(ROOT, "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import workloads  # noqa: E402


# ---- CLI ----------------------------------------------------------------------------------

def test_parse_args_per_axis_and_broadcast():
    a = profile_cli.parse_args(["-i", "32", "48", "-k", "7", "-s", "1", "2", "--dilation", "2",
                                "-c", "true", "false", "--dtype", "bf16", "--backprop",
                                "-b", "2", "-n", "3", "-d", "40"])
    assert a.rank == 2
    assert a.kernel_size == (7, 7)
    assert a.stride == (1, 2)
    assert a.dilation == (2, 2)
    assert a.causal == (True, False)
    assert a.dtype == "bfloat16"
    assert a.backprop and not a.dry_run
    p = profile_cli.build_problem(a)
    assert p.spatial == (32, 48) and p.batch == 2 and p.heads == 3 and p.head_dim == 40
    assert p.dtype_name == "bfloat16"


def test_parse_args_defaults_and_bare_causal():
    a = profile_cli.parse_args(["-i", "10", "11", "12", "-k", "3", "-c"])
    assert a.rank == 3 and a.kernel_size == (3, 3, 3)
    assert a.causal == (True, True, True)
    assert a.stride == (1, 1, 1) and a.dilation == (1, 1, 1)
    assert a.dtype == "float16" and a.backend == "auto"
    b = profile_cli.parse_args(["-i", "64", "-k", "5"])
    assert b.rank == 1 and b.causal == (False,)


@pytest.mark.parametrize("argv", [
    ["-i", "8", "8", "8", "8", "-k", "3"],            # four extents
    ["-i", "8", "8", "-k", "3", "3", "3"],            # kernel axes != rank
    ["-i", "8", "-k", "3", "-c", "maybe"],            # not a bool
    ["-i", "8", "-k", "3", "--unfused", "-s", "2"],   # unfused takes stride 1 only
])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        profile_cli.parse_args(argv)


def test_dry_run_lists_backends_without_gpu(capsys):
    rc = profile_cli.main(["-i", "24", "20", "-k", "5", "-n", "2", "-d", "16", "--backprop",
                           "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("reference", "naive", "tiled", "fused"):
        assert name in out
    assert "auto picks" in out and "fused_backward" in out
    assert "GFLOP" in out


def test_dry_run_unfused_and_requested_backend(capsys):
    rc = profile_cli.main(["-i", "24", "-k", "5", "--unfused", "--backend", "reference",
                           "--dtype", "fp32", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "requested backend 'reference'" in out and "unfused" in out


def test_refused_backend_is_reported_before_any_gpu_work(capsys):
    rc = profile_cli.main(["-i", "24", "-k", "5", "--backend", "tiled"])
    out = capsys.readouterr().out
    assert rc == 2 and "backend 'tiled' cannot run this" in out


def test_invalid_problem_is_reported(capsys):
    rc = profile_cli.main(["-i", "6", "6", "-k", "7", "--dry-run"])
    assert rc == 2
    assert "kernel_size * dilation" in capsys.readouterr().out


def test_profile_stays_the_function_after_the_cli_is_imported():
    """Importing the CLI module leaves ``natten_cupy.profile`` the context-manager function, and
    no submodule named ``profile`` exists to replace it (run in a fresh interpreter, so the
    order is: the package, then the CLI module)."""
    code = (
        "import importlib.util, types\n"
        "import natten_cupy\n"
        "from natten_cupy.profiler import Profiler\n"
        "before = natten_cupy.profile\n"
        "assert isinstance(before, types.FunctionType)\n"
        "import natten_cupy.profile_cli as cli\n"
        "assert callable(cli.main)\n"
        "assert natten_cupy.profile is before\n"
        "assert isinstance(natten_cupy.profile(), Profiler)\n"
        "with natten_cupy.profile() as prof:\n"
        "    pass\n"
        "assert prof.records == [] and prof.total_ms == 0\n"
        "assert importlib.util.find_spec('natten_cupy.profile') is None\n"
        "assert natten_cupy.profile is before\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"
    assert isinstance(natten_cupy.profile(), profiler.Profiler)


# ---- Profiler bookkeeping (fake events) ----------------------------------------------------

class _FakeEvent:
    def __init__(self, t):
        self.t = t

    def synchronize(self):
        pass


def test_profiler_groups_launches(monkeypatch):
    from natten_cupy import _launch
    monkeypatch.setattr(profiler, "_elapsed_ms", lambda s, e: e.t - s.t)
    with profiler.Profiler() as prof:
        assert prof in _launch._recorders
        for i, (name, ms) in enumerate([("na_fwd", 2.0), ("na_bwd", 3.0), ("na_fwd", 1.0)]):
            prof.record(name=name, backend="naive", tile=(8, 8), grid=(4, 1, 1),
                        block=(128, 1, 1), start=_FakeEvent(0.0), stop=_FakeEvent(ms))
    assert prof not in _launch._recorders
    assert [r["ms"] for r in prof.records] == [2.0, 3.0, 1.0]
    assert prof.total_ms == 6.0
    summary = prof.summary()
    assert [(g["name"], g["calls"], g["ms"]) for g in summary] == [("na_fwd", 2, 3.0),
                                                                   ("na_bwd", 1, 3.0)]
    from rich.console import Console
    console = Console(record=True, width=160)
    console.print(prof.table(flops=6e9, floor_ms=1.5, measured_ms=6.5))
    text = console.export_text()
    assert "na_fwd" in text and "8x8" in text and "50.0%" in text
    assert "0.92" in text        # 6e9 FLOP in 6.5 ms = 0.92 TFLOP/s
    assert "23.1%" in text       # floor 1.5 ms of 6.5 ms


def test_profiler_keeps_the_original_error(monkeypatch):
    def broken(start, stop):
        raise RuntimeError("device lost")
    monkeypatch.setattr(profiler, "_elapsed_ms", broken)
    with pytest.raises(ValueError, match="in the block"):
        with profiler.Profiler() as prof:
            prof.record(name="k", backend="naive", tile=None, grid=(1,), block=(32,),
                        start=_FakeEvent(0.0), stop=_FakeEvent(1.0))
            raise ValueError("in the block")
    assert prof.records[0]["ms"] is None and prof.total_ms == 0
    with pytest.raises(RuntimeError, match="device lost"):
        with profiler.Profiler() as prof:
            prof.record(name="k", backend="naive", tile=None, grid=(1,), block=(32,),
                        start=_FakeEvent(0.0), stop=_FakeEvent(1.0))


# ---- cost model against hand-computed W2 figures ------------------------------------------

def test_w2_flops_and_floors():
    w2 = workloads.WORKLOADS["W2"]
    # 4 * B * N * H * K * D = 4 * 1 * 1048576 * 8 * 81 * 32
    assert w2.flops() == 86_973_087_744
    assert w2.flops(backward=True) == 2.5 * 86_973_087_744
    tensor16 = 1048576 * 8 * 32 * 2          # one fp16 tensor: 512 MiB
    lse = 1048576 * 8 * 4
    assert w2.bytes_moved("fp16") == 4 * tensor16 + lse
    assert w2.bytes_moved("fp16", True) == 8 * tensor16 + lse
    # fp16: memory-bound (FLOPs / 657 TFLOP/s = 0.13 ms is lower); BENCH.md: 0.51 / 1.01 ms
    assert w2.floor_ms("fp16") == pytest.approx((4 * tensor16 + lse) / 4.28e12 * 1e3)
    assert w2.floor_ms("fp16") == pytest.approx(0.51, abs=0.005)
    assert w2.floor_ms("fp16", True) == pytest.approx(1.01, abs=0.005)
    assert w2.floor_ms("tf32") == pytest.approx(1.01, abs=0.005)
    assert w2.floor_ms("tf32", True) == pytest.approx(2.01, abs=0.01)
    # exact fp32: compute-bound on the measured 51 TFLOP/s matmul
    assert w2.floor_ms("fp32") == pytest.approx(86_973_087_744 / 51e12 * 1e3)
    assert w2.floor_ms("fp32", True) == pytest.approx(2.5 * 86_973_087_744 / 51e12 * 1e3)


def test_profile_cost_matches_workloads():
    a = profile_cli.parse_args(["-i", "1024", "1024", "-k", "9", "-n", "8", "-d", "32"])
    p = profile_cli.build_problem(a)
    w2 = workloads.WORKLOADS["W2"]
    assert profile_cli.cost(p, False) == (w2.flops(), pytest.approx(w2.floor_ms("fp16")))
    assert profile_cli.cost(p, True)[0] == w2.flops(True)
    assert p.flops_forward() == w2.flops()


# ---- peers: the analytic mask and block mask ----------------------------------------------

CASES = [
    ((13,), (4,), (1,), (1,), (False,)),
    ((13,), (3,), (2,), (2,), (True,)),
    ((9,), (3,), (3,), (3,), (False,)),
    ((8, 12), (3, 5), (2, 1), (1, 2), (False, True)),
    ((16, 16), (5, 5), (1, 1), (1, 1), (False, False)),
    ((4, 6, 8), (3, 3, 5), (1, 2, 3), (1, 2, 1), (True, False, False)),
]


def _dense_from_table(spatial, kernel, stride, dilation, causal):
    n = math.prod(spatial)
    coords = numpy.unravel_index(numpy.arange(n), spatial)
    out = numpy.ones((n, n), bool)
    for a, (L, k, s, d, c) in enumerate(zip(spatial, kernel, stride, dilation, causal)):
        keys, valid = forward_table(L, k, s, d, c)
        m = numpy.zeros((L, L), bool)
        for i in range(L):
            m[i, keys[i][valid[i]]] = True
        out &= m[coords[a][:, None], coords[a][None, :]]
    return out


def _tiles(spatial):
    yield peers_mod().flat_tile(spatial, block=spatial[-1])
    yield tuple(2 if L % 2 == 0 else 1 for L in spatial)


def peers_mod():
    pytest.importorskip("torch")
    import peers
    return peers


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_mask_mod_matches_forward_table(case):
    peers = peers_mod()
    import torch
    spatial = case[0]
    geom = peers.Geometry(*case)
    ref = _dense_from_table(*case)
    assert (peers.dense_mask(geom).numpy() == ref).all()
    n = geom.tokens
    pos = torch.arange(n)
    for tile in _tiles(spatial):
        order = peers.TokenOrder(spatial, tile)
        coords = torch.as_tensor(order.coords, dtype=torch.int32)
        mod = peers.make_mask_mod(geom, coords)
        got = mod(0, 0, pos[:, None], pos[None, :]).numpy()
        assert (got == ref[order.perm][:, order.perm]).all(), tile


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_block_mask_matches_dense_evaluation(case):
    peers = peers_mod()
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    geom = peers.Geometry(*case)
    n = geom.tokens
    for tile in _tiles(geom.spatial):
        order = peers.TokenOrder(geom.spatial, tile)
        coords = torch.as_tensor(order.coords, dtype=torch.int32)
        mod = peers.make_mask_mod(geom, coords)
        bs = order.block_tokens
        dense = create_block_mask(mod, None, None, n, n, device="cpu", BLOCK_SIZE=bs)
        mine = peers.build_block_mask(geom, order, mod)
        for num, idx in (("kv_num_blocks", "kv_indices"),
                         ("full_kv_num_blocks", "full_kv_indices")):
            assert torch.equal(getattr(dense, num), getattr(mine, num)), (tile, num)
            counts = getattr(dense, num)[0, 0]
            for r, c in enumerate(counts.tolist()):
                assert (sorted(getattr(dense, idx)[0, 0, r, :c].tolist())
                        == sorted(getattr(mine, idx)[0, 0, r, :c].tolist()))


@pytest.mark.parametrize("spatial,tile", [((8, 12), (2, 4)), ((4, 6, 8), (2, 3, 2)),
                                          ((1024, 1024), (8, 16)), ((16, 256, 256), (2, 8, 8))])
def test_tiled_order_is_a_bijection(spatial, tile):
    peers = peers_mod()
    order = peers.TokenOrder(spatial, tile)
    n = math.prod(spatial)
    assert numpy.array_equal(numpy.sort(order.perm), numpy.arange(n))
    assert numpy.array_equal(order.perm[order.inverse], numpy.arange(n))
    # each block of prod(tile) tokens is one compact tile
    blk = order.coords[:, :math.prod(tile)]
    assert [int(c.max() - c.min() + 1) for c in blk] == list(tile)


def test_tile_choices_for_the_workloads():
    peers = peers_mod()
    assert peers.flat_tile((1024, 1024)) == (1, 128)
    assert peers.flat_tile((8, 128, 128)) == (1, 1, 128)
    assert peers.flat_tile((32768,)) == (128,)
    assert peers.flat_tile((100, 100)) is None
    assert peers.TokenOrder((1024, 1024), (1, 128)).is_identity
    for w in workloads.WORKLOADS.values():
        if w.id.startswith("M"):  # the model-shaped set runs Flex in row-major order only
            continue
        t = peers.compact_tile(w.spatial, w.kernel)
        assert t is not None and math.prod(t) == 128
    assert peers.compact_tile((1024, 1024), (9, 9)) in ((8, 16), (16, 8))


# ---- report ---------------------------------------------------------------------------------

def _synthetic():
    def rec(wid, dt, impl, kind, f, fb, **kw):
        r = dict(workload=wid, dtype=dt, impl=impl, kind=kind, status="ok", fwd_ms=f,
                 fwdbwd_ms=fb, bwd_ms=fb - f, fwd_tflops=1.0, fwdbwd_tflops=2.0,
                 floor_fraction_fwd=0.5, floor_fraction_bwd=0.25, check_ok=True,
                 rel_err={"out": 1e-3})
        r.update(kw)
        return r
    return {
        "meta": {"started": "2026-01-01 00:00:00 UTC",
                 "env": {"device": "NVIDIA H200", "torch": "2.11", "cupy": "14.2",
                         "commit": "abc1234"}},
        "workloads": {"W2": workloads.WORKLOADS["W2"].as_dict(),
                      "W1": workloads.WORKLOADS["W1"].as_dict()},
        "published_peers": {"W1/fp16": {"flex_flat": [1.2, 4.82], "flex_tiled": [1.19, 4.83]}},
        "results": [
            rec("W2", "fp16", "fused", "ours", 2.0, 6.0),
            rec("W2", "fp16", "naive", "ours", 20.0, 90.0),
            rec("W2", "fp16", "flex_tiled", "peer", 18.9, 64.1),
            rec("W2", "fp16", "flex_flat", "peer", 34.5, 119.0),
            {"workload": "W2", "dtype": "fp16", "impl": "sdpa_masked", "kind": "peer",
             "status": "skipped", "reason": "too large"},
            rec("W1", "fp16", "fused", "ours", 0.6, 2.4),
        ],
    }


def test_report_summary_and_table():
    import report
    data = _synthetic()
    rows = report.summarize(data)
    w2 = rows[0]
    assert w2["ours_fwd_ms"] == 2.0 and w2["peer_fwd_ms"] == 18.9
    assert w2["peer_fwd_ms_impl"] == "flex_tiled"
    assert w2["speedup_fwd_ms"] == pytest.approx(9.45)
    assert w2["speedup_fwdbwd_ms"] == pytest.approx(64.1 / 6.0)
    w1 = rows[1]   # no live peer: BENCH.md's figure, marked
    assert not w1["peer_fwd_ms_live"] and w1["peer_fwd_ms"] == 1.19
    table = report.markdown_table(data)
    assert "| W2 (1024x1024, k 9x9, H 8, D 32) | fp16 | 2 / 6 (fused)" in table
    assert "1.19* / 4.82*" in table
    assert "9.45x" in table


def test_report_readme_block_and_check(tmp_path):
    import report
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nbefore\n" + report.START + "\nold\n" + report.END
                      + "\nafter\n")
    data = _synthetic()
    js = tmp_path / "r.json"
    js.write_text(json.dumps(data))
    assert report.main([str(js), "--readme", str(readme), "--check"]) == 1
    png = tmp_path / "chart.png"
    pytest.importorskip("matplotlib")
    assert report.main([str(js), "--readme", str(readme), "--png", str(png)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n") and text.endswith("\nafter\n")
    assert "old" not in text and "flex_tiled" in text
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert report.main([str(js), "--readme", str(readme), "--check"]) == 0


def test_suite_arguments_and_plan():
    import suite
    a = suite.parse_args(["--workloads", "W2b,W1", "--dtypes", "fp16", "--no-peers",
                          "--budget-s", "10"])
    assert a.workloads == ["W2b", "W1"] and a.dtypes == ["fp16"] and not a.peers
    plan = suite.plan_group(workloads.WORKLOADS["W2b"], workloads.dtype_spec("fp16"), a)
    assert all(kind == "ours" for _, kind, _ in plan)
    with pytest.raises(SystemExit):
        suite.parse_args(["--workloads", "W9"])


def test_suite_list_needs_no_gpu(capsys):
    import suite
    assert suite.main(["--list", "--workloads", "W2", "--dtypes", "fp16,fp32"]) == 0
    out = capsys.readouterr().out
    assert "W2: 1024 x 1024, kernel 9 x 9" in out and "floor 0.510 / 1.011 ms" in out


# ---- GPU: kernel times add up ---------------------------------------------------------------

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""

# (backend, path, dtype, allow_tf32, spatial): every backend and arithmetic the library has.
PROFILED = [
    ("naive", "fused", "float32", False, (96, 96)),
    ("naive", "unfused", "float16", False, (96, 96)),
    ("tiled", "unfused", "float16", False, (256, 256)),
    ("tiled", "unfused", "float32", False, (256, 256)),
    ("tiled", "unfused", "float32", True, (256, 256)),
    ("fused", "fused", "float16", False, (512, 512)),
    ("fused", "fused", "bfloat16", False, (512, 512)),
    ("fused", "fused", "float32", False, (384, 384)),
    ("fused", "fused", "float32", True, (384, 384)),
    ("reference", "fused", "float32", False, (96, 96)),
    ("reference", "unfused", "float32", False, (96, 96)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend, path, dtype, tf32, spatial", PROFILED,
                         ids=["-".join(map(str, c[:4])) for c in PROFILED])
def test_profiler_kernels_add_up(backend, path, dtype, tf32, spatial):
    """Per-kernel times of a forward + backward add up to the span they ran in (GPU events
    around the whole step) within 10%: no launch escapes the profiler. A spin kernel queued
    first keeps the GPU busy while the host prepares the launches, so host overhead between
    calls does not open gaps in the span."""
    import cupy
    from natten_cupy import _compile
    from natten_cupy.backends import get_backend
    from natten_cupy.profile_cli import random_array, unfused_backward, unfused_forward
    if get_backend(backend) is None:
        pytest.skip(f"{backend} backend not available")
    shape = (1, *spatial, 4, 32)
    q, k, v, do = (random_array(cupy, shape, dtype, i) for i in range(4))
    kw = dict(backend=backend, allow_tf32=tf32)

    def step():
        if path == "fused":
            out, lse = natten_cupy.na2d(q, k, v, 9, return_lse=True, **kw)
            natten_cupy.na2d_backward(do, q, k, v, out, lse, 9, **kw)
        else:
            _, attn = unfused_forward(2, q, k, v, 9, **kw)
            unfused_backward(2, do, q, k, v, attn, 9, **kw)

    spin = cupy.RawModule(code=SPIN, options=_compile.compile_options()).get_function("spin")
    step()
    cupy.cuda.Device().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    with natten_cupy.profile() as prof:
        # ~50 ms of queue ahead of the host (10 ms was not always enough beside 13 other
        # test workers)
        spin((1,), (1,), (numpy.int64(100_000_000),))
        start.record()
        step()
        stop.record()
    stop.synchronize()
    measured = cupy.cuda.get_elapsed_time(start, stop)
    assert len(prof.records) >= 2
    assert all(r["backend"] in (backend, "softmax") and r["ms"] > 0 for r in prof.records)
    if path == "unfused":
        assert {"softmax", backend} <= {r["backend"] for r in prof.records}
    assert abs(measured - prof.total_ms) <= 0.1 * measured, (measured, prof.total_ms,
                                                             prof.records)


def test_suite_smoke_on_cpu(tmp_path):
    """The suite's whole control flow on tiny problems (reference backend, CPU peers)."""
    pytest.importorskip("torch")
    import report
    import suite
    out = tmp_path / "smoke.json"
    rc = suite.main(["--device", "cpu", "--workloads", "T2,T1", "--dtypes", "fp32",
                     "--backends", "reference,naive", "--item-s", "1", "--budget-s", "60",
                     "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    status = {(r["workload"], r["impl"]): r for r in data["results"]}
    ours = status[("T2", "reference")]
    assert ours["status"] == "ok" and ours["kind"] == "ours"
    assert ours["fwd_ms"] > 0 and ours["fwdbwd_ms"] > 0 and ours["reps_fwd"] >= 3
    assert ours["rel_err"] == {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    masked = status[("T2", "sdpa_masked")]
    assert masked["status"] == "ok" and masked["checked_against"] == "reference"
    assert masked["rel_err"]["out"] < 1e-4          # same mask, same math as our reference
    assert status[("T2", "flex_flat")]["status"] == "skipped"     # CUDA only
    assert status[("T1", "sdpa")]["status"] == "ok"
    assert status[("T1", "sdpa")]["rel_err"]["out"] < 1e-4
    assert data["meta"]["env"]["device"] == "cpu"
    rows = report.summarize(data)
    assert [(r["workload"], r["dtype"]) for r in rows] == [("T2", "fp32"), ("T1", "fp32")]
    assert "T2" in report.markdown_table(data)


class _FakeCupy:
    """Just enough of CuPy for the CLI's flow on NumPy arrays (reference backend, CPU)."""

    @staticmethod
    def get_array_module(*arrays):
        return numpy

    class random:
        class RandomState:
            def __init__(self, seed):
                self.rs = numpy.random.RandomState(seed)

            def standard_normal(self, shape, dtype=numpy.float64):
                return self.rs.standard_normal(shape).astype(dtype)

    class cuda:
        class Event:
            def record(self):
                import time
                self.t = time.perf_counter()

            def synchronize(self):
                pass

        @staticmethod
        def get_elapsed_time(a, b):
            return (b.t - a.t) * 1e3

        @staticmethod
        def get_current_stream():
            class _S:
                def synchronize(self):
                    pass
            return _S()


@pytest.mark.parametrize("extra", [["--backprop"], ["--backprop", "--unfused"],
                                   ["--dtype", "fp64", "-c", "true", "false"]])
def test_cli_profile_flow_on_cpu(monkeypatch, capsys, extra):
    # The reference backend binds cupy at import: imported first under the stand-in it would
    # keep it for the session. Imported here with the real one, it runs NumPy for this test.
    from natten_cupy.backends import reference
    monkeypatch.setattr(reference, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    monkeypatch.setenv("COLUMNS", "200")
    rc = profile_cli.main(["-i", "12", "10", "-k", "5", "-n", "2", "-d", "8", "--backend",
                           "reference", "--warmup-steps", "1", "--dtype", "fp32"] + extra)
    out = capsys.readouterr().out
    assert rc == 0
    assert "forward: kernels" in out and "measured around the call" in out
    assert ("backward: kernels" in out) == ("--backprop" in extra)
    assert "kernels sum to" in out
