"""Tensor maps for the Hopper kernels' TMA loads (``cuda_src/natten/hopper/tma.cuh``).

A tensor map is the driver's 128-byte description of one operand for the Tensor Memory
Accelerator: its dimensions, byte strides, the box one load copies, the element step per
dimension and the shared-memory swizzle. A plan encodes one per TMA operand with the driver's
``cuTensorMapEncodeTiled`` (through cuda-python's ``cuda.bindings``: CuPy has no binding for
it) at a placeholder address; the kernel takes it by value, and each launch puts the call's
data pointer in it with ``cuTensorMapReplaceAddress`` (``TensorMap`` below, filled by
``natten_cupy._launch.KernelCall``).

The operands are ``[batch, *spatial, heads, head_dim]`` arrays. Map dimensions, innermost
first (``tma.cuh``'s ``tma_tile`` reads them so):

* rank 1: (head dim, heads, axis 0, batch);
* rank 2: (head dim, heads, axis 1, axis 0, batch);
* rank 3: (heads * head dim, axis 2, axis 1, axis 0, batch): five dimensions at most, so a
  3-D operand's heads and columns are one dimension, which needs each head's columns right
  after the previous head's and the head dim equal to the kernel's column count (else a box's
  columns would run into the next head).

Boxes are 64 columns (128 bytes, the swizzle's width) by the tile's rows along each spatial
axis; a dilated axis steps by its dilation (the map's element stride, at most 8, the box then
spans rows x dilation elements, at most 256; rank-1 tiles load as boxes of 64 rows). Elements
outside the tensor land as zeros.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

__all__ = ["unavailable_reason", "operand_map", "TensorMap", "maps_of", "MAP_BYTES"]

MAP_BYTES = 128
MAP_ALIGN = 64
_PLACEHOLDER = 1 << 20   # a 16-byte aligned address to encode with; every launch replaces it
_MAX_BOX, _MAX_STEP, _MAX_STRIDE, _MAX_DIM = 256, 8, 1 << 40, 1 << 32


@functools.lru_cache(maxsize=None)
def _driver():
    from cuda.bindings import driver
    return driver


@functools.lru_cache(maxsize=None)
def unavailable_reason():
    """Why tensor maps cannot be made here (None: they can): cuda-python's driver bindings
    missing or without the two calls, or no CUDA driver to call."""
    try:
        d = _driver()
    except Exception as e:  # not installed, or a build for another CUDA
        return f"cuda-python's driver bindings are not importable ({type(e).__name__}: {e})"
    for name in ("cuTensorMapEncodeTiled", "cuTensorMapReplaceAddress"):
        if not hasattr(d, name):
            return f"cuda.bindings.driver has no {name}"
    try:   # the calls go through the driver library, which a machine without a GPU lacks
        d.cuDriverGetVersion()
    except Exception as e:
        return f"the CUDA driver library cannot be loaded ({type(e).__name__})"
    return None


def operand_map(layout, rank, rows, dilation, columns):
    """(dims, byte strides of dims 1.., box, element steps) of the map of one operand
    (``natten_cupy._operands.Layout`` of a ``[B, *spatial, H, D]`` array) whose tiles are
    ``rows`` (per spatial axis, in-group) by ``columns`` (the kernel's head-dim bucket), or
    the reason it has none."""
    shape, strides, item = layout.shape, layout.strides, layout.dtype.itemsize
    if not layout.aligned:
        return "the array's first element is not 16-byte aligned"
    batch, spatial, heads, hd = shape[0], shape[1:1 + rank], shape[1 + rank], shape[-1]
    sb, ss, sh, sd = strides[0], strides[1:1 + rank], strides[1 + rank], strides[-1]
    if hd > 1 and sd != item:
        return "the head dim is not contiguous"
    # (extent, byte stride, box, step) per dimension, innermost first
    dims = [(hd, item, 64, 1)]
    if rank < 3:
        dims.append((heads, sh, 1, 1))
    else:
        if hd != columns or (heads > 1 and sh != hd * item):
            return ("a 3-D map takes heads and columns as one dimension: head dim "
                    f"{hd} (kernel columns {columns}), head stride {sh} bytes")
        dims[0] = (heads * hd, item, 64, 1)
    for a in reversed(range(rank)):
        dims.append((spatial[a], ss[a], rows[a] * dilation[a], dilation[a]))
    dims.append((batch, sb, 1, 1))
    out = []
    for i, (n, s, box, step) in enumerate(dims):
        if n == 1:
            s = 16   # one coordinate (0) only: any valid stride
        if i and not (0 < s < _MAX_STRIDE and s % 16 == 0):
            return f"dimension {i} has byte stride {s} (TMA takes multiples of 16, positive)"
        if not (0 < n <= _MAX_DIM and box <= _MAX_BOX and step <= _MAX_STEP):
            return f"dimension {i}: extent {n}, box {box}, step {step} out of TMA's range"
        out.append((n, s, box, step))
    return (tuple(n for n, _, _, _ in out), tuple(s for _, s, _, _ in out[1:]),
            tuple(b for _, _, b, _ in out), tuple(t for _, _, _, t in out))


_DATA_TYPE = {"float16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16",
              "bfloat16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}


@functools.lru_cache(maxsize=1024)
def _encode(dtype_name, dims, strides, box, steps):
    d = _driver()
    err, tmap = d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, _DATA_TYPE[dtype_name]), len(dims), _PLACEHOLDER,
        [d.cuuint64_t(n) for n in dims], [d.cuuint64_t(n) for n in strides],
        [d.cuuint32_t(n) for n in box], [d.cuuint32_t(n) for n in steps],
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != d.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled refused dims {dims}, byte strides {strides}, "
                         f"box {box}, steps {steps}: {err}")
    return ctypes.string_at(tmap.getPtr(), MAP_BYTES)


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """A kernel argument: the tensor map ``data`` (encoded at a placeholder address) of the
    call's ``index``-th array, whose data pointer each launch writes into it."""
    index: int
    data: bytes

    @classmethod
    def of(cls, index, layout, rank, rows, dilation, columns):
        """The map of operand ``index`` (``operand_map``'s arguments), or the reason there is
        none (the operand's layout, or no way to encode maps here)."""
        spec = operand_map(layout, rank, rows, dilation, columns)
        if isinstance(spec, str):
            return spec
        why = unavailable_reason()
        if why:
            return why
        return cls(index, _encode(layout.dtype.name, *spec))


def maps_of(operands, rank, rows, dilation, columns):
    """The maps of ``operands`` ((plan index, name, Layout) each; ``TensorMap.of``'s other
    arguments shared), or "name: reason" for the first one that has none."""
    maps = []
    for index, name, layout in operands:
        m = TensorMap.of(index, layout, rank, rows, dilation, columns)
        if isinstance(m, str):
            return f"{name}: {m}"
        maps.append(m)
    return tuple(maps)


class AddressSlot:
    """A tensor map inside a launch's argument buffer (at ``address``, 64-byte aligned), with
    the pointer it holds; ``set(ptr)`` replaces it where it changed."""

    __slots__ = ("view", "ptr", "replace", "ok")

    def __init__(self, address):
        d = _driver()
        self.view = d.CUtensorMap(_ptr=address)
        self.ptr = None
        self.replace = d.cuTensorMapReplaceAddress
        self.ok = d.CUresult.CUDA_SUCCESS

    def set(self, ptr):
        if ptr != self.ptr:
            got = self.replace(self.view, ptr)
            err = got[0] if isinstance(got, tuple) else got
            if err != self.ok:
                raise RuntimeError(f"cuTensorMapReplaceAddress({ptr:#x}) failed: {err}")
            self.ptr = ptr
