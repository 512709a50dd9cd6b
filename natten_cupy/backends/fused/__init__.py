"""Fused backend: flash-style NA on tensor cores (no attention matrix in memory).

This module only dispatches; the kernels' launchers live in three parts:

* ``mma_forward``: forward on tensor cores (float16, bfloat16; float32 as TF32 when the
  caller allows it);
* ``mma_backward``: backward on tensor cores (same dtypes);
* ``exact_fp32``: exact-float32 forward and backward (tiled FMA, no TF32);
* ``wgmma_forward``: forward on Hopper's warpgroup MMA (sm_90a; float16, bfloat16, head dims
  above 32; with a bias, not with additional tokens), taken over ``mma_forward`` where it
  accepts the problem and its window was measured large enough to pay (``_hopper_fwd_pays``);
* ``wgmma_backward``: backward on Hopper's warpgroup MMA (same conditions), taken over
  ``mma_backward`` where it accepts the problem and was measured faster (``_hopper_bwd_pays``);
  with ``deterministic=False`` it adds dQ in its dK/dV pass where that measured faster
  (``wgmma_backward.atomic_pays``).

Each part provides ``refuse(problem) -> str | None``, ``forward``/``backward`` (whichever it
implements) and ``instantiations()``; a part with several tile configurations lists them in
``CONFIGS`` (per rank, each with a ``box``: the CTA's query box).

``tile="autotune"`` times every candidate once per problem signature (shape, geometry, dtype,
device) on the caller's inputs and keeps the winner, in memory and in a JSON file under
``$NATTEN_CUPY_CACHE_DIR`` (default ``~/.cache/natten_cupy``), so later processes reuse it
without timing again. The candidates are the mma.sync part's tiles and, where it accepts the
problem, the Hopper part: the measured winner replaces the fixed rule of ``_hopper_bwd_pays``
(and of the forward) for that signature.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import pathlib

from ..._dtypes import FLOAT32, HALF_TYPES
from ..._operands import arch_refusal

NAME = "fused"
DTYPES = HALF_TYPES + (FLOAT32,)
# Tile values an autotuned problem carries internally (never a caller's): the Hopper part,
# and the mma.sync backward's one configuration (it has no tile choice).
HOPPER = "wgmma"
MMA = "mma.sync"
_HOPPER_PART = {"fused_forward": "wgmma_forward", "fused_backward": "wgmma_backward"}
_MMA_PART = {"fused_forward": "mma_forward", "fused_backward": "mma_backward"}


def _part(name):
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.{name}":
            raise
        return None


def _hopper_serves(problem, name="wgmma_forward"):
    """Whether the op may go to the Hopper part ``name`` (wgmma, sm_90): float16/bfloat16
    with a head dim of at least 32 for the forward (32 pads to 64 columns; only large
    windows pay there, ``HOPPER_FWD_FROM_D32``) and above 32 for the backward (the mma.sync
    backward, tuned for 32, was measured faster everywhere at 32), no tile override, no
    additional tokens (the mma.sync kernels attend to them themselves), and the part accepts
    the problem on this device (the backward refuses a bias with deterministic=True: its bias
    gradient sums with atomics)."""
    least = 32 if name == "wgmma_forward" else 33
    if (problem.tile is not None or problem.dtype not in HALF_TYPES or problem.head_dim < least
            or problem.has_extra):
        return False
    part = _part(name)
    return part is not None and part.refuse(problem) is None


def _exact_fp32(problem):
    return problem.dtype == FLOAT32 and not problem.allow_tf32


def _parts_for(op, problem):
    if _exact_fp32(problem):
        return "exact_fp32"
    if problem.tile == HOPPER:
        return _HOPPER_PART[op]
    if problem.tile == MMA:
        return _MMA_PART[op]
    if op == "fused_forward":
        return "wgmma_forward" if _hopper_fwd_pays(problem) else "mma_forward"
    return "wgmma_backward" if _hopper_bwd_pays(problem) else "mma_backward"


# Windows (neighbors per query) from which the Hopper forward beats the mma.sync one, per
# (rank, head-dim bucket, bias). Kernels alone on an H100 with TMA loads, the 64-query boxes
# and the bias started in S's accumulator (bench/results/hopper_dispatch_v2.json, small
# problems: B 2-4, H 8): mma.sync / Hopper at the thresholds' neighbors, 1-D D64 255: 1.02,
# D128 127: 1.10 (63: 0.90); 2-D D64 13x13: 0.97 (kept at 128, as measured on the H200, v6),
# with a bias 13x13: 1.16 (11x11: 0.99); 2-D D128 7x7: 1.21 (5x5: 1.00), with a bias 9x9:
# 1.04 (7x7: 0.90); 3-D D64 3x7x7: 1.14 (3x5x5: 0.91), with a bias 3x5x5: 1.01; 3-D D128
# 3x3x3: 1.14, with a bias 3x5x5: 1.13 (3x3x3: 0.86). NOTES-hopper-fwd.md (v6, v15).
# 1-D without a bias since its 64-query boxes (v16, hopper_small_box_1d_kernels.json, H100,
# kernels alone, B 4-32, H 8-16): D64 63: 1.06 (47: 0.84, 31: 0.82), 127: 1.17; D128 63: 1.14
# (47: 0.91, 31: 0.88, 15: 0.87), 119: 1.30.
HOPPER_FWD_FROM = {
    (1, 64, False): 64, (1, 64, True): 128, (1, 128, False): 56, (1, 128, True): 64,
    (2, 64, False): 128, (2, 64, True): 150, (2, 128, False): 32, (2, 128, True): 80,
    (3, 64, False): 128, (3, 64, True): 75, (3, 128, False): 27, (3, 128, True): 64,
    # head dims 136-256 (no bias): every window (H100, kernels alone, head dims 160 and 256:
    # mma.sync / Hopper 1.6-7.8 in 1-D from window 15 and 1.4-2.7 in 2-D from 3x3,
    # hopper_dispatch_d256.json; 2.1-3.9 in 3-D from 3x3x3, hopper_dispatch_d256_3d.json)
    (1, 256, False): 1, (2, 256, False): 1, (3, 256, False): 1,
}

# The same at head dim 32 per (rank, bias), where the Hopper forward pads q and k to 64
# columns and so pays only on large windows. Kernels alone on an H100
# (bench/results/hopper_dispatch_d32.json, dispatch_r1_2d_d32.json): mma.sync / Hopper,
# 1-D 1023: 1.05 (511: 0.94), with a bias 511: 1.03 (255: 0.84); 2-D 31x31 on 48x48: 1.23 and
# 33x33 on 96x96: 1.21 (29x29: 0.90, 23x23: 0.83-1.04), with a bias 31x31: 1.13, 33x33: 1.28
# (29x29: 0.98); 3-D never (5x9x9: 1.02, 7x11x11: 0.87).
HOPPER_FWD_FROM_D32 = {(1, False): 1023, (1, True): 511, (2, False): 900, (2, True): 900,
                       (3, False): None, (3, True): None}


def _hopper_fwd_pays(problem):
    """Whether the forward goes to the Hopper part: where it accepts the problem and its
    window is large enough (``HOPPER_FWD_FROM``, ``HOPPER_FWD_FROM_D32``) to beat the
    mma.sync forward."""
    if not _hopper_serves(problem):
        return False
    if problem.head_dim == 32:
        least = HOPPER_FWD_FROM_D32[(problem.rank, problem.has_rpb)]
        return least is not None and problem.num_neighbors >= least
    dp = _part("wgmma_forward")._bucket(problem.head_dim)
    least = HOPPER_FWD_FROM.get((problem.rank, dp, problem.has_rpb))   # (None: not timed)
    return least is not None and problem.num_neighbors >= least


def _hopper_bwd_pays(problem):
    """Whether the backward goes to the Hopper part: where it accepts the problem and was
    measured faster than the mma.sync backward: head dims above 64 at every rank; at head
    dims up to 64 1-D windows from 160 (from 96 with a bias), and above 32 without a bias or
    additional tokens (the mma.sync backward takes those in its kernels), where the dK/dV
    pass takes one compute warpgroup and 64-key boxes, 1-D windows from 48 and 2-D windows
    of 200 neighbors or more; 3-D stays on mma.sync; with a bias at ranks 2 and 3 where the
    dS-workspace variant takes it (``wgmma_backward.atomic_pays``). The timings:
    NOTES-hopper-bwd.md, "Dispatch" and the seventeenth session (kernels alone on an H100,
    head dim 64, bench/results/bwd_dispatch_d64_kv1.json: 1-D window 47 Hopper part 1.02x
    faster, 63 causal 1.11x, 255 1.45x; 2-D 13 x 13 mma.sync 1.04x faster, 15 x 15 the Hopper
    part 1.08x, 31 x 31 1.57x; 3-D 3 x 7 x 7 and 3 x 11 x 11 mma.sync 1.12x, 5 x 9 x 9 even)."""
    if not _hopper_serves(problem, "wgmma_backward"):
        return False
    if problem.head_dim > 64:
        return True
    if problem.has_rpb and problem.rank > 1:   # where its dS-workspace variant takes it
        return _part("wgmma_backward").atomic_pays(problem)
    one_wg = problem.head_dim > 32 and not problem.has_rpb and not problem.has_extra
    if problem.rank == 1:
        return problem.kernel_size[0] >= (48 if one_wg else 96 if problem.has_rpb else 160)
    return one_wg and problem.rank == 2 and problem.num_neighbors >= 200


def refuse(op, problem):
    if op not in ("fused_forward", "fused_backward"):
        return "the fused backend runs only the fused ops (use tiled or naive for qk/av)"
    if problem.dtype not in DTYPES:
        return f"dtype {problem.dtype_name} is not supported (float16, bfloat16, float32)"
    if problem.v_dim != problem.head_dim:   # every part sizes v's tiles by q's head dim
        return (f"the fused kernels need the value head dim equal to the query/key head dim, "
                f"got head dim {problem.head_dim} and value head dim {problem.v_dim} "
                "(naive and reference run it)")
    arch = arch_refusal("the fused backend")
    if arch is not None:
        return arch
    if problem.tile == "autotune":  # accepted where the default choice is
        problem = dataclasses.replace(problem, tile=None)
    name = _parts_for(op, problem)
    part = _part(name)
    if part is None:
        return f"{name} is not built yet"
    return part.refuse(problem)


# Inputs (in plan order) the kernels read by 16-byte rows; the fast path copies those that
# cannot be read as they are (lse, read element-wise, is not among them).
ROW_INPUTS = {"fused_forward": (0, 1, 2), "fused_backward": (0, 1, 2, 3, 4)}   # (plain ops)


def plan(op, problem, layouts):
    """The launch Plan of ``op`` on the current device for operand layouts: (q, k, v, out,
    lse) forward, (d_out, q, k, v, out, lse, dq, dk, dv) backward, then with a bias or
    additional tokens theirs as the mma.sync parts take them (``plan_forward``,
    ``plan_backward`` there; the Hopper forward takes a bias in the same place); None if an
    operand must first be copied, or for a bias or tokens the chosen part does not take
    (tokens merged in array math: ``runs_extra``). ``problem.tile`` must not be "autotune"
    (see ``tuned``)."""
    name = _parts_for(op, problem)
    takes_bias = name in (_MMA_PART[op], "wgmma_forward", "wgmma_backward")
    if (problem.has_rpb and not takes_bias) or (problem.has_extra and (
            name != _MMA_PART[op] or not runs_extra(op, problem))):
        return None
    part = _part(name)
    if op == "fused_forward":
        return part.plan_forward(problem, *layouts)
    return part.plan_backward(problem, *layouts)


def tuned(op, problem):
    """``problem`` with tile="autotune" replaced by its known winner (or the only candidate),
    or None while no call has timed the candidates yet."""
    cands = _candidates(op, problem)
    if len(cands) < 2:
        return dataclasses.replace(problem, tile=cands[0] if cands else None)
    box = _tuned_memory.get(_signature(op, problem))
    return None if box is None else dataclasses.replace(problem, tile=box)


def runs_extra(op, problem):
    """Whether the kernels attend to the additional tokens themselves: the mma.sync parts
    with their default tile and no bias (``ops`` merges them in array math elsewhere)."""
    if problem.tile is not None or _exact_fp32(problem):
        return False
    part = _part(_MMA_PART[op])
    return part is not None and part.takes_extra(problem)


def fused_forward(problem, q, k, v, out, lse, rpb=None, extra=None):
    kw = {} if rpb is None else {"rpb": rpb}
    if extra is not None:
        kw["extra"] = extra

    def run(p):
        _part(_parts_for("fused_forward", p)).forward(p, q, k, v, out, lse, **kw)
    run(_tuned("fused_forward", problem, run))


def fused_backward(problem, q, k, v, out, lse, d_out, dq, dk, dv, rpb=None, d_rpb=None,
                   extra=None, d_extra=None):
    kw = {} if rpb is None else {"rpb": rpb, "d_rpb": d_rpb}
    if extra is not None:
        kw.update(extra=extra, d_extra=d_extra)

    def run(p):
        _part(_parts_for("fused_backward", p)).backward(p, q, k, v, out, lse, d_out, dq, dk, dv,
                                                        **kw)
    run(_tuned("fused_backward", problem, run))


# ---- autotuning ------------------------------------------------------------------------

_tuned_memory = {}


def _candidates(op, problem):
    """The tiles an autotuned ``problem`` chooses among: the boxes of the part's CONFIGS
    (the mma.sync part's, or the exact-fp32 part's), and HOPPER where that part accepts the
    problem (then MMA stands for an mma.sync part without boxes)."""
    plain = dataclasses.replace(problem, tile=None)
    exact_fp32 = _exact_fp32(problem)
    part = _part("exact_fp32" if exact_fp32 else _MMA_PART[op])
    boxes = []
    for cfg in getattr(part, "CONFIGS", {}).get(problem.rank, ()):
        box = tuple(cfg.box[:problem.rank])
        if box not in boxes:
            boxes.append(box)
    if not exact_fp32 and _hopper_serves(plain, _HOPPER_PART[op]):
        boxes = (boxes or [MMA]) + [HOPPER]
    return boxes


def _tile_value(stored):
    """A winner as cached (a list for a box, a string for a part) as a problem's tile."""
    return stored if isinstance(stored, str) else tuple(stored)


def _cache_file():
    root = os.environ.get("NATTEN_CUPY_CACHE_DIR") or pathlib.Path.home() / ".cache" / "natten_cupy"
    return pathlib.Path(root) / "autotune.json"


@functools.lru_cache(maxsize=None)
def _device_name(device_id):
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(device_id)["name"].decode()


def _signature(op, problem):
    import cupy
    p = dataclasses.replace(problem, tile=None, scale=0.0)
    return f"{_device_name(cupy.cuda.Device().id)}|{op}|{p!r}"


def _tuned(op, problem, run):
    """``problem`` with its tile fixed: unchanged unless it asks for "autotune"."""
    if problem.tile != "autotune":
        return problem
    boxes = _candidates(op, problem)
    if len(boxes) < 2:
        return dataclasses.replace(problem, tile=boxes[0] if boxes else None)
    key = _signature(op, problem)
    box = _tuned_memory.get(key)
    if box is None:
        path = _cache_file()
        try:
            box = json.loads(path.read_text()).get(key)
        except (OSError, ValueError):
            box = None
        if box is None:
            box = _time_candidates(op, problem, boxes, run)
            _store(path, key, box)
        box = _tile_value(box)
        _tuned_memory[key] = box
    return dataclasses.replace(problem, tile=box)


def _time_candidates(op, problem, boxes, run, reps=3):
    """The candidate whose run is fastest (median of ``reps`` after one warm-up), by CUDA
    events: a list for a box, the string for a part."""
    import cupy
    best, best_ms = None, float("inf")
    for box in boxes:
        p = dataclasses.replace(problem, tile=box)
        if refuse(op, p) is not None:
            continue
        run(p)
        times = []
        for _ in range(reps):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            run(p)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        ms = sorted(times)[len(times) // 2]
        if ms < best_ms:
            best, best_ms = box, ms
    best = best if best is not None else boxes[0]
    return best if isinstance(best, str) else list(best)


def _store(path, key, box):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = box if isinstance(box, str) else list(box)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs re-timing in the next process


def _unsupported(*_args, **_kwargs):
    raise NotImplementedError("the fused backend runs only the fused ops")


qk = av = qk_backward = av_backward = _unsupported


def instantiations():
    out = []
    for name in ("mma_forward", "mma_backward", "exact_fp32"):
        part = _part(name)
        if part is not None:
            out += list(part.instantiations())
    return out
