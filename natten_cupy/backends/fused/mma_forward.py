"""Fused forward on tensor cores (``cuda_src/fused/mma_forward.cu``): float16, bfloat16, and
float32 as TF32 when the caller allows it.

A CTA owns a box of queries of one dilation group; each warp a compact 16-query patch. The
CTA stages its key halo in shared memory (streamed in double-buffered chunks when it does not
fit) and each warp walks only its own patch's halo: in 2-D and 3-D line by line (a line: keys
that differ on the last axis only) in groups of 8 keys, so that masking is one interval test
per column, else (1-D, and tiles whose lines would pad badly) 16 keys at a time in flat
row-major order.

Tile configurations are data (``CONFIGS``): per rank, the warp patch and the warps per CTA
along each axis; ``DEFAULT`` picks one per (rank, head-dim bucket) and ``problem.tile`` (the
CTA's query box, one entry per axis) overrides it.

Predictions and measurements: ``bench/results/NOTES-fused-fwd.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from ... import _window
from ..._compile import get_kernel
from ..._dtypes import FLOAT32, HALF_TYPES, c_type
from ..._launch import KernelCall, Operand, Plan
from ..._operands import head_dim_bucket, rows_ready, run_forward, smem_refusal
from ..._params import make_params

SOURCE = "fused/mma_forward.cu"
BUCKETS = (32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    patch: tuple   # queries per warp along (axis0, axis1, axis2); product 16
    warps: tuple   # warps per CTA along (axis0, axis1, axis2)
    kb: int        # 16-key sub-blocks a warp takes per iteration
    lines: bool = True   # walk the warp halo by lines (2-D, 3-D; else flat, 16 keys at a time)

    @property
    def box(self):
        return tuple(p * w for p, w in zip(self.patch, self.warps))

    @property
    def num_warps(self):
        return math.prod(self.warps)


# Per rank: the default first, then an alternative compiled for float16/bfloat16 up to head
# dim 64 (reachable through ``problem.tile``). A line of the warp halo holds patch + kernel - 1
# keys, padded to 8: the 2x8 patch makes a 9x9 window's lines exactly 16 wide, the 1x4x4 patch
# a 3x5x5 window's 8. The line walk pays where lines pad little, costs where they pad much,
# and gains nothing in 1-D (NOTES-fused-fwd.md, v3).
CONFIGS = {
    1: (TileConfig((16, 1, 1), (4, 1, 1), 4, False), TileConfig((16, 1, 1), (8, 1, 1), 4, False)),
    2: (TileConfig((2, 8, 1), (4, 1, 1), 2), TileConfig((4, 4, 1), (4, 2, 1), 2, False)),
    3: (TileConfig((1, 4, 4), (2, 2, 1), 2), TileConfig((2, 2, 4), (2, 2, 1), 2)),
}
DEFAULT = {(rank, dp): CONFIGS[rank][0] for rank in (1, 2, 3) for dp in BUCKETS}
# Head dim 128 and up (larger windows, e.g. W2b's 13x13): the flat walk, as before v3.
DEFAULT.update({(2, dp): TileConfig((4, 4, 1), (2, 2, 1), 2, False) for dp in (128, 256)})
DEFAULT.update({(3, dp): TileConfig((1, 4, 4), (2, 2, 1), 2, False) for dp in (128, 256)})

# Shared-memory budget of one CTA: whole halo in one buffer when it fits, else two chunks.
SINGLE_BUDGET = 80 * 1024
STREAM_BUDGET = 80 * 1024
MAX_HALO = 1 << 22   # warp-halo flat indices are split with float reciprocals (exact below)
BIAS_TABLE_BUDGET = 32 * 1024   # a bias table [2k-1, ...] of floats, in shared memory
# Additional tokens in the kernels up to this head dim (at 256 their walk spills; the array
# math of ``natten_cupy._extra`` takes them there).
EXTRA_MAX_DIM = 128


def _bias_table_bytes(problem):
    return 4 * math.prod(2 * k - 1 for k in problem.kernel_size) if problem.has_rpb else 0


def _bucket(head_dim):
    return head_dim_bucket(head_dim, BUCKETS)


def _compiled_for(cfg, rank, dtype, dp, bias=False, extra=False):
    """Whether ``cfg`` is among the instantiations for this rank, dtype and head-dim bucket
    (with a relative positional bias: the default configurations only; with additional
    tokens: the default configurations without a bias)."""
    if extra:
        return not bias and cfg == DEFAULT[(rank, dp)] and dp <= EXTRA_MAX_DIM
    return (cfg == DEFAULT[(rank, dp)]
            or (not bias and cfg in CONFIGS[rank] and dtype in HALF_TYPES and dp <= 64))


def takes_extra(problem):
    """Whether the kernels attend to ``problem``'s additional tokens themselves (the default
    tile, no bias); elsewhere they are merged in array math (``natten_cupy._extra``)."""
    if problem.has_rpb or refuse(problem) is not None or problem.head_dim > EXTRA_MAX_DIM:
        return False
    return _config(problem) == DEFAULT[(problem.rank, _bucket(problem.head_dim))]


def _config(problem):
    """The TileConfig for ``problem``, or a str saying why there is none."""
    dp = _bucket(problem.head_dim)
    if problem.tile is None:
        return DEFAULT[(problem.rank, dp)]
    want = tuple(problem.tile) + (1,) * (3 - len(problem.tile))
    if DEFAULT[(problem.rank, dp)].box == want:
        return DEFAULT[(problem.rank, dp)]
    for cfg in CONFIGS[problem.rank]:
        if cfg.box == want:
            if _compiled_for(cfg, problem.rank, problem.dtype, dp, problem.has_rpb):
                return cfg
            if problem.has_rpb:
                return (f"tile {problem.tile} is not built with a relative positional bias "
                        "(rpb): the default tile is")
            return (f"tile {problem.tile} is built only for float16/bfloat16 with head dim "
                    f"<= 64")
    have = ", ".join(str(c.box[:problem.rank]) for c in CONFIGS[problem.rank])
    return f"tile {problem.tile} is not a fused-forward tile for rank {problem.rank} ({have})"


@functools.lru_cache(maxsize=512)
def configure(problem):
    """The Tiling of ``problem`` (everything a launch needs besides the device and the
    arrays), or a str saying why this part cannot run it: the one place the part decides,
    read by ``refuse`` and ``plan_forward``."""
    if problem.dtype not in HALF_TYPES and not (problem.dtype == FLOAT32 and problem.allow_tf32):
        return ("fused forward on tensor cores runs float16, bfloat16 and TF32, not "
                f"{problem.dtype_name}")
    if problem.head_dim % 8 or problem.head_dim > 256:
        return f"head dim {problem.head_dim} is not a multiple of 8 up to 256"
    cfg = _config(problem)
    if isinstance(cfg, str):
        return cfg
    if math.prod(_halo_max(problem, cfg)) >= MAX_HALO:
        return "key halo of one query tile exceeds 2^22 keys"
    if _bias_table_bytes(problem) > BIAS_TABLE_BUDGET:
        return (f"the bias table of kernel {problem.kernel_size} exceeds "
                f"{BIAS_TABLE_BUDGET // 1024} KB of shared memory (backend 'naive' runs it)")
    return _tiling(problem, cfg)


def refuse(problem):
    """None if this part runs ``problem`` on the current device, else the reason: the
    problem's own (``configure``) or the device's shared memory per block."""
    t = configure(problem)
    if isinstance(t, str):
        return t
    return smem_refusal(t.smem, "the mma.sync fused forward")


@functools.lru_cache(maxsize=512)
def _halo_max(problem, cfg):
    """Largest key halo of a CTA's query box, per axis (exact, over every tile and group)."""
    return tuple(_window.box_span(problem.spatial[a], problem.kernel_size[a], problem.stride[a],
                                  problem.dilation[a], problem.is_causal[a], cfg.box[a])
                 for a in range(problem.rank)) + (1,) * (3 - problem.rank)


def _name(dtype, rank, dp, cfg, bias=False, extra=False):
    p, w = cfg.patch, cfg.warps
    flag = lambda b: "true" if b else "false"
    return (f"na_fwd_fused<{c_type(dtype)}, {rank}, {dp}, {p[0]}, {p[1]}, {p[2]}, "
            f"{w[0]}, {w[1]}, {w[2]}, {cfg.kb}, {flag(cfg.lines)}, {flag(bias)}, "
            f"{flag(extra)}>")


def instantiations():
    out = []
    for dtype in HALF_TYPES + (FLOAT32,):
        for rank, cfgs in CONFIGS.items():
            for cfg in cfgs + tuple(DEFAULT[(rank, dp)] for dp in BUCKETS):
                for dp in BUCKETS:
                    for bias in (False, True):
                        for extra in (False, True):
                            if _compiled_for(cfg, rank, dtype, dp, bias, extra):
                                out.append((SOURCE, _name(dtype, rank, dp, cfg, bias, extra)))
    return sorted(set(out))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How one problem is cut (depends on the problem alone)."""
    name: str         # kernel name expression
    cfg: TileConfig
    chunk: int        # keys per shared-memory buffer
    stages: int       # 1: the whole halo resident; 2: chunks double-buffered
    smem: int         # dynamic shared memory, bytes
    ctas: int         # grid x: heads x tiles x dilation groups


def _tiling(problem, cfg):
    dp = _bucket(problem.head_dim)
    es = numpy.dtype(problem.dtype).itemsize
    q_bytes = cfg.num_warps * 16 * dp * es + _bias_table_bytes(problem)   # and the bias
    row_bytes = 2 * dp * es
    hmax = _halo_max(problem, cfg)
    halo = math.prod(hmax)
    if q_bytes + halo * row_bytes <= SINGLE_BUDGET:
        chunk, stages = halo, 1
        if problem.has_extra and halo < problem.extra_tokens:
            # Room for the additional tokens in as few chunks as the budget allows.
            fit = (SINGLE_BUDGET - q_bytes) // row_bytes // 16 * 16
            chunk = max(halo, min(-(-problem.extra_tokens // 16) * 16, fit))
    else:
        # Whole iterations per chunk where they fit, else 16-key multiples (wide TF32 rows);
        # the line walk (2-D, 3-D) cuts chunks at halo lines, so at least one line.
        step = 16 * cfg.kb
        fit = (STREAM_BUDGET - q_bytes) // (2 * row_bytes)
        chunk = fit // step * step if fit >= step else max(16, fit // 16 * 16)
        if cfg.lines and problem.rank >= 2:
            chunk = max(chunk, hmax[problem.rank - 1])
        chunk, stages = min(chunk, halo), 2
    ctas = problem.heads
    for a in range(problem.rank):
        glen = -(-problem.spatial[a] // problem.dilation[a])
        ctas *= problem.dilation[a] * -(-glen // cfg.box[a])
    name = _name(problem.dtype, problem.rank, dp, cfg, problem.has_rpb, problem.has_extra)
    return Tiling(name, cfg, chunk, stages, q_bytes + stages * chunk * row_bytes, ctas)


# fused_fwd::HaloChunks of the .cu: how a CTA stages its key halo.
MAX_GRID_Z = 65535   # batches a launch covers (grid z)
HALO_CHUNKS = numpy.dtype([("chunk_keys", numpy.int32), ("stages", numpy.int32)], align=True)


def _halo_chunks(t):
    h = numpy.zeros((), HALO_CHUNKS)
    h["chunk_keys"], h["stages"] = t.chunk, t.stages
    return h[()]


def plan_forward(problem, q, k, v, out, lse, rpb=None, xk=None, xv=None):
    """The Plan of one forward on the current device for operand layouts (q, k, v, out, lse
    [, rpb: with ``problem.has_rpb``, read element by element at any strides] [, xk, xv:
    the additional tokens, with ``problem.has_extra``]), or None if one of q, k, v, out, xk,
    xv cannot be read as it is (``rows_ready``)."""
    if not all(rows_ready(x) for x in (q, k, v, out, xk, xv) if x is not None):
        return None
    t = configure(problem)
    if isinstance(t, str):
        raise ValueError(t)
    too_big = smem_refusal(t.smem, "the mma.sync fused forward")
    if too_big is not None:   # (refuse says so first, where the dispatch asks)
        raise RuntimeError(too_big)
    if t.ctas >= 2 ** 31:
        raise ValueError(f"problem too large for one fused-forward launch ({t.ctas} CTAs)")
    params = make_params(problem, q=q, k=k, v=v, o=out, lse=lse, rpb=rpb, xk=xk, xv=xv)
    null = numpy.uint64(0)
    fn = get_kernel(SOURCE, t.name)
    # The batch rides on grid z (at most MAX_GRID_Z): a larger batch runs in chunks, each
    # launch's batch-indexed operands starting at its chunk's first element (the kernel reads
    # the batch only as blockIdx.z, through the strides).
    bias = Operand(5) if problem.has_rpb else null   # (per head, not per batch)
    calls = []
    for b0 in range(0, problem.batch, MAX_GRID_Z):
        at = [Operand(i, b0 * lay.strides[0]) for i, lay in enumerate((q, k, v, out, lse))]
        extra = ((Operand(6, b0 * xk.strides[0]), Operand(7, b0 * xv.strides[0]))
                 if problem.has_extra else (null, null))
        calls.append(KernelCall(fn, (t.ctas, 1, min(MAX_GRID_Z, problem.batch - b0)),
                                (32 * t.cfg.num_warps, 1, 1),
                                (*at, bias, *extra, params, _halo_chunks(t)),
                                shared_mem=t.smem, name="na_fwd_fused", backend="fused",
                                tile=t.cfg.box[:problem.rank]))
    return Plan(tuple(calls))


def forward(problem, q, k, v, out, lse, rpb=None, extra=None):
    run_forward(plan_forward, problem, q, k, v, out, lse, rpb, extra)
