"""Where an eager torch-layer call spends its host time, for one workload: warm forward (with
grad recorded) and forward + backward wall times per call, whether the fast path served them
(its entry count), the same with Python's garbage collector off, the collections that ran,
and a cProfile of the slowest of the two. ``--after G7:bf16`` first runs another workload
through ``models.run_group`` (its FlexAttention compile included) in the same process, as
``models.py`` does before this one.

    python bench/probes/eager_probe.py --workload G8 --dtype bf16 [--calls 50] [--after G7:bf16]
        [--out p.json]
"""

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

import models  # noqa: E402
import timing  # noqa: E402
import workloads as wl  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="G8")
    ap.add_argument("--dtype", default="bf16", choices=sorted(wl.DTYPES))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--after", default=None, metavar="WORKLOAD:DTYPE",
                    help="run this workload through models.run_group first (same process)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    from natten_cupy import _fast
    if args.after:
        wid, dt = args.after.split(":")
        models.run_group(wl.model_workload(wid), dt, compiled=False)

    w = wl.model_workload(args.workload)
    spec = wl.dtype_spec(args.dtype)
    leaves, do = models.make_inputs(w, wl.torch_dtype(spec), "cuda",
                                    torch.Generator(device="cuda").manual_seed(0))
    ours = models.make_ours(w, spec["tf32"])

    def fwd():
        return ours(*leaves)

    def fwd_bwd():
        torch.autograd.grad(ours(*leaves), leaves, do)

    t0 = time.perf_counter()
    fwd_bwd()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    rows = {}
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        for collector in ("on", "off"):
            if collector == "off":
                gc.disable()
            before = [s["collections"] for s in gc.get_stats()]
            try:
                pairs = timing.wall_us(fn, calls=args.calls, reps=3, warmup=5, per_run=True,
                                       host=True)
                rounds = [w / 1e3 for w, _ in pairs]
                host = [h / 1e3 for _, h in pairs]
            finally:
                gc.enable()
            ran = [s["collections"] - c for s, c in zip(gc.get_stats(), before)]
            rows[f"{name}, gc {collector}"] = dict(ms_rounds=rounds, host_ms_rounds=host,
                                                  entries=len(_fast._entries),
                                                  collections_by_generation=ran)
    slow = max(rows, key=lambda k: min(rows[k]["ms_rounds"]))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        (fwd if slow.startswith("forward,") else fwd_bwd)()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    report = dict(workload=w.id, dtype=args.dtype, after=args.after, first_call_s=first_s,
                  rows=rows,
                  profiled=slow, profile=text.getvalue()[-4000:],
                  device=torch.cuda.get_device_name())
    print(f"{w.id}:{args.dtype} first call {first_s:.2f} s")
    for name, r in rows.items():
        print(f"  {name:24s} ms per call {[round(x, 3) for x in r['ms_rounds']]} (host "
              f"{[round(x, 3) for x in r['host_ms_rounds']]})  "
              f"fast-path entries {r['entries']}  gc runs {r['collections_by_generation']}")
    print(f"-- cProfile of 20 {slow} calls\n{report['profile']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
