"""The naive backend on tensors of more than 2**31 elements (int64 offsets end to end).

q, k, v are float16 ``[1, 2**21 + 3, 1, 1024]`` (2**31 + 3072 elements, 4 GiB each), 1-D,
kernel 3. The fused forward (non-causal and causal) and qk run on the whole tensors with
NaN-poisoned outputs; every output element must be written, and rows at the start, the
middle and the end (the last ones sit past element 2**31) must match the reference run on
just the slices they need. About 17 GiB of GPU memory, a few seconds on an H200.
"""

import numpy
import pytest

from natten_cupy import _args, _window, ops
from natten_cupy.backends import get_backend

import gpu_cases

LENGTH = 2 ** 21 + 3
HEAD_DIM = 1024
KERNEL = 3
SLICE = 16          # tokens per checked slice
ROWS_PER_STEP = 1 << 18  # tokens per step when filling or scanning (well under 2**31 elements)


def _xp(x):
    import cupy
    return cupy.get_array_module(x)


def _fill_random(x, seed):
    import cupy
    rng = cupy.random.default_rng(seed)
    for lo in range(0, x.shape[1], ROWS_PER_STEP):
        hi = min(lo + ROWS_PER_STEP, x.shape[1])
        x[:, lo:hi] = rng.standard_normal((x.shape[0], hi - lo) + x.shape[2:],
                                          dtype=numpy.float32).astype(x.dtype)


def _poisoned(xp, shape, dtype):
    """An array of NaN, filled in row steps (each step stays under 2**31 elements)."""
    x = xp.empty(shape, dtype=dtype)
    for lo in range(0, shape[1], ROWS_PER_STEP):
        x[:, lo:lo + ROWS_PER_STEP] = numpy.nan
    return x


def _count_nan(x):
    """NaN elements of x, scanned in row steps (each step stays under 2**31 elements)."""
    xp = _xp(x)
    total = xp.zeros((), dtype=xp.int64)
    for lo in range(0, x.shape[1], ROWS_PER_STEP):
        total += xp.isnan(x[:, lo:lo + ROWS_PER_STEP]).sum()
    return int(total)


def slices(length):
    """Token ranges [a, b) to check: the start, the middle and the end of the sequence."""
    mid = length // 2
    return [(0, SLICE), (mid - SLICE // 2, mid + SLICE // 2), (length - SLICE, length)]


def same_window_rows(a, b, length, causal):
    """Local rows of slice [a, b) whose window in the slice is their window in the whole axis."""
    full_start, full_end = _window.window_bounds(numpy.arange(a, b), length, KERNEL, 1, causal)
    start, end = _window.window_bounds(numpy.arange(b - a), b - a, KERNEL, 1, causal)
    return numpy.nonzero((start + a == full_start) & (end + a == full_end))[0]


def _host_slice(x, a, b):
    return gpu_cases.to_host(x[:, a:b])


def check_fused_forward(q, k, v, causal):
    """Run the naive fused forward on q, k, v and check it; returns the rows checked."""
    xp = _xp(q)
    naive = get_backend("naive")
    out = _poisoned(xp, q.shape, q.dtype)
    lse = _poisoned(xp, q.shape[:-1], numpy.float32)
    problem = _args.check_fused(1, q, k, v, KERNEL, 1, 1, causal, None, "naive")
    ops.run_fused_forward(problem, naive, q, k, v, out, lse)
    assert _count_nan(out) == 0, "fused forward left output elements unwritten"
    assert _count_nan(lse) == 0, "fused forward left lse elements unwritten"
    case = gpu_cases.Case("fused", 1, "float16", (SLICE,), (KERNEL,), (1,), (1,), (causal,),
                          q.shape[-1], batch=1, heads=1)
    checked = 0
    for a, b in slices(q.shape[1]):
        rows = same_window_rows(a, b, q.shape[1], causal)
        truth, yard = _reference_fused(q, k, v, a, b, causal)
        got = {"out": _host_slice(out, a, b)[:, rows], "lse": _host_slice(lse, a, b)[:, rows]}
        gpu_cases.compare(case, got, {n: t[:, rows] for n, t in truth.items()},
                          {n: t[:, rows] for n, t in yard.items()},
                          where=f"[fused forward, tokens {a}..{b - 1}, causal={causal}] ")
        checked += len(rows)
    return checked


def _reference_fused(q, k, v, a, b, causal):
    ref = get_backend("reference")
    results = []
    for dtype in (numpy.float64, numpy.float16):
        x = [_host_slice(t, a, b).astype(dtype) for t in (q, k, v)]
        out = numpy.empty_like(x[0])
        lse = numpy.empty(x[0].shape[:-1], dtype=numpy.float64 if dtype == numpy.float64
                          else numpy.float32)
        problem = _args.check_fused(1, *x, KERNEL, 1, 1, causal, None, "reference")
        ops.run_fused_forward(problem, ref, *x, out, lse)
        results.append({"out": out.astype(numpy.float64), "lse": lse.astype(numpy.float64)})
    return results


def check_qk(q, k):
    xp = _xp(q)
    naive, ref = get_backend("naive"), get_backend("reference")
    attn = _poisoned(xp, q.shape[:-1] + (KERNEL,), q.dtype)
    problem = _args.check_qk(1, q, k, KERNEL, 1, False, None, "naive")
    ops.run_qk(problem, naive, q, k, None, attn)
    assert _count_nan(attn) == 0, "qk left attention weights unwritten"
    checked = 0
    for a, b in slices(q.shape[1]):
        rows = same_window_rows(a, b, q.shape[1], False)
        # Non-causal: no empty slots, whatever the extent the case names.
        case = gpu_cases.Case("qk", 1, "float16", (len(rows),), (KERNEL,), (1,), (1,), (False,),
                              q.shape[-1], batch=1, heads=1)
        expect = []
        for dtype in (numpy.float64, numpy.float16):
            x = [_host_slice(t, a, b).astype(dtype) for t in (q, k)]
            out = numpy.empty(x[0].shape[:-1] + (KERNEL,), dtype=dtype)
            ops.run_qk(_args.check_qk(1, *x, KERNEL, 1, False, None, "reference"), ref, *x,
                       None, out)
            expect.append({"attn": out.astype(numpy.float64)[:, rows]})
        gpu_cases.compare(case, {"attn": _host_slice(attn, a, b)[:, rows]}, *expect,
                          where=f"[qk, tokens {a}..{b - 1}] ")
        checked += len(rows)
    return checked


@pytest.fixture(scope="module")
def big_qkv():
    import cupy
    need = 17 * 2 ** 30
    free = cupy.cuda.Device().mem_info[0]
    if free < need:
        pytest.skip(f"needs {need / 2 ** 30:.0f} GiB of free GPU memory, "
                    f"{free / 2 ** 30:.1f} GiB free")
    shape = (1, LENGTH, 1, HEAD_DIM)
    assert numpy.prod(shape, dtype=numpy.int64) > 2 ** 31
    tensors = []
    for seed in (1, 2, 3):
        x = cupy.empty(shape, dtype=numpy.float16)
        _fill_random(x, seed)
        tensors.append(x)
    yield tensors
    del tensors
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fused_forward_past_2_31_elements(big_qkv, causal):
    q, k, v = big_qkv
    assert check_fused_forward(q, k, v, causal) >= 3 * (SLICE - 2)


@pytest.mark.gpu
def test_qk_past_2_31_elements(big_qkv):
    q, k, _ = big_qkv
    assert check_qk(q, k) >= 3 * (SLICE - 2)


def test_checked_rows_keep_their_windows():
    """The slice logic on the CPU: rows kept are exactly those whose window fits the slice."""
    L = 40
    start, mid, end = slices(L)
    expected = {
        (start, False): range(0, SLICE - 1), (mid, False): range(1, SLICE - 1),
        (end, False): range(1, SLICE),
        (start, True): range(0, SLICE), (mid, True): range(2, SLICE), (end, True): range(2, SLICE),
    }
    for (a, b), causal in expected:
        assert list(same_window_rows(a, b, L, causal)) == list(expected[(a, b), causal])
    assert slices(LENGTH)[-1] == (LENGTH - SLICE, LENGTH)
