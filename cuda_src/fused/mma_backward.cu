// Fused NA backward on tensor cores (f16/bf16 m16n8k16, float as TF32 m16n8k8): a query-
// parallel pass for dQ and delta = rowsum(dO * O), then a key-parallel pass for dK, dV.
// Threads: a CTA owns a multi-dimensional tile of one dilation group; each warp owns a compact
// 16-row patch of it (the m16 rows) and walks, 32 rows at a time, only the rows its patch
// reaches, gathered from a shared-memory slab (one row address per lane), no atomics.
// Reads q, k, v, d_o, lse (and o for delta); writes dq and delta, then dk, dv, each once
// (grouped-query attention: a dK/dV CTA of a kv head walks the queries of every query head of
// its group in turn).
#include "natten/common.cuh"
#include "natten/mma.cuh"
#include "natten/fused_bwd_tile.cuh"

using namespace natten;

namespace {

constexpr int kWarps = 4;  // warps per CTA (the launcher's tiles hold 4 warp patches)
constexpr int kNB = 32;    // gathered rows per warp step
// dS tile row stride (floats): a lane's two adjacent entries go as one 8-byte store, and the
// 16 lanes of a half-warp (4 rows, 8 bytes apart in a row) then hit 32 distinct banks (row
// r starts at bank 8 r mod 32); reading a row across the lanes is conflict-free at any stride.
constexpr int kTileStride = kNB + 8;

// d_o's entries in delta = rowsum(d_o * o) as the GEMMs read them: rounded to TF32 where T is
// float (its GEMMs are TF32), so that delta matches the dP = d_o v^T it is subtracted from.
// Summed from unrounded d_o, each row's dS = P (dP - delta) is off by the rounding of d_o
// times v, which the bias gradient's sum over every query grows (a 1-D sweep case of 66410
// queries: 0.19 against the 0.05 of rounding the inputs alone).
template <typename T>
__device__ __forceinline__ float gemm_operand(T x) { return to_float(x); }
template <>
__device__ __forceinline__ float gemm_operand<float>(float x) {
  return __uint_as_float(tc::to_tf32(x));
}

// One warp step: the warp's 16 owner rows against the kNB gathered rows whose descriptors
// it has just written to wdesc. S = own0 gat0^T and dP = own1 gat1^T; where the owner row
// attends P = exp2(S sl2 + bias - lse), else 0, and dS = P (dP - delta); then acc0 += dS
// gat0 and, where owners are keys, acc1 += P gat1, over the columns from col0.
// Shared memory: own_a0 is the lane's address in the owner tile (the second owner tensor
// own_shift bytes on), gat_base the slab's (the second gathered tensor gat_shift bytes on).
// Key owners take lse and delta from the descriptors, query owners from l2s and dls (the
// lane's two accumulator rows). With a bias: the head's table in shared memory (btab), the
// gathered rows' parts of an index into it (wbdesc), the owner rows' parts (own_t), and in
// the dQ pass the lane's entries of the warp's dS tile (wtl), stored here.
// Every: every owner row attends to every described row (masks all or nothing).
// The caller declares the step's tiles in its step loop: r0, r1 (the lane's row addresses
// in gat0 and gat1, set here) and s, dp (zeroed; S then P, dP then dS). As locals of this
// function they would sit ahead of the kernel's accumulators, which renumbers its registers.
template <typename T, int Dp, int DC, int N1, bool OwnerIsKey, bool BIAS, bool Every>
__device__ __forceinline__ void warp_step(
    float (&acc0)[DC / 8][4], float (&acc1)[N1][4], typename bwd::Step<T>::Rows& r0,
    typename bwd::Step<T>::Rows& r1, float (&s)[4][4], float (&dp)[4][4],
    const bwd::RowDesc* wdesc, unsigned own_a0, unsigned own_shift, unsigned gat_base,
    unsigned gat_shift, int col0, float sl2, const float* l2s, const float* dls,
    const int* own_t, const float* btab, const bwd::BiasDesc* wbdesc, float* wtl) {
  typedef bwd::Step<T> St;
  constexpr unsigned RB = (Dp + 8) * sizeof(T);  // slab and owner-tile row stride in bytes
  const int lane = threadIdx.x & 31, group = lane >> 2, quad = lane & 3;
  r0 = St::rows(wdesc, lane, gat_base, RB, col0);
  r1 = St::shifted(r0, gat_shift);
  St::template abt<Dp>(s, own_a0, r0, RB);
  St::template abt<Dp>(dp, own_a0 + own_shift, r1, RB);

#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const bwd::RowDesc d = wdesc[nt * 8 + quad * 2 + c];
      int bt = 0;  // the gathered row's part of the table index
      if constexpr (BIAS) bt = wbdesc[nt * 8 + quad * 2 + c].t;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float l2 = OwnerIsKey ? d.l2 : l2s[hh];
        const float dl = OwnerIsKey ? d.dl : dls[hh];
        const int e = hh * 2 + c;
        const bool on = Every ? d.mask != 0u : (d.mask >> (group + 8 * hh)) & 1u;
        float x = s[nt][e] * sl2;
        if (BIAS && on) x += btab[bt - own_t[hh]];
        const float pv = on ? fast_exp2(x - l2) : 0.f;
        s[nt][e] = pv;
        dp[nt][e] = pv * (dp[nt][e] - dl);
      }
    }
  if constexpr (BIAS && !OwnerIsKey) {   // this lane's dS entries, two per store
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        *reinterpret_cast<float2*>(wtl + hh * 8 * kTileStride + nt * 8) =
            make_float2(dp[nt][hh * 2], dp[nt][hh * 2 + 1]);
  }
  St::template ab<DC>(acc0, dp, r0, RB);
  if (OwnerIsKey) St::template ab<N1 * 8>(acc1, s, r1, RB);
}

// Stages `rows` gathered rows of src0, src1 (last dims contiguous: the launcher guarantees it)
// into the slab, zeros past the head dim D, and waits for them at a CTA barrier. Each warp
// takes 32-row chunks: chunk(base) lets the lane find its own row base + lane (which may lie
// past `rows`) and returns row_offsets(j, o0, o1), which every lane calls together (so that it
// may shuffle them from lane j) for row base + j's element offsets in src0 and src1; the warp
// then copies the chunk's 16-byte pieces, 32 consecutive ones a turn (coalesced).
// The slab lies after the two owner tiles of kWarps * 16 rows in smem, the caller's dynamic
// shared memory (bwd_pass's and na_bwd_extra_kv's are two symbols: that kernel lies outside
// this namespace). The slab's tiles are computed here from smem rather than passed in: through
// pointer arguments the copies' shared addresses come out one add longer (NVVM simplifies
// this function before it sees that they are constant offsets into shared memory).
template <typename T, int RS, int EPP, int CH, typename Chunk>
__device__ __forceinline__ void stage_slab(unsigned char* smem, const T* src0, const T* src1,
                                           int slab_rows, int rows, int D, int warp, int lane,
                                           Chunk chunk) {
  T* const gat_s0 = reinterpret_cast<T*>(smem) + 2 * kWarps * 16 * RS;
  T* const gat_s1 = gat_s0 + slab_rows * RS;
  for (int base = warp * 32; base < rows; base += kWarps * 32) {
    const auto row_offsets = chunk(base);
#pragma unroll 4
    for (int idx = lane; idx < 32 * CH; idx += 32) {
      const int j = idx / CH, piece = idx % CH;
      i64 o0, o1;
      row_offsets(j, o0, o1);
      if (base + j < rows) {
        const bool ok = piece * EPP < D;
        const int e = ok ? piece * EPP : 0;
        tc::cp_async16(gat_s0 + (base + j) * RS + piece * EPP, src0 + (o0 + e), ok);
        tc::cp_async16(gat_s1 + (base + j) * RS + piece * EPP, src1 + (o1 + e), ok);
      }
    }
  }
  tc::cp_async_commit();
  tc::cp_async_wait<0>();
  __syncthreads();
}

// One pass of the backward. OwnerIsKey: owners are keys (rows of k, v), gathered rows are
// queries (q, d_o, lse, delta), outputs dk (scaled) and dv. Otherwise owners are queries
// (q, d_o), gathered rows keys (k, v), output dq (scaled); this pass also computes the
// owners' delta = rowsum(d_o * o) and writes it (chunk 0) for the dK/dV pass that follows.
// Owner tensors own0/own1, gathered gat0/gat1; S = own0 gat0^T, dP = own1 gat1^T,
// out0 += dS gat0, out1 += P gat1 (owners are keys only), over head-dim columns
// [chunk * DC, chunk * DC + DC). Dp: head dim padded to a multiple of 16 (zero columns).
// Grouped (owners are keys only): loop over the heads_per_kv query heads of the owner kv
// head; a separate instantiation, so that the kernels without GQA keep their registers.
// BIAS: add rpb (relative positional bias, [H, 2k-1, ...]) to every score; the dQ pass also
// sums dS per table entry over its CTA's queries (bwd::BiasGeom's box, one shared-memory copy
// per warp) and writes the CTA's box to bias_part, which na_bwd_fused_rpb reduces in a fixed
// order. Per step a warp stores its 16 x 32 dS tile, then each lane adds one gathered row's
// column into the box, owner row after owner row: in one such add the lanes' rows differ, so
// their slots do (no atomics, a fixed order, the same bits every run). With bg.wcopies = 4
// the warp's box has four copies, row r adding into copy r % 4: four rows a turn, their
// loads together (in one turn a lane's slots, and the lanes' slots, differ), a barrier per
// turn rather than per row; the copies are summed in order at the end.
// EXTRA (dQ pass, no bias): after the window, the owners also attend to the p.extra_tokens
// additional tokens xk, xv of their head's extra head, gathered slab_rows at a time.
// ONE (owners are keys): the gathered rows' delta is summed here from o and d_o instead of
// read from the dQ pass's, so that both passes can run in one launch (na_bwd_fused_one).
// block_x: the CTA's index among the pass's CTAs (blockIdx.x but in na_bwd_fused_one).
template <typename T, int Dp, int DC, bool OwnerIsKey, bool Grouped, bool BIAS, bool EXTRA,
          bool ONE = false>
__device__ __forceinline__ void bwd_pass(
    const T* __restrict__ own0, const T* __restrict__ own1, const T* __restrict__ gat0,
    const T* __restrict__ gat1, const T* __restrict__ o, const float* __restrict__ lse,
    float* __restrict__ delta, T* __restrict__ out0, T* __restrict__ out1, const NAParams& p, const i64* so0,
    const i64* so1, const i64* sg0, const i64* sg1, const i64* sw0, const i64* sw1,
    const int4* __restrict__ tab, const int (&tab_off)[3], const int (&tile)[3],
    const int (&patch)[3], const int (&lpatch)[3], const int (&ntile)[3], const int slab_rows,
    const int bh0, const T* __restrict__ rpb, float* __restrict__ bias_part,
    const bwd::BiasGeom& bg, const T* __restrict__ xk, const T* __restrict__ xv,
    const unsigned block_x) {
  static_assert(!EXTRA || (!OwnerIsKey && !BIAS), "additional tokens: dQ pass, no bias");
  static_assert(!ONE || (OwnerIsKey && !Grouped && !BIAS), "ONE: the plain dK/dV pass");
  typedef bwd::Step<T> St;
  constexpr int RS = Dp + 8;       // smem row stride (elements): conflict-free ldmatrix
  constexpr int EPP = 16 / (int)sizeof(T);  // elements per 16-byte piece
  constexpr int CH = Dp / EPP;              // 16-byte pieces per row
  constexpr int NACC1 = OwnerIsKey ? DC / 8 : 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane >> 2, quad = lane & 3;
  const int D = (int)p.head_dim;

  // ---- which tile, dilation group, head-dim chunk, batch and head ----
  bwd::AxisTable ax[3];
  int glen[3], grp[3], tix[3], org[3], last[3];
  unsigned bx = block_x;  // 32-bit index arithmetic: a 64-bit division is a ~70-instruction call
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    tix[a] = (int)(bx % (unsigned)ntile[a]);
    bx /= (unsigned)ntile[a];
  }
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    const Axis axis = axis_of(p, a);
    const int d = axis.dilation;
    int g = 0;
    if (d > 1) {  // uniform branch: no divisions without dilation
      g = (int)(bx % (unsigned)d);
      bx /= (unsigned)d;
    }
    grp[a] = g;
    ax[a].base = tab_off[a] + g;
    ax[a].d = d;
    glen[a] = axis.group_len(g);
  }
  const int col0 = (int)bx * DC;
  // Owner heads: query heads, or kv heads when owners are keys (grouped-query attention:
  // kv head h is read by query heads h * heads_per_kv + g, g < heads_per_kv).
  const int hpk = (int)p.heads_per_kv;
  const int nh = OwnerIsKey ? (int)p.kv_heads : (int)p.heads;
  const int bh = bh0 + (int)blockIdx.y;  // batch * nh < 2^31 (launcher)
  const int b = bh / nh, h = bh % nh;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    org[a] = tix[a] * tile[a];
    if (org[a] >= glen[a]) return;  // whole CTA: this group is shorter than the grid
    last[a] = min(org[a] + tile[a] - 1, glen[a] - 1);
  }
  // Full-axis coordinate of in-group index c.
  auto full = [&](int a, int c) { return grp[a] + ax[a].d * c; };

  // ---- shared memory (stage_slab finds the slab there too) ----
  extern __shared__ __align__(16) unsigned char smem[];
  T* own_s0 = reinterpret_cast<T*>(smem);
  T* own_s1 = own_s0 + kWarps * 16 * RS;
  T* gat_s0 = own_s1 + kWarps * 16 * RS;
  T* gat_s1 = gat_s0 + slab_rows * RS;
  bwd::RowDesc* desc = reinterpret_cast<bwd::RowDesc*>(gat_s1 + slab_rows * RS);
  float* lse_s = reinterpret_cast<float*>(desc + kWarps * kNB);  // owners are keys only
  float* dlt_s = lse_s + slab_rows;
  // BIAS: gathered rows' bias parts, the head's bias table (float, log2 units, row-major),
  // then (dQ pass) the warps' accumulator boxes.
  // (lse_s and dlt_s take slab_rows floats each in the dK/dV pass only.)
  bwd::BiasDesc* bdesc =
      reinterpret_cast<bwd::BiasDesc*>(lse_s + (OwnerIsKey ? 2 * slab_rows : 0));
  // The dK/dV pass copies a head's whole table; the dQ pass only the CTA's box of it (the
  // offsets its queries reach, bg.dim), and sums dS into per-warp boxes (bg.wdim: the
  // offsets of one warp's patch), added into the CTA's box at the end.
  const int tab_n = OwnerIsKey ? bg.tvol : bg.vol, wbox = (bg.wvol + 1) / 2 * 2;
  float* btab = reinterpret_cast<float*>(bdesc + kWarps * kNB);
  float* bacc = btab + (tab_n + 1) / 2 * 2;           // kWarps boxes (8-byte aligned each)
  float* dstile = bacc + kWarps * bg.wcopies * wbox;  // kWarps x 16 x kTileStride
  int* own_as = reinterpret_cast<int*>(dstile + kWarps * 16 * kTileStride);  // kWarps x 16
  int* wshift = own_as + kWarps * 16;  // per warp, its box's origin minus the CTA box's (x 4)

  // ---- this warp's patch (tile and patch extents are powers of two: shifts, no divisions) ----
  int wpos[3];
  {
    int w = warp;
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      const int lw = __ffs(tile[a] >> lpatch[a]) - 1;  // log2 of the warps along this axis
      wpos[a] = org[a] + ((w & ((1 << lw) - 1)) << lpatch[a]);
      w >>= lw;
    }
  }
  auto owner_coords = [&](int r, int (&c)[3]) {
    c[2] = wpos[2] + (r & (patch[2] - 1));
    c[1] = wpos[1] + ((r >> lpatch[2]) & (patch[1] - 1));
    c[0] = wpos[0] + (r >> (lpatch[1] + lpatch[2]));
    return c[0] < glen[0] && c[1] < glen[1] && c[2] < glen[2];
  };

  // Stage owner rows (zeros where out of range or past the head dim): lane r < 16 finds
  // row r's offsets, then the warp copies 32 consecutive 16-byte pieces per turn, each lane
  // taking its row's offset by shuffle (last dims contiguous: the launcher guarantees it).
  // Query owners stage o where q goes first: delta is summed from shared memory once both
  // o and d_o have landed, then q replaces o.
  int oc[3];
  const bool olive = lane < 16 && owner_coords(lane, oc);
  i64 off0 = 0, off1 = 0, offo = 0;
  if (olive) {
    const i64 f0 = full(0, oc[0]), f1 = full(1, oc[1]), f2 = full(2, oc[2]);
    off0 = offset6(so0, b, f0, f1, f2, h, 0);
    off1 = offset6(so1, b, f0, f1, f2, h, 0);
    if (!OwnerIsKey) offo = offset6(p.o, b, f0, f1, f2, h, 0);
  }
  auto stage = [&](T* dst, const T* src, i64 off, T* dst2, const T* src2, i64 off2,
                   bool two) {
#pragma unroll 4
    for (int idx = lane; idx < 16 * CH; idx += 32) {
      const int r = idx / CH, piece = idx % CH, at = (warp * 16 + r) * RS + piece * EPP;
      const bool ok = __shfl_sync(0xffffffffu, (int)olive, r) && piece * EPP < D;
      const int e = ok ? piece * EPP : 0;
      const i64 o_r = __shfl_sync(0xffffffffu, off, r);
      tc::cp_async16(dst + at, src + (ok ? o_r + e : 0), ok);
      if (two) {
        const i64 o2 = __shfl_sync(0xffffffffu, off2, r);
        tc::cp_async16(dst2 + at, src2 + (ok ? o2 + e : 0), ok);
      }
    }
  };
  stage(own_s0, OwnerIsKey ? own0 : o, OwnerIsKey ? off0 : offo, own_s1, own1, off1, true);
  tc::cp_async_commit();

  // Query owners: lse (log2 units) of this lane's two accumulator rows (delta below).
  float row_l2[2] = {0.f, 0.f}, row_dl[2] = {0.f, 0.f};
  if (!OwnerIsKey) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      int c[3];
      if (owner_coords(group + 8 * hh, c))
        row_l2[hh] = lse[offset6(p.lse, b, full(0, c[0]), full(1, c[1]), full(2, c[2]), h, 0)] *
                     bwd::kLog2e;
    }
  }
  // Owner-row bit patterns of the patch per axis (see bwd::axis_rows).
  int inner[3];
  unsigned rep[3];
  inner[2] = 1;
  inner[1] = patch[2];
  inner[0] = patch[1] * patch[2];
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    rep[a] = 0u;
    for (int i = 0; i < 16; i += inner[a] * patch[a]) rep[a] |= 1u << i;
  }

  // Relative positional bias: per axis the stride rs of the shared-memory table; the key
  // side's part of an index is sum key * rs, the query side's sum (query - kernel + 1) * rs
  // (in the dQ pass plus the CTA box's origin: its copy holds the box only); with keys as
  // owners both are negated, so that the index is always gathered part - owner part. The
  // warps' accumulator boxes index the same way with their strides and origins.
  int own_t[2] = {0, 0};
  int origin[3] = {0, 0, 0};  // dQ pass: table coordinates of the CTA box's first entry
  bwd::BiasDesc* wbdesc = bdesc + warp * kNB;
  float* wacc = bacc + warp * bg.wcopies * wbox;
  float* wtile = dstile + warp * 16 * kTileStride;
  float* const wtl = wtile + group * kTileStride + quad * 2;  // this lane's tile entries
  int* wown = own_as + warp * 16;
  auto rs = [&](int a) { return OwnerIsKey ? bg.tst[a] : bg.bst[a]; };
  // Copies query head hq's table (the dK/dV pass) or the CTA's box of it (the dQ pass; zero
  // past the table) into btab, in log2 units (the caller syncs before use).
  auto stage_bias = [&](int hq) {
    const int* st = OwnerIsKey ? bg.tst : bg.bst;
    for (int i = threadIdx.x; i < tab_n; i += kWarps * 32) {
      const int u0 = i / st[0], r = i - u0 * st[0], u1 = r / st[1], u2 = r - u1 * st[1];
      const int o0 = u0 + origin[0], o1 = u1 + origin[1], o2 = u2 + origin[2];
      const bool in = o0 < 2 * (int)p.kernel[0] - 1 && o1 < 2 * (int)p.kernel[1] - 1 &&
                      o2 < 2 * (int)p.kernel[2] - 1;
      btab[i] = in ? to_float(rpb[hq * p.rpb[0] + o0 * p.rpb[1] + o1 * p.rpb[2] +
                                  o2 * p.rpb[3]]) * bwd::kLog2e : 0.f;
    }
  };
  if constexpr (BIAS) {
    if (!OwnerIsKey) {
#pragma unroll
      for (int a = 0; a < 3; ++a)
        origin[a] = ax[a].at(tab, last[a]).x - last[a] + (int)p.kernel[a] - 1;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      int c[3];
      owner_coords(group + 8 * hh, c);
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        if (OwnerIsKey) own_t[hh] -= c[a] * rs(a);
        else own_t[hh] += (c[a] - (int)p.kernel[a] + 1 + origin[a]) * rs(a);
      }
    }
    if (!OwnerIsKey) {
      for (int i = threadIdx.x; i < kWarps * bg.wcopies * wbox; i += kWarps * 32)
        bacc[i] = 0.f;
      // The warp box's origin: the table coordinates its last owner reaches first (windows
      // are monotone, so no earlier owner reaches lower); a patch past the group's end has
      // no rows and keeps a zero box.
      int worg[3];
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        const int wl = max(min(wpos[a] + patch[a] - 1, glen[a] - 1), 0);
        worg[a] = wpos[a] < glen[a] ? ax[a].at(tab, wl).x - wl + (int)p.kernel[a] - 1
                                    : origin[a];
        if (lane == 0) wshift[warp * 4 + a] = worg[a] - origin[a];
      }
      // Warp-box parts of the warp's 16 owner rows, for the column adds (lane r: row r).
      if (lane < 16) {
        int c[3], a_part = 0;
        owner_coords(lane, c);
#pragma unroll
        for (int a = 0; a < 3; ++a)
          a_part += (c[a] - (int)p.kernel[a] + 1 + worg[a]) * bg.wbst[a];
        wown[lane] = a_part;
      }
    }
  }

  // Rows this warp's patch reaches (empty if the patch lies past the group's end) and the
  // CTA's union of them.
  int wlo[3], whi[3], clo[3], chi[3];
  {
    const bool any = wpos[0] < glen[0] && wpos[1] < glen[1] && wpos[2] < glen[2];
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      wlo[a] = whi[a] = 0;
      if (any) {
        bwd::reach<OwnerIsKey>(tab, ax[a], wpos[a], min(wpos[a] + patch[a] - 1, glen[a] - 1),
                               wlo[a], whi[a]);
      }
      bwd::reach<OwnerIsKey>(tab, ax[a], org[a], last[a], clo[a], chi[a]);
    }
  }

  // Query owners: delta = rowsum(d_o * o) of this lane's two rows, from shared memory (the
  // reach lookups above were in flight meanwhile). The four lanes of a quad share a row and
  // sum every fourth 16-byte piece (zero-filled past the head dim); chunk 0 stores it. Then q
  // replaces o, landing with the first slab.
  if (!OwnerIsKey) {
    tc::cp_async_wait<0>();
    __syncwarp();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = warp * 16 + group + 8 * hh;
      float dl = 0.f;
#pragma unroll
      for (int piece = quad; piece < CH; piece += 4) {
        const uint4 ov = *reinterpret_cast<const uint4*>(own_s0 + r * RS + piece * EPP);
        const uint4 dv = *reinterpret_cast<const uint4*>(own_s1 + r * RS + piece * EPP);
        const T* oe = reinterpret_cast<const T*>(&ov);
        const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
        for (int t = 0; t < EPP; ++t) dl += to_float(oe[t]) * gemm_operand(de[t]);
      }
      dl += __shfl_xor_sync(0xffffffffu, dl, 1);
      dl += __shfl_xor_sync(0xffffffffu, dl, 2);
      row_dl[hh] = dl;
      int c[3];
      if (quad == 0 && col0 == 0 && owner_coords(group + 8 * hh, c))
        delta[offset6(p.delta, b, full(0, c[0]), full(1, c[1]), full(2, c[2]), h, 0)] = dl;
    }
    __syncwarp();  // every lane is done reading o
    stage(own_s0, own0, off0, nullptr, nullptr, 0, false);
    tc::cp_async_commit();
  }

  float acc0[DC / 8][4], acc1[NACC1][4];
#pragma unroll
  for (int j = 0; j < DC / 8; ++j)
#pragma unroll
    for (int t = 0; t < 4; ++t) acc0[j][t] = 0.f;
#pragma unroll
  for (int j = 0; j < NACC1; ++j)
#pragma unroll
    for (int t = 0; t < 4; ++t) acc1[j][t] = 0.f;

  const float sl2 = p.scale * bwd::kLog2e;
  constexpr unsigned RB = RS * sizeof(T);  // row stride in bytes
  const unsigned own_a0 = tc::smem_addr(own_s0) + warp * 16 * RB + St::own_lane(lane, RB);
  const unsigned own_shift = kWarps * 16 * RB;  // own_s1 - own_s0
  const unsigned gat_base = tc::smem_addr(gat_s0);
  const unsigned gat_shift = slab_rows * RB;    // gat_s1 - gat_s0
  bwd::RowDesc* wdesc = desc + warp * kNB;

  // The warp's share of a staged slab: its reach intersected with the slab box (origin lo,
  // extents k1 k2 on the inner axes, as row-major counts) inside the slab (origin s, inner
  // extents m1 m2); or (extra) rows of additional tokens, row t at slab row t, seen by every
  // owner.
  struct Share {
    int lo0, lo1, lo2, k2, s0, s1, s2, m1, m2;
    bwd::FastDiv by_k12, by_k2;
    bool extra;
  };
  // Lane's descriptor of gathered row t of the share: its slab row, and which owner rows
  // attend (its interval per axis: the query's window when owners are keys, the key's
  // inverse range when owners are queries; owner rows inside it on every axis attend).
  auto describe = [&](int t, const Share& sh, bwd::RowDesc& d) {
    if (EXTRA && sh.extra) {
      d.row = t;
      d.mask = 0xffffu;
      return;
    }
    const int c0 = sh.by_k12.div(t), rem = t - c0 * sh.by_k12.m, c1 = sh.by_k2.div(rem);
    const int c[3] = {sh.lo0 + c0, sh.lo1 + c1, sh.lo2 + rem - c1 * sh.k2};
    d.row = ((c[0] - sh.s0) * sh.m1 + (c[1] - sh.s1)) * sh.m2 + (c[2] - sh.s2);
    d.mask = 0xffffu;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      const int4 e = ax[a].at(tab, c[a]);
      d.mask &= bwd::axis_rows(OwnerIsKey ? e.x : e.z, OwnerIsKey ? e.y : e.w, wpos[a],
                               patch[a], inner[a], rep[a]);
    }
    if (OwnerIsKey) {
      d.l2 = lse_s[d.row] * bwd::kLog2e;
      d.dl = dlt_s[d.row];
    }
    if constexpr (BIAS) {
      bwd::BiasDesc bd{0, 0};
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        if (OwnerIsKey) {
          bd.t -= (c[a] - (int)p.kernel[a] + 1) * rs(a);
        } else {
          bd.t += c[a] * rs(a);
          bd.a += c[a] * bg.wbst[a];
        }
      }
      wbdesc[lane] = bd;
    }
  };

  // The warp's steps over the `count` gathered rows of its share, kNB at a time.
  auto steps = [&](int count, const Share& sh) {
#pragma unroll 1
    for (int base = 0; base < count; base += kNB) {
      {
        bwd::RowDesc d;
        d.row = 0;
        d.mask = 0u;
        d.l2 = d.dl = 0.f;
        if (base + lane < count) describe(base + lane, sh, d);
        wdesc[lane] = d;
      }
      __syncwarp();
      typename St::Rows r0, r1;
      float s[4][4] = {}, dp[4][4] = {};
      warp_step<T, Dp, DC, NACC1, OwnerIsKey, BIAS, false>(
          acc0, acc1, r0, r1, s, dp, wdesc, own_a0, own_shift, gat_base, gat_shift, col0, sl2,
          row_l2, row_dl, own_t, btab, wbdesc, wtl);
      if constexpr (BIAS && !OwnerIsKey) {
        if (col0 == 0) {   // lane: gathered row `lane` of the step, owner rows in order
          __syncwarp();
          const unsigned m = wdesc[lane].mask;
          float* const at = wacc + wbdesc[lane].a;
          // Only where owner row r attends the row (elsewhere the entry may lie outside
          // the box); the lanes' words differ within a row, the barrier orders the rows.
          if (bg.wcopies == 4) {   // rows r0..r0+3 into copies 0..3: no two slots alike
#pragma unroll
            for (int r0 = 0; r0 < 16; r0 += 4) {
              float x[4];
#pragma unroll
              for (int j = 0; j < 4; ++j)
                x[j] = (m >> (r0 + j)) & 1u ? at[j * wbox - wown[r0 + j]] : 0.f;
#pragma unroll
              for (int j = 0; j < 4; ++j)
                if ((m >> (r0 + j)) & 1u)
                  at[j * wbox - wown[r0 + j]] = x[j] + wtile[(r0 + j) * kTileStride + lane];
              __syncwarp();
            }
          } else {
#pragma unroll 8
            for (int r = 0; r < 16; ++r) {
              if ((m >> r) & 1u) at[-wown[r]] += wtile[r * kTileStride + lane];
              __syncwarp();
            }
          }
        }
      }
      __syncwarp();  // descriptors are rewritten next step
    }
  };

  // Slabs: sub-boxes of the CTA's union holding at most slab_rows rows, innermost axis first.
  int n[3];
  n[2] = max(min(chi[2] - clo[2], slab_rows), 1);
  n[1] = max(min(chi[1] - clo[1], slab_rows / n[2]), 1);
  n[0] = max(min(chi[0] - clo[0], slab_rows / (n[1] * n[2])), 1);
  const unsigned lse_a = tc::smem_addr(lse_s), dlt_a = tc::smem_addr(dlt_s);
  // Gathered heads: the owner query head's kv head (one), or every query head of the owner
  // kv head's group in turn, accumulating into the same registers (dK, dV sum over the
  // group in a fixed order: deterministic, no atomics, no repeated copy of k and v).
  const int hg0 = OwnerIsKey ? h * hpk : h / hpk;
#pragma unroll 1
  for (int gi = 0; gi < (OwnerIsKey && Grouped ? hpk : 1); ++gi) {
    const int hg = hg0 + gi;
    // Gathered rows of this (batch, head): the launcher makes their last dims contiguous.
    const T* gat0_bh = gat0 + (b * sg0[0] + hg * sg0[4]);
    const T* gat1_bh = gat1 + (b * sg1[0] + hg * sg1[4]);
    const float* lse_bh = lse + (b * p.lse[0] + hg * p.lse[4]);
    const float* dlt_bh = delta + (b * p.delta[0] + hg * p.delta[4]);
    const T* o_bh = ONE ? o + (b * p.o[0] + hg * p.o[4]) : nullptr;
    // The bias table of this query head (the gathered one when owners are keys); the slab
    // loop's first barrier orders the copy before its use, and (next head) its last reads
    // before the copy is overwritten.
    if constexpr (BIAS) {
      if (gi > 0) __syncthreads();
      stage_bias(OwnerIsKey ? hg : h);
    }
    for (int s0 = clo[0]; s0 < chi[0]; s0 += n[0])
    for (int s1 = clo[1]; s1 < chi[1]; s1 += n[1])
    for (int s2 = clo[2]; s2 < chi[2]; s2 += n[2]) {
      const int e0 = min(s0 + n[0], chi[0]), e1 = min(s1 + n[1], chi[1]),
                e2 = min(s2 + n[2], chi[2]);
      const int m1 = e1 - s1, m2 = e2 - s2;
      const int rows = (e0 - s0) * m1 * m2;
      const bwd::FastDiv by_plane(m1 * m2), by_m2(m2);
      __syncthreads();  // every warp is done with the previous slab
      // Lane r of a chunk finds row base + r's offsets (and copies its lse and delta: query
      // rows of the dK/dV pass); the warp takes them by shuffle.
      const auto chunk = [=, &p](int base) {
        const int r = base + lane;
        i64 off0 = 0, off1 = 0;
        if (r < rows) {
          const int c0 = by_plane.div(r), rem = r - c0 * by_plane.m, c1 = by_m2.div(rem);
          const int x0 = full(0, s0 + c0), x1 = full(1, s1 + c1), x2 = full(2, s2 + rem - c1 * m2);
          off0 = x0 * sg0[1] + x1 * sg0[2] + x2 * sg0[3];
          off1 = x0 * sg1[1] + x1 * sg1[2] + x2 * sg1[3];
          if (OwnerIsKey) {
            bwd::cp_async4(lse_a + r * 4, lse_bh + (x0 * p.lse[1] + x1 * p.lse[2] + x2 * p.lse[3]));
            if constexpr (ONE) {   // delta = rowsum(d_o * o), this lane's row alone
              const T* orow = o_bh + (x0 * p.o[1] + x1 * p.o[2] + x2 * p.o[3]);
              const T* drow = gat1_bh + off1;
              float dl = 0.f;
#pragma unroll
              for (int piece = 0; piece < CH; ++piece) {
                if (piece * EPP < D) {
                  const uint4 ov = __ldg(reinterpret_cast<const uint4*>(orow + piece * EPP));
                  const uint4 dv = __ldg(reinterpret_cast<const uint4*>(drow + piece * EPP));
                  const T* oe = reinterpret_cast<const T*>(&ov);
                  const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
                  for (int t = 0; t < EPP; ++t) dl += to_float(oe[t]) * gemm_operand(de[t]);
                }
              }
              dlt_s[r] = dl;   // (visible after stage_slab's barrier)
            } else {
              bwd::cp_async4(dlt_a + r * 4,
                             dlt_bh + (x0 * p.delta[1] + x1 * p.delta[2] + x2 * p.delta[3]));
            }
          }
        }
        return [=](int j, i64& o0, i64& o1) {
          o0 = __shfl_sync(0xffffffffu, off0, j);
          o1 = __shfl_sync(0xffffffffu, off1, j);
        };
      };
      stage_slab<T, RS, EPP, CH>(smem, gat0_bh, gat1_bh, slab_rows, rows, D, warp, lane, chunk);

      // This warp's share of the slab: its reach intersected with the slab box.
      const int lo0 = max(wlo[0], s0), lo1 = max(wlo[1], s1), lo2 = max(wlo[2], s2);
      const int k0 = max(min(whi[0], e0) - lo0, 0), k1 = max(min(whi[1], e1) - lo1, 0),
                k2 = max(min(whi[2], e2) - lo2, 0);
      steps(k0 * k1 * k2, Share{lo0, lo1, lo2, k2, s0, s1, s2, m1, m2, bwd::FastDiv(k1 * k2),
                                bwd::FastDiv(k2), false});
    }
  }  // gathered heads

  // Additional tokens: every owner query sees all of them (nothing masked), slab by slab.
  if constexpr (EXTRA) {
    const int ntok = (int)p.extra_tokens;
    const int xh = h / (int)p.heads_per_extra;
    const T* xk_bh = xk + (b * p.xk[0] + xh * p.xk[4]);
    const T* xv_bh = xv + (b * p.xv[0] + xh * p.xv[4]);
    const bool live = wpos[0] < glen[0] && wpos[1] < glen[1] && wpos[2] < glen[2];
    for (int x0 = 0; x0 < ntok; x0 += slab_rows) {
      const int rows = min(slab_rows, ntok - x0);
      __syncthreads();  // every warp is done with the previous slab
      // Token rows: every lane finds any row's offsets itself, only for rows of the slab
      // (the multiplies stay under the copies' branch).
      const auto chunk = [=, &p](int base) {
        return [=, &p](int j, i64& o0, i64& o1) {
          if (base + j < rows) {
            const i64 tok = x0 + base + j;
            o0 = tok * p.xk[1];
            o1 = tok * p.xv[1];
          }
        };
      };
      stage_slab<T, RS, EPP, CH>(smem, xk_bh, xv_bh, slab_rows, rows, D, warp, lane, chunk);
      steps(live ? rows : 0, Share{0, 0, 0, 1, 0, 0, 0, 1, 1, bwd::FastDiv(1), bwd::FastDiv(1),
                                   true});
    }
  }

  // dQ pass with bias: this CTA's box, the warps' boxes (placed at their origins) summed
  // in warp order (each warp's copies in copy order).
  if constexpr (BIAS && !OwnerIsKey) {
    __syncthreads();
    if (col0 == 0) {
      float* dst = bias_part + ((i64)bh * bg.ctas + block_x) * bg.vol;
      for (int i = threadIdx.x; i < bg.vol; i += kWarps * 32) {
        const int u0 = i / bg.bst[0], r = i - u0 * bg.bst[0], u1 = r / bg.bst[1],
                  u2 = r - u1 * bg.bst[1];
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const int x0 = u0 - wshift[w * 4], x1 = u1 - wshift[w * 4 + 1],
                    x2 = u2 - wshift[w * 4 + 2];
          if (x0 >= 0 && x0 < bg.wdim[0] && x1 >= 0 && x1 < bg.wdim[1] && x2 >= 0 &&
              x2 < bg.wdim[2]) {
            const float* wb =
                bacc + w * bg.wcopies * wbox + x0 * bg.wbst[0] + x1 * bg.wbst[1] + x2;
            for (int c = 0; c < bg.wcopies; ++c) v += wb[c * wbox];
          }
        }
        dst[i] = v;
      }
    }
  }

  // ---- write this lane's rows once (last dims contiguous, rows 16-byte aligned: the
  // launcher guarantees it), two adjacent columns per store ----
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    int c[3];
    if (!owner_coords(group + 8 * hh, c)) continue;
    const i64 f0 = full(0, c[0]), f1 = full(1, c[1]), f2 = full(2, c[2]);
    T* row0 = out0 + offset6(sw0, b, f0, f1, f2, h, 0);
    T* row1 = out1 + offset6(sw1, b, f0, f1, f2, h, 0);
#pragma unroll
    for (int j = 0; j < DC / 8; ++j) {
      const int col = col0 + j * 8 + quad * 2;
      if (col < D) {
        pack_store(row0 + col, acc0[j][hh * 2] * p.scale, acc0[j][hh * 2 + 1] * p.scale);
        if (OwnerIsKey) pack_store(row1 + col, acc1[j][hh * 2], acc1[j][hh * 2 + 1]);
      }
    }
  }
}

// Resident CTAs per SM the register budget is cut for (the most that compile without
// spills): the dK/dV pass holds two accumulator sets; sm_80's allocator needs a little more
// room than sm_90's for the head-dim-32 dQ pass, and so does CUDA 13.0's sm_90 allocator for
// the head-dim-32 f16/bf16 dK/dV pass (136 spill bytes at 3 CTAs; none from 13.1 on).
// The grouped-query dK/dV pass (Grouped) holds a few registers more for its loop over the
// group's query heads, and so does the pass with a bias (Bias); where that spills at 3 CTAs
// (sm_80, head dim 32) it keeps 2.
template <typename T, int Dp, bool OwnerIsKey, bool Grouped = false, bool Bias = false>
struct MinBlocks {
#if __CUDA_ARCH__ >= 900
  static constexpr int q32 = 4;
#else
  static constexpr int q32 = 3;
#endif
#if __CUDA_ARCH__ >= 900 && __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ < 1301
  static constexpr int kv32 = sizeof(T) == 2 ? 2 : 3;
#elif __CUDA_ARCH__ < 900
  static constexpr int kv32 = Grouped || Bias ? 2 : 3;
#else
  static constexpr int kv32 = 3;
#endif
  // The dQ pass with a bias also keeps its dS tile's stores in flight: one CTA fewer.
  static constexpr int value = OwnerIsKey ? (Dp <= 32 ? kv32 : 2)
                                          : (Dp <= 32 ? q32 - (Bias && sizeof(T) == 4) : Dp <= 64 ? 3 : 2);
};

}  // namespace

// dK, dV: owners are keys. Grid: x = (chunk, dilation group, tile), y = batch * kv heads
// from g.bh0; 4 warps. tab: per-axis window tables, axis a at tab + g.tab_off[a] (g: the
// pass's bwd::PassGeom). Grouped: grouped-query attention (heads_per_kv > 1), each CTA walks
// its kv head's query heads.
template <typename T, int Dp, int DC, bool Grouped, bool BIAS>
__global__ void __launch_bounds__(kWarps * 32, MinBlocks<T, Dp, true, Grouped, BIAS>::value)
na_bwd_fused_kv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ d_o, const float* __restrict__ lse,
                float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                const T* __restrict__ rpb, const bwd::BiasGeom bg,
                const int4* __restrict__ tab, const NAParams p, const bwd::PassGeom g) {
  bwd_pass<T, Dp, DC, true, Grouped, BIAS, false>(k, v, q, d_o, nullptr, lse, delta, dk, dv, p,
                                                  p.k, p.v, p.q, p.d_o, p.dk, p.dv, tab, g.tab_off,
                                                  g.tile, g.patch, g.lpatch, g.ntile, g.slab_rows,
                                                  g.bh0, rpb, nullptr, bg, nullptr, nullptr,
                                                  blockIdx.x);
}

// dQ and delta: owners are queries. Same grid and arguments as na_bwd_fused_kv, plus o and
// (EXTRA) the additional tokens xk, xv; runs first (the dK/dV passes read the delta it writes).
template <typename T, int Dp, int DC, bool BIAS, bool EXTRA>
__global__ void __launch_bounds__(kWarps * 32, MinBlocks<T, Dp, false, false, BIAS>::value)
na_bwd_fused_q(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ d_o, const T* __restrict__ o, const float* __restrict__ lse,
               float* __restrict__ delta, T* __restrict__ dq, const T* __restrict__ rpb,
               float* __restrict__ bias_part, const bwd::BiasGeom bg,
               const T* __restrict__ xk, const T* __restrict__ xv,
               const int4* __restrict__ tab, const NAParams p, const bwd::PassGeom g) {
  bwd_pass<T, Dp, DC, false, false, BIAS, EXTRA>(q, d_o, k, v, o, lse, delta, dq, dq, p, p.q,
                                                 p.d_o, p.k, p.v, p.dq, p.dq, tab, g.tab_off,
                                                 g.tile, g.patch, g.lpatch, g.ntile, g.slab_rows,
                                                 g.bh0, rpb, bias_part, bg, xk, xv, blockIdx.x);
}

// Both passes in one launch, for problems whose CTAs of both passes are all resident at once
// (the launcher's one_launch; no bias, no additional tokens, no grouped-query heads): CTAs [0, nq) of grid x run the dQ pass
// (geometry gq, head-dim chunks of DCQ), the rest the dK/dV pass (gkv, DCKV), which sums its
// gathered rows' delta itself (ONE) instead of waiting for the dQ pass's. Same grid y (batch *
// heads) and threads; dynamic shared memory the larger pass's.
// Two CTAs an SM: both passes' code in one kernel needs the larger register budget (at
// head dim 32 the dK/dV pass's three-CTA budget spills here).
template <typename T, int Dp, int DCQ, int DCKV>
__global__ void __launch_bounds__(kWarps * 32, 2)
na_bwd_fused_one(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ d_o, const T* __restrict__ o,
                 const float* __restrict__ lse, float* __restrict__ delta, T* __restrict__ dq,
                 T* __restrict__ dk, T* __restrict__ dv, const int4* __restrict__ tab,
                 const NAParams p, const bwd::PassGeom gq, const bwd::PassGeom gkv,
                 const unsigned nq) {
  const bwd::BiasGeom bg{};
  if (blockIdx.x < nq) {
    bwd_pass<T, Dp, DCQ, false, false, false, false>(
        q, d_o, k, v, o, lse, delta, dq, dq, p, p.q, p.d_o, p.k, p.v, p.dq, p.dq, tab,
        gq.tab_off, gq.tile, gq.patch, gq.lpatch, gq.ntile, gq.slab_rows, gq.bh0, nullptr,
        nullptr, bg, nullptr, nullptr, blockIdx.x);
  } else {
    bwd_pass<T, Dp, DCKV, true, false, false, false, true>(
        k, v, q, d_o, o, lse, delta, dk, dv, p, p.k, p.v, p.q, p.d_o, p.dk, p.dv, tab,
        gkv.tab_off, gkv.tile, gkv.patch, gkv.lpatch, gkv.ntile, gkv.slab_rows, gkv.bh0,
        nullptr, nullptr, bg, nullptr, nullptr, blockIdx.x - nq);
  }
}

// The origin (table coordinates of entry 0) of dQ CTA t's box, and whether that CTA exists
// (false where its dilation group is shorter than the grid: it wrote no box). The CTA's tile
// and dilation group per axis are decoded as na_bwd_fused_q does.
__device__ __forceinline__ bool rpb_box_origin(const int4* __restrict__ tab, const NAParams& p,
                                               const bwd::BiasGeom& bg, int t, int (&o)[3]) {
  unsigned bx = (unsigned)t;
  int tix[3];
  bool live = true;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    tix[a] = (int)(bx % (unsigned)bg.ntile[a]);
    bx /= (unsigned)bg.ntile[a];
  }
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    const Axis axis = axis_of(p, a);
    const int d = axis.dilation;
    const int g = (int)(bx % (unsigned)d);
    bx /= (unsigned)d;
    const int glen = axis.group_len(g), org = tix[a] * bg.tile[a];
    const int last = min(org + bg.tile[a] - 1, glen - 1);
    live &= org < glen;
    o[a] = org < glen ? tab[bg.tab_off[a] + g + d * last].x - last + (int)p.kernel[a] - 1 : 0;
  }
  return live;
}

// d_rpb from the dQ pass's CTA boxes (bias_part, [batch * heads, bg.ctas, bg.vol]): one CTA
// per table entry (grid x) and head (grid y); its threads take the dQ CTAs in turn (thread i:
// CTAs i, i + 128, ...; each over the batch in order) and sum those whose box holds the
// entry, then the CTA adds the threads' sums in a fixed tree. Writes every entry of d_rpb
// [H, 2k-1, ...] (zero where no query reaches it), the same bits every run.
template <typename T>
__global__ void __launch_bounds__(128)
na_bwd_fused_rpb(const float* __restrict__ bias_part, T* __restrict__ d_rpb,
                 const int4* __restrict__ tab, const NAParams p, const bwd::BiasGeom bg) {
  __shared__ float part[128];
  int n[3], o[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) n[a] = 2 * (int)p.kernel[a] - 1;
  const int e = blockIdx.x, h = blockIdx.y;
  o[2] = e % n[2];
  o[1] = (e / n[2]) % n[1];
  o[0] = e / (n[1] * n[2]);
  const int heads = (int)p.heads, batch = (int)p.batch;
  float sum = 0.f;
  for (int t = threadIdx.x; t < bg.ctas; t += blockDim.x) {
    int origin[3], local = 0;
    bool inside = rpb_box_origin(tab, p, bg, t, origin);   // (no such dQ CTA: no box)
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      const int l = o[a] - origin[a];
      inside &= l >= 0 && l < bg.dim[a];   // the entry in the CTA's box
      local += l * bg.bst[a];
    }
    if (!inside) continue;
    const float* src = bias_part + ((i64)h * bg.ctas + t) * bg.vol + local;
    const i64 per_batch = (i64)heads * bg.ctas * bg.vol;
    for (int b = 0; b < batch; ++b) sum += src[b * per_batch];
  }
  part[threadIdx.x] = sum;
  __syncthreads();
#pragma unroll
  for (int w = 64; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0)
    d_rpb[h * p.d_rpb[0] + o[0] * p.d_rpb[1] + o[1] * p.d_rpb[2] + o[2] * p.d_rpb[3]] =
        store_as<T>(part[0]);
}

// ---- d_rpb from the dQ CTAs' boxes in two launches --------------------------------------
// na_bwd_rpb_boxes: CTA (part, head, batch) adds the boxes of dQ CTAs [part * per, part * per
// + per) of its (batch, head) into a table of the head's entries in shared memory: thread i
// holds box entries i + kRpbThreads s (s < SLOTS) in registers across consecutive boxes of
// one origin (the interior CTAs' boxes share it), and adds them into the table where the
// origin changes (a barrier apart: in one such add the threads' entries differ). RpbRun<SLOTS>
// boxes load together whatever their origins (about 64 loads a thread in flight; no branch
// per slot: entries past the box load as zeros), then add in order. Writes the table (every
// entry) to parts [B, H, parts, entries], which na_bwd_rpb_sum adds. The same fields of bg as
// na_bwd_fused_rpb (the Hopper dQ pass's boxes too); boxes of up to kRpbThreads * SLOTS
// entries, tables of up to the launcher's shared memory. Every entry's adds run in box order
// whichever path takes a box, so the same boxes give the same bits.
constexpr int kRpbThreads = 256;
template <int SLOTS>
struct RpbRun {
  static constexpr int value = SLOTS >= 64 ? 1 : (64 / SLOTS < 16 ? 64 / SLOTS : 16);
};

template <int SLOTS>
__global__ void __launch_bounds__(kRpbThreads, 1)
na_bwd_rpb_boxes(const float* __restrict__ bias_part, float* __restrict__ parts,
                 const int4* __restrict__ tab, const NAParams p, const bwd::BiasGeom bg,
                 const int per) {
  constexpr int RUN = RpbRun<SLOTS>::value;
  extern __shared__ float table[];            // bg.tvol floats
  __shared__ int4 origin_s[kRpbThreads];      // per box of the turn: origin, live
  const int tid = threadIdx.x, h = blockIdx.y, b = blockIdx.z, vol = bg.vol;
  int n[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) n[a] = 2 * (int)p.kernel[a] - 1;
  for (int i = tid; i < bg.tvol; i += kRpbThreads) table[i] = 0.f;
  float acc[SLOTS];
  bool in[SLOTS];   // the slot lies in the box
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    acc[s] = 0.f;
    in[s] = tid + s * kRpbThreads < vol;
  }
  int cur[3] = {-1, -1, -1};   // origin of the registers' boxes (none yet)
  // acc into the table at the current origin (entries past the table: none of its queries
  // reach them, and the box holds zeros there), then a barrier.
  auto flush = [&]() {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int j = tid + s * kRpbThreads;
      if (in[s]) {
        const int l0 = j / bg.bst[0], r = j - l0 * bg.bst[0], l1 = r / bg.bst[1];
        const int e0 = cur[0] + l0, e1 = cur[1] + l1, e2 = cur[2] + r - l1 * bg.bst[1];
        if (e0 < n[0] && e1 < n[1] && e2 < n[2])
          table[e0 * bg.tst[0] + e1 * bg.tst[1] + e2] += acc[s];
      }
      acc[s] = 0.f;
    }
    __syncthreads();
  };
  const int t0 = blockIdx.x * per, t1 = min(t0 + per, bg.ctas);
  const float* src = bias_part + ((i64)b * p.heads + h) * bg.ctas * vol + tid;
  __syncthreads();   // the table is zeroed
  for (int tb = t0; tb < t1; tb += kRpbThreads) {
    const int m = min(kRpbThreads, t1 - tb);
    if (tid < m) {
      int o[3];
      const bool live = rpb_box_origin(tab, p, bg, tb + tid, o);
      origin_s[tid] = make_int4(o[0], o[1], o[2], live);
    }
    __syncthreads();
    // RUN boxes at a time: every load first (dead boxes and boxes past the turn load as
    // zeros), then the adds in box order, flushing where the origin changes (the same for
    // every thread: the branch and the barrier in flush are uniform).
    for (int i = 0; i < m; i += RUN) {
      const float* box = src + (i64)(tb + i) * vol;
      float x[RUN][SLOTS];
#pragma unroll
      for (int u = 0; u < RUN; ++u) {
        const bool live = i + u < m && origin_s[min(i + u, m - 1)].w;
        const float* bu = box + (i64)u * vol;
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) x[u][s] = live && in[s] ? bu[s * kRpbThreads] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < RUN; ++u) {
        if (i + u >= m) break;
        const int4 o = origin_s[i + u];
        if (!o.w) continue;
        if (o.x != cur[0] || o.y != cur[1] || o.z != cur[2]) {
          if (cur[0] >= 0) flush();
          cur[0] = o.x;
          cur[1] = o.y;
          cur[2] = o.z;
        }
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) acc[s] += x[u][s];
      }
    }
    __syncthreads();   // origin_s is rewritten next turn
  }
  if (cur[0] >= 0) flush();
  float* dst = parts + (((i64)b * p.heads + h) * gridDim.x + blockIdx.x) * bg.tvol;
  for (int i = tid; i < bg.tvol; i += kRpbThreads) dst[i] = table[i];
}

// d_rpb [H, 2k-1, ...] = the sum over batches and parts of part [B, H, parts, entries]
// (na_bwd_rpb_boxes', or the Hopper dS workspace's na_bwd_ds_rpb), in order: a thread per
// table entry (grid x) and head (grid y); every entry written.
template <typename T>
__global__ void __launch_bounds__(128)
na_bwd_rpb_sum(const float* __restrict__ part, T* __restrict__ d_rpb, const int entries,
               const int parts, const NAParams p) {
  const int e = blockIdx.x * 128 + threadIdx.x, h = blockIdx.y;
  if (e >= entries) return;
  float sum = 0.f;
  for (int b = 0; b < (int)p.batch; ++b) {
    const float* src = part + ((i64)b * p.heads + h) * parts * entries + e;
#pragma unroll 8
    for (int c = 0; c < parts; ++c) sum += src[(i64)c * entries];
  }
  int n[3], o[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) n[a] = 2 * (int)p.kernel[a] - 1;
  o[2] = e % n[2];
  o[1] = (e / n[2]) % n[1];
  o[0] = e / (n[1] * n[2]);
  d_rpb[h * p.d_rpb[0] + o[0] * p.d_rpb[1] + o[1] * p.d_rpb[2] + o[2] * p.d_rpb[3]] =
      store_as<T>(sum);
}

// dK, dV of the additional tokens (every query attends to all of them): owners are extra
// tokens, 16 per warp and 64 per CTA, gathered rows the query tokens of one split [z *
// split_rows, ...) of the flattened extents, for each query head of the owner's extra head
// in turn, slab_rows at a time (with their lse and the delta of the dQ pass). The same warp
// step as the dK/dV pass (warp_step), every owner row attending to every gathered row. Grid: x =
// (token tile, head-dim chunk), y = batch * extra heads from bh0, z = splits. Writes float32
// partial sums, dK already scaled, to part [2][splits][B][T][H_x][Dp] (dK, then dV), which
// na_bwd_extra_sum adds in split order: no atomics, the same bits every run.
template <typename T, int Dp, int DC>
__global__ void __launch_bounds__(kWarps * 32, MinBlocks<T, Dp, true>::value)
na_bwd_extra_kv(const T* __restrict__ q, const T* __restrict__ d_o,
                const float* __restrict__ lse, const float* __restrict__ delta,
                const T* __restrict__ xk, const T* __restrict__ xv, float* __restrict__ part,
                const NAParams p, const bwd::ExtraGeom eg) {
  const int split_rows = eg.split_rows, slab_rows = eg.slab_rows, bh0 = eg.bh0;
  typedef bwd::Step<T> St;
  constexpr int RS = Dp + 8, EPP = 16 / (int)sizeof(T), CH = Dp / EPP;
  constexpr unsigned RB = RS * sizeof(T);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane >> 2, quad = lane & 3;
  const int D = (int)p.head_dim, ntok = (int)p.extra_tokens, hx = (int)p.extra_heads;
  const int hpx = (int)p.heads_per_extra;
  const int col0 = (int)(blockIdx.x % (unsigned)(Dp / DC)) * DC;
  const int tok0 = (int)(blockIdx.x / (unsigned)(Dp / DC)) * (kWarps * 16);
  const int bh = bh0 + (int)blockIdx.y, b = bh / hx, xh = bh % hx;
  const int e1 = (int)p.extent[1], e2 = (int)p.extent[2];
  const int ntokens = (int)p.extent[0] * e1 * e2;
  const int n_lo = (int)blockIdx.z * split_rows, n_hi = min(ntokens, n_lo + split_rows);

  extern __shared__ __align__(16) unsigned char smem[];
  T* own_s0 = reinterpret_cast<T*>(smem);
  T* own_s1 = own_s0 + kWarps * 16 * RS;
  T* gat_s0 = own_s1 + kWarps * 16 * RS;
  T* gat_s1 = gat_s0 + slab_rows * RS;
  bwd::RowDesc* desc = reinterpret_cast<bwd::RowDesc*>(gat_s1 + slab_rows * RS);
  float* lse_s = reinterpret_cast<float*>(desc + kWarps * kNB);
  float* dlt_s = lse_s + slab_rows;

  // Owner rows (zeros past the last token or the head dim), lane r < 16 finding row r.
  const int my_tok = tok0 + warp * 16 + lane;
  const bool olive = lane < 16 && my_tok < ntok;
  const i64 ok_off = olive ? b * p.xk[0] + (i64)my_tok * p.xk[1] + xh * p.xk[4] : 0;
  const i64 ov_off = olive ? b * p.xv[0] + (i64)my_tok * p.xv[1] + xh * p.xv[4] : 0;
#pragma unroll 4
  for (int idx = lane; idx < 16 * CH; idx += 32) {
    const int r = idx / CH, piece = idx % CH, at = (warp * 16 + r) * RS + piece * EPP;
    const bool ok = __shfl_sync(0xffffffffu, (int)olive, r) && piece * EPP < D;
    const int e = ok ? piece * EPP : 0;
    const i64 o0 = __shfl_sync(0xffffffffu, ok_off, r), o1 = __shfl_sync(0xffffffffu, ov_off, r);
    tc::cp_async16(own_s0 + at, xk + (ok ? o0 + e : 0), ok);
    tc::cp_async16(own_s1 + at, xv + (ok ? o1 + e : 0), ok);
  }
  tc::cp_async_commit();

  float acc0[DC / 8][4], acc1[DC / 8][4];
#pragma unroll
  for (int j = 0; j < DC / 8; ++j)
#pragma unroll
    for (int t = 0; t < 4; ++t) acc0[j][t] = acc1[j][t] = 0.f;

  const float sl2 = p.scale * bwd::kLog2e;
  const unsigned own_a0 = tc::smem_addr(own_s0) + warp * 16 * RB + St::own_lane(lane, RB);
  const unsigned own_shift = kWarps * 16 * RB;
  const unsigned gat_base = tc::smem_addr(gat_s0), gat_shift = slab_rows * RB;
  const unsigned lse_a = tc::smem_addr(lse_s), dlt_a = tc::smem_addr(dlt_s);
  bwd::RowDesc* wdesc = desc + warp * kNB;
  const bool wlive = tok0 + warp * 16 < ntok;

#pragma unroll 1
  for (int gi = 0; gi < hpx; ++gi) {
    const int hq = xh * hpx + gi;
    for (int s0 = n_lo; s0 < n_hi; s0 += slab_rows) {
      const int rows = min(slab_rows, n_hi - s0);
      __syncthreads();  // every warp is done with the previous slab
      // Lane r of a chunk finds query row base + r's offsets and copies its lse and delta;
      // the warp takes the offsets by shuffle.
      const auto chunk = [=, &p](int base) {
        const int r = base + lane;
        i64 off0 = 0, off1 = 0;
        if (r < rows) {
          const int n = s0 + r, x0 = n / (e1 * e2), rem = n - x0 * (e1 * e2), x1 = rem / e2;
          const int x2 = rem - x1 * e2;
          off0 = offset6(p.q, b, x0, x1, x2, hq, 0);
          off1 = offset6(p.d_o, b, x0, x1, x2, hq, 0);
          bwd::cp_async4(lse_a + r * 4, lse + offset6(p.lse, b, x0, x1, x2, hq, 0));
          bwd::cp_async4(dlt_a + r * 4, delta + offset6(p.delta, b, x0, x1, x2, hq, 0));
        }
        return [=](int j, i64& o0, i64& o1) {
          o0 = __shfl_sync(0xffffffffu, off0, j);
          o1 = __shfl_sync(0xffffffffu, off1, j);
        };
      };
      stage_slab<T, RS, EPP, CH>(smem, q, d_o, slab_rows, rows, D, warp, lane, chunk);

#pragma unroll 1
      for (int base = 0; base < (wlive ? rows : 0); base += kNB) {
        {
          bwd::RowDesc d;
          const int t = base + lane;
          d.row = t < rows ? t : 0;
          d.mask = t < rows ? 0xffffu : 0u;
          d.l2 = lse_s[d.row] * bwd::kLog2e;
          d.dl = dlt_s[d.row];
          wdesc[lane] = d;
        }
        __syncwarp();
        typename St::Rows r0, r1;
        float s[4][4] = {}, dp[4][4] = {};
        warp_step<T, Dp, DC, DC / 8, true, false, true>(
            acc0, acc1, r0, r1, s, dp, wdesc, own_a0, own_shift, gat_base, gat_shift, col0, sl2,
            nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
        __syncwarp();  // descriptors are rewritten next step
      }
    }
  }

  // ---- this lane's rows of the split's partial sums ----
  const i64 plane = (i64)p.batch * ntok * hx * Dp;   // one split of one of dK, dV
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int tok = tok0 + warp * 16 + group + 8 * hh;
    if (tok >= ntok) continue;
    float* row0 = part + (i64)blockIdx.z * plane + (((i64)b * ntok + tok) * hx + xh) * Dp;
    float* row1 = row0 + (i64)gridDim.z * plane;
#pragma unroll
    for (int j = 0; j < DC / 8; ++j) {
      const int col = col0 + j * 8 + quad * 2;
      *reinterpret_cast<float2*>(row0 + col) =
          make_float2(acc0[j][hh * 2] * p.scale, acc0[j][hh * 2 + 1] * p.scale);
      *reinterpret_cast<float2*>(row1 + col) = make_float2(acc1[j][hh * 2], acc1[j][hh * 2 + 1]);
    }
  }
}

// dxk, dxv from na_bwd_extra_kv's partial sums: thread per (tensor, batch, token, head,
// column), the splits added in order.
template <typename T>
__global__ void __launch_bounds__(256)
na_bwd_extra_sum(const float* __restrict__ part, T* __restrict__ dxk, T* __restrict__ dxv,
                 const NAParams p, const bwd::ExtraGeom eg) {
  const int splits = eg.splits, dp = eg.dp;
  const int ntok = (int)p.extra_tokens, hx = (int)p.extra_heads, D = (int)p.head_dim;
  const i64 plane = (i64)p.batch * ntok * hx * dp;
  const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 2 * plane) return;
  const int which = (int)(i / plane);
  const i64 r = i - which * plane;
  const int col = (int)(r % dp);
  if (col >= D) return;
  const i64 row = r / dp;
  const int xh = (int)(row % hx), tok = (int)((row / hx) % ntok), b = (int)(row / ((i64)hx * ntok));
  float sum = 0.f;
  for (int z = 0; z < splits; ++z) sum += part[((i64)which * splits + z) * plane + r];
  const i64* st = which ? p.dxv : p.dxk;
  T* dst = which ? dxv : dxk;
  dst[b * st[0] + tok * st[1] + xh * st[4] + col * st[5]] = store_as<T>(sum);
}
