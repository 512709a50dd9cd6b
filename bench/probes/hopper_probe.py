"""Device probe of the Hopper (wgmma) fused forward: compile, SASS, check, time, in one call.

    CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 python3 bench/probes/hopper_probe.py
        [--no-flex] [--no-sass] [--sass-only]
        (--sass-only needs no GPU: nvcc and nvdisasm or cuobjdump on the PATH)

1. compile every instantiation (seconds each), dump SASS of each through nvcc's cubin and
   cuobjdump, count HGMMA / HMMA / local-memory instructions;
2. the problems checked against the mma.sync kernel, and (1-D) on the first queries against
   the tests' float64 oracle (``tests/oracle.py``, ``fused_forward_rows``) and, dense,
   against torch SDPA;
3. times (``bench/timing.py``'s CUDA-event medians: 3 warm-ups, median of 20, fresh random
   inputs) of the Hopper kernel (default and alternative tiles), the current fused kernel
   (mma_forward) and torch SDPA on dense problems, FlexAttention on W1 unless --no-flex; ms
   and TFLOP/s on useful FLOPs 4 B N H K D. Workloads are ``bench/workloads.py``'s
   (``WORKLOADS`` and the probes' ``PROBE_WORKLOADS``). Full results in
   $OUT/hopper_probe.json, SASS in $OUT/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH, os.path.join(ROOT, "tests")]   # natten_cupy, bench/, the oracle

import oracle  # noqa: E402
import workloads as wl  # noqa: E402
from timing import event_ms  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/hopper_probe")
RESULTS = {"compile": [], "sass": [], "check": [], "time": []}

# (workload id of bench/workloads.py, dtypes of workloads.DTYPES) in the order they run
F16, BF16 = ("fp16",), ("fp16", "bf16")
RUNS = (("SA", BF16), ("SA128", BF16), ("W1", BF16), ("W1-D128", F16), ("C8K", F16),
        ("SA4K", F16), ("W2b", F16), ("2D-33", F16), ("M5", ("bf16",)), ("M4", ("bf16",)),
        ("M7", ("bf16",)))
FLEX = "W1"          # FlexAttention's workload (fp16), unless --no-flex
# 1-D: the first queries of batch 0 checked against the float64 oracle, at most 384 and at
# most 2^20 / K (the oracle's scores are [H, rows, K] on the host: dense 16K, 64 rows)
ORACLE_ROWS, ORACLE_SCORES = 384, 1 << 20


def log(*a):
    print(*a, flush=True)


def _out():
    os.makedirs(OUT, exist_ok=True)
    return OUT


def compile_all():
    from natten_cupy._compile import get_kernel
    from natten_cupy.backends.fused import wgmma_forward as H
    for src, name in H.instantiations():
        t = time.perf_counter()
        try:
            get_kernel(src, name, extra_options=H.OPTIONS)
            err = None
        except Exception as e:
            err = f"{type(e).__name__}: {str(e)[:1500]}"
        dt = time.perf_counter() - t
        RESULTS["compile"].append({"name": name, "s": dt, "error": err})
        log(f"compile {name}: {dt:.1f} s" + (f" FAILED {err}" if err else ""))


def sass_all():
    """SASS of every instantiation (nvcc -cubin for sm_90a, then cuobjdump or nvdisasm); counts
    of the instructions that matter per kernel. NVRTC's cubin is not used: the disassemblers
    rejected it as an invalid ELF file (seen on the H200 and here)."""
    import shutil
    from natten_cupy._compile import cuda_src_dir
    from natten_cupy.backends.fused import wgmma_forward as H
    names = [n for _, n in H.instantiations()]
    src = os.path.join(_out(), "hopper_inst.cu")
    with open(src, "w") as f:
        f.write(f'#include "{H.SOURCE}"\n')
        for n in names:
            t = n[n.index("<") + 1:n.index(",")]
            f.write(f"template __global__ void {n}(const {t}*, const {t}*, const {t}*, {t}*, "
                    f"float*, const natten::NAParams);\n")
    cubin = os.path.join(OUT, "hopper.cubin")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
                    f"-I{cuda_src_dir()}", "-o", cubin, src], check=True, timeout=300)
    dis = shutil.which("cuobjdump")
    cmd = [dis, "--dump-sass", cubin] if dis else [shutil.which("nvdisasm"), "-c", cubin]
    sass = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    with open(os.path.join(OUT, "hopper_sass.txt"), "w") as f:
        f.write(sass)
    funcs = re.split(r"Function : |//-+ \.text\.", sass)
    for n in names:
        tail = n[n.index("<"):]
        args = [x.strip() for x in tail[1:-1].split(",")[1:]]
        mangled = "".join(f"Li{a}E" if a.isdigit() else f"Lb{int(a == 'true')}E" for a in args)
        tname = "6__half" if "__half" in n else "13__nv_bfloat16"
        body = next((f for f in funcs if f"I{tname}{mangled}" in f[:300]), "")
        row = {"name": n}
        for ins in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "MUFU.EX2", "BAR.SYNC", "SYNCS"):
            row[ins] = len(re.findall(rf"\b{re.escape(ins)}", body))
        RESULTS["sass"].append(row)
        log("sass", row)


def _inputs(torch, w, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*w.shape, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def _problem(q, w):
    from natten_cupy import _args
    return _args.check_fused(w.rank, q, q, q, w.kernel, w.stride, w.dilation, w.causal, None,
                             "fused")


def _time(fn, reps=20, warm=3):
    """Median ms of ``fn`` by CUDA events (bench/timing.py)."""
    return event_ms(fn, warmup=warm, reps=reps)


def _host64(x):
    """A torch tensor (any float dtype, any device) as a float64 NumPy array."""
    return x.detach().double().cpu().numpy()


def workloads(no_flex):
    import cupy
    import torch
    import torch.nn.functional as F
    from natten_cupy.backends.fused import mma_forward, wgmma_forward as H
    for wid, dtypes in RUNS:
        w = wl.probe_workload(wid)
        for dkey in dtypes:
            tname = wl.dtype_spec(dkey)["name"]
            tdt = getattr(torch, tname)
            q, k, v = _inputs(torch, w, tdt)
            cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
            prob = _problem(cq, w)
            out = cupy.full(cq.shape, cupy.nan, cq.dtype)
            lse = cupy.full(cq.shape[:-1], cupy.nan, cupy.float32)
            N, K, D = w.tokens, w.neighbors, w.dim
            flops = w.flops()
            why = H.refuse(prob)
            if why:
                log(f"{wid} {tname}: refused: {why}")
                continue
            one_d = w.rank == 1
            tiles = [None] + (list(H.ALTERNATIVES[H._bucket(D)])
                              if tname == "float16" and one_d else [])
            # correctness on the full problem: NaN-free, vs the mma.sync kernel; 1-D also vs
            # the float64 oracle on the first queries (and vs SDPA where dense)
            H.forward(prob, cq, ck, cv, out, lse)
            cupy.cuda.runtime.deviceSynchronize()
            rec = {"id": wid, "dtype": tname,
                   "nan": int(cupy.isnan(out).sum()) + int(cupy.isnan(lse).sum())}
            ours = torch.from_dlpack(out)
            fout = cupy.empty_like(out)
            flse = cupy.empty_like(lse)
            if mma_forward.refuse(prob) is None:
                mma_forward.forward(prob, cq, ck, cv, fout, flse)
                rec["vs_fused"] = float(cupy.abs(out.astype(cupy.float32) - fout).max())
                rec["lse_vs_fused"] = float(cupy.abs(lse - flse).max())
            if one_d:
                rows = numpy.arange(min(N, ORACLE_ROWS, max(16, ORACLE_SCORES // K)))
                ref_out, ref_lse = oracle.fused_forward_rows(
                    *(_host64(x[0]) for x in (q, k, v)), rows, w.kernel, w.stride, w.dilation,
                    w.causal, prob.scale)
                n = len(rows)
                rec["err_vs_f64"] = float(numpy.abs(_host64(ours[0, :n]) - ref_out).max())
                rec["lse_err"] = float(numpy.abs(_host64(torch.from_dlpack(lse)[0, :n])
                                                 - ref_lse).max())
                if K == N and not w.causal[0]:
                    sd = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
                    sd = sd.transpose(1, 2)
                    rec["sdpa_err_vs_f64"] = float(numpy.abs(_host64(sd[0, :n]) - ref_out).max())
                    rec["vs_sdpa"] = float((ours.float() - sd.float()).abs().max())
            RESULTS["check"].append(rec)
            _dump()
            log("check", rec)
            for tile in tiles:
                if one_d:
                    ms = _time(lambda: H.forward(prob, cq, ck, cv, out, lse, tile=tile))
                    _rec(wid, tname, "hopper " + _label(tile or H.DEFAULT[H._bucket(D)]), ms,
                         flops)
                    continue
                chosen = "boxes" if "true>" in H._plan(prob).name else "flat"
                for walk in (False, True):
                    ms = _time(lambda: H.forward(prob, cq, ck, cv, out, lse, walk_boxes=walk))
                    name = "boxes" if walk else "flat"
                    _rec(wid, tname, f"hopper {_label(H.DEFAULT_ND)} {name}"
                         + (" (default)" if name == chosen else ""), ms, flops)
            if mma_forward.refuse(prob) is None and (tname == "float16" or not one_d
                                                    or wid.startswith("SA")):
                ms = _time(lambda: mma_forward.forward(prob, cq, ck, cv, fout, flse), reps=10)
                _rec(wid, tname, "fused (mma.sync)", ms, flops)
            if one_d and K == N and not w.causal[0]:
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                ms = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt))
                _rec(wid, tname, "torch SDPA", ms, flops)
            del q, k, v, cq, ck, cv, out, lse, fout, flse
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()
    if not no_flex:  # last: its compile takes long
        w = wl.WORKLOADS[FLEX]
        (N,), (K,) = w.spatial, w.kernel
        _flex(torch, *_inputs(torch, w, torch.float16), N, K, w.flops(), w.id, "float16")


def _label(t):
    flags = "".join(f"/{n}" for n in ("pipe", "pp") if getattr(t, n))
    return f"{t.wg}x64 q, {t.bn} k, {t.stages} st{flags}"


def _dump():
    with open(os.path.join(_out(), "hopper_probe.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def _rec(wid, tname, impl, ms, flops):
    r = {"id": wid, "dtype": tname, "impl": impl, "ms": ms, "tflops": flops / ms / 1e9}
    RESULTS["time"].append(r)
    _dump()
    log(f"time {wid:8s} {tname:8s} {impl:42s} {ms:8.3f} ms {r['tflops']:6.1f} TFLOP/s")


def _flex(torch, q, k, v, N, K, flops, wid, tname):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        lam = K // 2

        def mask_mod(b, h, qi, ki):
            start = (qi - lam).clamp(min=0).clamp(max=N - K)
            return (ki >= start) & (ki < start + K)
        bm = create_block_mask(mask_mod, None, None, N, N, device="cuda")
        fa = torch.compile(flex_attention)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        t = time.perf_counter()
        fa(qt, kt, vt, block_mask=bm)
        torch.cuda.synchronize()
        log(f"flex compile {time.perf_counter() - t:.1f} s")
        ms = _time(lambda: fa(qt, kt, vt, block_mask=bm))
        _rec(wid, tname, "FlexAttention", ms, flops)
    except Exception as e:
        log(f"flex failed: {type(e).__name__}: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention (on W1) out")
    ap.add_argument("--no-sass", action="store_true", help="leave the SASS counts out")
    ap.add_argument("--sass-only", action="store_true",
                    help="only the SASS counts (nvcc, cuobjdump or nvdisasm; no GPU)")
    args = ap.parse_args(argv)
    if args.sass_only:
        sass_all()
        _dump()
        return
    no_flex = args.no_flex
    t0 = time.perf_counter()
    compile_all()
    if not args.no_sass:
        try:
            sass_all()
        except Exception as e:
            log(f"sass failed: {type(e).__name__}: {e}")
    log(f"[{time.perf_counter() - t0:.0f} s] compiled")
    try:
        workloads(no_flex)
    finally:
        _dump()
        log(f"[{time.perf_counter() - t0:.0f} s] done")
        log("\n| workload | dtype | impl | ms | TFLOP/s |")
        for r in RESULTS["time"]:
            log(f"| {r['id']} | {r['dtype']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
        for r in RESULTS["check"]:
            log("check", {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()})
        for r in RESULTS["sass"]:
            log("sass", r)


if __name__ == "__main__":
    main()
