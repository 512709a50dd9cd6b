"""NAParams packing: per-tensor element strides over (batch, axis0..2, head, last)."""

import numpy

from natten_cupy import _args
from natten_cupy._params import PARAMS_DTYPE, make_params


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


def test_scale_travels_as_float32_and_float64():
    """Float kernels read the float32 rounding of the scale, float64 kernels the caller's
    float64: 24 ** -0.5 is not a float32, so the two fields differ."""
    q = numpy.zeros((1, 9, 2, 24), dtype=numpy.float64)
    p = _args.check_fused(1, q, q, q, 3, 1, 1, False, None, "auto")
    params = make_params(p, q=q)
    assert p.scale == 24 ** -0.5
    assert params["scale_f64"].dtype == numpy.float64 and params["scale_f64"] == p.scale
    assert params["scale"].dtype == numpy.float32 and params["scale"] == numpy.float32(p.scale)
    assert float(params["scale"]) != p.scale
    given = make_params(_args.check_fused(1, q, q, q, 3, 1, 1, False, 0.1, "auto"))
    assert given["scale_f64"] == 0.1 and float(given["scale"]) != 0.1


def test_layout_of_the_scale_fields():
    """The float64 scale follows the float32 pair, 8-byte aligned, and the additional
    tokens' fields come after it (C layout of NAParams)."""
    fields = PARAMS_DTYPE.fields
    names = PARAMS_DTYPE.names
    at = names.index("scale")
    assert names[at:at + 3] == ("scale", "pad_", "scale_f64")
    assert names[at + 3:] == ("extra_tokens", "extra_heads", "heads_per_extra", "xk", "xv",
                              "dxk", "dxv")
    assert fields["pad_"][1] == fields["scale"][1] + 4
    assert fields["scale_f64"][1] == fields["pad_"][1] + 4
    assert fields["scale_f64"][1] % 8 == 0
    assert fields["extra_tokens"][1] == fields["scale_f64"][1] + 8
    assert PARAMS_DTYPE.itemsize == fields["dxv"][1] + 48
    assert PARAMS_DTYPE.alignment == 8


def test_params_of_additional_tokens():
    """[B, T, H_x, D] strides land as (batch, token, 0, 0, head, last); counts as given."""
    q = numpy.zeros((2, 9, 4, 8), dtype=numpy.float32)
    xk = numpy.zeros((2, 5, 2, 8), dtype=numpy.float32)[:, :, :, :]
    xv = numpy.zeros((2, 2, 5, 8), dtype=numpy.float32).transpose(0, 2, 1, 3)
    p = _args.check_fused(1, q, q, q, 3, 1, 1, False, None, "auto", additional_keys=xk,
                          additional_values=xv)
    assert (p.extra_tokens, p.extra_heads, p.heads_per_extra) == (5, 2, 2)
    params = make_params(p, q=q, xk=xk, xv=xv)
    assert list(params["xk"]) == [80, 16, 0, 0, 8, 1]
    assert list(params["xv"]) == [80, 8, 0, 0, 40, 1]
    assert (params["extra_tokens"], params["extra_heads"], params["heads_per_extra"]) == (5, 2, 2)
