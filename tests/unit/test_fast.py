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
    shared_size_bytes = 0   # static shared memory


def test_prepare_opts_in_where_static_and_dynamic_shared_memory_pass_48_kib(monkeypatch):
    """The 48 KiB a launch gets without opting in count static and dynamic shared memory
    together: a plan's dynamic bytes under 48 KiB still need the limit raised when the
    kernel declares enough static memory (the exact-fp32 weighted sums: 45.5 + 5 KiB)."""
    class Static(_FakeKernel):
        shared_size_bytes = 5 * 1024

    for fn_type, dynamic, raised in ((Static, 46592, True), (Static, 43 * 1024, False),
                                     (_FakeKernel, 46592, False),
                                     (_FakeKernel, 48 * 1024 + 16, True), (Static, 0, False)):
        call = KernelCall(fn_type(), (1, 1, 1), (128, 1, 1), (Operand(0),),
                          shared_mem=dynamic).prepare()
        assert call.fn.max_dynamic_shared_size_bytes == (dynamic if raised else 0), \
            (fn_type.__name__, dynamic)
    fn = Static()
    _launch.allow_shared_memory(fn, 46592)   # the general path's launch does the same
    assert fn.max_dynamic_shared_size_bytes == 46592


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


def test_kernel_call_with_one_operand_and_with_none(monkeypatch):
    calls = _launched(monkeypatch)
    one = KernelCall(_FakeKernel(), (1, 1, 1), (32, 1, 1), (numpy.int32(9), Operand(1))).prepare()
    none = KernelCall(_FakeKernel(), (1, 1, 1), (32, 1, 1), (numpy.int64(-2),)).prepare()
    one([0x10, 0x20], stream=1)
    none([0x10, 0x20], stream=2)
    assert _arg(calls[0]["params"], 0, 4) == numpy.int32(9).tobytes()
    assert _arg(calls[0]["params"], 1, 8) == (0x20).to_bytes(8, "little")
    assert _arg(calls[1]["params"], 0, 8) == numpy.int64(-2).tobytes()
    assert [c["stream"] for c in calls] == [1, 2]


# ---- warm calls on stand-ins for device arrays ---------------------------------------------

def _device_array(shape, dtype=numpy.float16, ptr=0x10000, device=0, strides=None):
    """A cupy.ndarray over memory that is never touched (no GPU needed)."""
    mem = cupy.cuda.UnownedMemory(ptr, 1 << 20, None, device_id=device)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem, 0), strides=strides)


class _SubArray(cupy.ndarray):
    pass


def test_cupy_signature_keys_what_changes_the_plan():
    shape = (1, 8, 8, 1, 32)
    q = _device_array(shape)

    def key(*arrays, options=(3,)):
        fam, k = _fast._signature("fused_forward", 2, arrays, options)
        assert fam == "cupy"
        return k

    base = key(q, q, q)
    assert key(q, q, _device_array(shape, ptr=0x20000)) == base   # pointers are per call
    assert key(q, q, _device_array(shape, ptr=0x10002)) != base   # alignment is not
    assert key(q, q, _device_array(shape, device=1)) != base
    assert key(q, q, _device_array(shape, numpy.float32)) != base
    assert key(q, q, _device_array(shape, strides=(4096, 64, 512, 64, 2))) != base
    assert key(q, q, _device_array((1, 8, 8, 1, 16))) != base
    assert key(q, q, q.view(_SubArray)) != base   # each array's type
    assert key(q, q, q, options=(True,)) != key(q, q, q, options=(1,))
    assert _fast._signature("fused_backward", 2, (q, q, q), (3,))[1] != base
    assert _fast._signature("fused_forward", 1, (q, q, q), (3,))[1] != base


class _LooksLikeCupy:
    """An array of another library with the attributes the CuPy signature reads."""
    shape, strides, dtype = (1, 8, 1, 8), (128, 16, 16, 2), numpy.dtype("float16")

    class data:  # noqa: N801
        ptr, device_id = 0x30000, 0


def test_mixed_frameworks_cache_the_general_path(monkeypatch):
    _fast.clear()
    validated = []
    monkeypatch.setattr(_fast._args, "check_fused", lambda *a: validated.append(a))
    q = _device_array((1, 8, 1, 8))
    for _ in range(2):
        assert _fast.fused_forward(1, q, _LooksLikeCupy(), q, 3, 1, 1, False, None, "auto",
                                   False, False, False, None) is None
    assert validated == [] and list(_fast._entries.values()) == [_fast._SLOW]
    _fast.clear()


def test_unhashable_option_takes_the_general_path():
    q = _device_array((1, 8, 1, 8))
    assert _fast.fused_forward(1, q, q, q, {3: 3}, 1, 1, False, None, "auto", False, False,
                               False, None) is None


@pytest.fixture
def fake_allocator():
    """CuPy allocations handed out from one never-touched range, one after another."""
    at = [0x100000]

    def malloc(size):
        ptr = at[0]
        at[0] += -(-max(size, 1) // 512) * 512
        mem = cupy.cuda.UnownedMemory(ptr, max(size, 1), None, device_id=0)
        return cupy.cuda.MemoryPointer(mem, 0)
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(malloc)
    yield
    cupy.cuda.set_allocator(previous)


def test_array_maker_makes_what_cupy_ndarray_makes(fake_allocator):
    new = _fast._array_maker(cupy)
    for shape, dtype in (((2, 5, 3, 32), numpy.dtype("float16")), ((7,), numpy.dtype("f4")),
                         ((0, 3), numpy.dtype("f8")), ((), numpy.dtype("f4"))):
        a, b = new(shape, dtype), cupy.ndarray(shape, dtype)
        assert type(a) is cupy.ndarray
        assert (a.shape, a.strides, a.dtype, a.size, a.nbytes, a.base) == \
               (b.shape, b.strides, b.dtype, b.size, b.nbytes, b.base)
        assert a.flags.c_contiguous and a.flags.owndata
        assert a.data.ptr != b.data.ptr and a.data.mem.size >= a.nbytes


def _entry(outputs, workspaces, n_inputs):
    """An entry whose one kernel takes every operand: inputs, outputs, workspaces."""
    n = n_inputs + len(outputs) + len(workspaces)
    call = KernelCall(_FakeKernel(), (2, 1, 1), (64, 1, 1),
                      (*map(Operand, range(n)), numpy.int32(7))).prepare()
    empty = KernelCall(_FakeKernel(), (0, 1, 1), (64, 1, 1), (Operand(0),)).prepare()
    plan = Plan((call, empty), workspaces=workspaces)
    return _fast.Entry(None, plan, 0, (), outputs, workspaces)


def test_warm_cupy_call_passes_inputs_outputs_and_workspaces(monkeypatch, fake_allocator):
    calls = _launched(monkeypatch)
    f16, f32 = numpy.dtype("float16"), numpy.dtype("float32")
    e = _entry((((2, 4, 8), f16), ((2, 4), f32)), (((2, 4), f32),), 3)
    streams = []
    monkeypatch.setattr(_fast, "_new_cupy_array", _fast._array_maker(cupy))
    monkeypatch.setattr(_fast, "_cupy_alloc", cupy.cuda.memory.alloc)
    monkeypatch.setattr(_fast, "_cupy_stream",
                        lambda device: streams.append(device) or type("S", (), {"ptr": 5})())
    ins = [_device_array((2, 4, 8), ptr=p) for p in (0x1000, 0x2000, 0x3000)]
    outs = _fast._run_cupy(e, ins)
    assert [(o.shape, o.dtype) for o in outs] == [((2, 4, 8), f16), ((2, 4), f32)]
    assert len(calls) == 1 and calls[0]["stream"] == 5 and streams == [0]   # empty: skipped
    got = [int.from_bytes(_arg(calls[0]["params"], i, 8), "little") for i in range(6)]
    assert got[:5] == [0x1000, 0x2000, 0x3000, outs[0].data.ptr, outs[1].data.ptr]
    assert got[5] not in got[:5] and got[5] >= 0x100000   # the workspace: a fresh allocation
    assert _arg(calls[0]["params"], 6, 4) == numpy.int32(7).tobytes()


def test_warm_torch_call_allocates_like_torch_empty(monkeypatch):
    torch = pytest.importorskip("torch")
    calls = _launched(monkeypatch)
    f16, f32 = numpy.dtype("float16"), numpy.dtype("float32")
    e = _entry((((2, 4, 8), f16), ((2, 4), f32)), (((3,), f32),), 2)
    e.torch_out = _fast._torch_specs(e.outputs + e.workspaces)
    e.torch_device = torch.device("cpu")
    monkeypatch.setattr(_fast, "_torch_tensor", torch.Tensor)
    monkeypatch.setattr(_fast, "_torch_empty", torch.empty)
    monkeypatch.setattr(_fast, "_torch_stream", lambda device: 9)
    x = torch.zeros((2, 4, 8), dtype=torch.float16, requires_grad=True)
    for first in (x, torch.nn.Parameter(x.detach())):   # new_empty, then torch.empty
        outs = _fast.run_torch(e, [first, x])
        assert [(type(o), o.shape, o.dtype, o.requires_grad) for o in outs] == [
            (torch.Tensor, (2, 4, 8), torch.float16, False),
            (torch.Tensor, (2, 4), torch.float32, False)]
        got = [int.from_bytes(_arg(calls[-1]["params"], i, 8), "little") for i in range(5)]
        assert got[:4] == [first.data_ptr(), x.data_ptr(), outs[0].data_ptr(),
                           outs[1].data_ptr()]
        assert calls[-1]["stream"] == 9


@pytest.mark.parametrize("op", ["fused_forward", "fused_backward"])
@pytest.mark.parametrize("has_rpb,has_extra", [(True, False), (False, True), (True, True)])
def test_ext_order_is_the_general_paths_operand_order(monkeypatch, op, has_rpb, has_extra):
    """The warm ext calls hand the plan the operands the general path (``_operands``) hands
    it, in its order, and copy the inputs it makes ready: both read off that path itself."""
    from natten_cupy import _operands
    made_ready, seen = [], []
    monkeypatch.setattr(_operands, "ready_inputs", lambda xs: made_ready.extend(xs) or list(xs))
    monkeypatch.setattr(_operands, "writable_outputs", lambda xs: list(xs))
    monkeypatch.setattr(_operands, "_layouts", lambda xs: list(xs))
    monkeypatch.setattr(_operands, "_workspaces", lambda plan: ())
    monkeypatch.setattr(_operands, "copy_back", lambda *a: None)
    monkeypatch.setattr(_launch, "run_plan_on", lambda plan, arrays: None)

    def plan(problem, *layouts):
        seen.append(layouts)
    rpb = "rpb" if has_rpb else None
    keys, values = ("keys", "values") if has_extra else (None, None)
    if op == "fused_forward":
        inputs, outputs = ["q", "k", "v", rpb, keys, values], ["out", "lse"]
        _operands.run_forward(plan, None, "q", "k", "v", "out", "lse", rpb,
                              (keys, values) if has_extra else None)
    else:
        inputs = ["d_out", "q", "k", "v", "out", "lse", rpb, keys, values]
        outputs = ["dq", "dk", "dv"] + ["d_rpb"] * has_rpb + ["d_keys", "d_values"] * has_extra
        _operands.run_backward(plan, None, "q", "k", "v", "out", "lse", "d_out", "dq", "dk",
                               "dv", rpb, "d_rpb" if has_rpb else None,
                               (keys, values) if has_extra else None,
                               ("d_keys", "d_values") if has_extra else None)
    order, rows = _fast.ext_order(op, has_rpb, has_extra)
    names = inputs + outputs
    assert len(seen) == 1 and tuple(names[i] for i in order) == tuple(seen[0])
    assert sorted(names[i] for i in rows) == sorted(x for x in made_ready if x is not None)


def test_block_puts_outputs_and_small_workspaces_in_one_allocation():
    # backward-like: three 4 KiB outputs, a 200-byte workspace (joins: under 1/16)
    b = _fast._Block((4096, 4096, 4096), (200,))
    assert b.outputs == (0, 4096, 8192) and b.workspaces == (12288,) and b.apart == ()
    assert b.bytes == 12288 + 256
    # a workspace over 1/16 of the outputs (a float32 dQ accumulator) is allocated apart
    b = _fast._Block((1000, 1000, 1000), (8000,))
    assert b.outputs == (0, 1024, 2048) and b.workspaces == () and b.apart == (8000,)
    assert b.bytes == 3072
    # pieces start 256-byte aligned
    b = _fast._Block((10, 300, 1), ())
    assert b.outputs == (0, 256, 768) and b.bytes == 1024
    # fewer than three pieces (a forward's out and lse), or nothing at all: as usual
    assert _fast._Block((4096, 64), ()).bytes == 0
    assert _fast._Block((4096,), (64,)).bytes == 0
    assert _fast._Block((0, 0, 0), ()).bytes == 0


def test_operand_offsets_move_non_null_pointers_only(monkeypatch):
    """Operand(i, offset): the pointer plus offset bytes; a null pointer (an absent optional
    array) stays null."""
    calls = _launched(monkeypatch)
    call = KernelCall(_FakeKernel(), (1, 1, 1), (32, 1, 1),
                      (Operand(0, 4096), Operand(1), Operand(2, 64))).prepare()
    call([0x10000, 0x20000, 0], stream=0)
    p = calls[0]["params"]
    assert [ctypes.c_uint64.from_buffer_copy(_arg(p, i, 8)).value for i in range(3)] == [
        0x10000 + 4096, 0x20000, 0]


def test_mma_forward_runs_a_large_batch_in_chunks(monkeypatch):
    """Batches past grid z's 65535 run as several launches, each chunk's batch-indexed
    operands (q, k, v, out, lse and the additional tokens, not the bias) starting at the
    chunk's first element; every batch covered once."""
    from types import SimpleNamespace
    from natten_cupy import _args
    from natten_cupy.backends.fused import mma_forward as mf
    from natten_cupy import _operands
    monkeypatch.setattr(mf, "get_kernel", lambda *a, **k: _FakeKernel())
    monkeypatch.setattr(_operands, "_current_device", lambda: 0)
    monkeypatch.setattr(_operands, "device_limits",
                        lambda dev: SimpleNamespace(smem_per_block=1 << 20))
    batch = 2 * 65535 + 7
    x = numpy.zeros((batch, 6, 1, 8), numpy.float16)
    lse = numpy.zeros((batch, 6, 1), numpy.float32)
    problem = _args.check_fused(1, x, x, x, 3, 1, 1, False, None, "fused")
    lay = Layout(x.shape, x.strides, x.dtype)
    plan = mf.plan_forward(problem, lay, lay, lay, lay, Layout(lse.shape, lse.strides,
                                                                 lse.dtype))
    assert [c.grid[2] for c in plan.calls] == [65535, 65535, 7]
    for n, c in enumerate(plan.calls):
        ops = [a for a in c.args if isinstance(a, Operand)]
        assert [a.index for a in ops] == [0, 1, 2, 3, 4]
        b0 = n * 65535
        assert [a.offset for a in ops] == [b0 * x.strides[0]] * 4 + [b0 * lse.strides[0]]
    rpb = numpy.zeros((1, 5), numpy.float16)   # per head: the same table for every chunk
    problem = _args.check_fused(1, x, x, x, 3, 1, 1, False, None, "fused", rpb=rpb)
    plan = mf.plan_forward(problem, lay, lay, lay, lay, Layout(lse.shape, lse.strides,
                                                                 lse.dtype),
                           Layout(rpb.shape, rpb.strides, rpb.dtype))
    assert len(plan.calls) == 3
    for c in plan.calls:
        (bias,) = [a for a in c.args if isinstance(a, Operand) and a.index == 5]
        assert bias.offset == 0


class _FakeSelection:
    """A Selection whose plan launches one fake kernel over every operand it is given."""
    has_plans = True
    row_inputs = (0, 1, 2)

    def __init__(self, problem):
        self.problem = problem
        self.layouts = []

    def tuned(self):
        return self

    def plan(self, layouts):
        self.layouts.append(list(layouts))
        args = tuple(map(Operand, range(len(layouts))))
        return Plan((KernelCall(_FakeKernel(), (1, 1, 1), (32, 1, 1), args),))


def test_forward_without_lse_keeps_it_a_workspace(monkeypatch, fake_allocator):
    """A warm fused forward without return_lse: its own entry, out returned alone, and the
    kernels still get an lse of their own (a fresh allocation past out, not an array), in
    the plan's operand order (q, k, v, out, lse)."""
    import contextlib
    calls = _launched(monkeypatch)
    made = []
    monkeypatch.setattr(_fast, "select_backend",
                        lambda op, problem, xp, backend: made.append(_FakeSelection(problem))
                        or made[-1])
    monkeypatch.setattr(_fast, "_one_gpu", True)
    arrays = []   # (shape, dtype) of every array a call makes
    maker = _fast._array_maker(cupy)
    monkeypatch.setattr(_fast, "_new_cupy_array",
                        lambda shape, dtype, *mem: arrays.append((shape, dtype))
                        or maker(shape, dtype, *mem))
    monkeypatch.setattr(_fast, "_cupy_alloc", cupy.cuda.memory.alloc)
    monkeypatch.setattr(_fast, "_cupy_stream", lambda device: type("S", (), {"ptr": 3})())
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: contextlib.nullcontext())
    shape = (2, 9, 9, 2, 32)
    q, k, v = (_device_array(shape, ptr=p) for p in (0x10000, 0x20000, 0x30000))
    _fast.clear()
    args = (3, 1, 1, False, None, "fused", False, False, None)
    for _ in range(2):   # the first call builds the entry, the second is warm
        arrays.clear()
        out = _fast.fused_forward(2, q, k, v, *args[:5], args[5], False, *args[6:])
        assert arrays == [(shape, numpy.dtype(numpy.float16))]   # out alone
        assert isinstance(out, cupy.ndarray) and out.shape == shape
        ptrs = [int.from_bytes(_arg(calls[-1]["params"], i, 8), "little") for i in range(5)]
        assert ptrs[:4] == [0x10000, 0x20000, 0x30000, out.data.ptr]
        lse_at = ptrs[4]   # 2 x 9 x 9 x 2 float32, apart from out's 2 x 9 x 9 x 2 x 32 halves
        assert not (out.data.ptr <= lse_at < out.data.ptr + out.nbytes) and lse_at >= 0x100000
    assert _fast.entries() == 1 and len(made) == 1
    assert [(lay.shape, lay.dtype) for lay in made[0].layouts[0][3:]] == [
        (shape, numpy.dtype(numpy.float16)), (shape[:-1], numpy.dtype(numpy.float32))]
    out, lse = _fast.fused_forward(2, q, k, v, *args[:5], args[5], True, *args[6:])
    assert _fast.entries() == 2 and lse.shape == shape[:-1] and lse.dtype == numpy.float32
    ptrs = [int.from_bytes(_arg(calls[-1]["params"], i, 8), "little") for i in range(5)]
    assert ptrs[3:] == [out.data.ptr, lse.data.ptr]
    _fast.clear()
