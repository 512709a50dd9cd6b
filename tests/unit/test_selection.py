"""The select step (``natten_cupy._selection``) without a GPU: which backend a problem gets,
why the faster ones refused, and what the selection's plan and tuning ask of the backend.

Refusals need no device, so GPU arrays are stood in for by any module other than NumPy (the
select step only asks whether the arrays are NumPy's). The problems are chosen so that no
backend reads the device to refuse: float64 (every GPU-planned backend refuses it by dtype)
and exact float32 (the fused backend's exact-fp32 part)."""

import dataclasses
import logging
import re

import numpy
import pytest

from natten_cupy import _args, _fast
from natten_cupy._operands import Layout
from natten_cupy._selection import Selection, select_backend
from natten_cupy.backends import fused, get_backend, naive, tiled

GPU = object()   # where the arrays live, for select_backend: not NumPy


def _x(shape=(1, 9, 2, 8), dtype=numpy.float32):
    return numpy.zeros(shape, dtype)


def _fused(dtype=numpy.float32, tile=None, rpb=False):
    q = _x(dtype=dtype)
    bias = numpy.zeros((2, 5), dtype) if rpb else None
    return _args.check_fused(1, q, q, q, 3, 1, 1, False, None, "auto", False, False, tile, bias)


def _qk(dtype=numpy.float16):
    q = _x(dtype=dtype)
    return _args.check_qk(1, q, q, 3, 1, False, None, "auto", False)


def test_numpy_arrays_select_the_reference_backend_which_plans_nothing():
    sel = select_backend("fused_forward", _fused(), numpy)
    assert (sel.op, sel.name, sel.refused) == ("fused_forward", "reference", ())
    assert sel.backend is get_backend("reference") and sel.problem == _fused()
    assert not sel.has_plans
    assert sel.plan([Layout.contiguous((1, 9, 2, 8), numpy.dtype(numpy.float32))] * 5) is None
    assert select_backend("qk", _qk(), numpy, "reference").name == "reference"


@pytest.mark.parametrize("backend", ["naive", "tiled", "fused"])
def test_a_gpu_backend_for_numpy_arrays_is_refused(backend):
    with pytest.raises(ValueError, match=re.escape(
            f"backend {backend!r} runs on the GPU and needs CuPy or CUDA arrays; NumPy/CPU "
            "arrays run on backend 'reference'")):
        select_backend("qk", _qk(), numpy, backend)


def test_auto_takes_the_first_backend_that_accepts():
    sel = select_backend("qk", _qk(), GPU)
    assert (sel.name, sel.backend, sel.refused) == ("tiled", tiled, ())
    assert sel.has_plans and sel.row_inputs == tiled.ROW_INPUTS["qk"]
    sel = select_backend("fused_forward", _fused(), GPU)   # exact float32: fused's own part
    assert (sel.name, sel.backend, sel.refused) == ("fused", fused, ())
    assert sel.row_inputs == fused.ROW_INPUTS["fused_forward"]


def test_refusals_are_recorded_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="natten_cupy"):
        sel = select_backend("qk", _qk(numpy.float64), GPU)
    why = "tiled: dtype float64 is not supported (float16, bfloat16, float32)"
    assert (sel.name, sel.backend, sel.refused) == ("naive", naive, (why,))
    assert caplog.messages == [f"natten_cupy qk: using naive ({why})"]
    assert not sel.has_plans and sel.plan([None] * 4) is None
    sel = select_backend("fused_forward", _fused(rpb=True), GPU)
    assert sel.name == "naive" and len(sel.refused) == 1
    assert sel.refused[0].startswith("fused: the exact-float32 kernels take no relative "
                                     "positional bias")
    huge = dataclasses.replace(_qk(numpy.float64), spatial=(2 ** 31,))   # in PREFERENCE order
    assert select_backend("qk", huge, GPU).refused == (
        why, "naive: extents of 2**31 or more do not fit the kernels' int32 coordinates")


def test_a_requested_backend_that_refuses_raises_with_its_reason():
    with pytest.raises(ValueError, match=re.escape(
            "backend 'tiled' cannot run fused_forward for this problem (dtype float32, "
            "head_dim 8): tiled: the tiled backend runs only the unfused ops")):
        select_backend("fused_forward", _fused(), GPU, "tiled")


def test_a_selection_is_frozen_and_keys_like_its_parts():
    a = select_backend("qk", _qk(numpy.float64), GPU)
    b = select_backend("qk", _qk(numpy.float64), GPU)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != select_backend("qk", _qk(), GPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "tiled"


def test_plan_asks_the_backend_for_this_op_problem_and_layouts(monkeypatch):
    asked = []
    monkeypatch.setattr(tiled, "plan", lambda *args: asked.append(args) or "the plan")
    sel = select_backend("qk", _qk(), GPU)
    layouts = [Layout.contiguous((1, 9, 2, 8), numpy.dtype(numpy.float16))] * 2
    assert sel.plan(layouts) == "the plan"
    assert asked == [("qk", sel.problem, layouts)]


def test_tuned_puts_the_timed_winner_in_or_waits(monkeypatch):
    sel = select_backend("fused_forward", _fused(tile="autotune"), GPU)
    monkeypatch.setattr(fused, "tuned", lambda op, problem: None)   # not timed yet
    assert sel.tuned() is None
    won = dataclasses.replace(sel.problem, tile=(32,))
    monkeypatch.setattr(fused, "tuned", lambda op, problem: won)
    assert sel.tuned() == dataclasses.replace(sel, problem=won)
    plain = select_backend("fused_forward", _fused(), GPU)
    assert plain.tuned() is plain
    on_naive = Selection("fused_forward", "naive", naive, _fused(tile="autotune"))
    assert on_naive.tuned() is on_naive   # no tile choice there


def test_the_fast_path_builds_from_the_selection_before_any_gpu_work(monkeypatch):
    """A backend without plans is served by the general path for good (_SLOW); an autotuned
    problem whose winner is not yet known is not cached (None)."""
    x = _x(dtype=numpy.float64)
    outputs = [((1, 9, 2, 8), numpy.dtype(numpy.float64))]
    sel = select_backend("fused_forward", _fused(numpy.float64), GPU)
    assert sel.name == "naive"
    assert _fast._build(sel, "cupy", [x, x, x], outputs) is _fast._SLOW
    monkeypatch.setattr(fused, "tuned", lambda op, problem: None)
    sel = select_backend("fused_forward", _fused(tile="autotune"), GPU)
    assert _fast._build(sel, "cupy", [x, x, x], outputs) is None


def test_the_hopper_backward_takes_what_it_was_measured_faster_on(monkeypatch):
    """Where the Hopper part serves a problem (the device is sm_90), the fused backward goes
    to it at head dims above 64; at head dims 40-64 without a bias or additional tokens for
    1-D windows from 48 and 2-D windows of 200 neighbors or more; with a bias, or at head dim
    32, for 1-D windows from 96 / 160; smaller windows and 3-D at 64 and below stay on
    mma.sync."""
    monkeypatch.setattr(fused, "_hopper_serves", lambda problem, part: True)

    def part(rank, kernel, dim, rpb=False, tokens=0):
        spatial = (600,) if rank == 1 else (40,) * rank
        q = numpy.zeros((1, *spatial, 4, dim), numpy.float16)
        bias = numpy.zeros((4, *(2 * k - 1 for k in kernel)), numpy.float16) if rpb else None
        p = _args.check_fused(rank, q, q, q, kernel, 1, 1, False, None, "auto", rpb=bias)
        p = dataclasses.replace(p, extra_tokens=tokens, extra_heads=4 if tokens else 0)
        return fused._parts_for("fused_backward", p)

    assert part(1, (47,), 64) == "mma_backward"
    assert part(1, (48,), 64) == part(1, (48,), 40) == "wgmma_backward"
    assert part(1, (511,), 64) == "wgmma_backward"
    assert part(1, (159,), 32) == "mma_backward"
    assert part(1, (160,), 32) == "wgmma_backward"
    assert part(1, (95,), 64, rpb=True) == "mma_backward"
    assert part(1, (96,), 64, rpb=True) == "wgmma_backward"
    assert part(1, (31,), 128) == "wgmma_backward"
    assert part(2, (13, 13), 64) == "mma_backward"
    assert part(2, (15, 15), 64) == part(2, (31, 31), 64) == "wgmma_backward"
    assert part(2, (15, 15), 32) == part(2, (15, 15), 64, rpb=True) == "mma_backward"
    assert part(1, (129,), 64, tokens=256) == part(2, (15, 15), 64, tokens=4) == "mma_backward"
    assert part(3, (5, 9, 9), 64) == "mma_backward"
    assert part(2, (7, 7), 128) == "wgmma_backward"


def test_a_device_with_less_shared_memory_sends_the_mma_parts_elsewhere(monkeypatch):
    """On a GPU that allows less shared memory per block than an mma.sync part needs (e.g.
    ~99 KB on the consumer parts, against 128 KB for a TF32 forward at head dim 160), the
    fused backend refuses with the sizes and auto falls to naive; a device with room keeps
    it. (The device is stood in for: limits read through ``device_limits``.)"""
    from types import SimpleNamespace
    import cupy
    from natten_cupy import _device, _operands
    from natten_cupy.backends.fused import mma_backward, mma_forward
    q = _x((1, 64, 2, 160), numpy.float32)
    problem = _args.check_fused(1, q, q, q, 9, 1, 1, False, None, "auto", allow_tf32=True)
    fwd_smem = mma_forward.configure(problem).smem
    assert fwd_smem > 99 * 1024
    monkeypatch.setattr(_device, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: SimpleNamespace(id=0))
    monkeypatch.setattr(_operands, "_capability", lambda dev: (8, 6))
    for allowed, runs in ((99 * 1024, "naive"), (227 * 1024, "fused")):
        monkeypatch.setattr(_operands, "device_limits", lambda dev, n=allowed: SimpleNamespace(
            smem_per_block=n, smem_per_sm=n, sm_count=132))
        sel = select_backend("fused_forward", problem, GPU)
        assert sel.name == runs
        if runs == "naive":
            (why,) = sel.refused
            assert why.startswith(f"fused: the mma.sync fused forward needs {fwd_smem} bytes "
                                  "of shared memory per block")
            assert why.endswith(f"allows {allowed}")
    t = mma_backward.configure(problem)
    need = max(t.q.smem, t.kv.smem)
    monkeypatch.setattr(_operands, "device_limits", lambda dev: SimpleNamespace(
        smem_per_block=need - 1, smem_per_sm=need, sm_count=132))
    assert "shared memory" in mma_backward.refuse(problem)
    monkeypatch.setattr(_operands, "device_limits", lambda dev: SimpleNamespace(
        smem_per_block=need, smem_per_sm=need, sm_count=132))
    assert mma_backward.refuse(problem) is None


@pytest.mark.parametrize("cc", ["75", "70", "86"])
def test_gpus_before_ampere_run_the_naive_kernels(monkeypatch, cc):
    """The tensor-core backends (fused, tiled: mma.sync m16n8k16, cp.async, bfloat16 tiles)
    refuse a GPU below compute capability 8.0 with its capability, and auto runs naive there;
    from 8.0 they run. (The device is stood in for.)"""
    from types import SimpleNamespace
    import cupy
    from natten_cupy import _device, _operands
    monkeypatch.setattr(_device, "gpu_unavailable_reason", lambda: None)
    monkeypatch.setattr(cupy.cuda, "Device",
                        lambda *a: SimpleNamespace(id=0, compute_capability=cc))
    monkeypatch.setattr(_operands, "_capability", lambda dev: (int(cc[0]), int(cc[1])))
    monkeypatch.setattr(_operands, "device_limits", lambda dev: SimpleNamespace(
        smem_per_block=99 * 1024, smem_per_sm=100 * 1024, sm_count=80))
    fused_sel = select_backend("fused_forward", _fused(numpy.float16), GPU)
    qk_sel = select_backend("qk", _qk(), GPU)
    if cc == "86":
        assert (fused_sel.name, qk_sel.name) == ("fused", "tiled")
        return
    assert (fused_sel.name, qk_sel.name) == ("naive", "naive")
    why = f"needs compute capability 8.0 or newer (Ampere on); this device has {cc[0]}.{cc[1]}"
    assert fused_sel.refused == (f"fused: the fused backend {why}",)
    assert qk_sel.refused == (f"tiled: the tiled backend {why}",)
