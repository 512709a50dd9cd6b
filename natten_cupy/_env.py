"""What this install can use: package versions, NVRTC, CUDA headers, the GPU, and a clear error
when CUDA arrays are asked for and no GPU is visible.

Nothing here creates a CUDA context or touches the driver on a machine without an NVIDIA
device node (some driver calls hang there instead of failing): the GPU questions go through
``_device.gpu_unavailable_reason``, which looks for ``/dev/nvidia*`` first.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

from ._device import gpu_unavailable_reason

__all__ = ["NoGPUError", "require_gpu", "no_gpu_message", "cupy_packages", "cupy_problem",
           "nvrtc_version", "nvrtc_unavailable_reason", "environment", "is_no_gpu_error"]


class NoGPUError(RuntimeError):
    """CUDA arrays or kernels were asked for and no usable GPU is visible."""


_HINT = ("Without a GPU, pass NumPy arrays (the reference backend runs them on the CPU); "
         "`python -m natten_cupy demo --check` shows what this install can use.")


def no_gpu_message(what="this", reason=None, hint=_HINT):
    """One sentence: ``what`` needs a CUDA GPU, none is visible, why, and what to do instead."""
    reason = reason or gpu_unavailable_reason() or "no GPU"
    return f"{what} needs a CUDA GPU, and none is visible here ({reason}). {hint}"


def require_gpu(what="this", hint=_HINT):
    """Raise NoGPUError (one clear sentence) unless CuPy can use a CUDA GPU.

    Call it before the first CuPy call that needs a device (array creation, DLPack import,
    a kernel launch): on a machine without a GPU, CuPy itself reports the misleading
    "CUDA driver version is insufficient for CUDA runtime version".
    """
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise NoGPUError(no_gpu_message(what, reason, hint))


def is_no_gpu_error(exc):
    """True for the errors CuPy (cuRAND, cuBLAS, the runtime) raises when no GPU is usable."""
    if isinstance(exc, NoGPUError):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return gpu_unavailable_reason() is not None and any(
        s in text for s in ("InsufficientDriver", "NoDevice", "CURAND", "CUBLAS",
                            "no CUDA-capable device", "driver version is insufficient"))


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cupy_packages():
    """Installed CuPy distributions, e.g. ['cupy-cuda13x 14.2.0'] (more than one is a problem)."""
    found = []
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            found.append(f"{name} {dist.version}")
    return sorted(set(found))


def cupy_problem():
    """None, or a sentence when the CuPy install cannot work (none, or several builds)."""
    pkgs = cupy_packages()
    if not pkgs:
        return ("CuPy is not installed: pip install 'natten_cupy[cuda13]' (CUDA 13 driver) or "
                "'natten_cupy[cuda12]' (CUDA 12 driver)")
    if len(pkgs) > 1:
        return (f"several CuPy builds are installed ({', '.join(pkgs)}); keep the one that "
                "matches the driver (pip uninstall the others)")
    return None


def nvrtc_version():
    """(major, minor) of the NVRTC that CuPy loads, or None with no CuPy or no NVRTC."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        return tuple(nvrtc.getVersion())
    except Exception:
        return None


def nvrtc_unavailable_reason():
    """None when kernels can be compiled here without a GPU (NVRTC and CUDA headers), else why."""
    problem = cupy_problem()
    if problem and not cupy_packages():
        return problem
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:
        return (f"CuPy cannot load NVRTC ({type(e).__name__}: {e}); the cuda12/cuda13 extras "
                "install it from pip")
    from ._compile import cuda_include_dirs
    if not cuda_include_dirs():
        return "no CUDA headers (cuda_fp16.h) found: pip install nvidia-cuda-runtime"
    return None


def _torch_line():
    try:
        import torch
    except Exception as e:  # ImportError or a broken install
        return "not installed" if isinstance(e, ImportError) else f"broken: {e}"
    cuda = getattr(torch.version, "cuda", None)
    return f"{torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU build'})"


def environment():
    """[(item, value)]: what a bug report needs. Asks the GPU only where a device node exists."""
    from . import __version__
    rows = [("natten_cupy", __version__),
            ("python", f"{platform.python_version()} ({sys.platform}, {platform.machine()})"),
            ("numpy", _version("numpy") or "not installed")]
    pkgs = cupy_packages()
    rows.append(("cupy", ", ".join(pkgs) if pkgs else "not installed"))
    rows.append(("torch", _torch_line()))
    ver = nvrtc_version()
    pip_nvrtc = [f"{d} {v}" for d in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12")
                 for v in [_version(d)] if v]
    rows.append(("NVRTC", (f"{ver[0]}.{ver[1]}" if ver else "not loadable")
                 + (f" (pip: {', '.join(pip_nvrtc)})" if pip_nvrtc else "")))
    try:
        from ._compile import cuda_include_dirs
        inc = cuda_include_dirs()
    except Exception:
        inc = []
    rows.append(("CUDA headers", str(inc[0]) if inc else "none found"))
    reason = gpu_unavailable_reason()
    if reason is None:
        import cupy
        drv = cupy.cuda.runtime.driverGetVersion()
        rows.append(("driver", f"CUDA {drv // 1000}.{drv % 1000 // 10}"))
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        rows.append(("GPU", f"{props['name'].decode()} (sm_{props['major']}{props['minor']})"))
    else:
        rows.append(("driver", "not asked (no GPU)"))
        rows.append(("GPU", f"none: {reason}"))
    problem = cupy_problem()
    if problem and pkgs:
        rows.append(("problem", problem))
    return rows
