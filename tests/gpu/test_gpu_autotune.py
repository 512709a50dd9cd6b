"""tile="autotune": the fused forward times its candidate tiles once and remembers the winner."""

import json

import numpy
import pytest

import natten_cupy
from natten_cupy.backends import fused


@pytest.mark.gpu
def test_autotune_times_once_and_persists(tmp_path, monkeypatch, rng):
    import cupy
    monkeypatch.setenv("NATTEN_CUPY_CACHE_DIR", str(tmp_path))
    fused._tuned_memory.clear()
    shape = (1, 40, 36, 2, 32)
    q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(numpy.float16)) for _ in range(3))
    calls = []
    real = fused._time_candidates

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused, "_time_candidates", counting)
    tuned = natten_cupy.na2d(q, k, v, 7, backend="fused", tile="autotune")
    default = natten_cupy.na2d(q, k, v, 7, backend="fused")
    assert len(calls) == 1
    data = json.loads((tmp_path / "autotune.json").read_text())
    (key, box), = data.items()
    # the winner: an mma.sync query box, or the Hopper part where it serves head dim 32
    assert "fused_forward" in key and (box == fused.HOPPER or len(box) == 2), box
    err = float(cupy.abs(tuned.astype(cupy.float32) - default.astype(cupy.float32)).max())
    assert err < 2e-3
    # A new process (simulated by clearing the memory cache) reads the file, no re-timing.
    fused._tuned_memory.clear()
    natten_cupy.na2d(q, k, v, 7, backend="fused", tile="autotune")
    assert len(calls) == 1


def test_autotune_is_a_valid_tile_option():
    q = numpy.zeros((1, 8, 8, 1, 8), numpy.float32)
    out = natten_cupy.na2d(q, q, q, 3, tile="autotune")
    assert out.shape == q.shape
    with pytest.raises(ValueError, match="tile must be a tuple of positive ints or 'autotune'"):
        natten_cupy.na2d(q, q, q, 3, tile="fastest")


def test_autotune_candidates_include_the_hopper_part(monkeypatch):
    """Where the Hopper part accepts a problem, autotune times it against the mma.sync
    part's tiles (the backward's mma.sync part has one configuration, MMA); the winner routes
    the problem to that part, and a stored string winner stays a string."""
    import dataclasses
    from natten_cupy import _args
    q = numpy.zeros((1, 64, 2, 128), numpy.float16)
    problem = _args.check_fused(1, q, q, q, 9, 1, 1, False, None, "fused", tile="autotune")
    monkeypatch.setattr(fused, "_hopper_serves", lambda p, name="wgmma_forward": True)
    fwd = fused._candidates("fused_forward", problem)
    bwd = fused._candidates("fused_backward", problem)
    assert fwd[-1] == fused.HOPPER and all(isinstance(b, tuple) for b in fwd[:-1]) and fwd[:-1]
    assert bwd == [fused.MMA, fused.HOPPER]
    as_hopper = dataclasses.replace(problem, tile=fused.HOPPER)
    assert fused._parts_for("fused_forward", as_hopper) == "wgmma_forward"
    assert fused._parts_for("fused_backward", as_hopper) == "wgmma_backward"
    assert fused._parts_for("fused_backward", dataclasses.replace(problem, tile=fused.MMA)) \
        == "mma_backward"
    assert fused._tile_value("wgmma") == "wgmma" and fused._tile_value([8, 16]) == (8, 16)
    monkeypatch.setattr(fused, "_hopper_serves", lambda p, name="wgmma_forward": False)
    assert fused._candidates("fused_backward", problem) == []
    f32 = _args.check_fused(1, q.astype(numpy.float32), q.astype(numpy.float32),
                            q.astype(numpy.float32), 9, 1, 1, False, None, "fused",
                            tile="autotune")
    assert fused.HOPPER not in fused._candidates("fused_forward", f32)


@pytest.mark.gpu
def test_autotune_chooses_between_hopper_and_mma_sync(tmp_path, monkeypatch, rng):
    """On an H200 a 1-D head-dim-128 problem has both parts as candidates, forward and
    backward; the tuned results match the default ones."""
    import cupy
    from natten_cupy.backends.fused import wgmma_forward
    if wgmma_forward._compute_capability() != (9, 0):
        pytest.skip("needs a compute capability 9.0 GPU")
    monkeypatch.setenv("NATTEN_CUPY_CACHE_DIR", str(tmp_path))
    fused._tuned_memory.clear()
    shape = (1, 700, 2, 128)
    q, k, v, d_out = (cupy.asarray(rng.standard_normal(shape).astype(numpy.float16))
                      for _ in range(4))

    def run(tile):
        out, lse = natten_cupy.na1d(q, k, v, 65, return_lse=True, tile=tile)
        grads = natten_cupy.na1d_backward(d_out, q, k, v, out, lse, 65, tile=tile)
        return [out, lse, *grads]

    tuned, default = run("autotune"), run(None)
    data = json.loads((tmp_path / "autotune.json").read_text())
    ops = sorted(key.split("|")[1] for key in data)
    assert ops == ["fused_backward", "fused_forward"], data
    for winner in data.values():
        assert winner in (fused.HOPPER, fused.MMA) or isinstance(winner, list), winner
    for a, b in zip(tuned, default):
        err = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
        assert err < 5e-3


@pytest.mark.gpu
def test_torch_layer_autotune_matches_default(tmp_path, monkeypatch):
    """natten_cupy.torch with tile="autotune": the first call tunes (forward and backward),
    later calls take the warm path with the winner; gradients match the default call."""
    import torch
    from natten_cupy import torch as nt
    monkeypatch.setenv("NATTEN_CUPY_CACHE_DIR", str(tmp_path))
    fused._tuned_memory.clear()
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, d_out = (torch.randn(2, 24, 20, 2, 64, device="cuda", dtype=torch.bfloat16,
                                  generator=gen) for _ in range(4))

    def grads(**kw):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = nt.na2d(*leaves, 7, **kw)
        out.backward(d_out)
        return [out.detach()] + [x.grad for x in leaves]

    default = grads()
    first, warm = grads(tile="autotune"), grads(tile="autotune")
    assert len(json.loads((tmp_path / "autotune.json").read_text())) >= 1
    for a, b, c in zip(default, first, warm):
        assert torch.equal(b, c)
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
