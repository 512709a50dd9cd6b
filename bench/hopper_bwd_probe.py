"""Device probe of the Hopper fused backward (backends/_fused_hopper_bwd.py, not yet dispatched).

One script for one GPU call (H200), in this order, each step logged as it ends:

1. compile every instantiation through CuPy (seconds each, timed);
2. SASS of every instantiation (nvcc -cubin for sm_90a, then cuobjdump or nvdisasm): counts of
   HGMMA / HMMA / local memory per kernel (``--sass-only`` runs this step alone, no GPU);
3. per workload (dense N=16384 H16 D64/D128 fp16 and bf16, BENCH.md's W1, M5, M4, M7): the
   forward of the Hopper part for out and lse, then the new backward on NaN-poisoned gradients,
   checked against the current fused backward (mma.sync, tested) and, dense, against torch
   SDPA's gradients; then timings (CUDA events, medians) of the new backward, the current fused
   backward (the mma.sync part, ``_fused_bwd.backward``) and, dense, SDPA's backward
   (``torch.autograd.grad`` on a recorded forward).

Backward FLOPs = 2.5 x the forward's 4 B N H K D (K = prod(kernel_size), nominal for causal
windows). JSON in $OUT/hopper_bwd_probe.json (rewritten after every record); the last lines
are a short table. Run: ``PYTHONPATH=$PWD python bench/hopper_bwd_probe.py [--quick]
[--no-sass] [--only ID,...]``; ``--quick`` keeps one dtype per workload and compiles
kernels on first use only.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp/hopper_bwd_probe")
os.makedirs(OUT, exist_ok=True)
RESULTS = {"compile": [], "sass": [], "check": [], "time": [], "log": []}

# (id, B, spatial, heads, head dim, kernel, causal, dtypes)
WORKLOADS = [
    ("SA16K-D64", 1, (16384,), 16, 64, (16384,), (False,), ("float16", "bfloat16")),
    ("SA16K-D128", 1, (16384,), 16, 128, (16384,), (False,), ("float16", "bfloat16")),
    ("W1", 1, (32768,), 16, 64, (2047,), (False,), ("float16",)),
    ("M5", 1, (128, 128), 16, 128, (21, 21), (False, False), ("bfloat16",)),
    ("M4", 2, (16, 40, 64), 16, 64, (5, 9, 9), (False, False, False), ("bfloat16",)),
    ("M7", 4, (12, 32, 32), 8, 64, (6, 9, 9), (True, False, False), ("bfloat16",)),
    ("2D-D64", 2, (96, 96), 8, 64, (15, 15), (False, False), ("bfloat16",)),
    ("2D-D64-7", 8, (56, 56), 4, 64, (7, 7), (False, False), ("float16",)),
    ("3D-D128", 1, (16, 32, 32), 8, 128, (5, 7, 7), (False, False, False), ("bfloat16",)),
    ("1D-D64-small", 16, (4096,), 8, 64, (255,), (False,), ("float16",)),
]


def log(*args):
    line = " ".join(str(a) for a in args)
    print(line, flush=True)
    RESULTS["log"].append(line)


def _dump():
    with open(os.path.join(OUT, "hopper_bwd_probe.json"), "w") as f:
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
    from natten_cupy.backends import _fused_hopper_bwd as H
    names = [n for _, n in H.instantiations()]
    src = os.path.join(OUT, "hopper_bwd_inst.cu")
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
    from natten_cupy.backends import _fused_hopper_bwd as H
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
    from timing import event_ms
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
    for wid, B, spatial, Hh, D, ks, ca, dtypes in WORKLOADS:
        if only and wid not in only:
            continue
        for tname in dtypes[:1] if quick else dtypes:
            _workload(wid, B, spatial, Hh, D, ks, ca, tname)
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()


def _workload(wid, B, spatial, Hh, D, ks, ca, tname):
    import cupy
    import torch
    import torch.nn.functional as F
    from natten_cupy import _args
    from natten_cupy.backends import _fused_hopper, _fused_hopper_bwd as H
    tdt = getattr(torch, tname)
    rank = len(spatial)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(B, *spatial, Hh, D, device="cuda", dtype=tdt, generator=g)
                      for _ in range(4))
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, d_out))
    prob = _args.check_fused(rank, cq, ck, cv, ks, 1, 1, ca, None, "fused")
    why = H.refuse(prob) or _fused_hopper.refuse(prob)
    if why:
        log(f"{wid} {tname}: refused: {why}")
        return
    N, K = math.prod(spatial), math.prod(ks)
    flops = 2.5 * 4 * B * N * Hh * K * D
    out = cupy.empty(cq.shape, cq.dtype)
    lse = cupy.empty(cq.shape[:-1], cupy.float32)
    _fused_hopper.forward(prob, cq, ck, cv, out, lse)
    grads = [cupy.full(cq.shape, cupy.nan, cq.dtype) for _ in range(3)]
    t = time.perf_counter()
    H.backward(prob, cq, ck, cv, out, lse, cdo, *grads)
    cupy.cuda.runtime.deviceSynchronize()
    rec = {"id": wid, "dtype": tname, "first_call_s": time.perf_counter() - t,
           "nan": [int(cupy.isnan(x).sum()) for x in grads],
           "workspace_bytes": int(math.prod(lse.shape)) * 4}
    # the mma.sync backward part, called directly: fused.py now dispatches to the Hopper one
    from natten_cupy.backends import _fused_bwd
    to = torch.from_dlpack
    mma = [cupy.empty_like(cq) for _ in range(3)]

    def fn():
        _fused_bwd.backward(prob, cq, ck, cv, out, lse, cdo, *mma)
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
    ms = _time(lambda: H.backward(prob, cq, ck, cv, out, lse, cdo, *grads))
    _rec(wid, tname, "hopper bwd (new, deterministic)", ms, flops)
    if H.atomic_supported(rank, H._bucket(D)):
        agrads = [cupy.full(cq.shape, cupy.nan, cq.dtype) for _ in range(3)]
        H.backward(prob, cq, ck, cv, out, lse, cdo, *agrads, dq_atomic=True)
        arec = {"id": wid, "dtype": tname, "variant": "atomic dQ",
                "nan": [int(cupy.isnan(x).sum()) for x in agrads],
                "rel_vs_fused": [_rel(to(a), b) for a, b in zip(agrads, old)],
                "rel_vs_deterministic": [_rel(to(a), b) for a, b in zip(agrads, new)],
                "workspace_bytes": rec["workspace_bytes"] + int(math.prod(cq.shape)) * 4}
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
    ms = _time(lambda: _fused_hopper.forward(prob, cq, ck, cv, out, lse))
    _rec(wid, tname, "hopper fwd (for the ratio)", ms, flops / 2.5)


def main():
    t0 = time.perf_counter()
    if "--sass-only" in sys.argv:
        sass_all()
        return
    only = set()
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    if "--quick" not in sys.argv:  # --quick: kernels compile on first use
        compile_all()
    if "--no-sass" not in sys.argv:
        try:
            sass_all()
        except Exception as e:
            log(f"sass failed: {type(e).__name__}: {e}")
    log(f"[{time.perf_counter() - t0:.0f} s] compiled")
    try:
        workloads(only, "--quick" in sys.argv)
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
