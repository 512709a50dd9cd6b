"""Shared test fixtures: GPU detection (without touching CUDA on machines that lack it).

The tests live in tests/unit/ (CPU), tests/gpu/ (marked gpu) and tests/bench/ (the bench/
tools); this file, at tests/, applies to all three. The helpers they share stay here too
(oracle.py, gpu_cases.py, emulator/, hopper_bwd/): tests/ goes on sys.path below, so
``import oracle``, ``import gpu_cases`` and ``import emulator`` work from every subfolder
(whatever pytest's --import-mode)."""

import os
import re
import sys
import zlib

import numpy
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from natten_cupy._device import gpu_unavailable_reason  # noqa: E402


GPU_REASON = gpu_unavailable_reason()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU through CuPy (skipped otherwise)")


def pytest_collection_modifyitems(config, items):
    if GPU_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {GPU_REASON}")
    for item in items:
        # the marker, not the keyword: "gpu" is also the name of the tests/gpu/ folder, whose
        # unmarked tests (launch plans, case tables: no GPU needed) must run everywhere
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce.

    The id is taken without the tests' subfolder ("tests/unit/test_x.py::t" seeds as
    "tests/test_x.py::t"), so that a test draws the same inputs in whichever folder it lives.
    """
    seed = zlib.crc32(re.sub(r"^tests/[^/]+/(?=test_)", "tests/", request.node.nodeid).encode())
    return numpy.random.default_rng(seed)


@pytest.fixture(params=[False, True], ids=["rpb-one-launch", "rpb-two-launch"])
def rpb_reduction(request, monkeypatch):
    """Both reductions of the fused backward's bias-gradient boxes in turn (the mma.sync
    backward's ``RPB_TWO_LAUNCH``, which the Hopper dQ pass's boxes take too): the decision
    caches are cleared on the way in and out, so no Tiling of the other setting outlives the
    test. Yields the setting."""
    from natten_cupy.backends.fused import mma_backward, wgmma_backward

    def clear():
        mma_backward._configure.cache_clear()
        wgmma_backward._configure.cache_clear()

    monkeypatch.setattr(mma_backward, "RPB_TWO_LAUNCH", request.param)
    clear()
    yield request.param
    clear()


@pytest.fixture(params=[1, 4], ids=["box-copies-1", "box-copies-4"])
def box_copies(request, monkeypatch):
    """The mma.sync dQ pass's bias-gradient boxes with one and with four copies per warp
    (``BIAS_BOX_COPIES``), the warm-call plans cleared on the way in and out. Yields the
    setting."""
    from natten_cupy import _fast
    from natten_cupy.backends.fused import mma_backward

    monkeypatch.setattr(mma_backward, "BIAS_BOX_COPIES", request.param)
    _fast.clear()
    yield request.param
    _fast.clear()
