"""Launch structs against their NumPy twins, read from the CUDA headers (no compiler).

Every kernel takes its arguments as pointers plus structs passed by value; the launcher packs
each struct as a NumPy structured scalar of the same layout. ``fields(path, name)`` parses a
plain C struct (fields of ``int``, ``i64``/``long long``, ``float``, ``double``, with fixed
array lengths; comments allowed) from a file under ``cuda_src/``; ``mismatch(dtype, path,
name)`` says where a twin differs (names, order, types, lengths, C offsets and size), or
returns ``None``.
"""

from __future__ import annotations

import pathlib
import re

import numpy

__all__ = ["fields", "mismatch", "c_layout"]

CUDA_SRC = pathlib.Path(__file__).resolve().parents[1] / "cuda_src"

_TYPES = {"int": numpy.int32, "unsigned": numpy.uint32, "i64": numpy.int64,
          "long long": numpy.int64, "float": numpy.float32, "double": numpy.float64}


def fields(path, name):
    """(field, numpy type, length) of C struct ``name`` in ``cuda_src/path``, in order."""
    text = (CUDA_SRC / path).read_text()
    m = re.search(r"struct " + name + r"\s*\{(.*?)\};", text, re.S)
    if m is None:
        raise LookupError(f"no struct {name} in cuda_src/{path}")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    out = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        t = re.match(r"(?:const )?(long long|unsigned|int|i64|float|double) (.+)", decl)
        if t is None:
            raise ValueError(f"struct {name}: cannot read the declaration {decl!r}")
        for item in t.group(2).split(","):
            f = re.fullmatch(r"\s*(\w+)(?:\[(\d+)\])?\s*", item)
            if f is None:
                raise ValueError(f"struct {name}: cannot read the field {item!r}")
            out.append((f.group(1), _TYPES[t.group(1)], int(f.group(2) or 1)))
    return out


def c_layout(fs):
    """(offsets, size) of fields ``fs`` under the C rules (each field at its type's
    alignment, the size rounded up to the largest one)."""
    pos, offsets, align = 0, [], 1
    for _, t, _n in fs:
        a = numpy.dtype(t).itemsize
        pos = -(-pos // a) * a
        offsets.append(pos)
        pos += a * _n
        align = max(align, a)
    return offsets, -(-pos // align) * align


def mismatch(dtype, path, name):
    """Where NumPy ``dtype`` differs from C struct ``name`` of ``cuda_src/path``, or None."""
    fs = fields(path, name)
    if list(dtype.names) != [f for f, _, _ in fs]:
        return f"fields {list(dtype.names)} != C {[f for f, _, _ in fs]}"
    offsets, size = c_layout(fs)
    for (f, t, n), off in zip(fs, offsets):
        sub, at = dtype.fields[f][:2]
        if sub.base != numpy.dtype(t) or (sub.shape or (1,)) != (n,):
            return f"{f}: {sub} != C {numpy.dtype(t)}[{n}]"
        if at != off:
            return f"{f}: offset {at} != C {off}"
    if dtype.itemsize != size:
        return f"size {dtype.itemsize} != C {size}"
    return None
