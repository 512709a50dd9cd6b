"""Scores a warp patch computes per useful score, for every patch shape of a workload's rank.

The mma.sync fused kernels give each warp a patch of queries (16: one m16 row tile; 32 would
be two) and compute the scores of every patch query against every key of the patch's halo,
the union of its queries' windows; only the keys inside a query's own window are useful.
Away from the borders (stride 1, no dilation) the halo of patch p under kernel k is
prod(p_a + k_a - 1) keys; the line walk pads the last axis to a multiple of 8 (its n8 groups).
So the ratio halo / window is the work per useful score before any instruction is spent (it
grows with the patch: two m16 tiles per warp would reuse each key fragment twice, but compute
more scores per useful one), and a kernel bound by instruction issue pays it directly: this is
why the 3-D workload W3 (3x5x5, at best 2.56) costs more per useful FLOP than the 2-D W2 (9x9,
1.98 with the line walk's 2x8 patches) at equal tokens. No GPU needed.

    python bench/probes/patch_geometry.py [--workloads W2,W3,W3b,M1,M4,M7] [--queries 16,32]
"""

import argparse
import itertools
import math
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from workloads import probe_workload  # noqa: E402


def patches(rank, queries):
    """Every shape of ``queries`` queries over ``rank`` axes (powers of two per axis)."""
    exps = int(math.log2(queries))
    for split in itertools.product(range(exps + 1), repeat=rank):
        if sum(split) == exps:
            yield tuple(2 ** e for e in split)


def halo(patch, kernel, lines):
    """Keys of a patch's halo away from the borders; ``lines``: last axis padded to 8."""
    dims = [p + k - 1 for p, k in zip(patch, kernel)]
    if lines:
        dims[-1] = -(-dims[-1] // 8) * 8
    return math.prod(dims)


def rows(workload, queries):
    """Per patch shape: (patch, halo, halo with lines, scores per useful score flat/lines)."""
    window = math.prod(workload.kernel)
    out = []
    for q in queries:
        for p in patches(workload.rank, q):
            if any(x > 2 * e for x, e in zip(p, workload.spatial)):
                continue   # longer than the map along an axis: never a full patch
            h, hl = halo(p, workload.kernel, False), halo(p, workload.kernel, True)
            out.append((p, h, hl, h / window, hl / window))
    return sorted(out, key=lambda r: (math.prod(r[0]), r[3]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W2,W3,W3b,M1,M4,M7")
    ap.add_argument("--queries", default="16,32", help="patch sizes (queries per warp)")
    ap.add_argument("--top", type=int, default=3, help="best shapes shown per patch size")
    args = ap.parse_args(argv)
    queries = [int(x) for x in args.queries.split(",")]
    for wid in args.workloads.split(","):
        w = probe_workload(wid)
        print(f"{wid}: {w.describe()} (window {math.prod(w.kernel)} keys)")
        for q in queries:
            best = [r for r in rows(w, [q])][:args.top]
            for p, h, hl, ratio, ratio_l in best:
                print(f"  {q:>2} queries {'x'.join(map(str, p)):>8}: halo {h:>5} keys, "
                      f"{ratio:5.2f} scores per useful one ({ratio_l:5.2f} with 8-key lines)")


if __name__ == "__main__":
    main()
