"""Is there a CUDA GPU that CuPy can use? Asked without touching CUDA on machines that lack one."""

from __future__ import annotations

import functools
import glob
import os

__all__ = ["gpu_unavailable_reason", "gpu_available"]


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason():
    """None when CuPy can use a CUDA GPU, else a sentence saying why not.

    A machine without an NVIDIA driver can hang on some CUDA calls instead of failing, so the
    device nodes are looked for before CUDA is asked anything.
    """
    if os.environ.get("NATTEN_CUPY_NO_GPU"):
        return "NATTEN_CUPY_NO_GPU is set"
    if not glob.glob("/dev/nvidia[0-9]*"):
        return "no NVIDIA GPU on this machine (no /dev/nvidia*)"
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as e:  # ImportError, CUDARuntimeError, driver errors
        return f"CuPy cannot use a GPU: {type(e).__name__}: {e}"
    return None


def gpu_available():
    return gpu_unavailable_reason() is None
