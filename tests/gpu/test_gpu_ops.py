"""The shared GPU correctness suite: every GPU backend against the float64 reference.

Parametrized over backend (naive, tiled, fused) x the cases of ``gpu_cases`` (every op kind
x rank x dtype, causal mixes, odd and even kernels, dilation, stride for the fused ops, odd
extents, permuted layouts). What each backend must accept is a capability table
(``gpu_cases.expected_refusal``): a supported case that is refused fails, and a case outside
a backend's table passes only if its refusal names the reason. ``NATTEN_CUPY_GPU_QUICK=1`` runs a
quarter of the cases. The tests without the gpu mark check the case list itself on the CPU.
"""

import itertools
import math

import numpy
import pytest

import natten_cupy
from natten_cupy.backends import OPS, get_backend

import gpu_cases
from gpu_cases import BACKENDS, Case

CASES = gpu_cases.make_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_against_reference(backend, case):
    gpu_cases.check_backend(case, backend)


# ---- empty problems, streams --------------------------------------------------------------

def _public_calls(cupy, B, H, backend):
    """Every public 2-D call on [B, 9, 7, H, 32] float16 inputs; yields (op, result, expect)."""
    rng = numpy.random.default_rng(0)
    shape = (B, 9, 7, H, 32)
    wshape = (B, 9, 7, H, 9)

    def rand(s):
        return cupy.asarray(rng.standard_normal(s).astype(numpy.float16))

    q, k, v, d_out, attn = rand(shape), rand(shape), rand(shape), rand(shape), rand(wshape)
    rpb = rand((H, 5, 5))
    kw = dict(backend=backend)
    calls = {
        "fused_forward": lambda: natten_cupy.na2d(q, k, v, 3, return_lse=True, **kw),
        "fused_backward": lambda: natten_cupy.na2d_backward(
            d_out, q, k, v, q, cupy.zeros(shape[:-1], cupy.float32), 3, **kw),
        "qk": lambda: natten_cupy.na2d_qk(q, k, 3, rpb=rpb, **kw),
        "av": lambda: natten_cupy.na2d_av(attn, v, 3, **kw),
        "qk_backward": lambda: natten_cupy.na2d_qk_backward(attn, q, k, 3, rpb=rpb, **kw),
        "av_backward": lambda: natten_cupy.na2d_av_backward(d_out, attn, v, 3, **kw),
    }
    expect = {
        "fused_forward": (shape, shape[:-1]),
        "fused_backward": (shape, shape, shape),
        "qk": (wshape,),
        "av": (shape,),
        "qk_backward": (shape, shape, (H, 5, 5)),
        "av_backward": (wshape, shape),
    }
    for op in OPS:
        yield op, calls[op], expect[op]


# The case of each public call of _public_calls, for the capability table.
_PUBLIC_KINDS = {"fused_forward": "fused", "fused_backward": "fused", "qk": "qk_rpb",
                 "av": "av", "qk_backward": "qk_backward_rpb", "av_backward": "av_backward"}


def _available(backend):
    mod = get_backend(backend)
    assert mod is not None, f"backend {backend} is not available in this install"
    return mod


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,H", [(0, 3), (2, 0)])
def test_zero_batch_or_heads(backend, B, H):
    """Empty batch or heads: right empty shapes, no launch; d_rpb of an empty batch is 0.
    An op the capability table says the backend runs must run; the others must be refused
    for the table's reason."""
    import cupy
    _available(backend)
    for op, call, expect in _public_calls(cupy, B, H, backend):
        case = Case(_PUBLIC_KINDS[op], 2, "float16", (9, 7), (3, 3), (1, 1), (1, 1),
                    (False, False), 32, batch=B, heads=H)
        refused = gpu_cases.expected_refusal(case, backend)
        if refused is not None:
            with pytest.raises(ValueError, match="cannot run") as e:
                call()
            assert refused in str(e.value), (op, refused, str(e.value))
            continue
        result = call()
        if not isinstance(result, tuple):  # qk and av return one array
            result = (result,)
        assert tuple(tuple(r.shape) for r in result) == expect, op
        if op == "qk_backward" and B == 0:
            assert (result[2] == 0).all(), "d_rpb of an empty batch must be zero"


# Batches past grid z's 65535 (every fused backend folds or chunks the batch): fused cases
# with tiny maps and 65535 + 2 batches, plain and causal with stride.
LARGE_BATCH_CASES = [
    Case("fused", 1, "float16", (5,), (3,), (1,), (1,), (False,), 8, batch=65535 + 2, heads=1),
    Case("fused", 2, "bfloat16", (2, 3), (2, 2), (1, 2), (1, 1), (True, False), 16,
         batch=65535 + 2, heads=1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LARGE_BATCH_CASES, ids=[c.id for c in LARGE_BATCH_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batches_past_the_grid_limit(backend, case):
    """More batches than one launch's grid z holds: every backend that runs fused ops runs
    them (or refuses with the capability table's reason), every element written and right
    (the mma.sync forward runs such a batch in chunks of 65535)."""
    gpu_cases.check_backend(case, backend)


def _stream_case(backend):
    """A fused case for backends that run fused ops, an unfused one otherwise (the first the
    capability table says the backend runs; then a refusal fails the test)."""
    mod = _available(backend)
    for kind in ("fused", "qk_backward_rpb", "av"):
        case = Case(kind, 2, "float16", (9, 11), (5, 4), (1, 1), (1, 2), (True, False), 32,
                    permuted=True)
        if gpu_cases.expected_refusal(case, backend) is None:
            why = gpu_cases.refusal(case, mod)
            assert why is None, f"{backend} must run {case.id} but refuses it: {why}"
            return case, mod
    raise AssertionError(f"the capability table gives {backend} no stream case")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_default_stream(backend):
    """Kernels run on the caller's current (non-blocking) stream, ordered after its work."""
    import cupy
    case, mod = _stream_case(backend)
    x, truth, yard = gpu_cases.references(case)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        xd = gpu_cases.inputs_on_device(x, case)
        # q is spoiled, slow work is queued, then q is restored, all on the stream: an op
        # launched on any other stream would likely read the spoiled q and fail.
        first = next(iter(xd))
        keep = xd[first].copy()
        xd[first][...] = numpy.nan
        busy = cupy.zeros(1 << 24, cupy.float32)
        for _ in range(16):
            busy += 1
        xd[first][...] = keep
        y = gpu_cases.run(case, mod, xd, cupy)
    stream.synchronize()
    gpu_cases.compare(case, {n: gpu_cases.to_host(a) for n, a in y.items()}, truth, yard,
                      where=f"[{backend} on a non-default stream] ")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_capture(backend):
    """Every launch goes to the current stream: a CUDA graph captured on it replays the op."""
    import cupy
    case, mod = _stream_case(backend)
    x, truth, yard = gpu_cases.references(case)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        xd = gpu_cases.inputs_on_device(x, case)
        gpu_cases.run(case, mod, xd, cupy)  # compile and warm the memory pool first
        outputs = gpu_cases.run(case, mod, xd, cupy)
        for a in outputs.values():
            a[...] = numpy.nan
        probs = gpu_cases.problems(case, xd, backend)
        stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        _replay_ops(case, mod, probs, xd, outputs)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    gpu_cases.compare(case, {n: gpu_cases.to_host(a) for n, a in outputs.items()}, truth,
                      yard, where=f"[{backend} replayed from a CUDA graph] ")


def _replay_ops(case, mod, probs, x, y):
    from natten_cupy import ops
    if case.fused:
        ops.run_fused_forward(probs["fused_forward"], mod, x["q"], x["k"], x["v"], y["out"],
                              y["lse"])
        ops.run_fused_backward(probs["fused_backward"], mod, x["d_out"], x["q"], x["k"],
                               x["v"], y["out"], y["lse"], y["dq"], y["dk"], y["dv"])
    elif case.kind == "qk_backward_rpb":
        ops.run_qk_backward(probs["qk_backward"], mod, x["d_attn"], x["q"], x["k"], y["dq"],
                            y["dk"], y["d_rpb"])
    else:
        ops.run_av(probs["av"], mod, x["attn"], x["v"], y["out"])


# ---- the case list itself (CPU) -----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_capability_table_matches_the_backends_refusals(backend):
    """On the CPU (refusals need no GPU): every case a backend must run is accepted, and
    every other case is refused for the reason the table names."""
    mod = get_backend(backend)
    ran = 0
    for case in CASES:
        why = gpu_cases.refusal(case, mod)
        expected = gpu_cases.expected_refusal(case, backend)
        if expected is None:
            assert why is None, f"{backend} refuses {case.id}: {why}"
            ran += 1
        else:
            assert why is not None and expected in why, (case.id, expected, why)
    assert ran >= 20, f"{backend} runs only {ran} cases of the suite"


def test_cases_are_valid_and_cover_the_grid():
    seen = set()
    for case in CASES:
        x = gpu_cases.make_inputs(case)
        for problem in gpu_cases.problems(case, x).values():
            assert problem.rank == case.rank
        seen.add((case.kind, case.rank, case.dtype))
    if gpu_cases.QUICK:
        return
    assert seen == set(itertools.product(gpu_cases.KINDS, (1, 2, 3), gpu_cases.DTYPES))
    fused = [c for c in CASES if c.fused]
    assert {c.rank for c in fused if any(s > 1 for s in c.stride)} == {1, 2, 3}
    assert any(c.spatial == c.kernel for c in fused), "no self-attention case"
    for rank in (1, 2, 3):
        mine = [c for c in CASES if c.rank == rank]
        assert any(all(c.causal) for c in mine) and any(not any(c.causal) for c in mine)
        assert any(k % 2 == 0 for c in mine for k in c.kernel)
        assert any(k % 2 == 1 for c in mine for k in c.kernel)
        assert any(d > 1 for c in mine for d in c.dilation)
        assert any(L % 2 == 1 for c in mine for L in c.spatial)
        if rank > 1:
            assert any(len(set(c.causal)) > 1 for c in mine), "no mixed causal case"
    assert any(c.permuted for c in CASES) and any(c.tf32 for c in CASES)
    assert any(c.head_dim % 8 for c in CASES), "no odd head dim"
    assert 150 <= len(CASES) <= 400


def test_empty_slots_follow_the_spec():
    """empty_slots against SPEC's rules, brute force, on every unfused geometry."""
    for case in CASES:
        if case.fused:
            continue
        empty = gpu_cases.empty_slots(case)
        for coord in itertools.product(*(range(L) for L in case.spatial)):
            counts = []
            for i, L, k, d, c in zip(coord, case.spatial, case.kernel, case.dilation,
                                     case.causal):
                ig = i // d
                if c:
                    counts.append(ig + 1 - max(ig - k + 1, 0))
                else:
                    counts.append(k)
            for t, slot in enumerate(itertools.product(*(range(k) for k in case.kernel))):
                want = any(s >= n for s, n in zip(slot, counts))
                assert empty[coord + (t,)] == want, (case.id, coord, t)
        assert empty.shape == case.spatial + (math.prod(case.kernel),)


def test_permuted_layout_round_trip():
    """The head-major permutation used for permuted cases is a true [B, *spatial, H, D] view."""
    shape = (2, 5, 7, 3, 4)
    buffer_shape, order = gpu_cases._head_major(shape, 2)
    assert buffer_shape == (2, 3, 5, 7, 4)
    a = numpy.arange(math.prod(shape)).reshape(buffer_shape)
    view = a.transpose(order)
    assert view.shape == shape and not view.flags.c_contiguous
    assert view[1, 4, 6, 2, 3] == a[1, 2, 4, 6, 3]
    lse_shape = (2, 5, 7, 3)
    buffer_shape, order = gpu_cases._head_major(lse_shape, 2)
    assert buffer_shape == (2, 3, 5, 7) and order == (0, 2, 3, 1)


def test_tolerance_uses_the_yardstick():
    case = CASES[0]
    truth = numpy.array([1.0, -2.0, 0.5])
    yard = truth + numpy.array([0.0, 1e-3, 0.0])
    bound, ref_err = gpu_cases.error_bound(case, "out", truth, yard)
    assert ref_err == pytest.approx(1e-3)
    assert bound == pytest.approx(2 * 1e-3 + gpu_cases.FLOORS[case.dtype] * 2.0)
    bound, _ = gpu_cases.error_bound(case, "dq", truth, yard)
    assert bound == pytest.approx(3 * 1e-3 + gpu_cases.FLOORS[case.dtype] * 2.0)


def test_reference_runs_every_case_kind():
    """The reference fills every output (no NaN left) on one case of each kind and rank."""
    picked = {}
    for case in CASES:
        picked.setdefault((case.kind, case.rank), case)
    for case in picked.values():
        x, truth, yard = gpu_cases.references(case)
        for name, t in truth.items():
            assert not numpy.isnan(t).any(), (case.id, name)
            assert not numpy.isnan(yard[name]).any(), (case.id, name)
        # The float64 truth agrees with itself within the floors (sanity of compare()).
        gpu_cases.compare(case, truth, truth, truth)
        if case.dtype != "float64":
            gpu_cases.compare(case, yard, truth, yard)


# ---- the naive backend's launcher, without a GPU (CPU) -------------------------------------

def test_naive_instantiations_and_grids():
    from natten_cupy.backends import naive
    inst = naive.instantiations()
    assert len(inst) == len(set(inst)) == len(naive.KERNELS) * 4 * 3
    assert all(src == naive.SOURCE for src, _ in inst)
    assert ("na_naive.cu", "na_fwd_naive<__nv_bfloat16, 3>") in inst
    assert naive.grid_for(1) == (1,)
    assert naive.grid_for(naive.BLOCK + 1) == (2,)
    assert naive.grid_for(2 ** 40) == (naive.MAX_BLOCKS,)  # kernels grid-stride past it
    assert naive.MAX_BLOCKS < 2 ** 31


def test_naive_launch_plan(monkeypatch):
    """Each op launches the kernels it should, with its arrays, a params struct whose strides
    are those of the (permuted) arrays, and enough threads; checked on NumPy, no GPU."""
    from natten_cupy._params import element_strides
    from natten_cupy.backends import naive
    launched = []
    monkeypatch.setattr(naive, "get_kernel", lambda source, expr: expr)
    monkeypatch.setattr(naive, "launch", lambda fn, grid, block, args, **kw:
                        launched.append((fn, grid, block, args, kw)))
    for kind in gpu_cases.KINDS:
        case = Case(kind, 2, "float16", (9, 11), (5, 4),
                    (2, 1) if kind in gpu_cases.STRIDED else (1, 1),
                    (1, 2), (True, False), 40, permuted=True)
        x = {n: _numpy_permuted(a, case) for n, a in gpu_cases.make_inputs(case).items()}
        monkeypatch.setattr(gpu_cases, "poisoned", lambda xp, shape, dtype, c:
                            _numpy_permuted(numpy.full(shape, numpy.nan, dtype), c))
        launched.clear()
        y = gpu_cases.run(case, naive, x, numpy)
        names = [fn.split("<")[0] for fn, *_ in launched]
        want = {"fused": ["na_fwd_naive", "na_bwd_delta_naive", "na_bwd_dq_naive",
                          "na_bwd_dkdv_naive"],
                "fused_extra": ["na_fwd_naive", "na_bwd_delta_naive", "na_bwd_dq_naive",
                                "na_bwd_dkdv_naive"],
                "fused_rpb": ["na_fwd_naive", "na_bwd_delta_naive", "na_bwd_dq_naive",
                              "na_bwd_dkdv_naive", "na_bwd_rpb_naive"],
                "qk": ["na_qk_naive"], "qk_rpb": ["na_qk_naive"], "av": ["na_av_naive"],
                "qk_backward": ["na_qk_bwd_dq_naive", "na_qk_bwd_dk_naive"],
                "qk_backward_rpb": ["na_qk_bwd_dq_naive", "na_qk_bwd_dk_naive",
                                    "na_qk_bwd_rpb_naive"],
                "av_backward": ["na_av_bwd_dattn_naive", "na_av_bwd_dv_naive"]}[kind]
        assert names == want, kind
        rows = case.batch * 99 * case.heads
        for fn, grid, block, args, kw in launched:
            assert fn.endswith("<__half, 2>") and kw == dict(name=fn, backend="naive")
            assert block == (naive.BLOCK,)
            params = args[-1]
            assert isinstance(params, numpy.void)
            assert list(params["extent"]) == [9, 11, 1] and list(params["kernel"]) == [5, 4, 1]
            assert list(params["dilation"]) == [1, 2, 1] and list(params["causal"]) == [1, 0, 0]
            for name, field in (("q", "q"), ("k", "k"), ("v", "v"), ("d_out", "d_o"),
                                ("attn", "attn"), ("d_attn", "d_attn")):
                if name in x and any(a is x[name] for a in args):  # strides of the view
                    st = element_strides(x[name])
                    assert list(params[field]) == [st[0], st[1], st[2], 0, st[3], st[4]], name
            for name, field in (("out", "o"), ("lse", "lse"), ("dq", "dq"), ("dk", "dk"),
                                ("dv", "dv"), ("attn", "attn"), ("d_attn", "d_attn"),
                                ("d_rpb", "d_rpb")):
                if name in y and any(a is y[name] for a in args):
                    st = element_strides(y[name])
                    if name == "d_rpb":    # [H, 2k_0 - 1, 2k_1 - 1]
                        want = [st[0], st[1], st[2], 0, 0, 0]
                    elif name == "lse":    # [B, X, Y, H]
                        want = [st[0], st[1], st[2], 0, st[3], 0]
                    else:
                        want = [st[0], st[1], st[2], 0, st[3], st[4]]
                    assert list(params[field]) == want, name
            if "q" in x:
                st = element_strides(x["q"])
                assert st[4] == 1 and st[3] == 9 * 11 * 40  # head-major buffer, permuted view
            per_thread = {"na_qk_naive": 20, "na_av_bwd_dattn_naive": 20,
                          "na_qk_bwd_rpb_naive": None,
                          "na_bwd_rpb_naive": None}.get(fn.split("<")[0], 40)
            if per_thread is None:
                threads = case.heads * 9 * 7 * naive.WARP
            elif fn.startswith(("na_fwd", "na_bwd_dq", "na_bwd_dkdv")):
                threads = rows * 2  # two 32-wide chunks of a 40-wide head dim
            elif fn.startswith("na_bwd_delta"):
                threads = rows
            else:
                threads = rows * per_thread
            assert grid == (-(-threads // naive.BLOCK),), fn
        if kind in ("qk", "qk_rpb"):
            rpb_arg = launched[0][3][2]
            assert rpb_arg is (x["rpb"] if case.rpb else naive._NULL)


def _numpy_permuted(x, case):
    if x.ndim >= case.rank + 2 and x.shape[0] == case.batch:
        buffer_shape, order = gpu_cases._head_major(x.shape, case.rank)
        return numpy.ascontiguousarray(x.transpose(numpy.argsort(order))).transpose(order)
    return x
