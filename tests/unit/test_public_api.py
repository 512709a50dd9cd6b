"""The public functions as Python sees them: names, signatures, docstrings (help() works)."""

import inspect

import pytest

import natten_cupy

NAMES = [f"na{n}d{suffix}" for n in (1, 2, 3)
         for suffix in ("", "_backward", "_qk", "_av", "_qk_backward", "_av_backward")]


@pytest.mark.parametrize("name", NAMES)
def test_array_api_signature_drops_rank(name):
    fn = getattr(natten_cupy, name)
    params = list(inspect.signature(fn).parameters)
    assert "rank" not in params
    assert params[0] in ("q", "d_out", "d_attn", "attn")
    assert fn.__name__ == name and fn.__doc__


def test_torch_api_signature_drops_rank():
    nt = pytest.importorskip("natten_cupy.torch")
    for name in ("na2d", "na2d_qk", "na2d_av"):
        params = list(inspect.signature(getattr(nt, name)).parameters)
        assert params[0] in ("query", "q", "attn") and "rank" not in params


@pytest.mark.parametrize("name", NAMES)
def test_array_api_docstring_names_every_keyword(name):
    fn = getattr(natten_cupy, name)
    params = inspect.signature(fn).parameters.values()
    missing = [p.name for p in params
               if p.kind == p.KEYWORD_ONLY and p.name not in fn.__doc__]
    assert not missing, f"{name}'s docstring does not mention {missing}"


@pytest.mark.parametrize("name", ["na2d", "na2d_qk", "na2d_av"])
def test_torch_docstring_names_every_keyword(name):
    nt = pytest.importorskip("natten_cupy.torch")
    fn = getattr(nt, name)
    params = inspect.signature(fn).parameters.values()
    missing = [p.name for p in params
               if p.kind == p.KEYWORD_ONLY and p.name not in fn.__doc__]
    assert not missing, f"torch {name}'s docstring does not mention {missing}"


def test_torch_fused_calls_take_nattens_convention():
    """NATTEN's argument names and order (stride, dilation, is_causal, scale positional)."""
    nt = pytest.importorskip("natten_cupy.torch")
    for n in (1, 2, 3):
        params = list(inspect.signature(getattr(nt, f"na{n}d")).parameters)
        assert params[:10] == ["query", "key", "value", "kernel_size", "stride", "dilation",
                               "is_causal", "scale", "additional_keys", "additional_values"]
        assert "return_lse" in params and "backend" in params
