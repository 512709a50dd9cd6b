"""Tensor maps of the Hopper kernels' TMA loads without a GPU: the dimensions, strides,
boxes and element steps ``natten_cupy._tma.operand_map`` gives each rank, the operands it
refuses (with the reason), and a launch's argument buffer holding a map (64-byte aligned, its
address set per call), the forward's and the rank-1 backward's plans with maps and their
refusals. The maps' effect on the kernels is tested on the GPU (tests/gpu/test_gpu_hopper.py,
tests/gpu/test_gpu_hopper_bwd.py)."""

import ctypes

import numpy
import pytest

from natten_cupy import _launch, _tma
from natten_cupy._dtypes import BFLOAT16
from natten_cupy._launch import KernelCall, Operand
from natten_cupy._operands import Layout

F16 = numpy.dtype(numpy.float16)


def _layout(shape, dtype=F16, order=None):
    """Layout of a [B, *spatial, H, D] array stored in axis order ``order`` (outermost
    first; default: as it is)."""
    lay = Layout.contiguous(shape, dtype)
    if order is None:
        return lay
    stored = Layout.contiguous([shape[i] for i in order], dtype)
    strides = [0] * len(shape)
    for pos, axis in enumerate(order):
        strides[axis] = stored.strides[pos]
    return Layout(tuple(shape), tuple(strides), lay.dtype, True)


def test_rank1_map():
    dims, strides, box, steps = _tma.operand_map(_layout((3, 1000, 4, 64)), 1, (64,), (2,), 64)
    assert dims == (64, 4, 1000, 3)
    assert strides == (128, 4 * 128, 1000 * 4 * 128)
    assert box == (64, 1, 128, 1) and steps == (1, 1, 2, 1)


def test_rank2_map_with_padded_head_dim():
    # head dim 40 in the 64-column kernel: the box's columns past 40 lie outside the tensor
    dims, strides, box, steps = _tma.operand_map(_layout((2, 30, 29, 3, 40), BFLOAT16), 2,
                                                 (8, 16), (1, 3), 64)
    assert dims == (40, 3, 29, 30, 2)
    assert strides == (80, 240, 240 * 29, 240 * 29 * 30)
    assert box == (64, 1, 48, 8, 1) and steps == (1, 1, 3, 1, 1)


def test_rank3_map_merges_heads_and_columns():
    dims, strides, box, steps = _tma.operand_map(_layout((2, 6, 10, 11, 4, 128)), 3, (2, 8, 8),
                                                 (1, 2, 1), 128)
    assert dims == (4 * 128, 11, 10, 6, 2)
    assert strides == (4 * 256, 11 * 4 * 256, 10 * 11 * 4 * 256, 6 * 10 * 11 * 4 * 256)
    assert box == (64, 8, 16, 2, 1) and steps == (1, 1, 2, 1, 1)


def test_unit_axes_take_a_valid_stride():
    # one head and batch one: their strides are never stepped (coordinate 0), any valid one
    lay = _layout((1, 50, 1, 64))
    lay = Layout(lay.shape, (7, lay.strides[1], 3, 2), lay.dtype, True)
    dims, strides, _, _ = _tma.operand_map(lay, 1, (64,), (1,), 64)
    assert dims == (64, 1, 50, 1) and strides == (16, 128, 16)


def test_heads_first_layout_maps_at_rank_1_and_2():
    lay = _layout((2, 21, 18, 3, 64), order=(0, 3, 1, 2, 4))   # stored [B, H, X, Y, D]
    dims, strides, _, _ = _tma.operand_map(lay, 2, (8, 16), (1, 1), 64)
    assert dims == (64, 3, 18, 21, 2)
    assert strides == (21 * 18 * 128, 128, 18 * 128, 3 * 21 * 18 * 128)


@pytest.mark.parametrize("lay, rank, rows, dil, cols, why", [
    (_layout((2, 6, 10, 11, 4, 96)), 3, (2, 8, 8), (1, 1, 1), 128, "heads and columns"),
    (_layout((2, 6, 10, 11, 4, 64), order=(0, 4, 1, 2, 3, 5)), 3, (2, 8, 8), (1, 1, 1), 64,
     "head stride"),
    (_layout((2, 1000, 2, 64)), 1, (64,), (5,), 64, "box 320"),
    (_layout((2, 40, 40, 2, 64)), 2, (8, 16), (9, 1), 64, "step 9"),
    (Layout((2, 100, 2, 64), (100 * 2 * 128, -256, 128, 2), F16, True), 1, (64,), (1,), 64,
     "stride -256"),
    (Layout((2, 100, 2, 64), (100 * 2 * 136, 272, 136, 2), F16, True), 1, (64,), (1,), 64,
     "stride 136"),
    (Layout((2, 100, 2, 64), (25600, 256, 128, 2), F16, False), 1, (64,), (1,), 64,
     "16-byte aligned"),
])
def test_refusals_name_the_reason(lay, rank, rows, dil, cols, why):
    got = _tma.operand_map(lay, rank, rows, dil, cols)
    assert isinstance(got, str) and why in got, got


def test_kernel_call_holds_a_map_and_sets_its_address(monkeypatch):
    cupy = pytest.importorskip("cupy")
    calls, slots = [], []

    class FakeSlot:   # what cuTensorMapReplaceAddress would do: write the pointer in place
        def __init__(self, address):
            self.address, self.ptr = address, None
            slots.append(self)

        def set(self, ptr):
            self.ptr = ptr
            ctypes.c_uint64.from_address(self.address).value = ptr

    class FakeKernel:
        name = "fake"
        max_dynamic_shared_size_bytes = 0

        class kernel:  # noqa: N801
            ptr = 0xBEEF

    monkeypatch.setattr(_tma, "AddressSlot", FakeSlot)
    monkeypatch.setattr(cupy.cuda.driver, "launchKernel",
                        lambda *a: calls.append(a[-2]))   # the argument table
    data = bytes(range(128))
    args = (Operand(0), numpy.int32(3), _tma.TensorMap(1, data), _tma.TensorMap(0, data[::-1]))
    call = KernelCall(FakeKernel(), (1, 1, 1), (32, 1, 1), args).prepare()
    call([0x1000, 0x2000], 0)
    call([0x3000, 0x4000], 0)
    table = calls[-1]
    at = [ctypes.c_uint64.from_address(table + 8 * i).value for i in range(4)]
    assert at[2] % 64 == 0 and at[3] % 64 == 0
    assert ctypes.c_uint64.from_address(at[0]).value == 0x3000
    assert ctypes.string_at(at[2], 128) == (0x4000).to_bytes(8, "little") + data[8:]
    assert ctypes.string_at(at[3], 128) == (0x3000).to_bytes(8, "little") + data[::-1][8:]
    assert [s.ptr for s in slots] == [0x4000, 0x3000]
    assert _launch.TensorMap is _tma.TensorMap


@pytest.mark.parametrize("shape, kernel, walk, why", [
    ((1, 30, 29, 2, 64), (7, 7), False, "flat key walk has no box shape"),
    ((1, 6, 10, 11, 2, 96), (3, 5, 5), True, "heads and columns as one dimension"),
    ((1, 90, 2, 64), (7,), None, "box 320"),   # 1-D dilation 5: 64 rows x 5 > 256
])
def test_forced_tma_refuses_with_the_reason_before_any_gpu_work(shape, kernel, walk, why):
    """plan_forward(tma=True) on operands the maps cannot describe raises, naming why (the
    default, tma=None, takes the cp.async loader there: tests/gpu/test_gpu_hopper.py)."""
    from natten_cupy import _args
    from natten_cupy.backends.fused import wgmma_forward
    x = numpy.zeros(shape, F16)
    rank = len(shape) - 3
    dil = 5 if rank == 1 else 1
    prob = _args.check_fused(rank, x, x, x, kernel, 1, dil, False, None, "fused")
    lay = _layout(shape)
    lse = Layout.contiguous(shape[:-1], numpy.float32)
    with pytest.raises(ValueError, match="TMA loader cannot run") as err:
        wgmma_forward.plan_forward(prob, lay, lay, lay, lay, lse, walk_boxes=walk, tma=True)
    assert why in str(err.value)


@pytest.mark.parametrize("shape, kernel, dil, rpb, why", [
    ((1, 30, 29, 2, 64), (7, 7), 1, False, "rank 2 and 3"),
    ((1, 90, 2, 128), (7,), 5, False, "box 320"),   # 64 rows x dilation 5 > 256
    ((1, 300, 2, 64), (65,), 1, True, "with a bias"),
])
def test_backward_tma_refuses_with_the_reason_before_any_gpu_work(shape, kernel, dil, rpb, why,
                                                                  monkeypatch):
    """plan_backward(tma=True) where the dK/dV pass cannot load its query tiles by maps
    raises, naming why (tma=None takes its cp.async loader there)."""
    from natten_cupy import _args
    from natten_cupy.backends.fused import mma_backward, wgmma_backward as H
    for part in (H, mma_backward):   # (the bias reduction's kernels are mma_backward's)
        monkeypatch.setattr(part, "get_kernel", lambda *a, **k: None)
    monkeypatch.setattr(mma_backward, "_geometry", lambda p, t: (numpy.uint64(0), [0] * 3, {}))
    x = numpy.zeros(shape, F16)
    rank = len(shape) - 3
    bias = numpy.zeros((shape[-2],) + tuple(2 * k - 1 for k in kernel), F16) if rpb else None
    prob = _args.check_fused(rank, x, x, x, kernel, 1, dil, False, None, "fused", rpb=bias)
    lay, lse = _layout(shape), Layout.contiguous(shape[:-1], numpy.float32)
    extra = (_layout(bias.shape), _layout(bias.shape)) if rpb else ()
    with pytest.raises(ValueError, match="TMA loads cannot run") as err:
        H.plan_backward(prob, lay, lay, lay, lay, lay, lse, lay, lay, lay, *extra, tma=True)
    assert why in str(err.value)
    H.plan_backward(prob, lay, lay, lay, lay, lay, lse, lay, lay, lay, *extra)   # cp.async


@pytest.mark.gpu   # (the maps need the CUDA driver: run with the GPU tests)
@pytest.mark.parametrize("dq_atomic", [False, True])
def test_backward_rank1_plan_loads_query_tiles_by_maps(dq_atomic, monkeypatch):
    """The rank-1 dK/dV pass's default plan at head dim 128: the TMA kernel, with the maps of
    q (operand 1) and d_out (operand 0) after its parameters: 64-row boxes stepping the
    dilation."""
    from natten_cupy import _args
    from natten_cupy.backends.fused import wgmma_backward as H
    if _tma.unavailable_reason():
        pytest.skip(_tma.unavailable_reason())
    names = []
    monkeypatch.setattr(H, "get_kernel", lambda src, name, **k: names.append(name))
    shape = (2, 1000, 3, 128)
    x = numpy.zeros(shape, F16)
    # (a window over KV_ONE_WG_UP_TO[128]: smaller ones take the one-warpgroup pass, cp.async)
    prob = _args.check_fused(1, x, x, x, 129, 1, 3, False, None, "fused")
    lay, lse = _layout(shape), Layout.contiguous(shape[:-1], numpy.float32)
    args = (prob, lay, lay, lay, lay, lay, lse, lay, lay, lay)
    kv = H.plan_backward(*args, dq_atomic=dq_atomic).calls[1]
    assert names[-1].startswith("natten::na_bwd_hopper_kv_tma<")
    maps = [a for a in kv.args if isinstance(a, _tma.TensorMap)]
    assert [m.index for m in maps] == [1, 0] and kv.args[-3].dtype.names   # params, maps
    assert maps[0].data == _tma._encode("float16", *_tma.operand_map(lay, 1, (64,), (3,), 128))
    names.clear()
    plain = H.plan_backward(*args, dq_atomic=dq_atomic, tma=False).calls[1]
    assert [n.split("<")[0] for n in names if "hopper_kv" in n] == ["natten::na_bwd_hopper_kv"]
    assert plain.args == kv.args[:-2]
    # head dim 64 keeps cp.async by default (TMA_HEAD_DIMS: measured slower there)
    lay64 = _layout((2, 1000, 3, 64))
    prob64 = _args.check_fused(1, numpy.zeros(lay64.shape, F16), *[numpy.zeros(lay64.shape,
                               F16)] * 2, 65, 1, 3, False, None, "fused")
    kv64 = H.plan_backward(prob64, *[lay64] * 5, lse, *[lay64] * 3, dq_atomic=dq_atomic).calls[1]
    assert not [a for a in kv64.args if isinstance(a, _tma.TensorMap)]
