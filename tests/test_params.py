"""NAParams packing: per-tensor element strides over (batch, axis0..2, head, last)."""

import numpy

from natten_cupy import _args
from natten_cupy._params import make_params


def test_strides_of_full_lse_and_rpb_tensors():
    q = numpy.zeros((2, 5, 7, 3, 4), dtype=numpy.float32)
    p = _args.check_qk(2, q, q, 3, 1, False, None, "auto")
    lse = numpy.zeros((2, 5, 7, 3), dtype=numpy.float32)
    rpb = numpy.zeros((3, 5, 5), dtype=numpy.float32).transpose(0, 2, 1)
    params = make_params(p, q=q, lse=lse, rpb=rpb, k=None)
    assert list(params["q"]) == [420, 84, 12, 0, 4, 1]
    assert list(params["lse"]) == [105, 21, 3, 0, 1, 0]
    assert list(params["rpb"]) == [25, 1, 5, 0, 0, 0]
    assert list(params["k"]) == [0] * 6
    assert list(params["extent"]) == [5, 7, 1] and list(params["kernel"]) == [3, 3, 1]
