"""Array interop: NumPy, CuPy and any DLPack tensor (PyTorch, JAX) in, the caller's type out.

``place(...)`` inspects the caller's arrays once (which module runs them, the framework, the
GPU; no GPU work, so a backend can be chosen first); ``Inputs.gather(...)`` then turns them
into NumPy arrays (CPU) or CuPy arrays (GPU) without copies, remembers how to hand results
back (a torch tensor for torch inputs, a JAX array for JAX inputs) and which stream to
launch on (PyTorch's current stream for torch inputs). Mixing CPU and GPU arrays, or passing
something that is no array, raises before any GPU work.

The torch layer (``_torch_common``) checks its tensors itself but shares the rest: the array
module of a device (``module_for``), the same-GPU rule (``check_one_gpu``), PyTorch's stream
as a CuPy stream (``torch_stream``) and the launch context (``on_device``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy

from ._args import not_an_array
from ._dtypes import BFLOAT16

__all__ = ["Inputs", "Placement", "place", "array_module", "module_for", "check_one_device",
           "check_one_gpu", "torch_stream", "on_device"]

_DLPACK_CPU, _DLPACK_CUDA, _DLPACK_CUDA_HOST, _DLPACK_CUDA_MANAGED = 1, 2, 3, 13


def _cupy():
    try:
        import cupy
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return cupy


def _family(x):
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (by the array's module)."""
    mod = type(x).__module__.split(".", 1)[0]
    if isinstance(x, numpy.ndarray):
        return "numpy"
    if mod in ("cupy", "torch", "jax", "jaxlib"):
        return "jax" if mod == "jaxlib" else mod
    return "dlpack"


def _device_kind(name, x, family):
    """'cpu' or 'gpu' for one input, TypeError for non-arrays."""
    if family == "numpy":
        return "cpu"
    if family == "cupy":
        return "gpu"
    if not hasattr(x, "__dlpack_device__"):
        raise not_an_array(name, x)
    try:
        dev_type = int(x.__dlpack_device__()[0])
    except (ValueError, TypeError, RuntimeError, BufferError) as e:  # e.g. torch "meta"
        raise TypeError(f"{name} lives on a device DLPack cannot describe ({e}); only CPU "
                        "and CUDA arrays are supported") from None
    if dev_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
        return "cpu"
    if dev_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        return "gpu"
    raise TypeError(f"{name} lives on DLPack device type {dev_type}; only CPU and CUDA "
                    "arrays are supported")


def check_one_device(kinds):
    """``kinds``: {argument name: 'cpu' or 'gpu'}; ValueError naming each if they differ."""
    if len(set(kinds.values())) > 1:
        where = ", ".join(f"{n} on {k.upper()}" for n, k in kinds.items())
        raise ValueError(f"all arrays must be on the same device, got {where}")


def check_one_gpu(device_ids):
    """ValueError naming the GPUs if the arrays' ``device_ids`` are not all one."""
    if len(set(device_ids)) > 1:
        raise ValueError(f"all arrays must be on the same GPU, got devices "
                         f"{sorted(set(device_ids))}")


def module_for(on_gpu):
    """numpy for CPU arrays, cupy for GPU arrays (TypeError where CuPy is not installed)."""
    if not on_gpu:
        return numpy
    cupy = _cupy()
    if cupy is None:
        raise TypeError("GPU arrays were given but CuPy is not installed "
                        "(pip install natten_cupy[cuda13] or [cuda12])")
    return cupy


class Placement(NamedTuple):
    """Where a call's arrays live, as ``place`` found it."""
    xp: object        # numpy or cupy
    family: str       # the caller's framework ("numpy", "cupy", "torch", "jax", "dlpack")
    present: list     # (name, array) pairs of the arrays given (not None)
    device_id: int | None   # their GPU (None on the CPU)


def array_module(named):
    """numpy or cupy: where the arrays of ``named`` (as for ``Inputs.gather``) run (the
    ``xp`` of ``place``)."""
    return place(named).xp


def place(named):
    """The ``Placement`` of ``named`` (list of (argument name, array or None)): checks only,
    no GPU work, so that a call can pick its backend (and refuse) first. Raises what
    ``Inputs.gather`` raises for non-arrays, mixed devices, tensors that require grad and a
    missing CuPy."""
    present = [(n, x) for n, x in named if x is not None]
    for n, x in present:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise not_an_array(n, x)
    families = {n: _family(x) for n, x in present}
    kinds = {n: _device_kind(n, x, families[n]) for n, x in present}
    check_one_device(kinds)
    fams = set(families.values())
    family = fams.pop() if len(fams) == 1 else "mixed"
    for n, x in present:
        if families[n] == "torch" and getattr(x, "requires_grad", False):
            raise TypeError(
                f"{n} requires grad; the array-level calls do not record autograd. Use "
                "natten_cupy.torch (autograd) or pass a detached tensor")
    xp = module_for(bool(kinds) and next(iter(kinds.values())) == "gpu")
    if xp is numpy:
        return Placement(numpy, family, present, None)
    devices = [_device_id(xp, x) for _, x in present]
    check_one_gpu(devices)
    return Placement(xp, family, present, devices[0])


def _device_id(cupy, x):
    """The GPU a CuPy array or a CUDA DLPack tensor lives on."""
    return x.device.id if isinstance(x, cupy.ndarray) else int(x.__dlpack_device__()[1])


class Inputs:
    """The caller's arrays, seen as NumPy or CuPy arrays, and the way back."""

    def __init__(self, xp, family, stream, arrays, device_id):
        self.xp = xp              # numpy or cupy
        self.family = family      # what the caller passed (results come back as that)
        self.stream = stream      # CuPy stream to launch on (None on the CPU)
        self.arrays = arrays
        self.device_id = device_id

    @classmethod
    def gather(cls, named, placement=None):
        """``named``: list of (argument name, array or None). Nones pass through.
        ``placement``: ``place(named)`` where the caller has it already."""
        xp, family, present, device_id = placement or place(named)
        if xp is numpy:
            arrays = [None if x is None else _as_numpy(x) for _, x in named]
            return cls(numpy, family, None, arrays, None)
        from ._env import require_gpu
        require_gpu("CUDA arrays")   # one clear sentence instead of CuPy's driver-version error
        stream = _caller_stream(xp, family, present, device_id)
        with stream:
            arrays = [None if x is None else _as_cupy(xp, x) for _, x in named]
        return cls(xp, family, stream, arrays, device_id)

    def on_device(self):
        """Context in which kernels launch: the arrays' GPU and the caller's stream."""
        return on_device(self.xp, self.device_id, self.stream)

    def give_back(self, x):
        """Hand a NumPy/CuPy result back as the caller's array type (zero-copy)."""
        if x is None:
            return None
        if self.family == "torch":
            import torch
            if isinstance(x, numpy.ndarray) and x.dtype == BFLOAT16:
                # NumPy's DLPack has no bfloat16: hand the bits over as int16.
                return torch.from_dlpack(x.view(numpy.int16)).view(torch.bfloat16)
            return torch.from_dlpack(x)
        if self.family == "jax":
            import jax
            import jax.numpy as jnp
            if isinstance(x, numpy.ndarray) and x.dtype == BFLOAT16:
                # NumPy's DLPack has no bfloat16: hand the bits over as uint16 (same device
                # as any other CPU result), then reinterpret them.
                bits = jnp.from_dlpack(x.view(numpy.uint16))
                return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
            return jnp.from_dlpack(x)
        return x


def _resolve_neg(x):
    """A torch tensor with its lazy negation applied (``x.conj().imag`` and other views carry
    a neg bit that DLPack drops: exporting one as is would hand over the un-negated values).
    Copies only such views."""
    if _family(x) == "torch" and x.is_neg():
        return x.resolve_neg()
    return x


def _as_numpy(x):
    if isinstance(x, numpy.ndarray):
        return x
    x = _resolve_neg(x)
    if _family(x) == "torch" and str(x.dtype) == "torch.bfloat16":
        # NumPy's DLPack import knows no bfloat16: share the bits as int16, view as ml_dtypes'.
        import torch
        return numpy.from_dlpack(x.view(torch.int16)).view(BFLOAT16)
    if _family(x) == "jax" and x.dtype == BFLOAT16:
        # Same gap: a JAX CPU array shares its buffer (ml_dtypes' bfloat16, read-only)
        # through the array protocol instead.
        return numpy.asarray(x)
    return numpy.from_dlpack(x)


def _as_cupy(cupy, x):
    if isinstance(x, cupy.ndarray):
        return x
    return cupy.from_dlpack(_resolve_neg(x))


def _caller_stream(cupy, family, present, device_id):
    """PyTorch's current stream for torch inputs, else CuPy's current stream of the arrays'
    GPU (CuPy keeps one per device: the current device's would not serve arrays elsewhere)."""
    if family == "torch":
        return torch_stream(cupy, present[0][1].device)
    return cupy.cuda.get_current_stream(device_id)


def torch_stream(cupy, device):
    """PyTorch's current stream on ``device`` as a CuPy stream (kernels launched on it run in
    order with the caller's torch work)."""
    import torch
    return cupy.cuda.Stream.from_external(torch.cuda.current_stream(device))


@contextlib.contextmanager
def on_device(xp, device_id, stream):
    """Context in which kernels launch: GPU ``device_id`` current and ``stream`` CuPy's
    current stream (nothing for numpy)."""
    if xp is numpy:
        yield
        return
    with xp.cuda.Device(device_id), stream:
        yield
