"""Where the Hopper fused forward beats the mma.sync one: kernel times over a grid of shapes.

    python bench/probes/hopper_dispatch.py [--reps 15] [--out dispatch.json] [--grid d32|d256]

Per shape (1-D, 2-D and 3-D; windows from small to large; head dims 64 and 128, or with
``--grid d32`` large windows at head dim 32, with ``--grid d256`` head dims 160 and 256 in
1-D, 2-D and 3-D (the 3-D tile switched on: ``WIDE_3D``); float16) and
with and without a relative positional bias, both forward parts are called directly on the
same inputs and timed kernels alone (CUDA events around each launch through the library's
profiler hook, ``timing.kernel_ms``: host time between calls does not count; median
after a warm-up), so that the dispatch rule of
``natten_cupy.backends.fused._hopper_serves`` can be read off the table: the ratio
mma.sync / wgmma is printed per row (above 1: the Hopper kernel is faster).
"""

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH, os.path.join(BENCH, "probes")]

import cupy  # noqa: E402

from natten_cupy import _args  # noqa: E402
from natten_cupy.profile_cli import random_array  # noqa: E402
from timing import kernel_ms, save_rows  # noqa: E402
from workloads import DISPATCH_GRID, DISPATCH_GRID_D32, DISPATCH_GRID_D256  # noqa: E402

# --grid: (shapes, head dims, bias rows too)
GRIDS = {"default": (DISPATCH_GRID, (64, 128), True), "d32": (DISPATCH_GRID_D32, (32,), True),
         "d256": (DISPATCH_GRID_D256, (160, 256), False)}


def run(spatial, kernel, batch, heads, dim, bias, reps):
    from natten_cupy.backends.fused import mma_forward, wgmma_forward
    rank = len(spatial)
    shape = (batch, *spatial, heads, dim)
    q, k, v = (random_array(cupy, shape, "float16", i) for i in range(3))
    rpb = (random_array(cupy, (heads, *(2 * x - 1 for x in kernel)), "float16", 7)
           if bias else None)
    problem = _args.check_fused(rank, q, k, v, kernel, 1, 1, False, None, "fused", rpb=rpb)
    row = dict(spatial=list(spatial), kernel=list(kernel), batch=batch, heads=heads, dim=dim,
               bias=bias)
    out, lse = cupy.empty_like(q), cupy.empty(shape[:-1], cupy.float32)
    kw = {} if rpb is None else {"rpb": rpb}
    small = wgmma_forward.SMALL_BOX.get(wgmma_forward._bucket(dim))
    runs = [("wgmma", wgmma_forward, {}), ("mma.sync", mma_forward, {})]
    if rank > 1 and not bias and small is not None:
        runs.append(("wgmma+small", wgmma_forward, {"tile": small}))
    for name, part, tile in runs:
        why = part.refuse(problem)
        if why:
            row[name] = f"refused: {why}"[:200]
            continue
        row[name] = round(kernel_ms(lambda: part.forward(problem, q, k, v, out, lse, **kw,
                                                         **tile), reps), 4)
    for name in ("wgmma", "wgmma+small"):
        if isinstance(row.get(name), float) and isinstance(row["mma.sync"], float):
            row[f"mma/{name}"] = round(row["mma.sync"] / row[name], 3)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ranks", default="1,2,3", help="ranks of the grid to time")
    ap.add_argument("--no-bias", action="store_true", help="skip the rows with a bias")
    ap.add_argument("--grid", choices=tuple(GRIDS), default="default",
                    help="d32: the large windows of DISPATCH_GRID_D32 at head dim 32; d256: "
                         "DISPATCH_GRID_D256 at head dims 160 and 256")
    args = ap.parse_args(argv)
    ranks = {int(r) for r in args.ranks.split(",")}
    grid, dims, biased = GRIDS[args.grid]
    if args.grid == "d256":   # the head-dim-256 tile in 3-D, whatever WIDE_3D's default
        from natten_cupy.backends.fused import wgmma_forward
        wgmma_forward.WIDE_3D = True
    rows = []
    for spatial, kernels, batch, heads in grid:
        if len(spatial) not in ranks:
            continue
        for kernel in kernels:
            for dim in dims:
                for bias in ((False,) if args.no_bias or not biased else (False, True)):
                    row = run(spatial, kernel, batch, heads, dim, bias, args.reps)
                    rows.append(row)
                    print(f"{str(tuple(spatial)):>14} k{str(tuple(kernel)):<12} D{dim:<4} "
                          f"{'rpb ' if bias else '    '} wgmma {row['wgmma']!s:>8}  "
                          f"mma.sync {row['mma.sync']!s:>8}  mma/wgmma "
                          f"{row.get('mma/wgmma', '-')}"
                          + (f"  small {row['wgmma+small']!s:>8}  mma/small "
                             f"{row.get('mma/wgmma+small', '-')}" if "wgmma+small" in row
                             else ""), flush=True)
    if args.out:
        save_rows(args.out, rows)


if __name__ == "__main__":
    main()
