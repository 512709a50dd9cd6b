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
    assert "fused_forward" in key and len(box) == 2
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
