"""The fast path's parts that need no GPU: argument packing of prepared launches and the
call signatures (runs in CI; the GPU behaviour is in test_gpu_fast.py)."""

import ctypes

import numpy
import pytest

from natten_cupy import _fast, _launch
from natten_cupy._launch import KernelCall, Operand, Plan
from natten_cupy._operands import Layout, rows_ready
from natten_cupy._params import PARAMS_DTYPE

cupy = pytest.importorskip("cupy")


class _FakeKernel:
    name = "fake"

    class kernel:  # noqa: N801 - mimics RawKernel.kernel.ptr
        ptr = 0xDEAD

    max_dynamic_shared_size_bytes = 0


def _launched(monkeypatch):
    calls = []

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        calls.append(dict(f=f, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem,
                          stream=stream, params=params, extra=extra))
    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", fake_launch)
    return calls


def _arg(params, i, size):
    """Bytes of kernel argument ``i`` as the driver would read them."""
    ptr = ctypes.c_uint64.from_address(params + 8 * i).value
    return ctypes.string_at(ptr, size)


def test_kernel_call_packs_every_argument(monkeypatch):
    calls = _launched(monkeypatch)
    struct_arg = numpy.zeros((), dtype=PARAMS_DTYPE)
    struct_arg["batch"] = 7
    struct_arg["scale"] = 0.25
    struct_arg = struct_arg[()]
    args = (Operand(2), numpy.int32(-5), Operand(0), struct_arg, numpy.float32(1.5),
            Operand(1), numpy.int64(1 << 40))
    call = KernelCall(_FakeKernel(), (3, 2, 1), (128, 1, 1), args, shared_mem=96 * 1024)
    call.prepare()
    assert call.fn.max_dynamic_shared_size_bytes == 96 * 1024
    call([0x1000, 0x2000, 0x3000], stream=42)
    call([0x1111, 0x2222, 0x3333], stream=43)
    assert len(calls) == 2
    c = calls[1]
    assert (c["f"], c["grid"], c["block"], c["smem"], c["stream"], c["extra"]) == (
        0xDEAD, (3, 2, 1), (128, 1, 1), 96 * 1024, 43, 0)
    p = c["params"]
    assert _arg(p, 0, 8) == (0x3333).to_bytes(8, "little")
    assert _arg(p, 1, 4) == numpy.int32(-5).tobytes()
    assert _arg(p, 2, 8) == (0x1111).to_bytes(8, "little")
    assert _arg(p, 3, PARAMS_DTYPE.itemsize) == struct_arg.tobytes()
    assert _arg(p, 4, 4) == numpy.float32(1.5).tobytes()
    assert _arg(p, 5, 8) == (0x2222).to_bytes(8, "little")
    assert _arg(p, 6, 8) == numpy.int64(1 << 40).tobytes()
    for i in range(7):  # every argument sits at an 8-byte aligned address
        assert ctypes.c_uint64.from_address(p + 8 * i).value % 8 == 0


def test_kernel_call_refuses_python_ints():
    with pytest.raises(TypeError, match="numpy.int32"):
        KernelCall(_FakeKernel(), (1, 1, 1), (32, 1, 1), (Operand(0), 3))


def test_empty_grid_launches_nothing(monkeypatch):
    calls = _launched(monkeypatch)
    plan = Plan((KernelCall(_FakeKernel(), (0, 1, 1), (32, 1, 1), (Operand(0),)),))
    _launch.run_plan(plan.prepare(), [0x10], 0)
    assert calls == []


def test_option_types_are_part_of_the_signature():
    assert _fast._opt(True) != _fast._opt(1)
    assert _fast._opt((True, False)) != _fast._opt((1, 0))
    assert _fast._opt([3, 3]) != _fast._opt((3, 3))
    assert _fast._opt(None) == _fast._opt(None)
    key = _fast._options_key
    assert key((7, True, None)) != key((7, 1, None))
    assert key((7, (True, False))) != key((7, (1, 0)))
    assert key((7, [3, 3])) != key((7, (3, 3)))
    assert key((7, (3, 3), "auto")) == key((7, (3, 3), "auto"))


def test_numpy_and_unhashable_options_take_the_general_path():
    q = numpy.zeros((1, 8, 1, 8), numpy.float32)
    assert _fast._signature("fwd", 1, (q, q, q), (3,)) == (None, None)
    assert _fast.fused_forward(1, q, q, q, 3, 1, 1, False, None, "auto", False, False, False,
                               None) is None


def test_layout_readiness():
    ok = Layout.contiguous((2, 5, 3, 32), numpy.float16)
    assert rows_ready(ok)
    assert not rows_ready(Layout(ok.shape, ok.strides, ok.dtype, aligned=False))
    odd_row = Layout.contiguous((2, 5, 3, 12), numpy.float16)   # 24-byte rows
    assert not rows_ready(odd_row)
    strided_last = Layout((2, 5, 3, 32), (2 * 5 * 3 * 64, 3 * 64, 64, 4), numpy.dtype("f2"))
    assert not rows_ready(strided_last)
    unit = Layout((1, 5, 1, 32), (7, 64 * 3, 2, 2), numpy.dtype("f2"))  # extent-1 axes: any
    assert rows_ready(unit)
    assert ok.unsqueezed(2).shape == (2, 1, 1, 5, 3, 32)
    assert ok.unsqueezed(2).strides[1:3] == (0, 0)


def test_run_plan_on_passes_null_for_absent_operands(monkeypatch):
    """An optional operand given as None (qk without rpb) reaches the kernel as a null pointer."""
    calls = _launched(monkeypatch)

    class _Arr:
        class data:  # noqa: N801
            ptr = 0x4000

    monkeypatch.setattr(cupy.cuda, "get_current_stream",
                        lambda: type("S", (), {"ptr": 7})())
    plan = Plan((KernelCall(_FakeKernel(), (1, 1, 1), (32, 1, 1), (Operand(0), Operand(1))),))
    _launch.run_plan_on(plan, [_Arr(), None])
    assert _arg(calls[0]["params"], 0, 8) == (0x4000).to_bytes(8, "little")
    assert _arg(calls[0]["params"], 1, 8) == bytes(8)
