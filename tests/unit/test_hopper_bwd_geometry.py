"""The geometry of the Hopper fused backward (cuda_src/natten/hopper/bwd_geom.cuh), compiled
for the CPU: for every CTA, thread and tile that the dK/dV pass (keys own, inverse windows)
and the dQ pass (queries own, windows; 128-query boxes, and the 64-query boxes of its one
compute warpgroup variant) run, the (owner, other) pairs whose scores survive the
masks must be exactly the SPEC neighborhood (tests/oracle.py), each once; no unmasked score
may fall past the region or outside a dilation group. This covers the grid decode, the owner
rows of the wgmma accumulator layout, the region boxes, the flat tile walk, needs_mask and
mask_scores of the real header; and, for the kernels with a relative positional bias, that
every surviving pair reads the table entry of its offset inside the CTA's box (bias_box.cuh),
with boxes and regions within what the launcher sizes shared memory for. The wgmma layouts
and loaders are checked on the GPU (tests/gpu/test_gpu_hopper_bwd.py).
"""

import ctypes
import pathlib
import subprocess

import numpy
import pytest

import oracle
from natten_cupy import _args
from natten_cupy._params import PARAMS_DTYPE, make_params
from natten_cupy.backends.fused import wgmma_backward as H

TESTS = pathlib.Path(__file__).resolve().parents[1]   # tests/: the emulator and the harness
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    from emulator import compiler
    cxx = compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler")
    out = tmp_path_factory.mktemp("hopper_bwd_geom") / "libgeom.so"
    cmd = [cxx, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{TESTS / 'emulator' / 'include'}",
           f"-I{ROOT / 'cuda_src'}", str(TESTS / "hopper_bwd" / "geometry_harness.cpp"), "-o",
           str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    so = ctypes.CDLL(str(out))
    so.emu_bwd_pairs.restype = ctypes.c_longlong
    so.emu_bwd_pairs.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong,
                                 ctypes.c_void_p]
    so.emu_bwd_pairs_one_wg.restype = ctypes.c_longlong
    so.emu_bwd_pairs_one_wg.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_longlong, ctypes.c_void_p]
    so.emu_bwd_ds_slots.restype = ctypes.c_longlong
    so.emu_bwd_ds_slots.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_void_p]
    assert so.emu_params_size() == PARAMS_DTYPE.itemsize
    return so


# (spatial, kernel, stride, dilation, causal)
CASES = [
    ((97,), 7, 1, 2, True),
    ((200,), 33, 4, 1, False),
    ((300,), 300, 1, 1, False),
    ((517,), 129, 1, 1, False),
    ((500,), 128, 3, 1, True),
    ((400,), 64, 1, 3, False),
    ((129,), 2, 2, 1, False),
    ((333,), 65, 5, 2, True),
    ((64,), 64, 64, 1, False),
    ((89,), 2, 1, 40, False),     # groups of 2 and 3 (the sweep's fused/float16 #587)
    ((260,), 10, 10, 1, False),
    ((700,), 127, 1, 1, False),   # windows of 127 and 63: tiles that end one past the
    ((700,), 63, 1, 1, False),    # rows every owner reaches
    ((33, 41), (7, 5), (2, 1), (2, 3), (True, False)),
    ((24, 37), (4, 6), 1, 1, False),
    ((30, 29), 13, 1, 1, False),
    ((19, 23), (5, 4), (5, 2), (1, 2), (False, True)),
    ((20, 25), (20, 25), 1, 1, False),
    ((7, 70), (3, 33), 1, 1, (True, True)),
    ((9, 17, 13), (3, 5, 4), 1, (1, 2, 1), (False, False, True)),
    ((8, 12, 12), 3, (1, 3, 2), 1, False),
    ((6, 10, 11), (3, 5, 5), 1, 1, (True, False, False)),
    ((5, 6, 7), (5, 6, 7), 1, 1, False),
    ((10, 12, 13), (5, 9, 9), (2, 1, 3), (1, 1, 1), False),
    ((7, 5, 6), (4, 3, 3), 1, (1, 1, 2), (True, True, True)),
]


def _problem(spatial, ks, st, dl, ca):
    x = numpy.zeros((1, *spatial, 1, 64), numpy.float16)
    return _args.check_fused(len(spatial), x, x, x, ks, st, dl, ca, None, "fused")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-s{c[2]}-"
                         f"d{c[3]}-c{c[4]}")
@pytest.mark.parametrize("side", ["kv", "q64", "q128", "kv-one-wg", "kv32-one-wg",
                                  "q64-one-wg", "q128-one-wg"])
def test_surviving_scores_are_the_neighborhood(lib, case, side):
    """side: the dK/dV pass (query tiles of 64; "kv32": 32), or the dQ pass with key tiles of
    64 or 128 (128-row boxes of two compute warpgroups, or "-one-wg": 64-row boxes of one)."""
    spatial = case[0]
    prob = _problem(*case)
    mask = oracle.neighborhood_mask(*case)  # [query, key]
    expect = mask.T if side.startswith("kv") else mask
    points = mask.shape[0]
    pairs = numpy.zeros((points, points), numpy.int32)
    stats = numpy.zeros(6, numpy.int64)
    p = numpy.array(make_params(prob))
    one_wg = side.endswith("-one-wg")
    if side.startswith("kv"):   # query tiles of 64, or 32 (the one-warpgroup pass at 128)
        inv, n = 1, 32 if side.startswith("kv32") else 64
    else:
        inv, n = 0, int(side[1:].split("-")[0])
    if one_wg:
        ctas = H.owner_ctas(prob, H.Q_BOX_ONE_WG[len(spatial)])
        errors = lib.emu_bwd_pairs_one_wg(len(spatial), inv, n, p.ctypes.data, ctas,
                                          pairs.ctypes.data, points, stats.ctypes.data)
    else:
        errors = lib.emu_bwd_pairs(len(spatial), inv, n, p.ctypes.data, H.owner_ctas(prob),
                                   pairs.ctypes.data, points, stats.ctypes.data)
    assert errors == 0, f"{errors} unmasked scores past the region or a group"
    assert pairs.max() <= 1, "a pair counted twice"
    missing = numpy.argwhere(expect & (pairs == 0))
    extra = numpy.argwhere(~expect & (pairs > 0))
    assert not len(missing) and not len(extra), (missing[:5], extra[:5], stats)
    if one_wg:   # (no bias there)
        return
    if all(st == 1 for st in prob.stride):   # a bias takes stride 1 only
        assert stats[3] == 0, f"{stats[3]} pairs read a wrong bias entry or one outside the box"
    # the launcher's shared memory for the bias parts holds every CTA's box and region
    ext = H._bias_extents(prob)
    box, region = (3, 2) if side == "kv" else (1, 0)
    assert stats[4] <= numpy.prod([e[box] for e in ext])
    assert stats[5] <= numpy.prod([e[region] for e in ext])


@pytest.mark.parametrize("case", [c for c in CASES if all(
    st == 1 for st in ((c[2],) * len(c[0]) if isinstance(c[2], int) else c[2]))],
    ids=lambda c: f"{len(c[0])}d-{c[0]}-k{c[1]}-d{c[3]}-c{c[4]}")
def test_ds_workspace_slots_are_each_window_once(lib, case):
    """The dK/dV pass with a bias and dQ added in it (na_bwd_hopper_kv_ds): its surviving
    pairs write the dS workspace at (query, the key's slot in the query's window as the
    unfused chain numbers them), every slot of every window exactly once and no other; the
    reduction's bias entry of each slot is the pair's offset (stride 1: a bias takes no
    other)."""
    prob = _problem(*case)
    mask = oracle.neighborhood_mask(*case)  # [query, key]
    points, kvol = mask.shape[0], prob.num_neighbors
    hits = numpy.zeros((points, kvol), numpy.int32)
    p = numpy.array(make_params(prob))
    errors = lib.emu_bwd_ds_slots(len(case[0]), p.ctypes.data, H.owner_ctas(prob),
                                  hits.ctypes.data)
    assert errors == 0, f"{errors} pairs at a wrong slot or bias entry"
    assert hits.max() <= 1, "a slot written twice"
    assert (hits.sum(axis=1) == mask.sum(axis=1)).all(), "a window's slots not all written"
