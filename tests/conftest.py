"""Shared test fixtures: GPU detection (without touching CUDA on machines that lack it)."""

import glob
import os

import numpy
import pytest


def _gpu_reason():
    """None when a CUDA GPU is usable through CuPy, else why not."""
    if os.environ.get("NATTEN_CUPY_NO_GPU"):
        return "NATTEN_CUPY_NO_GPU is set"
    # Asking a driverless machine for devices can hang: look for device nodes first.
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "no NVIDIA GPU on this machine (no /dev/nvidia*)"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as e:  # ImportError, CUDARuntimeError, driver errors
        return f"CuPy cannot use a GPU: {type(e).__name__}: {e}"
    return None


GPU_REASON = _gpu_reason()


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
    seed = abs(hash(request.node.nodeid)) % (2 ** 32)
    return numpy.random.default_rng(seed)
