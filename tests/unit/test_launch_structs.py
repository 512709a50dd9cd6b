"""Every launch struct a kernel takes by value has a NumPy twin in its launcher with the same
fields, types, lengths and C layout, read from the header (``struct_twins``): a field added,
dropped or retyped on one side fails here, without a compiler or a GPU."""

import importlib

import numpy
import pytest

import struct_twins

# (C struct, file under cuda_src/, module and attribute of its NumPy twin)
TWINS = [
    ("NAParams", "natten/common.cuh", "natten_cupy._params", "PARAMS_DTYPE"),
    ("PassGeom", "natten/fused_bwd_tile.cuh", "natten_cupy.backends.fused.mma_backward",
     "PASS_GEOM"),
    ("BiasGeom", "natten/fused_bwd_tile.cuh", "natten_cupy.backends.fused.mma_backward",
     "BIAS_GEOM"),
    ("TilePlan", "fused/exact_fp32.cu", "natten_cupy.backends.fused.exact_fp32", "PLAN_DTYPE"),
    ("HaloChunks", "fused/mma_forward.cu", "natten_cupy.backends.fused.mma_forward",
     "HALO_CHUNKS"),
    ("ExtraGeom", "natten/fused_bwd_tile.cuh", "natten_cupy.backends.fused.mma_backward",
     "EXTRA_GEOM"),
    ("ScoresArgs", "na_tiled.cu", "natten_cupy.backends.tiled", "SCORES_ARGS"),
    ("WeightedArgs", "na_tiled.cu", "natten_cupy.backends.tiled", "WEIGHTED_ARGS"),
    ("RpbGradArgs", "na_tiled.cu", "natten_cupy.backends.tiled", "RPB_GRAD_ARGS"),
    ("SoftmaxArgs", "na_softmax.cu", "natten_cupy._softmax", "SOFTMAX_ARGS"),
]


@pytest.mark.parametrize("struct, path, module, attr", TWINS, ids=[t[0] for t in TWINS])
def test_launch_struct_matches_its_numpy_twin(struct, path, module, attr):
    dtype = getattr(importlib.import_module(module), attr)
    assert struct_twins.mismatch(dtype, path, struct) is None, \
        struct_twins.mismatch(dtype, path, struct)


def test_the_checker_finds_a_one_sided_change():
    """A twin with a field dropped, retyped or moved is reported (the check can fail)."""
    from natten_cupy.backends.fused import mma_backward
    good = mma_backward.PASS_GEOM
    assert struct_twins.mismatch(good, "natten/fused_bwd_tile.cuh", "PassGeom") is None
    names = list(good.names)
    dropped = numpy.dtype([(n, good.fields[n][0]) for n in names[:-1]])
    retyped = numpy.dtype([(n, numpy.dtype((numpy.int64, good.fields[n][0].shape))
                            if n == "bh0" else good.fields[n][0]) for n in names])
    moved = numpy.dtype([(n, good.fields[n][0]) for n in names[1:] + names[:1]])
    for bad in (dropped, retyped, moved):
        assert struct_twins.mismatch(bad, "natten/fused_bwd_tile.cuh", "PassGeom") is not None
    # C alignment: an int then a double puts the double at 8, the size at 16
    fs = [("a", numpy.int32, 1), ("b", numpy.float64, 1)]
    assert struct_twins.c_layout(fs) == ([0, 8], 16)


def test_mma_backward_constants_match_the_kernel():
    """The launcher sizes shared memory with the kernel's warps per CTA and rows per step
    (KWARPS, KNB): the constants the .cu declares."""
    import re

    from natten_cupy import _compile
    from natten_cupy.backends.fused import mma_backward as m
    src = _compile._read(m.SOURCE)
    for name, value in (("kWarps", m.KWARPS), ("kNB", m.KNB)):
        found = re.search(rf"constexpr int {name} = (\d+);", src)
        assert found and int(found.group(1)) == value, (name, found and found.group(0), value)
