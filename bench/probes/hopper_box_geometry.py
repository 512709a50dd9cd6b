"""Scores the Hopper forward computes per useful score, per query box, over a whole problem.

A Hopper forward CTA owns a box of queries (``wgmma_forward._box``: 128 queries with two
compute warpgroups, or ``SMALL_BOX``'s 64 with one) and computes every query of the box
against every key of its key region (per axis, from the first query's window start to the
last one's window end), walked in tiles of BN keys: ceil(region / BN) flat tiles, or (rank 2,
3, key boxes of the query box's shape) the product of ceil(region_a / box_a). This probe adds
that work up over every CTA of a workload, borders, dilation groups and causal axes included,
and divides by the useful scores (each query's own window): the work per useful score before
any instruction is spent, for each box, the walk ``_plan`` would pick, and which box the
dispatch takes (``_default_tile``). No GPU needed.

    python bench/probes/hopper_box_geometry.py [--workloads 2D-33,M5,W2b,3D-D128,M4,M7,2D-D64]
"""

import argparse
import math
import os
import sys

import numpy

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from natten_cupy import _args  # noqa: E402
from natten_cupy._window import box_ranges, group_size, window_bounds  # noqa: E402
from natten_cupy.backends.fused import wgmma_forward as F  # noqa: E402
from workloads import probe_workload  # noqa: E402

DEFAULT = "2D-33,M5,W2b,3D-D128,M4,M7,2D-D64"


def axis_regions(L, k, s, d, causal, t):
    """Per box along one axis (every dilation group): (region keys, useful keys summed over
    the box's queries, queries)."""
    out = []
    for g in range(d):
        glen = group_size(L, d, g)
        first, last, start, end = box_ranges(glen, k, s, causal, t)
        ws, we = window_bounds(numpy.arange(glen), glen, k, s, causal)
        per_query = we - ws
        for a, b, r in zip(first, last, end - start):
            out.append((int(r), int(per_query[a:b + 1].sum()), int(b - a + 1)))
    return out


def work(w, tile, walk_boxes):
    """(computed scores, useful scores) of the forward of workload ``w`` with ``tile``."""
    box = F._box(w.rank, tile)
    axes = [axis_regions(L, k, s, d, c, t) for L, k, s, d, c, t in
            zip(w.spatial, w.kernel, w.stride, w.dilation, w.causal, box)]
    computed = useful = 0
    for combo in numpy.ndindex(*[len(a) for a in axes]):
        parts = [axes[a][i] for a, i in enumerate(combo)]
        region = [p[0] for p in parts]
        tiles = (math.prod(-(-r // b) for r, b in zip(region, box)) if walk_boxes
                 else -(-math.prod(region) // tile.bn))
        computed += tile.bm * tiles * tile.bn
        # useful: per query the product of its per-axis window lengths, summed over the box
        useful += math.prod(p[1] for p in parts)
    return computed, useful


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=DEFAULT)
    args = ap.parse_args(argv)
    print(f"{'workload':>9} {'box':>12} {'walk':>5} {'computed/useful':>16} {'CTAs/head':>10}")
    for wid in args.workloads.split(","):
        w = probe_workload(wid)
        x = numpy.zeros((1, *w.spatial, 1, w.dim), numpy.float16)
        prob = _args.check_fused(w.rank, x, x, x, w.kernel, w.stride, w.dilation, w.causal,
                                 None, "fused")
        dp = F._bucket(w.dim)
        big = F.DEFAULT_ND if w.rank > 1 else F._default_tile(prob)
        for name, tile in (("default", big), ("small", F.SMALL_BOX[dp])):
            picked = F._plan(prob, tile).name.endswith("true, false>")
            c, u = work(w, tile, picked)
            ctas = F._plan(prob, tile).grid[0]
            box = "x".join(map(str, F._box(w.rank, tile)[:w.rank]))
            chosen = "  (dispatched)" if tile == F._default_tile(prob) else ""
            print(f"{wid:>9} {name + ' ' + box:>12} {'boxes' if picked else 'flat':>5} "
                  f"{c / u:16.2f} {ctas:10d}{chosen}")


if __name__ == "__main__":
    main()
