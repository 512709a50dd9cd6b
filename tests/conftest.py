"""Shared test fixtures: GPU detection (without touching CUDA on machines that lack it)."""

import zlib

import numpy
import pytest

from natten_cupy._device import gpu_unavailable_reason


GPU_REASON = gpu_unavailable_reason()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU through CuPy (skipped otherwise)")


def pytest_collection_modifyitems(config, items):
    if GPU_REASON is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {GPU_REASON}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return numpy.random.default_rng(seed)
