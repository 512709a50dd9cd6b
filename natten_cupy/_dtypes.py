"""Element types the library knows, their names and their CUDA C++ spellings."""

from __future__ import annotations

import numpy

try:  # bfloat16 for NumPy (and CuPy, which reuses NumPy's dtype objects)
    import ml_dtypes
    BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

FLOAT64 = numpy.dtype(numpy.float64)
FLOAT32 = numpy.dtype(numpy.float32)
FLOAT16 = numpy.dtype(numpy.float16)

DTYPE_NAMES = {FLOAT64: "float64", FLOAT32: "float32", FLOAT16: "float16"}
C_TYPES = {FLOAT64: "double", FLOAT32: "float", FLOAT16: "__half"}
if BFLOAT16 is not None:
    DTYPE_NAMES[BFLOAT16] = "bfloat16"
    C_TYPES[BFLOAT16] = "__nv_bfloat16"

HALF_TYPES = tuple(d for d in (FLOAT16, BFLOAT16) if d is not None)


def canonical_dtype(dtype):
    """The numpy dtype of a NumPy/CuPy/torch dtype, or TypeError if it is not supported."""
    try:
        d = numpy.dtype(dtype)
    except TypeError:
        d = _from_foreign(dtype)
    if d not in DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {dtype}")
    return d


def _from_foreign(dtype):
    name = str(dtype).rsplit(".", 1)[-1]  # torch.float16 -> float16
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    if name in by_name:
        return by_name[name]
    raise TypeError(f"unsupported dtype {dtype}")


def accumulator_dtype(dtype):
    """float64 for float64 inputs, float32 for everything else (also lse's dtype)."""
    return FLOAT64 if canonical_dtype(dtype) == FLOAT64 else FLOAT32


def c_type(dtype):
    return C_TYPES[canonical_dtype(dtype)]
