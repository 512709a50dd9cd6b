"""The probes' workload ids without a GPU: bench/workloads.py's tables keep their ids apart, every
id a probe runs by default names a workload there, and the fused probes' cases and selections
resolve."""

import ast
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository
BENCH = ROOT / "bench"
PROBES = BENCH / "probes"
sys.path.insert(0, str(BENCH))
import workloads as wl  # noqa: E402

TABLES = {"WORKLOADS": wl.WORKLOADS, "PROBE_WORKLOADS": wl.PROBE_WORKLOADS,
          "CHECK_WORKLOADS": wl.CHECK_WORKLOADS, "MODEL_VARIANTS": wl.MODEL_VARIANTS}
# Module-level names whose strings are "ID[:dtype[:layout]]" lists, and the RUNS tables whose
# rows start with an id.
ID_LISTS = ("DEFAULT", "CHECKS", "SMALL", "TIMED", "TIMED_ONLY", "FLEX")


def _probe(name="fused_bwd_probe"):
    spec = importlib.util.spec_from_file_location(name, PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _known(wid):
    try:
        wl.probe_workload(wid)
    except KeyError:
        return wid in wl.MODEL_VARIANTS
    return True


def test_tables_keep_their_ids_apart():
    seen = {}
    for name, table in TABLES.items():
        for wid, w in table.items():
            assert w.id == wid
            assert wid not in seen, f"{wid} is in both {seen.get(wid)} and {name}"
            seen[wid] = name
    for name in ("WORKLOADS", "PROBE_WORKLOADS", "CHECK_WORKLOADS"):
        for wid, w in TABLES[name].items():
            assert wl.probe_workload(wid) is w
    with pytest.raises(KeyError):
        wl.probe_workload("M4+kv256")


def test_check_workloads_are_small_plain_problems():
    for w in wl.CHECK_WORKLOADS.values():
        assert w.plain and w.batch == 2 and w.tokens <= 1000, w
        assert all(k <= L for k, L in zip(w.kernel, w.spatial)), w


def _default_ids(path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        name = getattr(node.targets[0], "id", None)
        if name in ID_LISTS:
            for c in ast.walk(node.value):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    yield name, [item.split(":")[0] for item in c.value.split(",") if item]
        elif name == "RUNS":
            for row in node.value.elts:
                yield name, [row.elts[0].value]


@pytest.mark.parametrize("path", sorted(PROBES.glob("*.py")), ids=lambda p: p.name)
def test_probe_defaults_name_workloads(path):
    for name, ids in _default_ids(path):
        unknown = [wid for wid in ids if not _known(wid)]
        assert not unknown, f"{path.name} {name}: {unknown} are not in bench/workloads.py"


def test_defaults_are_found():
    found = {}
    for name, ids in _default_ids(PROBES / "hopper_probe.py"):
        found.setdefault(name, []).extend(ids)
    assert found["FLEX"] == ["W1"] and found["RUNS"][:3] == ["SA", "SA128", "W1"]
    ids = [wid for _, ids in _default_ids(PROBES / "fused_bwd_probe.py") for wid in ids]
    assert "chk2-sdc-d200" in ids and "W3" in ids


def test_fused_bwd_probe_cases_resolve():
    probe = _probe()
    checks = probe.parse(",".join(probe.CHECKS), layouts=True)
    assert len(checks) == len(probe.CHECKS)
    assert all(w.id in wl.CHECK_WORKLOADS for w, _, _ in checks)
    assert {layout for _, _, layout in checks} == set(probe.LAYOUTS)
    timed = probe.parse(",".join(probe.TIMED))
    assert [(w.id, d) for w, d, _ in probe.parse(",".join(probe.TIMED_ONLY))] == [
        ("W2", "fp16"), ("W3", "fp16")]
    assert all(w.id in wl.WORKLOADS and layout == "canonical" for w, _, layout in timed)
    for rank, _, case, spec in probe.VARIANTS:
        (w, _, _), = probe.parse(case, layouts=True)
        (t, _, _), = probe.parse(spec)
        assert w.rank == t.rank == rank
    problem = probe.make_problem(wl.CHECK_WORKLOADS["chk2-sdc"], "tf32")
    assert (problem.batch, problem.spatial, problem.head_dim, problem.dtype.name,
            problem.allow_tf32) == (2, (21, 19), 72, "float32", True)
    assert problem.scale == 72 ** -0.5


@pytest.mark.parametrize("text,layouts", [("nope:fp16", True), ("chk1-odd:fp64", True),
                                          ("chk1-odd:fp16:sideways", True),
                                          ("W2:fp16:heads_first", False), ("W2", False)])
def test_fused_bwd_probe_rejects_bad_entries(text, layouts):
    with pytest.raises(ValueError, match=r"bad entries \['"):
        _probe().parse(f"chk1-odd:fp16,{text}", layouts=layouts)


def test_fused_fwd_probe_cases_resolve():
    probe = _probe("fused_fwd_probe")
    cases = probe.cases()
    tests = probe._gpu_tests()
    assert [case for _, case, _ in cases[:len(tests.CASES)]] == tests.CASES
    assert len(cases) == len(tests.CASES) + len(probe.CHECKS)
    assert {layout for _, _, layout in cases[len(tests.CASES):]} == {"heads_first",
                                                                      "strided_last"}
    # the cases the probe wrote inline before, now CHECK_WORKLOADS ids
    F16 = tests.F16
    assert [probe.case_of(item)[1:] for item in probe.SMALL] == [
        (((13, 11), (5, 4), (1, 2), (2, 1), (False, True), 1, 32, F16, None), "canonical"),
        (((700,), (257,), (1,), (1,), (False,), 1, 64, F16, None), "canonical")]
    assert probe.case_of("chk2-layout:fp16:strided_last")[1:] == (
        ((21, 18), (5, 7), (1, 1), (2, 1), (False, False), 3, 64, F16, None), "strided_last")
    assert probe.case_of("chk2-k9:bf16")[1][7] == tests.BF16


def test_perf_sweep_problems_resolve_by_id():
    """``R<seed>-<i>`` names the perf sweep's problem i of that seed in every lookup (so a
    probe can time any problem the sweep drew); other ids that look alike do not resolve."""
    import perf_sweep
    w, _ = perf_sweep.draw(1, 22)
    assert wl.probe_workload("R1-22") == w == wl.model_workload("R1-22")
    for bad in ("R1-", "R-3", "R1-2x", "r1-2"):
        with pytest.raises(KeyError):
            wl.probe_workload(bad)
    assert not any(wid.startswith("R") and wid[1:2].isdigit()
                   for table in TABLES.values() for wid in table)


def test_dispatch_grids_are_problems_both_forward_parts_plan(monkeypatch):
    """Every shape of the dispatch grids (hopper_dispatch.py --grid default, d32, d256) is a
    valid problem at its head dims that the mma.sync forward plans, and that the Hopper forward
    plans too (its device check aside; in 3-D above head dim 128 with WIDE_3D on, as the
    probe sets it)."""
    import numpy
    from natten_cupy import _args
    from natten_cupy.backends.fused import mma_forward, wgmma_forward
    monkeypatch.setattr(wgmma_forward, "WIDE_3D", True)
    grids = ((wl.DISPATCH_GRID, (64, 128)), (wl.DISPATCH_GRID_D32, (32,)),
             (wl.DISPATCH_GRID_D256, (160, 256)))
    for grid, dims in grids:
        for spatial, kernels, batch, heads in grid:
            for kernel in kernels:
                for dim in dims:
                    x = numpy.zeros((1, *spatial, 1, dim), numpy.float16)
                    p = _args.check_fused(len(spatial), x, x, x, kernel, 1, 1, False, None,
                                          "fused")
                    assert not isinstance(mma_forward.configure(p), str), (spatial, kernel)
                    why = wgmma_forward.refuse(p)
                    assert why is None or "compute capability" in why, (spatial, dim, why)
