"""The peers natten_cupy is measured against, in PyTorch.

* FlexAttention with a neighborhood mask. The mask_mod applies SPEC's per-axis window rules
  (the formulas of ``natten_cupy._window.window_bounds``) in torch ops; the BlockMask is built
  analytically, without evaluating the mask densely: NA's neighborhood is a Cartesian product
  of per-axis windows, and with a token order whose blocks are Cartesian products of per-axis
  ranges (both orders below), a (query block, key block) pair is touched iff it is touched on
  every axis, and full iff it is full on every axis. Two token orders:
  "flat" (row-major) and "tiled" (each 128-token block is a compact 2-D/3-D tile).
* Dense SDPA with an explicit additive mask, only where the N x N mask fits in memory.
* Plain SDPA self-attention, for the workload whose window is the whole sequence.

Every peer takes and returns tensors in natten_cupy's layout ``[B, *spatial, H, D]``; its
timed calls work on tensors already in the peer's own layout and order.
"""

from __future__ import annotations

import itertools
import math

import numpy
import torch

from natten_cupy._window import group_size, window_bounds

__all__ = ["Geometry", "axis_mask", "window_mask_1d", "TokenOrder", "flat_tile",
           "compact_tile", "make_mask_mod", "build_block_mask", "dense_mask",
           "FlexPeer", "SDPAMaskedPeer", "SDPAPeer", "peers_for", "BLOCK"]

BLOCK = 128


class Skip(Exception):
    """An implementation that cannot run this item (the reason is recorded)."""


class Geometry:
    """Per-axis NA options of one problem (extents, kernel, stride, dilation, causal)."""

    def __init__(self, spatial, kernel, stride=None, dilation=None, causal=None):
        n = len(spatial)
        self.spatial = tuple(int(x) for x in spatial)
        self.kernel = tuple(int(x) for x in kernel)
        self.stride = tuple(stride) if stride is not None else (1,) * n
        self.dilation = tuple(dilation) if dilation is not None else (1,) * n
        self.causal = tuple(bool(c) for c in causal) if causal is not None else (False,) * n

    @classmethod
    def of(cls, w):
        return cls(w.spatial, w.kernel, w.stride, w.dilation, w.causal)

    @property
    def rank(self):
        return len(self.spatial)

    @property
    def tokens(self):
        return math.prod(self.spatial)

    def axes(self):
        return zip(self.spatial, self.kernel, self.stride, self.dilation, self.causal)


# ---- window rules in torch ops ------------------------------------------------------------

def axis_mask(i, j, extent, kernel, stride, dilation, causal):
    """Whether key coordinate ``j`` is in the window of query coordinate ``i`` on one axis.

    ``i`` and ``j`` are integer tensors (broadcast against each other); SPEC section 1.
    """
    if dilation == 1:
        ig, jg, group_len = i, j, extent
        same_group = None
    else:
        g = i % dilation
        ig, jg = i // dilation, j // dilation
        group_len = (extent - g + dilation - 1) // dilation
        same_group = (j % dilation) == g
    base = (ig // stride) * stride
    if causal:
        leader = _min(base + (stride - 1), group_len - 1)
        start = torch.clamp(leader - (kernel - 1), min=0)
        end = ig + 1
    else:
        leader = _min(base + stride // 2, group_len - 1)
        start = _min(torch.clamp(leader - kernel // 2, min=0), group_len - kernel)
        end = start + kernel
    inside = (jg >= start) & (jg < end)
    return inside if same_group is None else inside & same_group


def _min(x, bound):
    return torch.clamp(x, max=bound) if isinstance(bound, int) else torch.minimum(x, bound)


def window_mask_1d(extent, kernel, stride, dilation, causal, device="cpu"):
    """[extent, extent] bool: row i holds the keys of query i on one axis."""
    i = torch.arange(extent, device=device)
    return axis_mask(i[:, None], i[None, :], extent, kernel, stride, dilation, causal)


# ---- token orders -------------------------------------------------------------------------

def flat_tile(spatial, block=BLOCK):
    """The tile shape whose tiled order is row-major order itself (blocks of ``block`` tokens
    are then Cartesian products of per-axis ranges), or None if no such shape exists."""
    tile = [1] * len(spatial)
    inner = 1
    for a in reversed(range(len(spatial))):
        if block % (inner * spatial[a]) == 0:
            tile[a] = spatial[a]
            inner *= spatial[a]
            if inner == block:
                return tuple(tile)
            continue
        t = block // inner
        if block % inner == 0 and spatial[a] % t == 0:
            tile[a] = t
            return tuple(tile)
        return None
    return tuple(tile)  # fewer tokens than a block: one block holds everything


def compact_tile(spatial, kernel, dilation=None, block=BLOCK):
    """A tile of ``block`` tokens (powers of two per axis, dividing the extents) whose key
    halo is smallest: minimizes prod(t_a + (k_a - 1) * d_a). None if there is none."""
    dilation = dilation or (1,) * len(spatial)
    choices = []
    for L in spatial:
        choices.append([t for t in (2 ** e for e in range(block.bit_length()))
                        if t <= block and L % t == 0])
    best = None
    for tile in itertools.product(*choices):
        if math.prod(tile) != block:
            continue
        halo = math.prod(t + (k - 1) * d for t, k, d in zip(tile, kernel, dilation))
        key = (halo, tuple(-t for t in reversed(tile)))
        if best is None or key < best[0]:
            best = (key, tile)
    return None if best is None else best[1]


class TokenOrder:
    """Tokens ordered tile by tile (tiles row-major over the tile grid, tokens row-major
    inside a tile). ``perm[p]`` is the row-major index of the token at position p."""

    def __init__(self, spatial, tile):
        if any(L % t for L, t in zip(spatial, tile)):
            raise ValueError(f"tile {tile} does not divide extents {spatial}")
        self.spatial, self.tile = tuple(spatial), tuple(tile)
        self.grid = tuple(L // t for L, t in zip(spatial, tile))
        pos = numpy.arange(math.prod(spatial))
        t_idx, w_idx = numpy.divmod(pos, math.prod(tile))
        tg = numpy.unravel_index(t_idx, self.grid)
        tw = numpy.unravel_index(w_idx, self.tile)
        self.coords = numpy.stack([g * t + w for g, t, w in zip(tg, self.tile, tw)])  # [n, N]
        self.perm = numpy.ravel_multi_index(tuple(self.coords), self.spatial)
        self.inverse = numpy.empty_like(self.perm)
        self.inverse[self.perm] = numpy.arange(self.perm.size)

    @property
    def block_tokens(self):
        return math.prod(self.tile)

    @property
    def is_identity(self):
        return bool((self.perm == numpy.arange(self.perm.size)).all())


def make_mask_mod(geom, coords):
    """FlexAttention mask_mod for ``geom``; ``coords`` is an int tensor [rank, N] giving the
    coordinates of the token at each position (the token order). The same mask_mod serves
    several orders of one geometry when ``coords`` is updated in place, so the compiled
    flex kernels are reused."""
    axes = list(geom.axes())

    def mask_mod(b, h, q_idx, kv_idx):
        ok = None
        for a, (L, k, s, d, c) in enumerate(axes):
            m = axis_mask(coords[a][q_idx], coords[a][kv_idx], L, k, s, d, c)
            ok = m if ok is None else ok & m
        return ok

    return mask_mod


def _axis_blocks(L, k, s, d, c, t):
    """Per axis, over segments of ``t`` coordinates: (touched, full) as [L/t, L/t] bool.

    Window bounds come from natten_cupy._window (the library's own formulas), so the block
    structure is independent of the torch re-expression in ``axis_mask``; the tests check
    both against each other through create_block_mask."""
    i = numpy.arange(L)
    g, ig = i % d, i // d
    start, end = window_bounds(ig, group_size(L, d, g), k, s, c)
    n = L // t
    k0 = numpy.arange(n) * t
    k1 = k0 + t
    # In-group indices of group g inside [k0, k1): [ceil((k0-g)/d), ceil((k1-g)/d)).
    lo = -((g[:, None] - k0[None, :]) // d)
    hi = -((g[:, None] - k1[None, :]) // d)
    touched = numpy.maximum(lo, start[:, None]) < numpy.minimum(hi, end[:, None])
    if t == 1:
        full = touched
    elif d == 1:
        full = (start[:, None] <= k0[None, :]) & (end[:, None] >= k1[None, :])
    else:
        full = numpy.zeros_like(touched)
    touched = touched.reshape(n, t, n).any(axis=1)
    full = full.reshape(n, t, n).all(axis=1)
    return touched, full


def _combine(mats, device):
    r = len(mats)
    out = None
    for a, m in enumerate(mats):
        shape = [1] * (2 * r)
        shape[a] = shape[r + a] = m.shape[0]
        v = torch.as_tensor(m, device=device).reshape(shape)
        out = v if out is None else out & v
    nb = math.prod(m.shape[0] for m in mats)
    return out.reshape(nb, nb)


def _ordered(mask):
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True)
    return num[None, None], idx.to(torch.int32)[None, None]


def block_structure(geom, order, device="cpu"):
    """(touched, full) [blocks, blocks] bool over blocks of ``order.block_tokens`` tokens."""
    touched, full = [], []
    for (L, k, s, d, c), t in zip(geom.axes(), order.tile):
        tm, fm = _axis_blocks(L, k, s, d, c, t)
        touched.append(tm)
        full.append(fm)
    return _combine(touched, device), _combine(full, device)


def build_block_mask(geom, order, mask_mod, device="cpu"):
    """FlexAttention BlockMask of ``geom`` in ``order``, built from per-axis block bounds."""
    from torch.nn.attention.flex_attention import BlockMask
    touched, full = block_structure(geom, order, device)
    partial = touched & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    n = geom.tokens
    kw = dict(BLOCK_SIZE=order.block_tokens, mask_mod=mask_mod)
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                        seq_lengths=(n, n), **kw)
    except TypeError:  # releases whose from_kv_blocks takes no seq_lengths
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, **kw)


def dense_mask(geom, rows=None, device="cpu"):
    """Row-major [len(rows), N] bool neighborhood mask (all N rows when ``rows`` is None)."""
    n = geom.tokens
    rows = torch.arange(n, device=device) if rows is None else rows
    q = torch.unravel_index(rows, geom.spatial) if geom.rank > 1 else (rows,)
    out = None
    for a, (L, k, s, d, c) in enumerate(geom.axes()):
        m = window_mask_1d(L, k, s, d, c, device)[q[a]]          # [R, L_a]
        shape = [rows.numel()] + [1] * geom.rank
        shape[1 + a] = L
        m = m.reshape(shape)
        out = m if out is None else out & m
    return out.reshape(rows.numel(), n)


# ---- the peers ----------------------------------------------------------------------------

_FLEX = {}
_MASK_MODS = {}


def _compiled_flex(device):
    """torch.compile'd flex_attention (one per process, so compiled kernels are reused);
    eager on the CPU, where the suite only smoke-tests its control flow."""
    from torch.nn.attention.flex_attention import flex_attention
    if torch.device(device).type != "cuda":
        return flex_attention
    if "fn" not in _FLEX:
        import torch._dynamo as dynamo
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 64)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _shared_mask_mod(geom, device):
    """One mask_mod (and its coordinate table) per geometry, reused across token orders."""
    key = (geom.spatial, geom.kernel, geom.stride, geom.dilation, geom.causal, str(device))
    if key not in _MASK_MODS:
        coords = torch.zeros((geom.rank, geom.tokens), dtype=torch.int32, device=device)
        _MASK_MODS[key] = {"coords": coords, "mod": make_mask_mod(geom, coords), "order": None}
    return _MASK_MODS[key]


class _Peer:
    kind = "peer"

    def __init__(self, workload, dtype, allow_tf32=False):
        self.w = workload
        self.dtype = dtype
        self.allow_tf32 = allow_tf32
        self.geom = Geometry.of(workload)
        self.sets = []
        self._i = 0

    def _next(self):
        s = self.sets[self._i % len(self.sets)]
        self._i += 1
        return s

    def to_peer(self, x):
        """[B, *spatial, H, D] -> [B, H, N, D] contiguous."""
        B, H, D = x.shape[0], x.shape[-2], x.shape[-1]
        return x.reshape(B, -1, H, D).transpose(1, 2).contiguous()

    def from_peer(self, y):
        B, H, _, D = y.shape
        return y.transpose(1, 2).reshape(B, *self.geom.spatial, H, D)

    def setup(self, input_sets):
        """``input_sets``: list of (q, k, v, d_out) in natten layout."""
        self.sets = []
        for q, k, v, do in input_sets:
            leaves = [self.to_peer(x).requires_grad_(True) for x in (q, k, v)]
            self.sets.append((*leaves, self.to_peer(do)))

    def attention(self, q, k, v):
        raise NotImplementedError

    def forward(self):
        q, k, v, _ = self._next()
        with self._precision():
            return self.attention(q, k, v)

    def forward_backward(self):
        q, k, v, do = self._next()
        with self._precision():
            out = self.attention(q, k, v)
            return torch.autograd.grad(out, (q, k, v), do)

    def results(self):
        """(out, dq, dk, dv) in natten layout, from the first input set."""
        q, k, v, do = self.sets[0]
        with self._precision():
            out = self.attention(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), do)
        return tuple(self.from_peer(t.detach()) for t in (out, *grads))

    def _precision(self):
        import contextlib
        if not self.allow_tf32:
            return contextlib.nullcontext()
        return _TF32()

    def teardown(self):
        self.sets = []


class _TF32:
    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old


class FlexPeer(_Peer):
    """torch.compile'd FlexAttention with an analytic neighborhood BlockMask."""

    def __init__(self, workload, dtype, order="flat", allow_tf32=False):
        super().__init__(workload, dtype, allow_tf32)
        self.name = f"flex_{order}"
        g = self.geom
        tile = (flat_tile(g.spatial) if order == "flat"
                else compact_tile(g.spatial, g.kernel, g.dilation))
        if tile is None:
            raise Skip(f"no {order} tile of {BLOCK} tokens fits extents {g.spatial}")
        self.order = TokenOrder(g.spatial, tile)
        self.tile = tile
        if order == "tiled" and self.order.is_identity:
            raise Skip("the tiled order is the flat order for this shape")

    def setup(self, input_sets):
        dev = input_sets[0][0].device
        if dev.type != "cuda":
            raise Skip("FlexAttention's backward runs on CUDA only")
        self.shared = _shared_mask_mod(self.geom, dev)
        self._activate()
        self.block_mask = build_block_mask(self.geom, self.order, self.shared["mod"], dev)
        self.perm = torch.as_tensor(self.order.perm, device=dev)
        self.inverse = torch.as_tensor(self.order.inverse, device=dev)
        super().setup(input_sets)
        self.fn = _compiled_flex(dev)

    def _activate(self):
        if self.shared["order"] is not self.order:
            self.shared["coords"].copy_(torch.as_tensor(self.order.coords,
                                                        dtype=torch.int32))
            self.shared["order"] = self.order

    def to_peer(self, x):
        B, H, D = x.shape[0], x.shape[-2], x.shape[-1]
        return x.reshape(B, -1, H, D)[:, self.perm].transpose(1, 2).contiguous()

    def from_peer(self, y):
        B, H, _, D = y.shape
        return y.transpose(1, 2)[:, self.inverse].reshape(B, *self.geom.spatial, H, D)

    def attention(self, q, k, v):
        self._activate()
        return self.fn(q, k, v, block_mask=self.block_mask)

    def teardown(self):
        super().teardown()
        self.block_mask = None


class SDPAMaskedPeer(_Peer):
    """Dense SDPA (memory-efficient kernel) with an explicit additive N x N mask."""

    name = "sdpa_masked"
    MAX_MASK_BYTES = 40 * 2 ** 30

    def setup(self, input_sets):
        dev = input_sets[0][0].device
        n = self.geom.tokens
        esize = torch.empty((), dtype=self.dtype).element_size()
        need = n * n * esize
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else need * 4
        if need > self.MAX_MASK_BYTES or need > free // 2:
            raise Skip(f"the dense {n} x {n} mask needs {need / 2 ** 30:.1f} GiB")
        self.mask = torch.empty((n, n), dtype=self.dtype, device=dev)
        step = max(1, (1 << 28) // n)
        for r0 in range(0, n, step):
            rows = torch.arange(r0, min(n, r0 + step), device=dev)
            allowed = dense_mask(self.geom, rows, dev)
            self.mask[r0:r0 + rows.numel()] = torch.where(allowed, 0.0, float("-inf")).to(
                self.dtype)
        super().setup(input_sets)

    def attention(self, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if not q.is_cuda:
            return sdpa(q, k, v, attn_mask=self.mask)
        # The math fallback would materialize H x N x N scores: allow the fused kernel only.
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return sdpa(q, k, v, attn_mask=self.mask)

    def teardown(self):
        super().teardown()
        self.mask = None


class SDPAPeer(_Peer):
    """Plain SDPA self-attention: only for problems where NA is self-attention."""

    name = "sdpa"

    def __init__(self, workload, dtype, allow_tf32=False):
        super().__init__(workload, dtype, allow_tf32)
        g = self.geom
        if not (g.kernel == g.spatial and all(s == 1 for s in g.stride)
                and all(d == 1 for d in g.dilation) and not any(g.causal)):
            raise Skip("NA is not self-attention for this workload")

    def attention(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def peers_for(workload):
    """[(name, factory(dtype, allow_tf32))] of the peers that apply to ``workload``."""
    g = Geometry.of(workload)
    self_attention = g.kernel == g.spatial
    if self_attention:
        return [("sdpa", lambda dt, tf: SDPAPeer(workload, dt, tf))]
    return [("flex_flat", lambda dt, tf: FlexPeer(workload, dt, "flat", tf)),
            ("flex_tiled", lambda dt, tf: FlexPeer(workload, dt, "tiled", tf)),
            ("sdpa_masked", lambda dt, tf: SDPAMaskedPeer(workload, dt, tf))]
