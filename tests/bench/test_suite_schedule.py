"""The benchmark suite's two phases, on a fake clock with fake item costs (no GPU, no timing)."""

import json
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<kind>/
BENCH = os.path.join(ROOT, "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

pytest.importorskip("torch")
pytest.importorskip("rich")

import suite  # noqa: E402

GROUPS = "T2:fp32,T3:fp32,T1:fp32,T2:fp16,T3:fp16"
CORE = {"reference", "flex_flat", "sdpa"}   # ours' best and the first peer of each plan


class FakeClock:
    """Stands in for the ``time`` module inside suite.py only."""

    strftime = staticmethod(time.strftime)
    gmtime = staticmethod(time.gmtime)

    def __init__(self):
        self.now = 1.0e9

    def time(self):
        return self.now

    perf_counter = time


def _run(monkeypatch, tmp_path, budget_s, compile_s=20.0):
    clock = FakeClock()
    calls = []

    def fake_run_one(name, factory, w, spec, group, args, measure_s):
        calls.append(dict(group=(w.id, spec["key"]), impl=name, measure_s=measure_s,
                          ref=(group.get("ref") or (None,))[0]))
        cost = 1.0 + min(max(measure_s, 0.0), args.item_s)
        if name.startswith("flex") and not group.get("flex_compiled"):
            cost += compile_s
        clock.now += cost
        if group.get("ref") is None:
            group["ref"] = (name, None)
        return {"status": "ok", "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "item_s": cost,
                "checked_against": group["ref"][0]}

    monkeypatch.setattr(suite, "time", clock)
    monkeypatch.setattr(suite, "_run_one", fake_run_one)
    out = tmp_path / "suite.json"
    assert suite.main(["--device", "cpu", "--groups", GROUPS, "--backends", "reference",
                       "--item-s", "5", "--budget-s", str(budget_s), "--out", str(out)]) == 0
    return calls, json.loads(out.read_text())


def _plan_order():
    args = suite.parse_args(["--device", "cpu", "--groups", GROUPS, "--backends", "reference"])
    suite.DEVICE["name"] = "cpu"
    return [(w, d, name) for w, d in args.groups
            for name, _, _ in suite.plan_group(suite.wl.WORKLOADS[w], suite.wl.dtype_spec(d),
                                               args)]


def test_small_budget_runs_every_core_item_first(monkeypatch, tmp_path):
    calls, data = _run(monkeypatch, tmp_path, budget_s=40)
    groups = [tuple(g.split(":")) for g in GROUPS.split(",")]
    phase1 = [c for c in calls if c["impl"] in CORE]
    # Every group's core items ran, before any other item, in group order.
    assert calls[:len(phase1)] == phase1
    assert [c["group"] for c in phase1] == [g for g in groups for _ in range(2)]
    # The budget cannot cover them: their repetitions are cut down (to --min-reps).
    assert all(c["measure_s"] == 0.0 for c in phase1[2:])
    status = {(r["workload"], r["dtype"], r["impl"]): r for r in data["results"]}
    assert all(status[(*c["group"], c["impl"])]["status"] == "ok" for c in phase1)
    # Nothing was left for phase 2.
    others = [r for r in data["results"] if r["impl"] not in CORE]
    assert others and all(r["status"] == "not run" and r["reason"] == "time budget spent"
                          for r in others)
    # Results in plan order, group by group.
    assert [(r["workload"], r["dtype"], r["impl"]) for r in data["results"]] == _plan_order()


def test_phase_two_runs_while_estimates_fit(monkeypatch, tmp_path):
    calls, data = _run(monkeypatch, tmp_path, budget_s=150)
    phase1 = [c for c in calls if c["impl"] in CORE]
    phase2 = calls[len(phase1):]
    assert all(c["impl"] not in CORE for c in phase2) and phase2
    # Phase 2 goes group by group and still checks against our best (kept from phase 1).
    order = [c["group"] for c in phase2]
    assert order == sorted(order, key=[c["group"] for c in phase1].index)
    assert all(c["ref"] == "reference" for c in phase2)
    # No phase-2 item was started with less budget than its estimated least cost.
    spent = data["meta"]["elapsed_s"]
    assert spent <= 150 + 1e-6
    statuses = {r["status"] for r in data["results"]}
    assert statuses <= {"ok", "not run"}
    assert [(r["workload"], r["dtype"], r["impl"]) for r in data["results"]] == _plan_order()


def test_ample_budget_runs_everything(monkeypatch, tmp_path):
    calls, data = _run(monkeypatch, tmp_path, budget_s=3600)
    assert all(r["status"] == "ok" for r in data["results"])
    assert len(calls) == len(data["results"]) == len(_plan_order())
    # Phase 1 had room: its items were given their full repetition time.
    assert all(c["measure_s"] >= 5 for c in calls if c["impl"] in CORE)
