"""Small cases of every kernel family, to run under compute-sanitizer (``bench/sanitize.py``).

Families, each op x rank x dtype x tile variant on tiny problems (a few CTAs):

* ``naive``: fused forward + backward, qk (+rpb), av, qk_backward (+d_rpb), av_backward;
  float64, float32, float16, bfloat16; head dims of two chunks (partial last chunk);
* ``tiled``: the four unfused ops (+rpb) on float32 (exact), TF32, float16, bfloat16, head
  dims 8..256 (every scores/weighted-sum bucket) and 1, 3, 8 heads;
* ``fused``: forward + backward on float16, bfloat16, TF32 (every head-dim bucket, each
  rank's alternative CTA tiles for float16/bfloat16 up to head dim 64, and a window whose
  key halo does not fit shared memory, so the streamed path runs) and exact float32 (head
  dims 4..256: every lane count);
* ``softmax``: forward + backward, rows of 9..3000 slots (row kernels, register-held and
  streamed lane-group kernels), 16-byte aligned and misaligned, every dtype.

The families are interleaved, so a run cut short by ``--time-budget-s`` still reaches each.
CuPy's memory pools are off while it runs (``cupy.cuda.set_allocator(None)``): pooled
blocks would hide out-of-bounds accesses from memcheck. Outputs start NaN and must hold no
NaN afterwards (every element written); the sanitizer judges the memory accesses.

    compute-sanitizer --tool memcheck python3 bench/sanitize_cases.py --out cases.json

``--list`` prints the cases; ``--families`` picks some; ``--limit`` keeps the first N.
The JSON names the cases run, the kernels they used (fetched through ``get_kernel``), and
the registered instantiations that no case used.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
import time
import traceback

import numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import sweep  # noqa: E402  (bench/sweep.py: configs, inputs, poisoned runs)

from natten_cupy import _compile, _softmax  # noqa: E402
from natten_cupy.backends import NAMES, get_backend  # noqa: E402

FAMILIES = ("naive", "tiled", "fused", "softmax")

GEOMS = {
    1: [((13,), (5,), (1,), (1,), (False,)), ((17,), (4,), (2,), (2,), (True,))],
    2: [((7, 9), (3, 4), (1, 2), (1, 2), (False, True)),
        ((9, 6), (5, 3), (2, 1), (1, 2), (True, False))],
    3: [((5, 6, 7), (3, 2, 4), (1, 2, 3), (1, 2, 1), (False, True, False)),
        ((6, 5, 5), (2, 3, 3), (1, 1, 3), (2, 1, 1), (True, False, True))],
}
# Windows whose key halo exceeds the fused forward's single shared-memory buffer.
STREAMED = {1: ((300,), (255,), (1,), (1,), (False,)),
            2: ((40, 40), (31, 31), (1, 1), (1, 1), (False, True)),
            3: ((12, 12, 12), (9, 9, 9), (1, 1, 1), (1, 1, 1), (False, False, False))}
UNFUSED = ("qk", "av", "qk_backward", "av_backward")


def _case(backend, dtype, kind, geom, head_dim, *, batch=2, heads=2, tile=None, n=0):
    spatial, kernel, stride, dilation, causal = geom
    if kind != "fused":
        stride = (1,) * len(spatial)
    return {"backend": backend, "dtype": dtype, "kind": kind, "rank": len(spatial),
            "spatial": list(spatial), "kernel": list(kernel), "stride": list(stride),
            "dilation": list(dilation), "causal": list(causal), "batch": batch,
            "heads": heads, "head_dim": head_dim, "rpb": kind in ("qk", "qk_backward"),
            "scale": None, "permuted": n % 3 == 2, "input_seed": 1000 + n, "tile": tile,
            "index": n, "seed": 0}


def naive_cases():
    out = []
    for dt in ("float64", "float32", "float16", "bfloat16"):
        for rank in (1, 2, 3):
            for i, kind in enumerate(("fused",) + UNFUSED):
                d = 20 if dt == "float64" else 40     # two head-dim chunks, the last partial
                out.append(_case("naive", dt, kind, GEOMS[rank][i % 2], d, n=len(out)))
    return out


def tiled_cases():
    out = []
    dims = (8, 32, 64, 128, 256)
    for dt in ("float16", "bfloat16", "float32", "tf32"):
        for rank in (1, 2, 3):
            for i, kind in enumerate(UNFUSED):
                for d in dims:
                    heads = (1, 3, 8)[(i + d) % 3]
                    out.append(_case("tiled", dt, kind, GEOMS[rank][(i + d) % 2], d,
                                     batch=1, heads=heads, n=len(out)))
    return out


def fused_cases():
    from natten_cupy.backends.fused import mma_forward
    out = []
    for dt in ("float16", "bfloat16", "tf32"):
        for rank in (1, 2, 3):
            for d in (32, 64, 128, 256):
                out.append(_case("fused", dt, "fused", GEOMS[rank][d % 3 % 2], d, n=len(out)))
                if d <= 64 and dt != "tf32":
                    default = mma_forward.DEFAULT[(rank, mma_forward._bucket(d))]
                    for cfg in (c for c in mma_forward.CONFIGS[rank] if c != default):
                        out.append(_case("fused", dt, "fused", GEOMS[rank][1], d,
                                         tile=list(cfg.box[:rank]), n=len(out)))
            if dt == "float16":
                out.append(_case("fused", dt, "fused", STREAMED[rank], 64, batch=1, heads=1,
                                 n=len(out)))
    for rank in (1, 2, 3):
        for i, d in enumerate((4, 8, 16, 32, 64, 128, 256)):
            out.append(_case("fused", "float32", "fused", GEOMS[rank][i % 2], d, n=len(out)))
    return out


def softmax_cases():
    out = []
    for dt in ("float64", "float32", "float16", "bfloat16"):
        for k in (9, 81, 200, 600, 3000):
            for aligned in (True, False):
                out.append({"backend": "softmax", "dtype": dt, "kind": "softmax", "K": k,
                            "rows": 40, "aligned": aligned, "input_seed": len(out)})
    return out


BUILDERS = {"naive": naive_cases, "tiled": tiled_cases, "fused": fused_cases,
            "softmax": softmax_cases}


def all_cases(families=FAMILIES):
    """The cases of ``families``, interleaved (one of each family in turn)."""
    lists = [BUILDERS[f]() for f in families]
    return [c for group in itertools.zip_longest(*lists) for c in group if c is not None]


def case_name(c):
    if c["kind"] == "softmax":
        return f"softmax/{c['dtype']} K{c['K']}{'' if c['aligned'] else ' misaligned'}"
    axes = "x".join(map(str, c["spatial"]))
    tile = f" tile {c['tile']}" if c.get("tile") else ""
    return (f"{c['backend']}/{c['dtype']} {c['kind']} {c['rank']}d L{axes} "
            f"k{'x'.join(map(str, c['kernel']))} D{c['head_dim']} H{c['heads']}{tile}")


# ---- runs -------------------------------------------------------------------------------

def run_softmax(c, dev):
    import natten_cupy
    cupy = dev.xp
    rng = numpy.random.default_rng(c["input_seed"])
    dt = sweep.NP_DTYPES[c["dtype"]]
    host = (2 * rng.standard_normal((c["rows"], c["K"]))).astype(dt)
    host[::3, c["K"] // 2:] = -numpy.inf
    host[1] = -numpy.inf                      # a row of only empty slots
    grads = rng.standard_normal(host.shape).astype(dt)

    def put(a):
        x = dev.put(a, False, 1)
        if c["aligned"]:
            return x
        word = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[a.dtype.itemsize]
        buf = cupy.empty(a.size + 8, dtype=x.dtype)
        view = buf[1:1 + a.size].reshape(a.shape)   # one element past 16-byte alignment
        view.view(word)[...] = x.view(word)
        return view
    p = natten_cupy.softmax(put(host), 0.7)
    dx = natten_cupy.softmax_backward(p, put(grads), 0.7)
    dev.sync()
    return {"probs": p, "d_x": dx}


def run_one(c, dev):
    """Run case ``c``; returns None, or why the backend refused it."""
    if c["kind"] == "softmax":
        y = run_softmax(c, dev)
    else:
        backend = get_backend(c["backend"])
        x = sweep.make_inputs(c)
        why = sweep.refusal(c, backend, x)
        if why is not None:
            return why
        xd = {n: dev.put(a, c["permuted"] and n != "rpb", c["rank"]) for n, a in x.items()}
        y = sweep.run(c, backend, xd, dev, c["permuted"])
        dev.sync()
    for name, a in y.items():
        h = dev.get(a)
        if numpy.isnan(h).any():
            raise AssertionError(f"{name}: {int(numpy.isnan(h).sum())} of {h.size} elements "
                                 "unwritten or NaN")
    return None


def registered():
    """Every kernel name expression the backends and softmax can compile."""
    names = set()
    for b in NAMES:
        mod = get_backend(b)
        if mod is not None:
            names.update(expr for _, expr in mod.instantiations())
    names.update(expr for _, expr in _softmax.instantiations())
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--limit", type=int, default=0, help="run only the first N cases")
    ap.add_argument("--time-budget-s", type=float, default=600.0)
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--out", default=None, help="JSON of the run")
    a = ap.parse_args(argv)
    families = [f for f in a.families.split(",") if f]
    bad = set(families) - set(FAMILIES)
    if bad:
        ap.error(f"unknown families {sorted(bad)} (choose from {', '.join(FAMILIES)})")
    cases = all_cases(families)
    if a.limit:
        cases = cases[:a.limit]
    if a.list:
        for c in cases:
            print(case_name(c))
        print(f"{len(cases)} cases")
        return 0

    import cupy
    cupy.cuda.set_allocator(None)             # no pool: memcheck sees every allocation
    cupy.cuda.set_pinned_memory_allocator(None)
    dev = sweep.Device("cuda")
    t0 = time.time()
    ran, refused, failures = 0, [], []
    out_of_time = False
    for c in cases:
        if time.time() - t0 >= a.time_budget_s:
            out_of_time = True
            break
        try:
            why = run_one(c, dev)
        except Exception as exc:  # noqa: BLE001 - reported, then the next case runs
            failures.append({"case": case_name(c), "config": c,
                             "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc(limit=5)})
            print(f"FAILED {case_name(c)}: {type(exc).__name__}: {exc}", flush=True)
            if sweep._fatal(exc):
                break
            ran += 1
            continue
        if why is not None:
            refused.append(f"{case_name(c)}: {why}")
        else:
            ran += 1
    # Kernels fetched through get_kernel (no launch recorder: with one, plans would take the
    # profiler's launch path instead of their own).
    used = {key[1] for key in _compile.compiled_keys()}
    never = sorted(registered() - used)
    print(f"CASES RUN {ran} of {len(cases)} ({len(refused)} refused, {len(failures)} failed"
          f"{', out of time' if out_of_time else ''}) in {time.time() - t0:.1f} s; "
          f"{len(used)} kernels used, {len(never)} registered ones never", flush=True)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({
            "cases_total": len(cases), "cases_run": ran, "refused": refused,
            "failures": failures, "out_of_time": out_of_time,
            "elapsed_s": round(time.time() - t0, 2),
            "kernels_used": sorted(used), "never_used": never,
        }, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
