"""The benchmark workloads of BENCH.md as data: shapes, FLOPs, floors and the peers' figures.

Every number in here comes from ../shared/BENCH.md (measured on the lent H200, B = 1). The
cost formulas are natten_cupy.profiler's, so the profiler CLI and the suite agree.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from natten_cupy.profiler import (BACKWARD_FLOP_FACTOR, CEILINGS, COPY_BANDWIDTH,  # noqa: E402
                                  bytes_moved, ceiling_key, flops, floor_ms)

__all__ = ["Workload", "WORKLOADS", "DEFAULT_WORKLOADS", "DTYPES", "DEFAULT_DTYPES",
           "PUBLISHED_PEERS", "PUBLISHED_FLOORS", "MODEL_WORKLOADS", "MODEL_VARIANTS",
           "model_workload", "GENERAL_WORKLOADS", "GENERAL_GROUPS", "PROBE_WORKLOADS",
           "CHECK_WORKLOADS", "probe_workload", "CEILINGS",
           "COPY_BANDWIDTH", "BACKWARD_FLOP_FACTOR", "dtype_spec", "torch_dtype", "dtype_key",
           "best_published"]


@dataclasses.dataclass(frozen=True)
class Workload:
    id: str
    spatial: tuple
    kernel: tuple
    heads: int
    dim: int
    why: str
    batch: int = 1
    stride: tuple = None
    dilation: tuple = None
    causal: tuple = None
    # Key/value heads (grouped-query attention: they divide ``heads``; query head h reads kv
    # head h // (heads / kv_heads)); None means ``heads``.
    kv_heads: int = None
    # Additional key/value tokens ``[B, T, kv_heads, D]`` that every query attends besides its
    # neighborhood (``additional_keys`` / ``additional_values``).
    extra_tokens: int = 0

    def __post_init__(self):
        n = len(self.spatial)
        for name, default in (("stride", 1), ("dilation", 1), ("causal", False)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, (default,) * n)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError(f"{self.id}: kv_heads {self.kv_heads} must divide heads "
                             f"{self.heads}")

    @property
    def plain(self):
        """No GQA and no extra tokens: every tensor has the query's shape."""
        return self.kv_heads == self.heads and not self.extra_tokens

    @property
    def rank(self):
        return len(self.spatial)

    @property
    def tokens(self):
        return math.prod(self.spatial)

    @property
    def neighbors(self):
        return math.prod(self.kernel)

    @property
    def shape(self):
        """Layout of q, k, v in natten_cupy: [B, *spatial, H, D]."""
        return (self.batch, *self.spatial, self.heads, self.dim)

    @property
    def kv_shape(self):
        """Layout of k, v: [B, *spatial, kv_heads, D]."""
        return (self.batch, *self.spatial, self.kv_heads, self.dim)

    @property
    def extra_shape(self):
        """Layout of the additional keys / values: [B, T, kv_heads, D]."""
        return (self.batch, self.extra_tokens, self.kv_heads, self.dim)

    def flops(self, backward=False):
        """Useful FLOPs: every query head attends its K neighbors and the T extra tokens,
        ``4 * B * N * H * (K + T) * D`` forward (GQA shares k/v, not the work); backward
        2.5x."""
        return flops(self.batch, self.tokens, self.heads, self.neighbors + self.extra_tokens,
                     self.dim, backward)

    def bytes_moved(self, dtype, backward=False):
        spec = dtype_spec(dtype)
        lse_itemsize = 8 if spec["name"] == "float64" else 4
        if self.plain:
            return bytes_moved(self.batch, self.tokens, self.heads, self.dim, spec["itemsize"],
                               backward, lse_itemsize)
        # profiler.bytes_moved with k, v (and dk, dv) at kv_heads over N + T tokens: forward
        # q, k, v, out and lse; backward q, k, v, out, dO, lse, dq, dk, dv.
        row = self.batch * self.dim * spec["itemsize"]
        q_side = self.tokens * self.heads * row
        kv_side = (self.tokens + self.extra_tokens) * self.kv_heads * row
        lse = self.batch * self.tokens * self.heads * lse_itemsize
        return (4 if backward else 2) * (q_side + kv_side) + lse

    def floor_ms(self, dtype, backward=False):
        spec = dtype_spec(dtype)
        if self.plain:
            return floor_ms(self.batch, self.tokens, self.heads, self.neighbors, self.dim,
                            spec["name"], backward, spec["tf32"])
        t = self.bytes_moved(dtype, backward) / COPY_BANDWIDTH
        key = ceiling_key(spec["name"], spec["tf32"])
        if key is not None:
            t = max(t, self.flops(backward) / CEILINGS[key])
        return t * 1e3

    def describe(self):
        grid = " x ".join(map(str, self.spatial))
        kern = " x ".join(map(str, self.kernel))
        text = f"{grid}, kernel {kern}, H={self.heads}, D={self.dim}"
        if self.kv_heads != self.heads:
            text += f", H_kv={self.kv_heads}"
        if self.extra_tokens:
            text += f", +{self.extra_tokens} extra kv tokens"
        return text

    def as_dict(self):
        d = dataclasses.asdict(self)
        if self.plain:   # the keys suite.json has always had
            del d["kv_heads"], d["extra_tokens"]
        d.update(rank=self.rank, tokens=self.tokens, neighbors=self.neighbors,
                 flops_fwd=self.flops(), flops_bwd=self.flops(True))
        return d


WORKLOADS = {w.id: w for w in (
    Workload("W2", (1024, 1024), (9, 9), 8, 32,
             "the 2-D case users report as too slow in backward"),
    Workload("W3", (16, 256, 256), (3, 5, 5), 8, 32,
             "the same tokens in 3-D (video); users find 3-D slower than 2-D"),
    Workload("W3b", (8, 128, 128), (5, 7, 7), 8, 32, "a video model's layer"),
    Workload("W2b", (256, 256), (13, 13), 4, 128, "large head dim, large window"),
    Workload("W1", (32768,), (2047,), 16, 64, "long 1-D sequence, large window"),
    # Not one of BENCH.md's five: NA whose window is the whole sequence is plain
    # self-attention (SPEC section 1), so it sets our fused kernel against dense SDPA at the
    # shape of BENCH.md's "dense self-attention" line.
    Workload("SA", (16384,), (16384,), 16, 64, "window = whole sequence: dense self-attention"),
    Workload("SA128", (16384,), (16384,), 16, 128, "dense self-attention at head dim 128"),
    # The large windows the Hopper forward is held to against dense SDPA (TFLOP/s on useful
    # FLOPs): W1 at head dim 128 and a 2-D window of 33 x 33 (suite groups, not defaults).
    Workload("W1-D128", (32768,), (2047,), 16, 128, "W1 at head dim 128"),
    Workload("2D-33", (256, 256), (33, 33), 16, 128, "2-D, a large window at head dim 128"),
    # Tiny problems for smoke tests of the suite itself (``--device cpu``), never in defaults.
    Workload("T2", (16, 16), (5, 5), 2, 16, "smoke test", stride=(1, 2), dilation=(1, 2)),
    Workload("T3", (4, 8, 8), (3, 3, 3), 2, 16, "smoke test", causal=(True, False, False)),
    Workload("T1", (128,), (128,), 2, 16, "smoke test: self-attention"),
    # BENCH.md's model-shaped set: batch > 1, small maps, head dims 64/128, causal axes.
    Workload("M1", (56, 56), (7, 7), 2, 32, "NAT-Mini stage 1", batch=128),
    Workload("M2", (28, 28), (7, 7), 4, 32, "DiNAT stage 2, dilated", batch=128,
             dilation=(4, 4)),
    Workload("M3", (14, 14), (7, 7), 8, 32, "NAT stage 3, a small map", batch=128),
    Workload("M4", (16, 40, 64), (5, 9, 9), 16, 64, "video diffusion layer", batch=2),
    Workload("M5", (128, 128), (21, 21), 16, 128, "image generator, head dim 128"),
    Workload("M6", (16384,), (4096,), 32, 128, "language model, sliding window",
             causal=(True,)),
    Workload("M7", (12, 32, 32), (6, 9, 9), 8, 64, "autoregressive video", batch=4,
             causal=(True, False, False)),
)}
# M4 with the features video and multimodal models add (issue 14), timed by bench/models.py
# only: suite.py and the probes call NA without extra tokens and with k, v at the query's heads,
# so these stay out of WORKLOADS. Same geometry, batch and head dim as M4.
MODEL_VARIANTS = {w.id: w for w in (
    dataclasses.replace(WORKLOADS["M4"], id="M4+kv256", extra_tokens=256,
                        why="video diffusion layer whose queries also attend 256 text tokens"),
    dataclasses.replace(WORKLOADS["M4"], id="M4-gqa8/2", heads=8, kv_heads=2,
                        why="video diffusion layer, grouped-query: 8 query heads, 2 kv heads"),
)}


# Layers of other published models, outside the M set: a check that the M set's results
# carry over to shapes nothing was tuned on (``bench/models.py --groups G1:fp16,...``).
GENERAL_WORKLOADS = {w.id: w for w in (
    Workload("G1", (56, 56), (7, 7), 2, 32, "NAT-Tiny stage 1", batch=64),
    Workload("G2", (56, 56), (7, 7), 3, 32, "DiNAT-Tiny stage 1, dilation 8", batch=32,
             dilation=(8, 8)),
    Workload("G3", (64, 64), (13, 13), 8, 64, "2-D, head dim 64, a mid-sized window", batch=8),
    Workload("G4", (32, 32), (31, 31), 8, 64, "2-D, a window nearly the map", batch=16),
    Workload("G5", (8192,), (511,), 12, 64, "1-D speech/text encoder layer", batch=4),
    Workload("G6", (4096,), (1024,), 16, 128, "1-D causal sliding window, short context",
             batch=4, causal=(True,)),
    Workload("G7", (8, 32, 32), (3, 7, 7), 16, 64, "3-D video, small clip", batch=2),
    Workload("G8", (16, 16, 16), (7, 7, 7), 8, 128, "3-D volume, head dim 128"),
    Workload("G9", (128, 128), (9, 9), 4, 32, "2-D high resolution, NAT stage 1", batch=16),
    Workload("G10", (64, 64), (11, 11), 8, 96, "2-D at head dim 96", batch=4),
    Workload("G11", (2048,), (127,), 16, 64, "1-D, many short sequences", batch=32),
    Workload("G12", (24, 48, 48), (3, 11, 11), 12, 64, "3-D, causal in time", batch=1,
             causal=(True, False, False)),
)}
GENERAL_GROUPS = tuple((w, "bf16") for w in GENERAL_WORKLOADS)


def _lookup(wid, *tables):
    """The workload ``wid`` of the first of ``tables`` that has it, or the perf sweep's
    problem ``R<seed>-<i>`` or ``R<seed>-<i>-D<head dim>`` (``perf_sweep.draw``: its layer,
    whatever dtype it was drawn with); KeyError if none."""
    for table in tables:
        if wid in table:
            return table[wid]
    m = re.fullmatch(r"R(\d+)-(\d+)(?:-D(\d+))?", wid)
    if m:
        import perf_sweep   # (it imports this module)
        dims = (int(m.group(3)),) if m.group(3) else None
        return perf_sweep.draw(int(m.group(1)), int(m.group(2)), head_dims=dims)[0]
    raise KeyError(wid)


def model_workload(wid):
    """A workload of WORKLOADS, MODEL_VARIANTS or GENERAL_WORKLOADS by id (KeyError if none
    has it)."""
    return _lookup(wid, WORKLOADS, MODEL_VARIANTS, GENERAL_WORKLOADS)


# Shapes the Hopper (wgmma) probes, bench/probes/hopper_probe.py and hopper_bwd_probe.py, time
# besides WORKLOADS' (head dims 64 / 128 at windows, batches and ranks the set above lacks).
# Kept out of WORKLOADS: the suite does not time them.
PROBE_WORKLOADS = {w.id: w for w in (
    Workload("C8K", (8192,), (1023,), 16, 128, "causal 1-D, 8K tokens, head dim 128", batch=2,
             causal=(True,)),
    Workload("SA4K", (4096,), (4096,), 16, 128, "dense self-attention, 4K tokens, head dim 128"),
    Workload("2D-D64", (96, 96), (15, 15), 8, 64, "2-D at head dim 64", batch=2),
    Workload("2D-D64-7", (56, 56), (7, 7), 4, 64, "2-D, a small window at head dim 64", batch=8),
    Workload("3D-D128", (16, 32, 32), (5, 7, 7), 8, 128, "3-D at head dim 128"),
    Workload("1D-D64-small", (4096,), (255,), 8, 64, "1-D, many short sequences", batch=16),
    Workload("1D-D64-1023", (8192,), (1023,), 12, 64, "1-D, window 1023 at head dim 64",
             batch=4),
    Workload("1D-D128-511", (8192,), (511,), 12, 128, "1-D, window 511 at head dim 128",
             batch=4),
    Workload("1D-D64-767", (8192,), (767,), 12, 64, "1-D, window 767 at head dim 64",
             batch=4),
    Workload("1D-D128-767", (8192,), (767,), 12, 128, "1-D, window 767 at head dim 128",
             batch=4),
    Workload("1D-D128-1023", (8192,), (1023,), 12, 128, "1-D, window 1023 at head dim 128",
             batch=4),
    Workload("1D-D128-2047", (16384,), (2047,), 16, 128, "1-D, window 2047 at head dim 128"),
    Workload("1D-D128-15", (16384,), (15,), 16, 128, "1-D, a small window at head dim 128",
             batch=4),
    Workload("1D-D128-31", (16384,), (31,), 16, 128, "1-D, window 31 at head dim 128",
             batch=4),
    Workload("1D-D128-47c", (16384,), (47,), 16, 128, "1-D causal, window 47 at head dim 128",
             batch=4, causal=(True,)),
    Workload("1D-D64-47", (8192,), (47,), 16, 64, "1-D, window 47 at head dim 64", batch=8),
    Workload("1D-D64-31", (8192,), (31,), 16, 64, "1-D, a small window at head dim 64",
             batch=8),
    Workload("1D-D64-63c", (8192,), (63,), 16, 64, "1-D causal, window 63 at head dim 64",
             batch=8, causal=(True,)),
)}


# Small, odd-sized problems that bench/probes/fused_bwd_probe.py checks on the device against
# the tests' float64 oracle (tests/oracle.py), and fused_fwd_probe.py against the reference
# backend (besides the GPU tests' cases): every axis option (stride, dilation, causal, uneven
# and even windows, a window as large as the map) at head dims 32 to 256, batch 2.
# Checked, never timed: kept out of WORKLOADS and PROBE_WORKLOADS.
CHECK_WORKLOADS = {w.id: w for w in (
    Workload("chk1-odd", (37,), (5,), 2, 32, "1-D, odd length", batch=2),
    Workload("chk1-sdc", (50,), (8,), 1, 64, "1-D, even window, strided, dilated, causal",
             batch=2, stride=(3,), dilation=(2,), causal=(True,)),
    Workload("chk1-large", (300,), (129,), 1, 256, "1-D, a large window at head dim 256",
             batch=2),
    Workload("chk1-dc", (97,), (7,), 2, 64, "1-D, dilated and causal", batch=2,
             dilation=(2,), causal=(True,)),
    Workload("chk2-mixed", (13, 11), (3, 4), 2, 40, "2-D, every option differs per axis",
             batch=2, stride=(1, 2), dilation=(2, 1), causal=(False, True)),
    Workload("chk2-d128", (20, 20), (7, 7), 1, 128, "2-D at head dim 128", batch=2),
    Workload("chk2-k9", (24, 24), (9, 9), 2, 32, "W2's window and heads on a small map",
             batch=2),
    Workload("chk2-full", (16, 16), (16, 16), 1, 64, "2-D, the window is the whole map",
             batch=2),
    Workload("chk2-sdc", (21, 19), (5, 6), 1, 72, "2-D, strided, dilated, causal, D = 72",
             batch=2, stride=(5, 3), dilation=(2, 3), causal=(True, True)),
    Workload("chk2-sdc-d200", (21, 19), (5, 6), 1, 200, "chk2-sdc at head dim 200", batch=2,
             stride=(5, 3), dilation=(2, 3), causal=(True, True)),
    Workload("chk2-d64", (17, 15), (5, 4), 2, 64, "2-D, strided, dilated, causal, D = 64",
             batch=2, stride=(2, 1), dilation=(1, 2), causal=(True, False)),
    Workload("chk2-tile", (37, 21), (9, 5), 1, 32, "the 2-D tile variants' case", batch=2,
             stride=(1, 2), dilation=(1, 2), causal=(False, True)),
    Workload("chk3-sdc", (5, 9, 7), (3, 3, 5), 1, 72, "3-D, strided, dilated, causal time",
             batch=2, stride=(1, 1, 2), dilation=(1, 2, 1), causal=(True, False, False)),
    Workload("chk3-sdc-d128", (5, 9, 7), (3, 3, 5), 1, 128, "chk3-sdc at head dim 128",
             batch=2, stride=(1, 1, 2), dilation=(1, 2, 1), causal=(True, False, False)),
    Workload("chk3-k355", (6, 12, 12), (3, 5, 5), 2, 32, "W3's window and heads, small video",
             batch=2),
    Workload("chk3-tile", (6, 13, 12), (3, 5, 5), 1, 32, "the 3-D tile variants' case", batch=2,
             stride=(1, 2, 1), dilation=(1, 1, 2), causal=(True, False, False)),
    # fused_fwd_probe.py's: its layout case, and its two compute-sanitizer cases.
    Workload("chk2-layout", (21, 18), (5, 7), 3, 64, "2-D, dilated, three heads", batch=2,
             dilation=(2, 1)),
    Workload("chk2-small", (13, 11), (5, 4), 1, 32, "2-D, strided, dilated, one causal axis",
             batch=2, stride=(1, 2), dilation=(2, 1), causal=(False, True)),
    Workload("chk1-k257", (700,), (257,), 1, 64, "1-D, a 257-token window", batch=2),
)}


def probe_workload(wid):
    """A workload of WORKLOADS, PROBE_WORKLOADS, CHECK_WORKLOADS or GENERAL_WORKLOADS by id
    (KeyError if none has it)."""
    return _lookup(wid, WORKLOADS, PROBE_WORKLOADS, CHECK_WORKLOADS, GENERAL_WORKLOADS)


# The shapes bench/probes/hopper_dispatch.py times both fused-forward parts on, to place the
# Hopper forward's dispatch thresholds (fused.HOPPER_FWD_FROM): (spatial, kernel sizes to try,
# batch, heads), at head dims 64 and 128 in float16.
DISPATCH_GRID = [
    ((8192,), [(7,), (15,), (31,), (63,), (127,), (255,)], 4, 8),
    ((64, 64), [(3, 3), (5, 5), (7, 7), (9, 9), (11, 11), (13, 13)], 4, 8),
    ((56, 56), [(7, 7)], 8, 4),
    ((8, 32, 32), [(3, 3, 3), (3, 5, 5), (3, 7, 7), (5, 7, 7)], 2, 8),
]
# The same at head dim 32 (``--grid d32``), where the mma.sync forward is tuned and the Hopper
# one pads to 64 columns: only large windows can pay (fused.HOPPER_FWD_FROM_D32).
DISPATCH_GRID_D32 = [
    ((8192,), [(255,), (511,), (1023,), (2047,)], 4, 8),
    ((96, 96), [(13, 13), (17, 17), (21, 21), (25, 25), (29, 29), (33, 33)], 2, 8),
    ((48, 48), [(23, 23), (31, 31)], 8, 6),
    ((8, 32, 32), [(3, 7, 7), (5, 9, 9), (7, 11, 11)], 2, 8),
]
# Head dims 160 and 256 (``--grid d256``, 1-D, 2-D and 3-D, no bias; the probe holds the
# 3-D tile on, wgmma_forward.WIDE_3D), where the Hopper forward's head-dim-256 tile meets the
# mma.sync forward padded to 256 (fused.HOPPER_FWD_FROM[(rank, 256, False)]).
DISPATCH_GRID_D256 = [
    ((4096,), [(15,), (63,), (127,), (255,), (565,)], 4, 8),
    ((64, 64), [(3, 3), (5, 5), (7, 7), (9, 9), (13, 13)], 2, 8),
    ((8, 32, 32), [(3, 3, 3), (3, 5, 5), (3, 7, 7), (5, 9, 9)], 2, 8),
]


# The host-overhead problem of bench/overhead.py and the torch-layer probes
# (probes/torch_dispatch.py, probes/torch_overhead_split.py): [B, 8, 8, H, D] float16 with a
# 3x3 window, so small that a call's time is its host time.
OVERHEAD_SHAPE = (1, 8, 8, 1, 32)
OVERHEAD_KERNEL = 3


# The model-shaped set with its dtype (BENCH.md), the extra fp32 runs it asks for, then (last,
# so that a budgeted run covers the rows above first) M4's variants.
MODEL_WORKLOADS = (("M1", "fp16"), ("M2", "fp16"), ("M3", "fp16"), ("M4", "bf16"),
                   ("M5", "bf16"), ("M6", "bf16"), ("M7", "bf16"), ("M1", "fp32"),
                   ("M4", "fp32"), ("M1", "tf32"), ("M4", "tf32"), ("M4+kv256", "bf16"),
                   ("M4-gqa8/2", "bf16"))
DEFAULT_WORKLOADS = ("W2", "W3", "W3b", "W2b", "W1", "SA")

# Names the suite accepts for --dtypes. "tf32" is float32 I/O with TF32 tensor cores allowed.
DTYPES = {
    "fp16": dict(name="float16", itemsize=2, tf32=False),
    "bf16": dict(name="bfloat16", itemsize=2, tf32=False),
    "fp32": dict(name="float32", itemsize=4, tf32=False),
    "tf32": dict(name="float32", itemsize=4, tf32=True),
}
DEFAULT_DTYPES = ("fp16", "fp32")


def dtype_spec(dtype):
    spec = DTYPES[dtype]
    return dict(spec, key=dtype)


def torch_dtype(spec):
    """The torch dtype of a ``dtype_spec`` (imports torch)."""
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64}[spec["name"]]


def dtype_key(name, tf32=False):
    """The ``DTYPES`` key of a NumPy dtype name ("float32" with ``tf32`` is "tf32")."""
    return next(k for k, s in DTYPES.items() if s["name"] == name and s["tf32"] == bool(tf32))


# BENCH.md "Peer: PyTorch FlexAttention", ms as (forward, forward+backward); None where
# BENCH.md gives no figure.
PUBLISHED_PEERS = {
    ("W2", "fp16"): {"flex_flat": (34.5, 119.0), "flex_tiled": (18.9, 64.1)},
    ("W2", "bf16"): {"flex_flat": (34.4, 118.6), "flex_tiled": (18.9, 64.1)},
    ("W2", "fp32"): {"flex_flat": (195.7, 2381.0), "flex_tiled": (71.6, 855.0)},
    ("W3", "fp16"): {"flex_flat": (65.7, 206.9), "flex_tiled": (86.4, 239.5)},
    ("W3", "fp32"): {"flex_tiled": (192.3, 2291.0)},
    ("W3b", "fp16"): {"flex_flat": (8.87, 27.5), "flex_tiled": (11.4, 31.7),
                      "sdpa_masked": (71.4, 248.4)},
    ("W3b", "fp32"): {"flex_tiled": (24.7, 298.9)},
    ("W2b", "fp16"): {"flex_flat": (1.98, 6.61), "flex_tiled": (0.774, 2.71),
                      "sdpa_masked": (14.6, 55.6)},
    ("W2b", "fp32"): {"flex_tiled": (13.3, 101.8)},
    ("W1", "fp16"): {"flex_flat": (1.20, 4.82), "flex_tiled": (1.19, 4.83),
                     "sdpa_masked": (9.76, 34.4)},
    ("W1", "fp32"): {"flex_tiled": (23.1, 203.6)},
    # BENCH.md dense self-attention, fp16, N = 16384, 16 heads, head dim 64.
    ("SA", "fp16"): {"sdpa": (2.47, 8.73)}, ("SA128", "fp16"): {"sdpa": (3.63, 13.98)},
    # BENCH.md: FlexAttention on the M set (eager, row-major order, create_block_mask,
    # torch.compile'd flex_attention).
    ("M1", "fp16"): {"flex_eager": (1.28, 4.69)}, ("M2", "fp16"): {"flex_eager": (1.31, 3.67)},
    ("M3", "fp16"): {"flex_eager": (0.30, 0.97)}, ("M4", "bf16"): {"flex_eager": (7.91, 29.1)},
    ("M5", "bf16"): {"flex_eager": (1.46, 5.15)}, ("M6", "bf16"): {"flex_eager": (2.43, 9.16)},
    ("M7", "bf16"): {"flex_eager": (1.50, 5.17)}, ("M1", "fp32"): {"flex_eager": (4.08, 45.7)},
    ("M4", "fp32"): {"flex_eager": (95.4, 760.0)},
}

def best_published(workload, dtype, backward=False):
    """The fastest published peer's ms, forward (or forward+backward), and its name; (None,
    None) where BENCH.md gives no figure."""
    figures = [(ms[1 if backward else 0], name)
               for name, ms in PUBLISHED_PEERS.get((workload, dtype), {}).items()
               if ms[1 if backward else 0] is not None]
    return min(figures) if figures else (None, None)


# BENCH.md "Floors" for W2 and W3, ms as (forward, backward). Note: its exact-fp32 row matches
# a 67 TFLOP/s ceiling (the H200 datasheet), not the 51 TFLOP/s matmul it measured; the
# suite computes floors from the measured ceilings, so its fp32 floors are 1.71 / 4.26 ms on W2.
PUBLISHED_FLOORS = {
    "fp16": (0.51, 1.01), "bf16": (0.51, 1.01), "tf32": (1.01, 2.01), "fp32": (1.30, 3.25),
}
