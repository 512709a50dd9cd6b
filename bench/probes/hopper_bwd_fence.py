"""Where the Hopper backward's proxy fences cost: its passes built with the fence that makes
the loader's cp.async writes visible to wgmma moved or left out, side by side with the
shipped kernels.

``fence.proxy.async`` compiles to ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S``. The compute
warpgroups run it after each tile's mbarrier wait, in the dK/dV pass while the previous
step's dV/dK GEMMs are still in flight (PIPE queues the next S/dP GEMMs there). If the
membar waits for those, the queueing buys nothing. Variants, made from the shipped source
by text edits into a temporary file under ``cuda_src/fused/`` (removed at exit):

* ``shipped``: ``cuda_src/fused/wgmma_backward.cu`` as it is;
* ``no_fence``: the compute warpgroups' fence after the mbarrier wait left out (timing
  only: the wgmma may then read stale shared memory, so its results are not checked);
* ``loader_fence``: each loader thread commits a cp.async group per step, waits for the
  previous step's group, fences and arrives on that step's mbarrier (the writer fences, as
  for any shared memory the async proxy reads); the consumers' fence left out. Checked
  bitwise against ``shipped`` (the arithmetic is the same);
* ``loader_fence_reorder``: that, and in the bulk-reduction variant the dS^T tile stored,
  fenced and published before the dV/dK GEMMs are issued (then dV, dK and dQ queue
  together), so its fence runs with none of the warpgroup's GEMMs in flight.

Per workload: the Hopper forward for out and lse, then each variant's deterministic and
bulk-reduction (``dq_atomic``) backward split into kernels (profiler launch events, median
of 5). JSON to --out.

    python bench/probes/hopper_bwd_fence.py [--only SA,W1] [--variants shipped,...] --out f.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PROBES = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(PROBES)
sys.path[:0] = [os.path.dirname(BENCH), BENCH, PROBES]   # natten_cupy, bench/, probes/

from hopper_bwd_dq import backward_inputs  # noqa: E402
from timing import kernel_split  # noqa: E402

RUNS = (("SA", "float16"), ("W1", "float16"), ("SA128", "float16"), ("M4", "bfloat16"),
        ("M6", "bfloat16"), ("M5", "bfloat16"))

CONSUMER_KV = ("    mbar_wait(sm.full + 8 * (jj % STAGES), (jj / STAGES) & 1);\n"
               "    fence_proxy_async();\n")
CONSUMER_Q = ("    mbar_wait(sm.full + 8 * (j % STAGES), (j / STAGES) & 1);\n"
              "    fence_proxy_async();\n")
LOADER_KV = ("        cp_async_arrive(sm.full + 8 * (j % STAGES));\n      }\n"
             "    cp_async_wait_all();\n    return;\n")
LOADER_Q = ("      cp_async_arrive(sm.full + 8 * (j % STAGES));\n    }\n"
            "    cp_async_wait_all();\n    return;\n")
HELPERS = """namespace natten {
namespace hopper {
// (probe) step j's cp.async writes as one group; step j - 1's once landed: fenced for the
// async proxy, then this thread's arrival on that step's mbarrier.
template <int STAGES>
__device__ __forceinline__ void publish_step(unsigned full, int j) {
  asm volatile("cp.async.commit_group;\\n" ::: "memory");
  if (j > 0) {
    asm volatile("cp.async.wait_group 1;\\n" ::: "memory");
    fence_proxy_async();
    mbar_arrive(full + 8 * ((j - 1) % STAGES));
  }
}
template <int STAGES>
__device__ __forceinline__ void publish_last(unsigned full, int last) {
  cp_async_wait_all();
  fence_proxy_async();
  if (last >= 0) mbar_arrive(full + 8 * (last % STAGES));
}
"""


RS_GEMMS = ("    wgmma_fence();\n    gemm_rs<T, D, BQ>(acc_dv, pa, sdo);\n"
            "    gemm_rs<T, D, BQ>(acc_dk, da, sq);\n    wgmma_commit();\n")
DS_PUBLISHED = "      else\n        named_sync(1 + wg, 128);\n"


def _edit(text, old, new, count):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)


def variant_source(name):
    from natten_cupy._compile import cuda_src_dir
    text = (cuda_src_dir() / "fused/wgmma_backward.cu").read_text()
    if name == "shipped":
        return text
    text = _edit(text, CONSUMER_KV, CONSUMER_KV.splitlines(True)[0], 1)
    text = _edit(text, CONSUMER_Q, CONSUMER_Q.splitlines(True)[0], 1)
    if name == "no_fence":
        return text
    assert name in ("loader_fence", "loader_fence_reorder")
    text = _edit(text, "namespace natten {\nnamespace hopper {\n", HELPERS, 1)
    text = _edit(text, LOADER_KV, "        publish_step<STAGES>(sm.full, j);\n      }\n"
                 "    publish_last<STAGES>(sm.full, j - 1);\n    return;\n", 1)
    text = _edit(text, LOADER_Q, "      publish_step<STAGES>(sm.full, j);\n    }\n"
                 "    publish_last<STAGES>(sm.full, num_tiles - 1);\n    return;\n", 1)
    if name == "loader_fence_reorder":
        text = _edit(text, RS_GEMMS, "    if constexpr (!ATOMIC) {\n" + "".join(
            "  " + x for x in RS_GEMMS.splitlines(True)) + "    }\n", 1)
        text = _edit(text, DS_PUBLISHED, DS_PUBLISHED + "".join(
            "  " + x for x in RS_GEMMS.splitlines(True)), 1)
    return text


VARIANTS = ("shipped", "no_fence", "loader_fence", "loader_fence_reorder")


def run(wid, tname, sources):
    import cupy
    from natten_cupy.backends.fused import wgmma_backward as H
    _, prob, q, k, v, d_out, out, lse = backward_inputs(wid, tname)
    rows, ref = [], {}
    for vname, src in sources.items():
        H.SOURCE = src
        for atomic in (False, True):
            grads = [cupy.full(q.shape, cupy.nan, q.dtype) for _ in range(3)]

            def fn():
                H.backward(prob, q, k, v, out, lse, d_out, *grads, dq_atomic=atomic)
            split = kernel_split(fn, reps=5)
            row = dict(id=wid, dtype=tname, variant=vname, dq_atomic=atomic, kernels_ms=split,
                       total_ms=round(sum(split.values()), 4))
            if vname != "no_fence":
                if not atomic and vname == "shipped":
                    ref = {n: x.copy() for n, x in zip(("dq", "dk", "dv"), grads)}
                for n, x in zip(("dq", "dk", "dv"), grads):
                    r = ref[n].astype(cupy.float64)
                    d = x.astype(cupy.float64)
                    row[f"{n}_bitwise_equal_shipped"] = bool((x.view(cupy.int16) ==
                                                              ref[n].view(cupy.int16)).all())
                    row[f"{n}_rel_err_vs_shipped"] = float(
                        cupy.nan_to_num(cupy.abs(d - r), nan=cupy.inf).max()
                        / max(float(cupy.abs(r).max()), 1e-30))
            rows.append(row)
            print(f"{wid:7s} {vname:13s} atomic={int(atomic)} {row['total_ms']:8.3f} ms "
                  f"{split} " + " ".join(f"{k}={v}" for k, v in row.items()
                                         if k.endswith("equal_shipped") or
                                         k.endswith("vs_shipped")), flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="workload ids, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from natten_cupy._compile import cuda_src_dir
    from natten_cupy.backends.fused import wgmma_backward as H
    shipped = H.SOURCE
    made = []
    sources = {}
    chosen = [x for x in args.variants.split(",") if x]
    assert set(chosen) <= set(VARIANTS) and "shipped" in chosen, chosen
    for name in chosen:
        if name == "shipped":
            sources[name] = shipped
            continue
        rel = f"fused/_probe_fence_{name}.cu"
        (cuda_src_dir() / rel).write_text(variant_source(name))
        made.append(cuda_src_dir() / rel)
        sources[name] = rel
    only = [x for x in args.only.split(",") if x]
    rows = []
    try:
        for wid, tname in RUNS:
            if not only or wid in only:
                rows += run(wid, tname, sources)
    finally:
        H.SOURCE = shipped
        for f in made:
            f.unlink()
    import cupy
    report = dict(device=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                  commit=os.environ.get("NATTEN_CUPY_COMMIT", ""), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
