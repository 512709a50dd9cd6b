"""Device probe of the Hopper (wgmma) fused forward: compile, SASS, check, time, in one call.

    CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONUNBUFFERED=1 python3 bench/hopper_probe.py [--no-flex]
        [--no-sass]      (SASS needs no GPU: `python3 -c "import hopper_probe; hopper_probe.sass_all()"`
                          from bench/ with nvcc and nvdisasm or cuobjdump on the PATH)

1. compile every instantiation (seconds each), dump SASS of each through NVRTC's cubin and
   cuobjdump, count HGMMA / HMMA / local-memory instructions;
2. dense problems checked against torch SDPA and against float64 on a slice of queries;
3. times (CUDA events, 3 warm-ups, median of 20, fresh random inputs) of the Hopper kernel
   (default and alternative tiles), the current fused kernel (_fused_fwd) and torch SDPA on
   dense problems, FlexAttention on W1 unless --no-flex; ms and TFLOP/s on useful FLOPs
   4 B N H K D. Full results in $OUT/hopper_probe.json, SASS in $OUT/.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OUT = os.environ.get("OUT", "/tmp/hopper_probe")
os.makedirs(OUT, exist_ok=True)
RESULTS = {"compile": [], "sass": [], "check": [], "time": []}

# (id, B, spatial, H, D, kernel, causal, dtypes); stride and dilation 1
F16, BF16 = ("float16",), ("float16", "bfloat16")
WORKLOADS = [
    ("SA64", 1, (16384,), 16, 64, (16384,), (False,), BF16),
    ("SA128", 1, (16384,), 16, 128, (16384,), (False,), BF16),
    ("W1", 1, (32768,), 16, 64, (2047,), (False,), BF16),
    ("W1-D128", 1, (32768,), 16, 128, (2047,), (False,), F16),
    ("C8K", 2, (8192,), 16, 128, (1023,), (True,), F16),
    ("SA4K", 1, (4096,), 16, 128, (4096,), (False,), F16),
    ("W2b", 1, (256, 256), 4, 128, (13, 13), (False, False), F16),
    ("2D-33", 1, (256, 256), 16, 128, (33, 33), (False, False), F16),
    ("M5", 1, (128, 128), 16, 128, (21, 21), (False, False), ("bfloat16",)),
    ("M4", 2, (16, 40, 64), 16, 64, (5, 9, 9), (False,) * 3, ("bfloat16",)),
    ("M7", 4, (12, 32, 32), 8, 64, (6, 9, 9), (True, False, False), ("bfloat16",)),
]


def log(*a):
    print(*a, flush=True)


def compile_all():
    from natten_cupy._compile import get_kernel
    from natten_cupy.backends import _fused_hopper as H
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
    from natten_cupy.backends import _fused_hopper as H
    names = [n for _, n in H.instantiations()]
    src = os.path.join(OUT, "hopper_inst.cu")
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


def _inputs(torch, B, spatial, H, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, *spatial, H, D, device="cuda", dtype=dtype, generator=g)
            for _ in range(3)]


def _problem(q, ks, ca):
    from natten_cupy import _args
    return _args.check_fused(q.ndim - 3, q, q, q, ks, 1, 1, ca, None, "fused")


def _time(fn, reps=20, warm=3):
    import cupy
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    ts.sort()
    return ts[len(ts) // 2]


def workloads(no_flex):
    import cupy
    import torch
    import torch.nn.functional as F
    from natten_cupy.backends import _fused_fwd, _fused_hopper as H
    for wid, B, spatial, Hh, D, ks, ca, dtypes in WORKLOADS:
        for tname in dtypes:
            tdt = getattr(torch, tname)
            q, k, v = _inputs(torch, B, spatial, Hh, D, tdt)
            cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
            prob = _problem(cq, ks, ca)
            out = cupy.full(cq.shape, cupy.nan, cq.dtype)
            lse = cupy.full(cq.shape[:-1], cupy.nan, cupy.float32)
            N, K = math.prod(spatial), math.prod(ks)
            flops = 4 * B * N * Hh * K * D
            why = H.refuse(prob)
            if why:
                log(f"{wid} {tname}: refused: {why}")
                continue
            one_d = len(spatial) == 1
            tiles = [None] + (list(H.ALTERNATIVES[H._bucket(D)])
                              if tname == "float16" and one_d else [])
            # correctness on the full problem: NaN-free, vs the mma.sync kernel; 1-D also vs
            # float64 on the first queries (and vs SDPA where dense)
            H.forward(prob, cq, ck, cv, out, lse)
            cupy.cuda.runtime.deviceSynchronize()
            rec = {"id": wid, "dtype": tname,
                   "nan": int(cupy.isnan(out).sum()) + int(cupy.isnan(lse).sum())}
            ours = torch.from_dlpack(out)
            fout = cupy.empty_like(out)
            flse = cupy.empty_like(lse)
            if _fused_fwd.refuse(prob) is None:
                _fused_fwd.forward(prob, cq, ck, cv, fout, flse)
                rec["vs_fused"] = float(cupy.abs(out.astype(cupy.float32) - fout).max())
                rec["lse_vs_fused"] = float(cupy.abs(lse - flse).max())
            if one_d:
                ref = _slice_reference(torch, q, k, v, K, ca[0], prob.scale)
                rows = ref[0].shape[1]
                rec["err_vs_f64"] = float((ours[:1, :rows].double() - ref[0]).abs().max())
                rec["lse_err"] = float((torch.from_dlpack(lse)[:1, :rows].double()
                                        - ref[1]).abs().max())
                if K == N and not ca[0]:
                    sd = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
                    sd = sd.transpose(1, 2)
                    rec["sdpa_err_vs_f64"] = float((sd[:1, :rows].double() - ref[0]).abs().max())
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
            if _fused_fwd.refuse(prob) is None and (tname == "float16" or not one_d
                                                    or wid.startswith("SA")):
                ms = _time(lambda: _fused_fwd.forward(prob, cq, ck, cv, fout, flse), reps=10)
                _rec(wid, tname, "fused (mma.sync)", ms, flops)
            if one_d and K == N and not ca[0]:
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                ms = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt))
                _rec(wid, tname, "torch SDPA", ms, flops)
            del q, k, v, cq, ck, cv, out, lse, fout, flse
            torch.cuda.empty_cache()
            cupy.get_default_memory_pool().free_all_blocks()
    if not no_flex:  # last: its compile takes long
        wid, B, (N,), Hh, D, (K,) = WORKLOADS[2][:6]
        _flex(torch, *_inputs(torch, B, (N,), Hh, D, torch.float16), N, K,
              4 * B * N * Hh * K * D, wid, "float16")


def _slice_reference(torch, q, k, v, K, causal, scale):
    """float64 out and lse of the first 384 queries of batch 0 (1-D, stride 1, dilation 1)."""
    B, N, Hh, D = q.shape
    n = min(N, 384)
    qi = torch.arange(0, n).cuda()
    kk = torch.arange(N).cuda()
    lam = K // 2
    if causal:
        start = (qi - K + 1).clamp(min=0)
        end = qi + 1
    else:
        start = (qi - lam).clamp(min=0).clamp(max=N - K)
        end = start + K
    mask = (kk[None] >= start[:, None]) & (kk[None] < end[:, None])
    qd, kd, vd = (x[0].double().transpose(0, 1) for x in (q[:, :n], k, v))  # [H, *, D]
    s = qd @ kd.transpose(1, 2) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vd
    return o.transpose(0, 1)[None], lse.transpose(0, 1)[None]


def _label(t):
    flags = "".join(f"/{n}" for n in ("pipe", "pp") if getattr(t, n))
    return f"{t.wg}x64 q, {t.bn} k, {t.stages} st{flags}"


def _dump():
    with open(os.path.join(OUT, "hopper_probe.json"), "w") as f:
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


def main():
    no_flex = "--no-flex" in sys.argv
    t0 = time.perf_counter()
    compile_all()
    if "--no-sass" not in sys.argv:
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
