"""Where a warm call's host time goes, piece by piece, on ``bench/overhead.py``'s tiny problem.

``overhead.py`` times whole calls; this splits them, on CUDA tensors, fast path on:

* torch's own floor: an ``autograd.Function`` shaped like ``FusedNA`` (3 inputs, out and lse
  made by ``new_empty``, 5 saved tensors, 3 gradients made by ``new_empty``, no kernels),
  forward alone and forward + backward, next to ours;
* the host time spent inside ``FusedNA.forward`` / ``FusedNA.backward`` (wrapped with a
  clock), the backward's body run on the calling thread, the array API's backward;
* a warm backward's steps one at a time: the signature and lookup (the full one, and the
  one from the forward's entry that the eager backward takes), torch's allocations of the
  outputs and workspaces, the pointer list, each kernel launch;
* a cProfile of each body (functions by own time; cProfile inflates small calls).

JSON to ``--out``; a table on stdout.

    python bench/probes/torch_overhead_split.py --out torch_overhead_split.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROBES = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(PROBES)
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # natten_cupy, bench/

import timing  # noqa: E402
from workloads import OVERHEAD_KERNEL as KERNEL, OVERHEAD_SHAPE as SHAPE  # noqa: E402


def _per_call_us(fn, n=2000):
    """Host microseconds per call of ``fn`` (n calls after 50, no synchronize inside)."""
    return timing.wall_us(fn, calls=n, reps=1, warmup=50, host=True)[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from natten_cupy import _fast, _torch_common, _torch_eager, torch as nt

    dev = "cuda"
    tq, tk, tv, tdo = (torch.randn(SHAPE, device=dev, dtype=torch.float16) for _ in range(4))
    tl = [x.detach().clone().requires_grad_() for x in (tq, tk, tv)]
    opts = (2, KERNEL, 1, 1, False, None, "auto", False, False, None)

    class Shaped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, d_out, d_lse):
            q, k, v, out, lse = ctx.saved_tensors
            return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def floor_fwd():
        return Shaped.apply(*tl)

    def floor_fwd_bwd():
        Shaped.apply(*tl)[0].backward(tdo)

    def ours_fwd():
        return nt.na2d(*tl, KERNEL)

    def ours_fwd_bwd():
        nt.na2d(*tl, KERNEL).backward(tdo)

    rows = {}
    for name, fn in (("torch floor: Function forward", floor_fwd),
                     ("torch floor: Function forward + backward", floor_fwd_bwd),
                     ("ours: forward (requires grad)", ours_fwd),
                     ("ours: forward + backward", ours_fwd_bwd)):
        rows[name] = timing.wall_us(fn, calls=500, host=True)[1]

    # host time inside the Function's bodies (the backward runs on autograd's device thread)
    spent = {"forward": [0.0, 0], "backward": [0.0, 0]}
    orig_f, orig_b = _torch_eager.FusedNA.forward, _torch_eager.FusedNA.backward

    def timed(which, body):
        def run(ctx, *a):
            t0 = time.perf_counter()
            r = body(ctx, *a)
            s = spent[which]
            s[0] += time.perf_counter() - t0
            s[1] += 1
            return r
        return staticmethod(run)

    _torch_eager.FusedNA.forward = timed("forward", orig_f)
    _torch_eager.FusedNA.backward = timed("backward", orig_b)
    try:
        for _ in range(50):
            ours_fwd_bwd()
        for s in spent.values():
            s[:] = [0.0, 0]
        whole = timing.wall_us(ours_fwd_bwd, calls=500, reps=3, host=True)[1]
    finally:
        _torch_eager.FusedNA.forward, _torch_eager.FusedNA.backward = orig_f, orig_b
    rows["ours: forward + backward, with the bodies timed"] = whole
    for which, (sec, n) in spent.items():
        rows[f"inside FusedNA.{which}"] = sec / max(n, 1) * 1e6

    out, lse = (t.detach() for t in nt.na2d(*tl, KERNEL, return_lse=True))
    det = [t.detach() for t in tl]
    tensors = (tdo, *det, out, lse)

    def body_bwd():
        return _torch_eager._fused_backward_no_grad(tensors, opts)

    def body_fwd():
        return _torch_eager._fused_no_grad(*det, opts)

    import natten_cupy

    def array_bwd():
        return natten_cupy.na2d_backward(tdo, *det, out, lse, KERNEL)

    rows["backward body on this thread"] = _per_call_us(body_bwd)
    rows["forward body on this thread (no autograd)"] = _per_call_us(body_fwd)
    rows["array API backward, torch tensors"] = _per_call_us(array_bwd)

    e = _torch_common._backward_entry(tensors, opts)
    rows["backward: signature + lookup"] = _per_call_us(lambda: _torch_common._backward_entry(
        tensors, opts))
    fe0 = _torch_common._forward_entry(*det, opts)
    kept = []
    o2, l2 = _fast.run_torch_call(fe0, tuple(det), None, kept)
    saved = (*det, o2, l2)
    after = (tdo, *saved)
    _fast.torch_after(fe0, kept, tdo, saved, lambda: _torch_common._backward_entry(after, opts))
    rows["backward: lookup from the forward's entry (torch_after)"] = _per_call_us(
        lambda: _fast.torch_after(fe0, kept, tdo, saved,
                                  lambda: _torch_common._backward_entry(after, opts)))
    first = tensors[0]
    rows["backward: torch allocations (%d)" % len(e.torch_out)] = _per_call_us(
        lambda: [first.new_empty(s, dtype=d) for s, d in e.torch_out])
    made = [first.new_empty(s, dtype=d) for s, d in e.torch_out]
    rows["backward: data pointers"] = _per_call_us(
        lambda: [x.data_ptr() for x in (*tensors, *made)])
    ptrs = [x.data_ptr() for x in (*tensors, *made)]
    stream = torch._C._cuda_getCurrentRawStream(tensors[0].device.index)
    rows["backward: current stream"] = _per_call_us(
        lambda: torch._C._cuda_getCurrentRawStream(0))
    for i, c in enumerate(e.calls):
        rows[f"backward: launch {i} ({c.name})"] = _per_call_us(lambda c=c: c(ptrs, stream))
    fe = _torch_common._forward_entry(*det, opts)
    for i, c in enumerate(fe.calls):
        fptrs = [x.data_ptr() for x in (*det, out, lse)]
        rows[f"forward: launch {i} ({c.name})"] = _per_call_us(lambda c=c: c(fptrs, stream))
    profiles = {name: timing.python_profile(fn, top=14) for name, fn in (
        ("backward body", body_bwd), ("forward body", body_fwd),
        ("array API backward", array_bwd), ("forward with grad", ours_fwd))}
    report = dict(problem=dict(shape=SHAPE, kernel=KERNEL, dtype="float16"),
                  device=torch.cuda.get_device_name(), torch=torch.__version__,
                  commit=os.environ.get("NATTEN_CUPY_COMMIT", ""),
                  backward_kernels=[c.name for c in e.calls],
                  backward_workspaces=[list(map(str, w)) for w in e.workspaces],
                  host_us=rows, profiles=profiles, fast_entries=_fast.entries())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    for k, v in rows.items():
        print(f"{k:60s} {v:8.2f} us")
    for name, p in profiles.items():
        print(f"-- {name}: {p['calls']:.0f} Python calls")
        for t in p["top"][:10]:
            print(f"   {t['tottime_us']:7.2f} us  x{t['calls']:<4.1f} {t['function']}")


if __name__ == "__main__":
    main()
