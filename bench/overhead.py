"""Per-call host overhead of natten_cupy on a tiny problem, fast path against general path.

Every row times a call on a problem whose kernels take a few microseconds (2-D 8x8 map,
kernel 3, one head of 32, float16), 500 calls then one synchronize, median of 5 runs (every
row warmed up first, the garbage collector off while timing): what a model with many small
NA layers pays per layer beyond its kernels. Each row runs with the
fast path (warm calls served by ``natten_cupy._fast``) and with it switched off (the general
path: validation, backend choice, DLPack, stream objects on every call), side by side in one
process. Also: the kernels alone (CUDA-graph replay), a cProfile count of the Python calls in
one warm call, a warm ``tile="autotune"`` call, FlexAttention's eager call on the same
problem for scale, the frameworks' own floor (an empty CuPy kernel launch, one output
array, one torch kernel launch), and the CuPy warm calls with their outputs in one
allocation against one allocation per array (``allocation_ab``), and the torch layer's
forward + backward against its eager-torch floor, interleaved (``torch_floor_ab``).

    python bench/overhead.py --out overhead.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402
from workloads import OVERHEAD_KERNEL as KERNEL, OVERHEAD_SHAPE as SHAPE  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file for the results (default: none)")
    ap.add_argument("--calls", type=int, default=500, help="calls per timed run (default 500)")
    ap.add_argument("--profile", action="store_true",
                    help="also print where a warm call spends its host time (cProfile)")
    args = ap.parse_args(argv)

    import cupy
    import torch

    import natten_cupy
    from natten_cupy import _fast
    from natten_cupy import _torch_library, torch as nt

    dev = "cuda"
    tq, tk, tv, tdo = (torch.randn(SHAPE, device=dev, dtype=torch.float16) for _ in range(4))
    cq, ck, cv, cdo = (cupy.asarray(x) for x in (tq, tk, tv, tdo))
    tl = [x.detach().clone().requires_grad_() for x in (tq, tk, tv)]
    out_c, lse_c = natten_cupy.na2d(cq, ck, cv, KERNEL, return_lse=True)
    out_t, lse_t = natten_cupy.na2d(tq, tk, tv, KERNEL, return_lse=True)

    def layer_fwd_bwd():
        out = nt.na2d(*tl, KERNEL)
        out.backward(tdo)

    # a relative positional bias and additional tokens (the ext ops), with gradients
    rpb = torch.randn((SHAPE[3], 2 * KERNEL - 1, 2 * KERNEL - 1), device=dev,
                      dtype=torch.float16, requires_grad=True)
    xk, xv = (torch.randn((SHAPE[0], 4, SHAPE[3], SHAPE[4]), device=dev, dtype=torch.float16,
                          requires_grad=True) for _ in range(2))

    def layer_rpb_fwd_bwd():
        nt.na2d(*tl, KERNEL, rpb=rpb).backward(tdo)

    def layer_tokens_fwd_bwd():
        nt.na2d(*tl, KERNEL, additional_keys=xk, additional_values=xv).backward(tdo)

    compiled = torch.compile(lambda q, k, v: nt.na2d(q, k, v, KERNEL), fullgraph=True)

    ks3 = [KERNEL, KERNEL]
    # The same forward's CUDA kernel registered alone (torch.library.Library + impl on CUDA,
    # no Autograd kernel), to measure what the op's Autograd kernel costs per call.
    lib = torch.library.Library("natten_cupy_overhead", "DEF")
    lib.define("fwd(Tensor q, Tensor k, Tensor v, int[] kernel_size, int[] stride, "
               "int[] dilation, bool[] is_causal, float? scale, str backend, bool allow_tf32, "
               "bool deterministic) -> (Tensor, Tensor)")
    lib.impl("fwd", _torch_library._fused_forward_impl, "CUDA")
    x_base = torch.randn(SHAPE, device=dev, requires_grad=True)
    nop = cupy.RawKernel('extern "C" __global__ void nop() {}', "nop")
    one = torch.empty(1, device=dev)

    def autograd_baseline():
        (x_base * 2).backward(tdo.float())

    # The floor of the layer's forward + backward in torch alone: a Function of the same
    # three leaves that allocates what the fast path allocates (out and lse; dq, dk, dv and a
    # workspace) and launches as many kernels (empty ones: one forward, two backward).
    lse_shape = SHAPE[:-1]

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = q.new_empty(SHAPE), q.new_empty(lse_shape, dtype=torch.float32)
            nop((1,), (32,), ())
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, d_out, d_lse):
            q = ctx.saved_tensors[0]
            grads = [q.new_empty(SHAPE) for _ in range(3)]
            q.new_empty(lse_shape, dtype=torch.float32)
            nop((1,), (32,), ())
            nop((1,), (32,), ())
            return tuple(grads)

    def floor_fwd_bwd():
        Floor.apply(*tl)[0].backward(tdo)

    rows = [
        ("array API, CuPy: forward", lambda: natten_cupy.na2d(cq, ck, cv, KERNEL)),
        ("array API, CuPy: backward",
         lambda: natten_cupy.na2d_backward(cdo, cq, ck, cv, out_c, lse_c, KERNEL)),
        ("array API, torch tensors: forward", lambda: natten_cupy.na2d(tq, tk, tv, KERNEL)),
        ("array API, torch tensors: backward",
         lambda: natten_cupy.na2d_backward(tdo, tq, tk, tv, out_t, lse_t, KERNEL)),
        ("torch layer: forward (no grad)", lambda: nt.na2d(tq, tk, tv, KERNEL)),
        ("torch layer: forward (requires grad)", lambda: nt.na2d(*tl, KERNEL)),
        ("torch layer: forward + backward", layer_fwd_bwd),
        ("torch layer, rpb: forward (no grad)",
         lambda: nt.na2d(tq, tk, tv, KERNEL, rpb=rpb.detach())),
        ("torch layer, rpb: forward + backward", layer_rpb_fwd_bwd),
        ("torch layer, 4 additional tokens: forward (no grad)",
         lambda: nt.na2d(tq, tk, tv, KERNEL, additional_keys=xk.detach(),
                         additional_values=xv.detach())),
        ("torch layer, 4 additional tokens: forward + backward", layer_tokens_fwd_bwd),
        ("torch.compile(fullgraph): forward", lambda: compiled(*tl)),
        ("torch.compile(fullgraph): forward + backward", lambda: compiled(*tl).backward(tdo)),
        ("array API, CuPy: forward, tile=autotune",
         lambda: natten_cupy.na2d(cq, ck, cv, KERNEL, tile="autotune")),
        ("torch custom op called directly: forward",
         lambda: torch.ops.natten_cupy.na_fused_forward(tq, tk, tv, ks3, [1, 1], [1, 1],
                                                         [False, False], None, "auto", False,
                                                         False)),
        ("same op registered with torch.library.Library.impl: forward",
         lambda: torch.ops.natten_cupy_overhead.fwd(tq, tk, tv, ks3, [1, 1], [1, 1],
                                                    [False, False], None, "auto", False,
                                                    False)),
        ("torch alone: (x * 2).backward(), for scale", autograd_baseline),
        ("torch alone: the layer's Function with empty kernels, forward + backward",
         floor_fwd_bwd),
        # The frameworks' own floor on this machine: what one launch and one output cost
        # without natten_cupy (a warm forward makes two outputs and one launch; a backward
        # three outputs, one workspace and two launches).
        ("CuPy alone: an empty kernel through cupy.RawKernel", lambda: nop((1,), (32,), ())),
        ("CuPy alone: cupy.empty of the output", lambda: cupy.empty(SHAPE, cupy.float16)),
        ("torch alone: torch.empty_like of the output", lambda: torch.empty_like(tq)),
        ("torch alone: one element zeroed (one kernel)", lambda: one.zero_()),
    ]
    # Every row warmed up first (the first row timed used to read high), and the garbage
    # collector off while timing (as timeit does): its pauses are not a call's cost.
    for _, fn in rows:
        for _ in range(50):
            fn()
    timing.sync()
    results = []
    gc.collect()
    gc.disable()
    try:
        for name, fn in rows:
            fast, fast_host = timing.wall_us(fn, calls=args.calls, host=True)
            _fast.enabled = False
            general, general_host = timing.wall_us(fn, calls=args.calls, host=True)
            _fast.enabled = True
            results.append(dict(call=name, fast_us=fast, general_us=general,
                                fast_host_us=fast_host, general_host_us=general_host))
    finally:
        gc.enable()
    profiles = {}
    if args.profile:
        for name, fn in rows[:2] + rows[6:7]:
            profiles[name] = timing.python_profile(fn)["top"]

    # The CuPy warm calls' one-block allocation of outputs and workspaces against one
    # allocation per array, side by side (interleaved, best of two medians each).
    alloc_ab = []
    for name, fn in rows[:2]:
        pair = {True: [], False: []}
        for shared in (True, False, True, False):
            _fast.share_allocation = shared
            pair[shared].append(timing.wall_us(fn, calls=args.calls))
        _fast.share_allocation = True
        alloc_ab.append(dict(call=name, one_block_us=min(pair[True]),
                             per_array_us=min(pair[False])))
    # The torch layer's forward + backward against its eager-torch floor (the Function with
    # empty kernels), interleaved, two rounds each (host speed drifts between rows): best median
    # of each, and what the layer costs above the floor.
    floor_ab = {"layer": [], "floor": []}
    for _ in range(2):
        for label, fn in (("layer", layer_fwd_bwd), ("floor", floor_fwd_bwd)):
            floor_ab[label].append(timing.wall_us(fn, calls=args.calls))
    floor_ab = dict(layer_us=min(floor_ab["layer"]), floor_us=min(floor_ab["floor"]),
                    rounds=floor_ab)
    floor_ab["above_floor_us"] = floor_ab["layer_us"] - floor_ab["floor_us"]
    kernel_fwd = timing.graph_ms(lambda: nt.na2d(tq, tk, tv, KERNEL)) * 1e3
    kernel_fb = timing.graph_ms(layer_fwd_bwd) * 1e3
    calls = {}
    for label, enabled in (("fast", True), ("general", False)):
        _fast.enabled = enabled
        got = timing.python_profile(lambda: natten_cupy.na2d(cq, ck, cv, KERNEL), n=20, top=0)
        calls[label] = got["calls"], got["functions"]
    _fast.enabled = True

    flex_us = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        N = SHAPE[1] * SHAPE[2]
        flex = torch.compile(flex_attention)
        fq, fk, fv = (x.reshape(1, N, 1, 32).transpose(1, 2).contiguous() for x in (tq, tk, tv))
        bm = create_block_mask(lambda b, h, i, j: (i // 8 - j // 8).abs() <= 1, None, None, N,
                               N, device=dev)
        flex_us = timing.wall_us(lambda: flex(fq, fk, fv, block_mask=bm), calls=args.calls)
    except Exception as e:  # FlexAttention is optional context, not a result
        print(f"FlexAttention not timed: {e}")

    report = dict(problem=dict(shape=SHAPE, kernel=KERNEL, dtype="float16"), calls=args.calls,
                  device=torch.cuda.get_device_name(), torch=torch.__version__,
                  cupy=cupy.__version__, commit=os.environ.get("NATTEN_CUPY_COMMIT", ""),
                  rows=results, kernel_only_us=dict(forward=kernel_fwd, forward_backward=kernel_fb),
                  python_calls_per_warm_forward=dict(
                      fast=dict(calls=calls["fast"][0], functions=calls["fast"][1]),
                      general=dict(calls=calls["general"][0], functions=calls["general"][1])),
                  flex_eager_forward_us=flex_us, profiles=profiles, allocation_ab=alloc_ab,
                  torch_floor_ab=floor_ab)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(f"kernels alone (graph replay): forward {kernel_fwd:.1f} us, "
          f"forward+backward {kernel_fb:.1f} us; FlexAttention eager forward "
          f"{flex_us if flex_us is None else round(flex_us, 1)} us")
    print(f"python calls per warm CuPy forward: fast {calls['fast'][0]:.0f} "
          f"({calls['fast'][1]} functions), general {calls['general'][0]:.0f} "
          f"({calls['general'][1]} functions)")
    for name, top in profiles.items():
        print(f"-- {name}: host time by function (cProfile, inflated)")
        for t in top[:8]:
            print(f"   {t['tottime_us']:7.2f} us  x{t['calls']:<4.0f} {t['function']}")
    print(f"{'call (us per call: wall / host alone)':55s} {'fast':>13s} {'general':>15s}")
    for r in results:
        print(f"{r['call']:55s} {r['fast_us']:6.1f} / {r['fast_host_us']:5.1f} "
              f"{r['general_us']:7.1f} / {r['general_host_us']:6.1f}")
    print(f"torch layer forward + backward {floor_ab['layer_us']:.1f} us against its eager "
          f"floor {floor_ab['floor_us']:.1f} us (interleaved, best of two medians each): "
          f"{floor_ab['above_floor_us']:+.1f} us")
    for r in alloc_ab:
        print(f"{r['call']}: outputs in one block {r['one_block_us']:.1f} us, one allocation "
              f"per array {r['per_array_us']:.1f} us")


if __name__ == "__main__":
    main()
