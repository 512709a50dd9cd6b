"""The model-shaped workloads (M1-M7 of the benchmark notes) timed as users call them.

Per workload and dtype, side by side in one process:

* ``ours_eager``: ``natten_cupy.torch.na{n}d`` on ``[B, *spatial, H, D]`` tensors that require
  grad, eager; forward, and forward + ``out.backward(d_out)``;
* ``ours_compiled``: the same call inside ``torch.compile(fullgraph=True)``;
* ``flex_eager``: FlexAttention as a user writes it: ``[B, H, N, D]`` tensors in row-major
  token order, ``create_block_mask`` from a ``mask_mod`` that encodes window, dilation and
  causal axes (made once), ``torch.compile(flex_attention)``;
* ``*_kernels``: the same forward and forward+backward captured in a CUDA graph and
  replayed: the kernels alone, no host overhead.

After the M set come M4's variants (``workloads.MODEL_VARIANTS``, last in the default list):

* ``M4+kv256``: every query also attends 256 extra tokens ``[B, 256, H, D]``. Ours:
  ``na3d(..., additional_keys=, additional_values=)``; Flex: the user concatenates the extra
  keys / values after the spatial ones (``torch.cat`` inside the timed call) and the mask_mod
  is the neighborhood on the first N kv indices OR ``kv_idx >= N``. Errors include the extra
  keys' and values' gradients.
* ``M4-gqa8/2``: M4's geometry, batch and head dim with 8 query heads and 2 key/value heads.
  Ours: ``na3d`` with k, v of 2 heads; Flex: ``flex_attention(..., enable_gqa=True)``, same
  mask.

Times are medians of CUDA-event timings after warm-up (``timing.py``); useful TFLOP/s count
4*B*N*H*(K+T)*D forward (T extra tokens, 0 but on M4+kv256; H the query heads, GQA or not)
and 2.5x that backward; "of floor" is the floor (bytes at copy bandwidth
or FLOPs at the dtype's matmul ceiling) over the time. Outputs and gradients of ours and
Flex's are compared (max abs error relative to the largest value). Peak is the extra device
memory of one forward+backward.

    python bench/models.py --out models.json [--groups M1:fp16,M4:bf16] [--budget-s 300]
    python bench/models.py --out variants.json --groups M4:bf16,M4+kv256:bf16,M4-gqa8/2:bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402
import workloads as wl  # noqa: E402


def _mask_mod(w):
    """A careful user's mask_mod for workload ``w`` on row-major token indices: per axis only
    the arithmetic its options need (no dilation groups without dilation, no stride groups
    without stride)."""
    import torch
    spatial = w.spatial
    strides = [1] * len(spatial)
    for a in range(len(spatial) - 2, -1, -1):
        strides[a] = strides[a + 1] * spatial[a + 1]

    def axis_ok(i, j, L, k, s, d, c):
        if d > 1:
            same = (i % d) == (j % d)
            glen = (L - i % d + d - 1) // d
            i, j = i // d, j // d
        else:
            same, glen = None, L
        lead = i if s == 1 else (i // s) * s + ((s - 1) if c else s // 2)
        if c:
            lead = torch.clamp(lead, max=glen - 1) if s > 1 else lead
            ok = (j <= i) & (j > lead - k)
        else:
            lead = torch.clamp(lead, max=glen - 1) if s > 1 else lead
            start = torch.clamp(torch.clamp(lead - k // 2, min=0), max=glen - k)
            ok = (j >= start) & (j < start + k)
        return ok if same is None else ok & same

    axes = list(zip(spatial, w.kernel, w.stride, w.dilation, w.causal, strides))

    def mask_mod(b, h, q_idx, kv_idx):
        ok = None
        for L, k, s, d, c, st in axes:
            qi = q_idx // st if st > 1 else q_idx
            ki = kv_idx // st if st > 1 else kv_idx
            if st * L < w.tokens:
                qi, ki = qi % L, ki % L
            m = axis_ok(qi, ki, L, k, s, d, c)
            ok = m if ok is None else ok & m
        return ok

    return mask_mod


_FLEX = {}


def _flex():
    import torch
    import torch._dynamo as dynamo
    from torch.nn.attention.flex_attention import flex_attention
    if "fn" not in _FLEX:
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 64)
        _FLEX["fn"] = torch.compile(flex_attention)
    return _FLEX["fn"]


def _reps(ms_guess):
    return (3, 1) if ms_guess > 60 else (10, 1) if ms_guess > 5 else (15, 5)


def _time_pair(fwd, fwd_bwd, kernels=True):
    """(fwd ms, fwd+bwd ms[, graph fwd ms, graph fwd+bwd ms]) of two callables."""
    import torch
    t0 = time.perf_counter()
    fwd()
    torch.cuda.synchronize()
    guess = (time.perf_counter() - t0) * 1e3
    reps, inner = _reps(guess)
    out = dict(fwd=timing.event_ms(fwd, reps=reps, inner=inner),
               fwd_bwd=timing.event_ms(fwd_bwd, reps=reps, inner=inner))
    if kernels:
        try:
            out["fwd_kernels"] = timing.graph_ms(fwd, reps=reps, inner=inner)
            out["fwd_bwd_kernels"] = timing.graph_ms(fwd_bwd, reps=reps, inner=inner)
        except Exception as e:  # record, do not hide, a capture failure
            out["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def _peak(fn):
    import torch
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def flex_mask_mod(w):
    """The mask_mod of workload ``w`` over its key/value indices: the neighborhood on the first
    N (the spatial tokens, ``_mask_mod``), and with extra tokens, every query sees kv indices
    N .. N + T - 1 (the extra tokens, concatenated after the spatial ones)."""
    base = _mask_mod(w)
    if not w.extra_tokens:
        return base
    N = w.tokens

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= N) | base(b, h, q_idx, kv_idx)

    return mask_mod


def make_inputs(w, dt, device, gen):
    """Ours' inputs in natten_cupy's layout, leaves that require grad: [q, k, v] (k, v at the
    workload's kv heads), then the extra keys and values where it has extra tokens; and d_out.
    Drawn in this order, so the plain rows' tensors are what they always were."""
    import torch

    def draw(shape):
        return torch.randn(shape, device=device, dtype=dt, generator=gen)
    q, k, v, do = draw(w.shape), draw(w.kv_shape), draw(w.kv_shape), draw(w.shape)
    extra = [draw(w.extra_shape) for _ in range(2)] if w.extra_tokens else []
    return [x.clone().requires_grad_() for x in (q, k, v, *extra)], do


def make_ours(w, tf32):
    """Ours as users call it: ``na{n}d(q, k, v, kernel, ...)``, with ``additional_keys`` /
    ``additional_values`` where the workload has extra tokens."""
    from natten_cupy import torch as nt
    na = getattr(nt, f"na{w.rank}d")
    opts = dict(dilation=w.dilation, is_causal=w.causal, stride=w.stride, allow_tf32=tf32)
    if w.extra_tokens:
        def ours(q, k, v, ek, ev):
            return na(q, k, v, w.kernel, additional_keys=ek, additional_values=ev, **opts)
    else:
        def ours(q, k, v):
            return na(q, k, v, w.kernel, **opts)
    return ours


def to_flex(x):
    """[B, n..., H, D] (ours) -> [B, H, n, D] (Flex's), contiguous, cut from the graph."""
    B, H, D = x.shape[0], x.shape[-2], x.shape[-1]
    return x.detach().reshape(B, -1, H, D).transpose(1, 2).contiguous()


def from_flex(x, shape):
    """[B, H, n, D] -> ours' ``shape``."""
    return x.transpose(1, 2).reshape(shape)


def make_peer(w, flex, device):
    """FlexAttention as a user writes it for ``w``: a BlockMask from ``flex_mask_mod`` (made
    once) over N queries and N + T keys; with extra tokens the user concatenates them after the
    spatial keys and values (inside the call, so their gradients flow); with fewer kv heads,
    ``enable_gqa=True``."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    N, T = w.tokens, w.extra_tokens
    bm = create_block_mask(flex_mask_mod(w), None, None, N, N + T, device=device)
    gqa = dict(enable_gqa=True) if w.kv_heads != w.heads else {}
    if T:
        def peer(q, k, v, ek, ev):
            return flex(q, torch.cat([k, ek], 2), torch.cat([v, ev], 2), block_mask=bm, **gqa)
    else:
        def peer(q, k, v):
            return flex(q, k, v, block_mask=bm, **gqa)
    return peer


ERROR_NAMES = ("out", "dq", "dk", "dv", "d_extra_k", "d_extra_v")


def rel_errors(mine, ref):
    """{name: max |ours - Flex's| / max |Flex's|} of out and the gradients, ``mine`` in ours'
    layout and ``ref`` in Flex's, in ERROR_NAMES order."""
    err = {}
    for name, a, b in zip(ERROR_NAMES, mine, ref):
        a, b = a.detach(), from_flex(b.detach(), a.shape)
        err[name] = float((a.float() - b.float()).abs().max() / b.float().abs().max())
    return err


def run_group(w, dtype_key, compiled=True):
    import torch
    spec = wl.dtype_spec(dtype_key)
    dt = wl.torch_dtype(spec)
    tf32 = spec["tf32"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves, do = make_inputs(w, dt, "cuda", gen)
    ours = make_ours(w, tf32)

    rec = dict(workload=w.id, dtype=dtype_key, shape=list(w.shape), kernel=list(w.kernel),
               flops_fwd=w.flops(), flops_bwd=w.flops(True),
               floor_fwd_ms=w.floor_ms(dtype_key), floor_bwd_ms=w.floor_ms(dtype_key, True))
    if w.kv_heads != w.heads:
        rec["kv_shape"] = list(w.kv_shape)
    if w.extra_tokens:
        rec["extra_shape"] = list(w.extra_shape)

    def fb(fn, xs):
        def step():
            out = fn(*xs)
            torch.autograd.grad(out, xs, do)
        return step

    rec["ours_eager"] = _time_pair(lambda: ours(*leaves), fb(ours, leaves))
    rec["ours_eager"]["peak_gib"] = _peak(fb(ours, leaves))
    if compiled:
        try:
            comp = torch.compile(ours, fullgraph=True)
            rec["ours_compiled"] = _time_pair(lambda: comp(*leaves), fb(comp, leaves),
                                              kernels=False)
        except Exception as e:  # record it; the eager and Flex numbers still stand
            rec["ours_compiled"] = dict(error=f"{type(e).__name__}: {e}"[:400])

    fl = [to_flex(x).requires_grad_() for x in leaves]
    fdo = to_flex(do)
    flex = _flex()
    try:
        peer = make_peer(w, flex, "cuda")

        def peer_fb():
            out = peer(*fl)
            torch.autograd.grad(out, fl, fdo)

        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            rec["flex_eager"] = _time_pair(lambda: peer(*fl), peer_fb)
            rec["flex_eager"]["peak_gib"] = _peak(peer_fb)
            ref = peer(*fl)
            ref_grads = torch.autograd.grad(ref, fl, fdo)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        mine = ours(*leaves)
        grads = torch.autograd.grad(mine, leaves, do)
        rec["max_rel_error_vs_flex"] = rel_errors((mine, *grads), (ref, *ref_grads))
    except Exception as e:
        rec["flex_eager"] = dict(error=f"{type(e).__name__}: {e}"[:400])
    for impl in ("ours_eager", "ours_compiled", "flex_eager"):
        r = rec.get(impl)
        if not r or "fwd" not in r:
            continue
        r["tflops_fwd"] = w.flops() / r["fwd"] / 1e9
        r["tflops_fwd_bwd"] = (w.flops() + w.flops(True)) / r["fwd_bwd"] / 1e9
        r["of_floor_fwd"] = rec["floor_fwd_ms"] / r["fwd"]
        r["of_floor_bwd"] = rec["floor_bwd_ms"] / max(r["fwd_bwd"] - r["fwd"], 1e-9)
    return rec


def parse_groups(text):
    """[(workload id, dtype)] of ``--groups`` text ("M1:fp16,M4+kv256:bf16"); ValueError naming
    the entries that are not a known workload (WORKLOADS or MODEL_VARIANTS) and dtype."""
    pairs, bad = [], []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        wid, sep, dt = item.rpartition(":")
        try:
            wl.model_workload(wid)
            ok = bool(sep) and dt in wl.DTYPES
        except KeyError:
            ok = False
        (pairs if ok else bad).append(item if not ok else (wid, dt))
    if bad:
        known = ", ".join([*wl.WORKLOADS, *wl.MODEL_VARIANTS, *wl.GENERAL_WORKLOADS])
        raise ValueError(f"--groups: bad entries {bad} (workload:dtype; workloads {known}; "
                         f"dtypes {', '.join(wl.DTYPES)})")
    return pairs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default=",".join(f"{w}:{d}" for w, d in wl.MODEL_WORKLOADS),
                    help="workload:dtype pairs, comma separated (default: the whole M set, "
                         "then M4's variants M4+kv256 and M4-gqa8/2)")
    ap.add_argument("--out", default=None, help="JSON file for the results (default: none)")
    ap.add_argument("--budget-s", type=float, default=420,
                    help="stop starting new groups after this many seconds (default 420)")
    ap.add_argument("--no-compiled", action="store_true",
                    help="skip the torch.compile'd variant of ours (saves compile time)")
    args = ap.parse_args(argv)
    try:
        groups = parse_groups(args.groups)
    except ValueError as e:
        ap.error(str(e))
    import torch
    import cupy
    t0 = time.perf_counter()
    results, skipped = [], []
    for wid, dt in groups:
        item = f"{wid}:{dt}"
        if time.perf_counter() - t0 > args.budget_s:
            skipped.append(item)
            continue
        print(f"== {item}", flush=True)
        try:
            rec = run_group(wl.model_workload(wid), dt, compiled=not args.no_compiled
                            and dt in ("fp16", "bf16"))
        except Exception as e:
            rec = dict(workload=wid, dtype=dt, error=f"{type(e).__name__}: {e}"[:400])
        rec["seconds"] = time.perf_counter() - t0
        results.append(rec)
        torch.cuda.empty_cache()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  cupy=cupy.__version__, commit=os.environ.get("NATTEN_CUPY_COMMIT", ""),
                  date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  results=results, not_run=skipped)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(table(report))


def table(report):
    lines = ["| workload | dtype | ours eager fwd / fwd+bwd ms | compiled | Flex eager | "
             "speedup eager fwd / fwd+bwd | kernels ours / Flex fwd+bwd ms | err vs Flex |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['dtype']} | error: {r['error'][:60]} |")
            continue
        o, f, c = r["ours_eager"], r.get("flex_eager", {}), r.get("ours_compiled")
        cc = (f"{c['fwd']:.3g} / {c['fwd_bwd']:.3g}" if c and "fwd" in c
              else "error" if c else "-")
        if "fwd" in f:
            ff = f"{f['fwd']:.3g} / {f['fwd_bwd']:.3g}"
            sp = f"{f['fwd'] / o['fwd']:.2f}x / {f['fwd_bwd'] / o['fwd_bwd']:.2f}x"
            kk = (f"{o.get('fwd_bwd_kernels', float('nan')):.3g} / "
                  f"{f.get('fwd_bwd_kernels', float('nan')):.3g}")
            err = max(r.get("max_rel_error_vs_flex", {}).values() or [float("nan")])
        else:
            ff, sp, kk, err = f.get("error", "-")[:40], "-", "-", float("nan")
        lines.append(f"| {r['workload']} | {r['dtype']} | {o['fwd']:.3g} / {o['fwd_bwd']:.3g} "
                     f"| {cc} | {ff} | {sp} | {kk} | {err:.1e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
