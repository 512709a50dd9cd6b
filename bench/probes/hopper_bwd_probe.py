"""Device probe of the Hopper fused backward (backends/wgmma_backward.py).

One script for one GPU call (H200), in this order, each step logged as it ends:

1. compile every instantiation through CuPy (seconds each, timed);
2. SASS of every instantiation (nvcc -cubin for sm_90a, then cuobjdump or nvdisasm): counts of
   HGMMA / HMMA / local memory per kernel (``--sass-only`` runs this step alone, no GPU);
3. per workload (``bench/workloads.py``'s: dense N=16384 H16 D64/D128 fp16 and bf16 (SA,
   SA128), BENCH.md's W1, M5, M4, M7, and the probes' ``PROBE_WORKLOADS``): the forward of the
   Hopper part for out and lse, then the Hopper backward on NaN-poisoned gradients, checked
   against the mma.sync fused backward (tested) and, dense, against torch SDPA's gradients;
   then timings (``bench/timing.py``'s CUDA-event medians) of the Hopper backward, the
   mma.sync fused backward (``mma_backward.backward``) and, dense, SDPA's backward
   (``torch.autograd.grad`` on a recorded forward).

Backward FLOPs = 2.5 x the forward's 4 B N H K D (K = prod(kernel_size), nominal for causal
windows; ``Workload.flops(backward=True)``). JSON in $OUT/hopper_bwd_probe.json (rewritten
after every record); the last lines are a short table. Run: ``python
bench/probes/hopper_bwd_probe.py [--quick] [--no-sass] [--only ID,...]``; ``--quick`` keeps
one dtype per workload and compiles kernels on first use only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]   # natten_cupy, bench/

import workloads as wl  # noqa: E402
from timing import event_ms  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/hopper_bwd_probe")
RESULTS = {"compile": [], "sass": [], "check": [], "time": [], "log": []}

# (workload id of bench/workloads.py, dtypes of workloads.DTYPES) in the order they run
RUNS = (("SA", ("fp16", "bf16")), ("SA128", ("fp16", "bf16")), ("W1", ("fp16",)),
        ("M5", ("bf16",)), ("M4", ("bf16",)), ("M7", ("bf16",)), ("2D-D64", ("bf16",)),
        ("2D-D64-7", ("fp16",)), ("3D-D128", ("bf16",)), ("1D-D64-small", ("fp16",)),
        ("M6", ("bf16",)))


def log(*args):
    line = " ".join(str(a) for a in args)
    print(line, flush=True)
    RESULTS["log"].append(line)


def _out():
    os.makedirs(OUT, exist_ok=True)
    return OUT


def _dump():
    with open(os.path.join(_out(), "hopper_bwd_probe.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def _signature(name):
    t = name[name.index("<") + 1:name.index(",")]
    if "_delta<" in name:
        return f"const {t}*, const {t}*, float*, float*, const natten::NAParams"
    if "_dq<" in name:
        return f"const float*, {t}*, const natten::NAParams"
    grads = f"{t}*, {t}*, float*" if "_kv<" in name else f"{t}*"
    return (f"const {t}*, const {t}*, const {t}*, const {t}*, const float*, const float*, "
            f"{grads}, const natten::NAParams")


def _disassembler():
    dis = shutil.which("cuobjdump")
    if dis:
        return [dis, "--dump-sass"]
    dis = shutil.which("nvdisasm")
    if not dis:
        try:
            import nvidia
            for base in nvidia.__path__:
                cand = os.path.join(base, "cu13", "bin", "nvdisasm")
                if os.path.isfile(cand):
                    dis = cand
        except ImportError:
            pass
    return [dis, "-c"] if dis else None


def sass_all():
    """SASS counts per instantiation (nvcc's cubin: the disassemblers reject NVRTC's)."""
    from natten_cupy._compile import cuda_src_dir
    from natten_cupy.backends.fused import wgmma_backward as H
    names = [n for _, n in H.instantiations()]
    src = os.path.join(_out(), "hopper_bwd_inst.cu")
    with open(src, "w") as f:
        f.write(f'#include "{H.SOURCE}"\n')
        for n in names:
            f.write(f"template __global__ void {n}({_signature(n)});\n")
    cubin = os.path.join(OUT, "hopper_bwd.cubin")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    done = subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a",
                           "-std=c++17", "-Xptxas", "-v", f"-I{cuda_src_dir()}", "-o", cubin,
                           src], capture_output=True, text=True, timeout=600)
    with open(os.path.join(OUT, "hopper_bwd_ptxas.txt"), "w") as f:
        f.write(done.stderr)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    log(f"nvcc ptxas: {len(spills)} functions, spilling: "
        f"{sum(1 for s in spills if s != ('0', '0'))}")
    dis = _disassembler()
    if dis is None:
        raise RuntimeError("no cuobjdump or nvdisasm")
    sass = subprocess.run(dis + [cubin], capture_output=True, text=True, timeout=300).stdout
    with open(os.path.join(OUT, "hopper_bwd_sass.txt"), "w") as f:
        f.write(sass)
    funcs = re.split(r"Function : |//-+ \.text\.", sass)
    for n in names:
        kernel = n.split("::")[1].split("<")[0]
        args = [x.strip() for x in n[n.index("<") + 1:-1].split(",")[1:]]
        tname = "6__half" if "__half" in n else "13__nv_bfloat16"
        mangled = f"{len(kernel)}{kernel}I{tname}" + "".join(
            f"Li{a}E" if a.isdigit() else f"Lb{int(a == 'true')}E" for a in args) + "EEv"
        body = next((f for f in funcs if mangled in f[:400]), "")
        row = {"name": n, "found": bool(body)}
        for ins in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "MUFU.EX2", "SYNCS", "USETMAXREG"):
            row[ins] = len(re.findall(rf"\b{re.escape(ins)}", body))
        RESULTS["sass"].append(row)
        log("sass", row)
    _dump()


def compile_all():
    from natten_cupy._compile import get_kernel
    from natten_cupy.backends.fused import wgmma_backward as H
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
    _dump()


def _time(fn, reps=20, warm=3):
    """Median ms of ``fn`` by CUDA events (bench/timing.py)."""
    return event_ms(fn, warmup=warm, reps=reps)


def _rec(wid, tname, impl, ms, flops):
    r = {"id": wid, "dtype": tname, "impl": impl, "ms": ms, "tflops": flops / ms / 1e9}
    RESULTS["time"].append(r)
    _dump()
    log(f"time {wid:10s} {tname:8s} {impl:34s} {ms:8.3f} ms {r['tflops']:6.1f} TFLOP/s")


def _rel(a, b):
    """max |a - b| / max(1, max |b|), in float32 on the GPU."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def workloads(only, quick):
    import cupy
    import torch
    for wid, dtypes in RUNS:
        if only and wid not in only:
            continue
        for dkey in dtypes[:1] if quick else dtypes:
            _workload(wl.probe_workload(wid), wl.dtype_spec(dkey)["name"])
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()


def _workload(w, tname):
    import cupy
    import torch
    import torch.nn.functional as F
    from natten_cupy import _args
    from natten_cupy.backends.fused import wgmma_forward, wgmma_backward as H
    wid, rank, ca, D = w.id, w.rank, w.causal, w.dim
    tdt = getattr(torch, tname)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(*w.shape, device="cuda", dtype=tdt, generator=g)
                      for _ in range(4))
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, d_out))
    prob = _args.check_fused(rank, cq, ck, cv, w.kernel, w.stride, w.dilation, ca, None,
                             "fused")
    why = H.refuse(prob) or wgmma_forward.refuse(prob)
    if why:
        log(f"{wid} {tname}: refused: {why}")
        return
    N, K = w.tokens, w.neighbors
    flops = w.flops(backward=True)
    out = cupy.empty(cq.shape, cq.dtype)
    lse = cupy.empty(cq.shape[:-1], cupy.float32)
    wgmma_forward.forward(prob, cq, ck, cv, out, lse)
    grads = [cupy.full(cq.shape, cupy.nan, cq.dtype) for _ in range(3)]
    t = time.perf_counter()
    H.backward(prob, cq, ck, cv, out, lse, cdo, *grads, dq_atomic=False)
    cupy.cuda.runtime.deviceSynchronize()
    rec = {"id": wid, "dtype": tname, "first_call_s": time.perf_counter() - t,
           "nan": [int(cupy.isnan(x).sum()) for x in grads],
           "workspace_bytes": int(math.prod(lse.shape)) * 4}
    # the mma.sync backward part, called directly: fused.py now dispatches to the Hopper one
    from natten_cupy.backends.fused import mma_backward
    to = torch.from_dlpack
    mma = [cupy.empty_like(cq) for _ in range(3)]

    def fn():
        mma_backward.backward(prob, cq, ck, cv, out, lse, cdo, *mma)
        return mma
    old = [to(x).clone() for x in fn()]
    new = [to(x) for x in grads]
    rec["rel_vs_fused"] = [_rel(a, b) for a, b in zip(new, old)]
    dense = rank == 1 and K == N and not ca[0]
    if dense:
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        o = F.scaled_dot_product_attention(qt, kt, vt)
        sd = torch.autograd.grad(o, (qt, kt, vt), d_out.transpose(1, 2))
        rec["rel_vs_sdpa"] = [_rel(a, b.transpose(1, 2)) for a, b in zip(new, sd)]
        rec["rel_fused_vs_sdpa"] = [_rel(a, b.transpose(1, 2)) for a, b in zip(old, sd)]
    RESULTS["check"].append(rec)
    _dump()
    log("check", rec)
    ms = _time(lambda: H.backward(prob, cq, ck, cv, out, lse, cdo, *grads, dq_atomic=False))
    _rec(wid, tname, "hopper bwd (new, deterministic)", ms, flops)
    # the atomic dQ variant (every rank and head dim)
    agrads = [cupy.full(cq.shape, cupy.nan, cq.dtype) for _ in range(3)]
    H.backward(prob, cq, ck, cv, out, lse, cdo, *agrads, dq_atomic=True)
    arec = {"id": wid, "dtype": tname, "variant": "atomic dQ",
            "nan": [int(cupy.isnan(x).sum()) for x in agrads],
            "rel_vs_fused": [_rel(to(a), b) for a, b in zip(agrads, old)],
            "rel_vs_deterministic": [_rel(to(a), b) for a, b in zip(agrads, new)],
            "workspace_bytes": rec["workspace_bytes"]
            + int(math.prod(H.dq_workspace(prob, H._bucket(D))[0])) * 4}
    RESULTS["check"].append(arec)
    log("check", arec)
    ms = _time(lambda: H.backward(prob, cq, ck, cv, out, lse, cdo, *agrads,
                                  dq_atomic=True))
    _rec(wid, tname, "hopper bwd (new, atomic dQ)", ms, flops)
    del agrads
    ms = _time(fn, reps=5, warm=1)
    _rec(wid, tname, "fused bwd (mma.sync)", ms, flops)
    if dense:
        qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        o = F.scaled_dot_product_attention(qt, kt, vt)
        dot = d_out.transpose(1, 2).contiguous()
        ms = _time(lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))
        _rec(wid, tname, "torch SDPA bwd", ms, flops)
    ms = _time(lambda: wgmma_forward.forward(prob, cq, ck, cv, out, lse))
    _rec(wid, tname, "hopper fwd (for the ratio)", ms, flops / 2.5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one dtype per workload; kernels compile on first use")
    ap.add_argument("--no-sass", action="store_true", help="leave the SASS counts out")
    ap.add_argument("--sass-only", action="store_true",
                    help="only the SASS counts (nvcc, cuobjdump or nvdisasm; no GPU)")
    ap.add_argument("--only", metavar="ID,...", default="",
                    help="only these workloads (bench/workloads.py ids, comma-separated)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.sass_only:
        sass_all()
        return
    only = {x for x in args.only.split(",") if x}
    unknown = sorted(only - {wid for wid, _ in RUNS})
    if unknown:
        ap.error(f"--only: not a workload of this probe: {', '.join(unknown)} "
                 f"(known: {', '.join(wid for wid, _ in RUNS)})")
    if not args.quick:  # --quick: kernels compile on first use
        compile_all()
    if not args.no_sass:
        try:
            sass_all()
        except Exception as e:
            log(f"sass failed: {type(e).__name__}: {e}")
    log(f"[{time.perf_counter() - t0:.0f} s] compiled")
    try:
        workloads(only, args.quick)
    finally:
        _dump()
        log(f"[{time.perf_counter() - t0:.0f} s] done")
        log("\n| workload | dtype | impl | ms | TFLOP/s |")
        for r in RESULTS["time"]:
            log(f"| {r['id']} | {r['dtype']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} |")
        for r in RESULTS["check"]:
            log("check", {k: ([round(x, 5) for x in v] if isinstance(v, list) else v)
                          for k, v in r.items()})
        for r in RESULTS["sass"]:
            log("sass", {k: v for k, v in r.items() if v})


if __name__ == "__main__":
    main()
