"""The naive backend's real CUDA source, run on the CPU (no GPU): see tests/emulator.

``cuda_src/na_naive.cu`` is compiled once per session with g++ against CPU stand-ins for the
CUDA built-ins; the unchanged ``natten_cupy.backends.naive`` launcher drives it through
monkeypatched ``get_kernel``/``launch``. Every case of the shared GPU suite (``gpu_cases``) but
the tf32 ones (every op kind x rank x dtype, causal mixes, dilation, stride, even kernels, odd
head dims, permuted layouts) runs against the reference backend with the suite's tolerances;
inputs and outputs sit between NaN guard bands (in the permuted head-major layout where the
case says so), outputs start NaN and must be fully written, guards must stay NaN. Cases
rotate between the launcher's own grid and grids of 1 and 3 blocks (grid-stride loops).

``NATTEN_CUPY_EMULATED_SRC=<folder>`` builds from another copy of cuda_src/ (for checking
that a planted bug is caught). ``NATTEN_CUPY_EMULATOR_MUTANTS=1`` also runs
``test_planted_bugs_are_caught``, which plants bugs in temporary copies of the source.
"""

from __future__ import annotations

import os
import shutil

import numpy
import pytest

import emulator
import gpu_cases
from natten_cupy._params import EXTRA_FIELDS, PARAMS_DTYPE, TENSOR_FIELDS
from natten_cupy.backends import naive

GUARD = 48  # NaN elements before and after every array the kernels see
GRIDS = (None, 1, 3)  # None: the launcher's grid; else at most that many blocks


@pytest.fixture(scope="session")
def emulated_lib(tmp_path_factory):
    why = emulator.unbuildable_reason()
    if why:
        pytest.skip(why)
    src = os.environ.get("NATTEN_CUPY_EMULATED_SRC")
    return emulator.build(tmp_path_factory.mktemp("naive_emulator"), cuda_src=src)


@pytest.fixture
def emu(emulated_lib, monkeypatch):
    e = emulator.Emulator(emulated_lib, block=naive.BLOCK, max_blocks=naive.MAX_BLOCKS)
    monkeypatch.setattr(naive, "get_kernel", e.get_kernel)
    monkeypatch.setattr(naive, "launch", e.launch)
    return e


def _suite_cases():
    """Every suite case but the tf32 ones (naive ignores allow_tf32), whatever
    NATTEN_CUPY_GPU_QUICK says."""
    quick = gpu_cases.QUICK
    gpu_cases.QUICK = False
    try:
        return [c for c in gpu_cases.make_cases() if not c.tf32]
    finally:
        gpu_cases.QUICK = quick


def _gqa_cases():
    """The GQA/MQA cases of the suite but the tf32 ones, whatever NATTEN_CUPY_GPU_QUICK says."""
    quick = gpu_cases.QUICK
    gpu_cases.QUICK = False
    try:
        return [c for c in gpu_cases.gqa_cases() if not c.tf32]
    finally:
        gpu_cases.QUICK = quick


CASES = _suite_cases()
GQA_CASES = _gqa_cases() + gpu_cases.dv_cases()   # with the value-head-dim cases


class Placement:
    """Arrays as the kernels will see them: between NaN guard bands, head-major if permuted."""

    def __init__(self, case):
        self.case = case
        self.buffers = []

    def __call__(self, x, name):
        case = self.case
        x = numpy.asarray(x)
        order = None
        if case.permuted and x.ndim >= case.rank + 2 and x.shape[0] == case.batch:
            _, order = gpu_cases._head_major(x.shape, case.rank)
            x = x.transpose(numpy.argsort(order))
        flat = numpy.full(x.size + 2 * GUARD, numpy.nan, dtype=x.dtype)
        inner = flat[GUARD:GUARD + x.size].reshape(x.shape)
        inner[...] = x
        self.buffers.append((name, flat, x.size))
        return inner if order is None else inner.transpose(order)

    def check_guards(self):
        for name, flat, n in self.buffers:
            spoiled = ~numpy.isnan(numpy.concatenate([flat[:GUARD], flat[GUARD + n:]]))
            assert not spoiled.any(), (
                f"[{self.case.id}] {name}: {int(spoiled.sum())} guard elements around the "
                "array were overwritten (out-of-bounds write)")


def _run_case(case, emu, monkeypatch, max_grid=None):
    x, truth, yard = gpu_cases.references(case)
    place = Placement(case)
    xd = {n: place(a, n) for n, a in x.items()}
    if case.permuted and "q" in xd:
        assert not xd["q"].flags.c_contiguous
    made = iter(range(1000))
    monkeypatch.setattr(gpu_cases, "poisoned", lambda xp, shape, dtype, c: place(
        numpy.full(shape, numpy.nan, dtype), f"output {next(made)}"))
    emu.max_grid = max_grid
    emu.launches.clear()
    y = gpu_cases.run(case, naive, xd, numpy)
    assert emu.launches, "nothing was launched"
    got = {n: gpu_cases.to_host(a) for n, a in y.items()}
    gpu_cases.compare(case, got, truth, yard, where=f"[emulated {case.id}, grid "
                      f"{'as launched' if max_grid is None else f'<= {max_grid}'}] ")
    place.check_guards()


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_naive_kernels_emulated(index, emu, monkeypatch):
    _run_case(CASES[index], emu, monkeypatch, GRIDS[index % len(GRIDS)])


@pytest.mark.parametrize("index", range(len(GQA_CASES)), ids=[c.id for c in GQA_CASES])
def test_naive_gqa_kernels_emulated(index, emu, monkeypatch):
    """Grouped-query / multi-query attention: kv heads read by their query groups, dk and dv
    summed over each group (every op kind x rank x dtype); and fused ops whose values have a
    head dim of their own (Dv != D)."""
    _run_case(GQA_CASES[index], emu, monkeypatch, GRIDS[index % len(GRIDS)])


def test_subset_covers_the_suite():
    """Every op kind, rank and dtype, with causal (mixed), dilation, stride, even kernels,
    permuted layouts and a head dim that is not a multiple of 8."""
    assert {(c.kind, c.rank, c.dtype) for c in CASES} == {
        (k, r, d) for k in gpu_cases.KINDS for r in (1, 2, 3) for d in gpu_cases.DTYPES}
    for rank in (1, 2, 3):
        mine = [c for c in CASES if c.rank == rank]
        assert any(all(c.causal) for c in mine) and any(not any(c.causal) for c in mine)
        assert any(any(k % 2 == 0 for k in c.kernel) for c in mine)
        assert any(any(d > 1 for d in c.dilation) for c in mine)
        assert any(any(s > 1 for s in c.stride) for c in mine if c.fused)
        assert any(c.permuted for c in mine)
        if rank > 1:
            assert any(len(set(c.causal)) > 1 for c in mine)
    assert any(c.head_dim % 8 for c in CASES)
    assert {c.dtype for c in CASES if c.permuted} == set(gpu_cases.DTYPES)


def test_params_layout_matches(emu):
    """NAParams as g++ lays it out == natten_cupy._params.PARAMS_DTYPE (what CuPy passes)."""
    offsets, size = emu.params_layout()
    names = ["extent", "kernel", "stride", "dilation", "causal", "batch", "heads", "head_dim",
             "num_neighbors", "kv_heads", "heads_per_kv", "v_dim", *TENSOR_FIELDS, "scale", "pad_",
             "scale_f64", "extra_tokens", "extra_heads", "heads_per_extra", *EXTRA_FIELDS]
    assert list(PARAMS_DTYPE.names) == names
    assert offsets == [PARAMS_DTYPE.fields[n][1] for n in names]
    assert size == PARAMS_DTYPE.itemsize


def test_harness_checks_launch_arguments(emu):
    """Wrong argument counts, element sizes and pointers are refused, not run."""
    q = numpy.zeros((2, 4, 1, 8), numpy.float32)
    params = numpy.zeros((), PARAMS_DTYPE)[()]
    fn = emu.get_kernel(naive.SOURCE, "na_av_naive<float, 1>")
    with pytest.raises(emulator.EmulationError, match="takes 4 arguments"):
        fn((1,), (32,), (q, q, params))
    with pytest.raises(emulator.EmulationError, match="argument 1"):
        fn((1,), (32,), (q, q.astype(numpy.float64), q, params))
    with pytest.raises(emulator.EmulationError, match="non-null"):
        fn((1,), (32,), (q, numpy.uint64(64), q, params))
    with pytest.raises(emulator.EmulationError, match="unexpected launch shape"):
        emu.launch(fn, (1,), (128,), (q, q, q, params))


# ---- planted bugs (on request: NATTEN_CUPY_EMULATOR_MUTANTS=1) ------------------------------

# (file under cuda_src, original text, replacement, what it breaks)
MUTANTS = [
    ("na_naive.cu", "return (i64)blockIdx.x * blockDim.x + threadIdx.x;",
     "return (i64)threadIdx.x;", "grid-stride start ignores the block"),
    ("na_naive.cu", "for (int width = 16; width > 0; width >>= 1) sum +=",
     "for (int width = 8; width > 0; width >>= 1) sum +=", "d_rpb warp sum misses half"),
    ("na_naive.cu", "for (int width = 16; width > 0; width >>= 1) sum +=",
     "for (int width = 16; width > 0; width >>= 1) if (lane < 16) sum +=",
     "divergent shuffle"),
    ("na_naive.cu", "return (int)((p.head_dim + kChunk - 1) / kChunk);",
     "return (int)(p.head_dim / kChunk);", "fused kernels drop the last partial chunk"),
    ("na_naive.cu", "(m + log2_of(l)) * (A)kLn2", "(m + log2_of(l))", "lse in log2 units"),
    ("na_naive.cu", "    out[at(so, row, row.x, slot)] = store_as<T>(value);",
     "    out[at(so, row, row.x, slot)] = store_as<T>(value);\n"
     "    if (idx == total - 1) out[at(so, row, row.x, slot) + 1] = store_as<T>(value);",
     "qk writes one element past the end"),
    ("natten/window.cuh", "const int leader = min(leader_base + stride - 1, glen - 1);",
     "const int leader = min(leader_base, glen - 1);", "causal stride leader"),
    ("natten/window.cuh", "start = min(max(leader - kernel / 2, 0), glen - kernel);",
     "start = max(leader - kernel / 2, 0);", "no border shift"),
]


@pytest.mark.skipif(not os.environ.get("NATTEN_CUPY_EMULATOR_MUTANTS"),
                    reason="planted-bug check runs on request: NATTEN_CUPY_EMULATOR_MUTANTS=1")
@pytest.mark.parametrize("mutant", range(len(MUTANTS)), ids=[m[3] for m in MUTANTS])
def test_planted_bugs_are_caught(mutant, tmp_path, monkeypatch):
    why = emulator.unbuildable_reason()
    if why:
        pytest.skip(why)
    path, old, new, what = MUTANTS[mutant]
    src = tmp_path / "cuda_src"
    shutil.copytree(emulator.ROOT / "cuda_src", src)
    text = (src / path).read_text()
    assert text.count(old) == 1, f"mutation site of {what!r} not found once in {path}"
    (src / path).write_text(text.replace(old, new))
    lib = emulator.build(tmp_path / "build", cuda_src=src)
    e = emulator.Emulator(lib, block=naive.BLOCK, max_blocks=naive.MAX_BLOCKS)
    monkeypatch.setattr(naive, "get_kernel", e.get_kernel)
    monkeypatch.setattr(naive, "launch", e.launch)
    for index, case in enumerate(CASES):
        try:
            with monkeypatch.context() as m:
                _run_case(case, e, m, GRIDS[index % len(GRIDS)])
        except (AssertionError, emulator.EmulationError):
            return  # caught
    pytest.fail(f"planted bug {what!r} went unnoticed by all {len(CASES)} cases")
