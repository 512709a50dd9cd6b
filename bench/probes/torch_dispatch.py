"""Per-call host cost of the torch-layer dispatch: ways to register an op, eager and compiled.

The same fused-forward op (``na_fused_forward``'s schema, a backward op with
``na_fused_backward``'s) is registered several ways in a scratch namespace, with a stand-in
body that only allocates its outputs (no kernel, no validation), so the rows time the
dispatch itself:

* ``custom_op``: ``torch.library.custom_op`` + ``register_fake`` + ``register_autograd``
  (what ``natten_cupy._torch_ops``, since split into ``_torch_library`` and others, used
  up to this probe);
* ``library+register_autograd``: ``torch.library.Library(ns, "FRAGMENT").define`` +
  ``.impl(name, fn, "CPU"/"CUDA")`` + ``register_fake`` + ``torch.library.register_autograd``;
* ``library+autograd_kernel``: the same, with a hand-written Autograd kernel (an
  ``autograd.Function`` applied from a Python kernel at the Autograd key);
* ``library, autograd.Function outside``: no Autograd kernel; the caller applies an
  ``autograd.Function`` around the op (what an eager fast path does);
* ``python function``: the stand-in called as a plain function (the floor).

Each is timed eager (inputs without and with ``requires_grad``, forward + backward) and inside
``torch.compile(fullgraph=True)`` with the ``aot_eager`` and ``inductor`` backends. Rows for
the real ``natten_cupy.torch.na2d`` on a tiny problem follow (the reference backend on CPU
tensors, so they include its arithmetic), and ``(x * 2).backward()`` for scale. Every row
gives the best and the median of 7 timed runs (``bench/timing.py``'s ``wall_us``, after up to
200 warm-up calls) and the Python function calls per call (cProfile), which do not drift with
the machine's load.

    python bench/probes/torch_dispatch.py [--device cpu|cuda] [--calls 2000] [--out f.json]

The dispatch cost is mostly device-independent; ``--device cuda`` times the same rows on a GPU
(with one synchronize per timed run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]   # natten_cupy, bench/

import timing  # noqa: E402
import torch  # noqa: E402
from workloads import OVERHEAD_KERNEL, OVERHEAD_SHAPE as SHAPE  # noqa: E402

NS = "natten_cupy_dispatch_probe"
FWD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, SymInt[] kernel_size, SymInt[] stride, "
              "SymInt[] dilation, bool[] is_causal, float? scale, str backend, bool allow_tf32, "
              "bool deterministic, bool lse_grad=False) -> (Tensor, Tensor)")
BWD_SCHEMA = ("(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
              "SymInt[] kernel_size, SymInt[] stride, SymInt[] dilation, bool[] is_causal, "
              "float? scale, str backend, bool allow_tf32, bool deterministic) "
              "-> (Tensor, Tensor, Tensor)")
OPTS = ([OVERHEAD_KERNEL] * 2, [1, 1], [1, 1], [False, False], None, "auto", False, False)


# ---- stand-in bodies ----------------------------------------------------------------------

def _fwd_body(q, k, v, *options):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))


def _bwd_body(d_out, q, k, v, out, lse, *options):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _fwd_fake(q, k, v, *options):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _bwd_fake(d_out, q, k, v, out, lse, *options):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.options = inputs[3:11]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _grad_with(bwd):
    def grad(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd(d_out, q, k, v, out, lse, *ctx.options)
        return (dq, dk, dv) + (None,) * 9
    return grad


# ---- the registrations --------------------------------------------------------------------

def _custom_op():
    fwd = torch.library.custom_op(f"{NS}::co_fwd", _fwd_body, mutates_args=(),
                                  schema=FWD_SCHEMA)
    bwd = torch.library.custom_op(f"{NS}::co_bwd", _bwd_body, mutates_args=(),
                                  schema=BWD_SCHEMA)
    fwd.register_fake(_fwd_fake)
    bwd.register_fake(_bwd_fake)
    fwd.register_autograd(_grad_with(torch.ops.__getattr__(NS).co_bwd.default),
                          setup_context=_setup)
    return torch.ops.__getattr__(NS).co_fwd.default


_LIB = []


def _library(tag):
    lib = torch.library.Library(NS, "FRAGMENT")
    _LIB.append(lib)
    tags = (torch.Tag.pt2_compliant_tag,)
    lib.define(f"{tag}_fwd{FWD_SCHEMA}", tags=tags)
    lib.define(f"{tag}_bwd{BWD_SCHEMA}", tags=tags)
    for key in ("CPU", "CUDA"):
        lib.impl(f"{tag}_fwd", _fwd_body, key)
        lib.impl(f"{tag}_bwd", _bwd_body, key)
    torch.library.register_fake(f"{NS}::{tag}_fwd", _fwd_fake, lib=lib)
    torch.library.register_fake(f"{NS}::{tag}_bwd", _bwd_fake, lib=lib)
    ops = torch.ops.__getattr__(NS)
    return lib, getattr(ops, f"{tag}_fwd").default, getattr(ops, f"{tag}_bwd").default


def _library_register_autograd():
    lib, fwd, bwd = _library("lra")
    torch.library.register_autograd(f"{NS}::lra_fwd", _grad_with(bwd), setup_context=_setup,
                                    lib=lib)
    return fwd


def _library_autograd_kernel():
    lib, fwd, bwd = _library("lak")
    below = torch._C._AutoDispatchBelowAutograd

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, *options):
            with below():
                out, lse = fwd(q, k, v, *options)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = options[:8]
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, d_out, d_lse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = bwd(d_out, q, k, v, out, lse, *ctx.options)
            return (dq, dk, dv) + (None,) * 9

    grad_enabled, any_rg = torch.is_grad_enabled, torch._C._any_requires_grad

    def autograd_kernel(q, k, v, *options):
        if grad_enabled() and any_rg(q, k, v):
            return Fn.apply(q, k, v, *options)
        with below():
            return fwd(q, k, v, *options)

    lib.impl("lak_fwd", autograd_kernel, "Autograd")
    return fwd


def _library_function_outside():
    _, fwd, bwd = _library("lfo")

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, options):
            out, lse = fwd(q, k, v, *options)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = options
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, d_out, d_lse):
            q, k, v, out, lse = ctx.saved_tensors
            return (*bwd(d_out, q, k, v, out, lse, *ctx.options), None)

    def call(q, k, v, *options):
        return Fn.apply(q, k, v, options)
    return call


class _PlainFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = _fwd_body(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_bwd_body(d_out, q, k, v, out, lse), None)


def variants():
    return {"custom_op": _custom_op(),
            "library+register_autograd": _library_register_autograd(),
            "library+autograd_kernel": _library_autograd_kernel(),
            "library, autograd.Function outside": _library_function_outside(),
            "python autograd.Function (no op)": lambda q, k, v, *o: _PlainFn.apply(q, k, v, o)}


# ---- timing -------------------------------------------------------------------------------

def python_calls(fn, n=50):
    """Python function calls per call of ``fn`` (cProfile; deterministic, unlike times)."""
    return timing.python_profile(fn, n=n, top=0)["calls"]


def rows_for(name, op, q, k, v, g, qg, kg, vg, backends):
    """(row name, callable) per way of calling ``op`` (the forward)."""
    def fwd_bwd(f):
        def run():
            out, _ = f(qg, kg, vg, *OPTS)
            out.backward(g)
        return run
    rows = [(f"{name}: eager forward, no grad", lambda: op(q, k, v, *OPTS)),
            (f"{name}: eager forward, requires grad", lambda: op(qg, kg, vg, *OPTS)),
            (f"{name}: eager forward + backward", fwd_bwd(op))]
    for be in backends:
        c = torch.compile(lambda q, k, v, *o: op(q, k, v, *o), fullgraph=True, backend=be)
        rows += [(f"{name}: compiled ({be}) forward, no grad", lambda c=c: c(q, k, v, *OPTS)),
                 (f"{name}: compiled ({be}) forward, requires grad",
                  lambda c=c: c(qg, kg, vg, *OPTS)),
                 (f"{name}: compiled ({be}) forward + backward", fwd_bwd(c))]
    return rows


def natten_rows(q, k, v, g, qg, kg, vg, backends):
    import natten_cupy.torch as nt

    def fb(f):
        def run():
            f(qg, kg, vg).backward(g)
        return run
    na = lambda q, k, v: nt.na2d(q, k, v, 3)  # noqa: E731
    op = torch.ops.natten_cupy.na_fused_forward.default
    rows = [("natten_cupy.torch.na2d: eager forward, no grad", lambda: na(q, k, v)),
            ("natten_cupy.torch.na2d: eager forward, requires grad", lambda: na(qg, kg, vg)),
            ("natten_cupy.torch.na2d: eager forward + backward", fb(na)),
            ("torch.ops.natten_cupy.na_fused_forward: no grad", lambda: op(q, k, v, *OPTS)),
            ("torch.ops.natten_cupy.na_fused_forward: requires grad",
             lambda: op(qg, kg, vg, *OPTS))]
    for be in backends:
        c = torch.compile(na, fullgraph=True, backend=be)
        rows += [(f"natten_cupy.torch.na2d: compiled ({be}) forward, no grad",
                  lambda c=c: c(q, k, v)),
                 (f"natten_cupy.torch.na2d: compiled ({be}) forward + backward", fb(c))]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--backends", default="aot_eager,inductor")
    ap.add_argument("--only", default="", help="substring a row name must contain")
    ap.add_argument("--no-natten", action="store_true", help="skip the natten_cupy rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    backends = [b for b in args.backends.split(",") if b]
    torch._dynamo.config.cache_size_limit = 64
    q, k, v, g = (torch.randn(SHAPE, device=dev, dtype=dtype) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    rows = []
    for name, op in variants().items():
        rows += rows_for(name, op, q, k, v, g, qg, kg, vg, backends)
    if not args.no_natten:
        rows += natten_rows(q, k, v, g, qg, kg, vg, backends)
    x = torch.randn(SHAPE, device=dev, requires_grad=True)
    rows.append(("torch alone: (x * 2).backward(g), for scale",
                 lambda: (x * 2).backward(g.float())))
    c2 = torch.compile(lambda x: x * 2, fullgraph=True, backend="aot_eager")
    rows.append(("torch alone: compiled (aot_eager) x * 2, requires grad", lambda: c2(x)))
    results = []
    print(f"{'best us':>9s} {'median':>9s} {'py calls':>7s}  call")
    for name, fn in rows:
        if args.only and args.only not in name:
            continue
        runs = timing.wall_us(fn, calls=args.calls, reps=7, warmup=min(args.calls, 200),
                              cpu=dev.type == "cpu", per_run=True)
        best, med = min(runs), statistics.median(runs)
        pc = python_calls(fn)
        results.append(dict(call=name, best_us=best, median_us=med, python_calls=pc))
        print(f"{best:9.1f} {med:9.1f} {pc:7.0f}  {name}", flush=True)
    report = dict(device=str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(),
                  torch=torch.__version__, dtype=str(dtype), shape=SHAPE, calls=args.calls,
                  commit=os.environ.get("NATTEN_CUPY_COMMIT", ""), rows=results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
