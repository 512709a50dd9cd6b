"""Window arithmetic (``natten_cupy._window``) against SPEC's worked examples and brute force."""

import numpy
import pytest

from natten_cupy import _window

import oracle

# SPEC section 1, worked examples: (L, k, s, d, causal) -> keys each query sees.
SPEC_EXAMPLES = [
    ((7, 3, 1, 1, False), {0: [0, 1, 2], 1: [0, 1, 2], 2: [1, 2, 3], 3: [2, 3, 4],
                           4: [3, 4, 5], 5: [4, 5, 6], 6: [4, 5, 6]}),
    ((7, 4, 1, 1, False), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [0, 1, 2, 3],
                           3: [1, 2, 3, 4], 4: [2, 3, 4, 5], 5: [3, 4, 5, 6],
                           6: [3, 4, 5, 6]}),
    ((7, 3, 1, 2, False), {0: [0, 2, 4], 1: [1, 3, 5], 2: [0, 2, 4], 3: [1, 3, 5],
                           4: [2, 4, 6], 5: [1, 3, 5], 6: [2, 4, 6]}),
    ((5, 3, 1, 1, True), {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [1, 2, 3], 4: [2, 3, 4]}),
    ((8, 4, 2, 1, False), {0: [0, 1, 2, 3], 1: [0, 1, 2, 3], 2: [1, 2, 3, 4],
                           3: [1, 2, 3, 4], 4: [3, 4, 5, 6], 5: [3, 4, 5, 6],
                           6: [4, 5, 6, 7], 7: [4, 5, 6, 7]}),
]


def _valid_keys(keys, valid, i):
    return [int(j) for j, ok in zip(keys[i], valid[i]) if ok]


@pytest.mark.parametrize("args,expected", SPEC_EXAMPLES, ids=lambda x: str(x)[:20])
def test_spec_worked_examples(args, expected):
    keys, valid = _window.forward_table(*args)
    L, k = args[0], args[1]
    assert keys.shape == valid.shape == (L, k)
    assert {i: _valid_keys(keys, valid, i) for i in range(L)} == expected


@pytest.mark.parametrize("args,expected", SPEC_EXAMPLES, ids=lambda x: str(x)[:20])
def test_oracle_matches_spec_examples(args, expected):
    """The oracle's own window rules reproduce SPEC's table (guards the oracle itself)."""
    assert {i: oracle.axis_keys(i, *args) for i in range(args[0])} == expected


def _random_axes(rng, count):
    cases = []
    while len(cases) < count:
        k = int(rng.integers(2, 8))
        d = int(rng.integers(1, 4))
        L = int(rng.integers(k * d, k * d + 12))
        s = int(rng.integers(1, k + 1))
        cases.append((L, k, s, d, bool(rng.integers(2))))
    return cases


AXES = _random_axes(numpy.random.default_rng(1234), 300)


def test_random_axes_cover_the_cases():
    assert {k % 2 for _, k, *_ in AXES} == {0, 1}
    assert {c for *_, c in AXES} == {False, True}
    assert any(s == k for _, k, s, _, _ in AXES) and any(d > 1 for *_, d, _ in AXES)


@pytest.mark.parametrize("L,k,s,d,causal", AXES)
def test_forward_table_against_oracle(L, k, s, d, causal):
    keys, valid = _window.forward_table(L, k, s, d, causal)
    for i in range(L):
        seen = _valid_keys(keys, valid, i)
        assert seen == oracle.axis_keys(i, L, k, s, d, causal)
        # Every key is in the query's dilation group, and valid slots come first.
        assert all(j % d == i % d for j in seen)
        assert valid[i, :len(seen)].all() and not valid[i, len(seen):].any()
        if not causal:
            assert len(seen) == k
        else:
            assert i in seen and max(seen) == i
    # Empty slots still hold an in-range coordinate (safe to gather).
    assert (keys >= 0).all() and (keys < L).all()


@pytest.mark.parametrize("L,k,s,d,causal", AXES)
def test_inverse_table_against_brute_force(L, k, s, d, causal):
    queries, slots, valid = _window.inverse_table(L, k, s, d, causal)
    assert queries.shape == slots.shape == valid.shape
    # Brute force: key j is in slot t of query i's window.
    expected = {j: set() for j in range(L)}
    for i in range(L):
        _, start, end = oracle.axis_window(i, L, k, s, d, causal)
        for t in range(end - start):
            expected[i % d + d * (start + t)].add((i, t))
    for j in range(L):
        got = [(int(i), int(t)) for i, t, ok in zip(queries[j], slots[j], valid[j]) if ok]
        assert len(got) == len(set(got))
        assert set(got) == expected[j]
        # Queries form a contiguous in-group range (the property the kernels rely on).
        ig = sorted(i // d for i, _ in got)
        assert ig == list(range(ig[0], ig[0] + len(ig)))
        # Padding repeats a valid entry, so gathering through it stays in range.
        for i, t in zip(queries[j][~valid[j]], slots[j][~valid[j]]):
            assert (int(i), int(t)) in expected[j]
    assert valid.sum(axis=1).max() == queries.shape[1]


@pytest.mark.parametrize("L,k,s,d,causal", AXES[:40])
def test_window_bounds_scalar_matches_vector(L, k, s, d, causal):
    for i in range(L):
        g, ig = i % d, i // d
        start, end = _window.window_bounds(ig, _window.group_size(L, d, g), k, s, causal)
        assert (int(start), int(end)) == oracle.axis_window(i, L, k, s, d, causal)[1:]


@pytest.mark.parametrize("L,k,s,d,causal", AXES[:60])
@pytest.mark.parametrize("inverse", [False, True])
def test_box_span_against_brute_force(L, k, s, d, causal, inverse):
    """The largest span of a box of rows (what the fused launchers size key halos by): the
    union of its rows' windows, or of its keys' inverse windows, from the oracle."""
    def in_group(i):   # in-group indices of query i's keys (window), as the oracle has them
        g, start, end = oracle.axis_window(i, L, k, s, d, causal)
        return set(range(start, end))
    for rows in (1, 2, 3, 8):
        best = 1
        for g in range(d):
            members = list(range(g, L, d))
            for b in range(0, len(members), rows):
                box = members[b:b + rows]
                if inverse:   # the in-group queries whose windows hold a key of the box
                    reach = {i // d for i in members if in_group(i) & {j // d for j in box}}
                else:
                    reach = set().union(*(in_group(i) for i in box))
                best = max(best, max(reach) - min(reach) + 1)
        assert _window.box_span(L, k, s, d, causal, rows, inverse) == best, rows


def test_group_size():
    assert [_window.group_size(7, 2, g) for g in range(2)] == [4, 3]
    assert [_window.group_size(9, 3, g) for g in range(3)] == [3, 3, 3]
    assert [_window.group_size(10, 3, g) for g in range(3)] == [4, 3, 3]


WINDOW_CHECK = r"""
#include "cuda_shim.h"
#include "natten/window.cuh"
#include <cstdio>
// Every in-group key's inverse range against brute force over the queries' windows.
int main() {
  long checked = 0;
  for (int glen = 1; glen <= 48; ++glen)
    for (int kernel = 1; kernel <= glen; ++kernel)
      for (int stride = 1; stride <= kernel && stride <= 4; ++stride)
        for (int causal = 0; causal < 2; ++causal) {
          natten::Axis ax{glen, kernel, stride, 1, causal};
          for (int j = 0; j < glen; ++j) {
            int lo, hi;
            ax.inverse_window(j, glen, lo, hi);
            for (int i = 0; i < glen; ++i) {
              int s, e;
              ax.window(i, glen, s, e);
              if ((s <= j && j < e) != (lo <= i && i < hi)) {
                std::printf("L=%d k=%d s=%d causal=%d key %d: [%d, %d) but query %d\n", glen,
                            kernel, stride, causal, j, lo, hi, i);
                return 1;
              }
              ++checked;
            }
          }
        }
  std::printf("%ld\n", checked);
  return 0;
}
"""


def test_window_cuh_inverse_ranges_match_brute_force(tmp_path):
    """cuda_src/natten/window.cuh itself, compiled for the host: every key's inverse range
    (the stride-1 closed forms and the bisections of other strides) holds exactly the queries
    whose windows hold the key, for every extent up to 48, kernel, stride up to 4, causal."""
    import subprocess

    import emulator
    why = emulator.unbuildable_reason()
    if why:
        pytest.skip(why)
    src = tmp_path / "window_check.cpp"
    src.write_text(WINDOW_CHECK)
    exe = tmp_path / "window_check"
    cuda_src = emulator.ROOT / "cuda_src"
    subprocess.run([emulator.compiler(), "-O1", "-std=c++17", f"-I{emulator.HERE / 'include'}",
                    f"-I{cuda_src}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    assert int(done.stdout) > 100_000
