#!/usr/bin/env python3
"""Cold start: how long the first na2d call takes before and after CuPy's kernel cache fills.

    python bench/cold_start.py [--backends naive,fused] [--out cold_start.json]

For each backend, a fresh process runs the first na2d forward with ``CUPY_CACHE_DIR`` set to
an empty temporary folder (NVRTC compiles), then another fresh process runs it again with
that folder filled (the binary comes from disk). Each child reports the import time, the
first call (wall clock, synchronized) and a second call for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy
import numpy
import natten_cupy
t_import = time.perf_counter() - t0
backend, dtype = sys.argv[1], sys.argv[2]
shape = (1, 64, 64, 4, 32)
rng = numpy.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(3))
cupy.cuda.Device().synchronize()

def call():
    t = time.perf_counter()
    natten_cupy.na2d(q, k, v, 7, backend=backend)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t) * 1e3

first = call()
second = call()
from natten_cupy._compile import compiled_keys
print(json.dumps({"import_s": t_import, "first_ms": first, "second_ms": second,
                  "kernels": [list(k[:2]) for k in compiled_keys()]}))
"""


def run_child(backend, dtype, cache_dir, timeout):
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, backend, dtype], env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"status": "error", "reason": p.stderr.strip()[-2000:], "process_s": wall}
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": "error", "reason": f"unreadable child output: {p.stdout[-500:]!r}"}
    out.update(status="ok", process_s=wall)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="naive,fused")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = {"dtype": args.dtype, "problem": "na2d 1x64x64x4x32, kernel 7", "backends": {}}
    for backend in [b for b in args.backends.split(",") if b]:
        cache = tempfile.mkdtemp(prefix=f"natten_cupy_cold_{backend}_")
        try:
            cold = run_child(backend, args.dtype, cache, args.timeout_s)
            warm = (run_child(backend, args.dtype, cache, args.timeout_s)
                    if cold.get("status") == "ok" else {"status": "not run"})
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        results["backends"][backend] = {"empty_cache": cold, "filled_cache": warm}
        line = f"{backend}: "
        for tag, r in (("empty cache", cold), ("filled cache", warm)):
            line += (f"{tag} first call {r['first_ms']:.0f} ms (second {r['second_ms']:.2f} ms); "
                     if r.get("status") == "ok" else f"{tag} {r.get('status')}: "
                     f"{str(r.get('reason', ''))[-200:]}; ")
        print(line)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
