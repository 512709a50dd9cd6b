// Fused neighborhood-attention backward for Hopper (sm_90a), 1-D, 2-D and 3-D, on wgmma: delta = rowsum(dO * O), then dK, dV (key-parallel) and dQ (query-parallel), deterministic (no atomics), or dQ added in the dK/dV pass by float32 bulk reductions; with a bias, d_rpb.
// delta: one group of D / 8 threads per query row. dK/dV: a CTA owns 128 in-group keys (1-D consecutive, 2-D 8x16, 3-D 2x8x8) of one dilation group, compute warpgroup w owns keys 64w..64w+63 and walks the queries of the keys' inverse windows in 64-query tiles; dQ: a CTA owns 128 queries (the forward's boxes) and walks their windows' keys in BN-key tiles. Warpgroup 0 of both loads (cp.async, mbarriers; the rank-1 dK/dV pass's Q and dO tiles by TMA in na_bwd_hopper_kv_tma).
// Reads q, k, v, dO, out (last dim contiguous, rows 16-byte aligned), lse (natural log) and delta (float32); writes delta, dq, dk, dv (every element of the valid rows, padded head-dim columns never) and d_rpb (every entry; from per-CTA boxes of the dQ pass, or in the atomic variant from a dS workspace reduced by na_bwd_ds_rpb).
#include "natten/common.cuh"
#include "natten/mma.cuh"
#include "natten/hopper/wgmma.cuh"
#include "natten/hopper/bwd_tiles.cuh"
#include "natten/hopper/bias_box.cuh"
#include "natten/hopper/tma.cuh"
#include "natten/hopper/epilogue.cuh"

namespace natten {
namespace hopper {

// Register budgets (loader, each of two compute warpgroups). The entry cap of 384 threads is
// 168, and setmaxnreg.inc only hands out what the CTA's warpgroups gave back, so loader + 2 x
// compute must stay within 3 x 168 = 504 (more and the compute warpgroups would wait forever).
// 40 / 232: the geometry sits in shared memory, the 1-D loader steps one pointer at a time;
// 48 / 232 would not fit, and the loaders spilled at 24-32, the D128 dK/dV compute warpgroups at
// 224 (NVRTC 13.0). The atomic dQ variant fits it too, at every rank and head dim.
struct BwdRegs {
  static constexpr int loader = 40, compute = 232;
  static_assert(loader + 2 * compute <= 3 * 168, "more registers than the CTA holds");
};

// The float32 dQ workspace of the atomic variant: [B, H, dilation group per axis, D / 64
// column chunks, in-group coordinate per axis (the longest group's extents), 64], so that
// queries consecutive along the last axis have consecutive rows of a chunk: a query tile's
// rows are one run of memory per region row (1-D: one run), each one bulk add. Each row's
// eight 8-float groups are permuted by the row (group j at j ^ (n0 + n1 + n2) % 8, n the
// in-group coordinates): the staging tile, an image of the runs in shared memory, then takes
// the accumulator's stores without bank conflicts. (Axes past the rank: one group of one.)
template <int D>
__device__ __forceinline__ i64 dq_ws_row(const NAParams& p, i64 b, i64 h, const int (&g)[3],
                                         int chunk, const int (&n)[3]) {
  i64 off = b * p.heads + h;
#pragma unroll
  for (int a = 0; a < 3; ++a) off = off * p.dilation[a] + g[a];
  off = off * (D / 64) + chunk;
#pragma unroll
  for (int a = 0; a < 3; ++a) off = off * Axis::longest_group(p.extent[a], p.dilation[a]) + n[a];
  return off * 64;
}
__device__ __forceinline__ int dq_ws_key(const int (&n)[3]) { return (n[0] + n[1] + n[2]) % 8; }
// Where 8-float group ch (columns 8 ch ..) of query row (b, x0, x1, x2, h) lies.
template <int D>
__device__ __forceinline__ i64 dq_ws_group(const NAParams& p, const i64 (&c)[5], int ch) {
  int g[3], n[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    g[a] = (int)Axis::group_of(c[1 + a], p.dilation[a]);
    n[a] = (int)Axis::in_group(c[1 + a], p.dilation[a]);
  }
  return dq_ws_row<D>(p, c[0], c[4], g, ch / 8, n) + (((ch % 8) ^ dq_ws_key(n)) * 8);
}

// Coordinates c = (batch, axis 0, 1, 2, head) of row `row` of the rows flat over them; false
// past the last row (c then row 0's). 32-bit divisions wherever the rows fit: with 64-bit ones
// the delta launch, a streaming kernel, was issue-bound (76% SM throughput at 68% of the DRAM
// bandwidth on a 1-D head-dim-128 backward, NOTES-hopper-bwd.md).
template <typename I>
__device__ __forceinline__ void split_row(I x, const NAParams& p, i64 (&c)[5]) {
  c[4] = x % (I)p.heads;
  x /= (I)p.heads;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    c[1 + a] = x % (I)p.extent[a];
    x /= (I)p.extent[a];
  }
  c[0] = x;
}
__device__ __forceinline__ bool row_coords(i64 row, const NAParams& p, i64 (&c)[5]) {
  const i64 rows = p.batch * p.extent[0] * p.extent[1] * p.extent[2] * p.heads;
  const bool live = row < rows;
  if (!live) row = 0;
  if (rows <= 0xFFFFFFFFll)
    split_row<unsigned>((unsigned)row, p, c);
  else
    split_row<i64>(row, p, c);
  return live;
}

// delta[row] = sum over the head dim of dO * O in float32; D / 8 consecutive threads per row
// (16 bytes each), rows flat over (batch, axis 0, 1, 2, head). With dq_ws (the atomic dQ
// variant) the same threads zero the row's workspace (all its D columns).
template <typename T, int D>
__device__ __forceinline__ void delta_rows(const T* __restrict__ d_o, const T* __restrict__ o,
                                           float* __restrict__ delta, float* __restrict__ dq_ws,
                                           const NAParams& p) {
  constexpr int LANES = D / 8;
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int ch = (int)(t % LANES);
  i64 c[5];
  const bool live = row_coords(t / LANES, p, c);
  float sum = 0.f;
  if (live && ch * 8 < p.head_dim) {
    const i64 off_do = offset6(p.d_o, c[0], c[1], c[2], c[3], c[4], 0) + ch * 8;
    const i64 off_o = offset6(p.o, c[0], c[1], c[2], c[3], c[4], 0) + ch * 8;
    const uint4 a = *reinterpret_cast<const uint4*>(d_o + off_do);
    const uint4 b = *reinterpret_cast<const uint4*>(o + off_o);
    const T* ea = reinterpret_cast<const T*>(&a);
    const T* eb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum = fmaf(to_float(ea[e]), to_float(eb[e]), sum);
  }
  if (dq_ws && live) {
    float4* at = reinterpret_cast<float4*>(dq_ws + dq_ws_group<D>(p, c, ch));
    at[0] = at[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int w = 1; w < LANES; w *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, w);
  if (live && ch == 0) delta[offset6(p.delta, c[0], c[1], c[2], c[3], c[4], 0)] = sum;
}

// dq = scale * dq_ws (the atomic variant's last launch), threads as in delta_rows.
template <typename T, int D>
__device__ __forceinline__ void dq_rows(const float* __restrict__ dq_ws, T* __restrict__ dq,
                                        const NAParams& p) {
  constexpr int LANES = D / 8;
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  const int ch = (int)(t % LANES);
  i64 c[5];
  if (!row_coords(t / LANES, p, c) || ch * 8 >= p.head_dim) return;
  const float4* from = reinterpret_cast<const float4*>(dq_ws + dq_ws_group<D>(p, c, ch));
  const float4 a = from[0], b = from[1];
  T* at = dq + offset6(p.dq, c[0], c[1], c[2], c[3], c[4], 0) + ch * 8;
  const float sc = p.scale;
  pack_store(at, a.x * sc, a.y * sc);
  pack_store(at + 2, a.z * sc, a.w * sc);
  pack_store(at + 4, b.x * sc, b.y * sc);
  pack_store(at + 6, b.z * sc, b.w * sc);
}

// A 16-bit store of the low half of x to at where pred is set (predicated, no branch).
__device__ __forceinline__ void st_global_u16_if(unsigned short* at, unsigned x, unsigned pred) {
  asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %2, 0;\n @p st.global.b16 [%0], %1;\n}\n"
               :: "l"(at), "h"((unsigned short)x), "r"(pred) : "memory");
}

// Shared-memory layout and mbarriers of both passes: the owner tiles (two tensors of OWN rows),
// STAGES slots of two region tiles of ROWS rows each, then (DS: the atomic dQ variant) the dS^T
// tiles of 64 x ROWS, one per compute warpgroup (at head dim 128 two sets, by step parity:
// each warpgroup reads both), and per compute warpgroup a float32 staging tile of 64 dQ rows
// of 64 columns (laid out as dq_ws_row's rows), then (dK/dV pass) STAGES pairs of float vectors of
// ROWS (lse, delta), then the mbarriers (full, empty per stage). Every tile starts on a
// 1024-byte boundary (the 128-byte swizzle's period).
template <int D, int ROWS, int STAGES, bool VALUES, bool DS = false, int OWN = 128>
struct BwdSmem {
  static constexpr unsigned OWNER = OWN * D * 2, TILE = ROWS * D * 2;
  static constexpr unsigned VEC = VALUES ? ROWS * 4 : 0;
  static constexpr unsigned DS_TILE = DS ? 64 * ROWS * 2 : 0;  // per compute warpgroup
  // The atomic variant at head dim 128: dQ's columns split between the warpgroups, each
  // reading both warpgroups' dS^T (two sets of them, by step parity).
  static constexpr bool SPLIT_DQ = D > 64;
  static constexpr int DS_SETS = SPLIT_DQ ? 2 : 1;
  static constexpr unsigned STAGE = DS ? 64 * 64 * 4 : 0;  // per compute warpgroup
  static constexpr unsigned BYTES = 2 * OWNER + STAGES * (2 * TILE + 2 * VEC) +
                                    2 * DS_SETS * DS_TILE + 2 * STAGE + 16 * STAGES + 1024;
  static_assert(OWNER % 1024 == 0 && TILE % 1024 == 0 && STAGE % 1024 == 0,
                "tiles on 1024-byte boundaries");
  static_assert(BYTES <= 227 * 1024, "sm_90 gives a CTA at most 227 KB of shared memory");
  unsigned own0, own1, reg0, ds, stage, vecs, full, empty;
  __device__ __forceinline__ void init(unsigned char* raw) {
    own0 = (smem_u32(raw) + 1023u) & ~1023u;
    own1 = own0 + OWNER;
    reg0 = own1 + OWNER;
    ds = reg0 + STAGES * 2 * TILE;
    stage = ds + 2 * DS_SETS * DS_TILE;
    vecs = stage + 2 * STAGE;
    full = vecs + STAGES * 2 * VEC;
    empty = full + 8 * STAGES;
  }
  __device__ __forceinline__ unsigned tile0(int j) const { return reg0 + (j % STAGES) * 2 * TILE; }
  __device__ __forceinline__ unsigned tile1(int j) const { return tile0(j) + TILE; }
  __device__ __forceinline__ unsigned vec0(int j) const { return vecs + (j % STAGES) * 2 * VEC; }
  __device__ __forceinline__ unsigned vec1(int j) const { return vec0(j) + VEC; }
  // The dS^T tile of compute warpgroup w at step j.
  __device__ __forceinline__ unsigned ds_tile(int j, int w) const {
    return ds + ((j % DS_SETS) * 2 + w) * DS_TILE;
  }
};

// Thread 0 decodes the CTA's geometry and sets up the stage barriers (a stage is full
// after the loader's FULL arrivals, empty after the compute warpgroups' EMPTY); then the
// whole CTA learns whether it has work.
// ASYNC: TMA loads complete on the full barriers too (their inits made visible to them).
template <int STAGES, int FULL, int EMPTY, bool ASYNC = false, typename Geom>
__device__ __forceinline__ bool begin_cta(Geom& G, int& live, unsigned full, unsigned empty,
                                          const NAParams& p) {
  if (threadIdx.x == 0) {
    live = G.init(p);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, FULL);
      mbar_init(empty + 8 * s, EMPTY);
    }
    if (ASYNC) fence_mbar_init();
  }
  __syncthreads();
  return live;
}

// dK, dV: keys own the CTA (128 keys, two compute warpgroups of 64), the region is the
// queries of their inverse windows, walked in BQ-query tiles: per tile S^T = K Q^T and dP^T =
// V dO^T (wgmma from shared memory), P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T
// (dP^T - delta), dV += P^T dO and dK += dS^T Q (P^T, dS^T from registers, dO and Q N-major).
// WG 1 (deterministic, no bias, cp.async loads): 64-key boxes (1-D 64, 2-D 8 x 8, 3-D 2 x 4
// x 8), one compute warpgroup, two CTAs an SM (at head dim 128 in 32-query tiles, so that
// dK, dV, S^T and dP^T fit the 216 registers two CTAs leave a compute thread).
// ATOMIC: also dQ += dS K for the tile's queries, added to the float32 workspace dq_ws by
// bulk reductions: no dQ pass, but the sums' order varies from run to run. dS^T goes through
// shared memory (wgmma reads it and K MN-major, as stored). Head dim 64: each warpgroup adds
// dS K over its own 64 keys; 128: warpgroup w adds columns 64w..64w+63 of dS K over all 128
// keys (both warpgroups' dS^T, a barrier between them; half the bytes to reduce). The 64 x 64
// float32 result is staged in shared memory as dq_ws_row lays its rows out, and warps 0 and 1
// of the warpgroup issue one bulk add (cp.reduce.async.bulk) per run of the tile's rows along
// the region's last axis (1-D: one), waiting for their reads a step later.
// BIAS: S^T gets rpb[h, key - query + kernel - 1] (KeyBiasBox, staged after the mbarriers for
// each query head of the walk in turn, with each region query's place in it for rank 2, 3).
// ATOMIC and BIAS (ds_ws): no dQ pass, so each score's dS (16-bit, as the GEMMs take it)
// inside its key's window and group goes to the workspace ds_ws [B, ws_heads, tokens,
// kernel volume] (the query heads of kv heads from hk_base on: the launch's) at its query's
// row and the key's slot in the query's window (DsWs, bwd_geom.cuh), which na_bwd_ds_rpb
// and (mma_backward.cu's) na_bwd_rpb_sum reduce into d_rpb: every slot of a window is
// written once, by the CTA owning its key.
// TMA (rank 1): thread 0 of the loader stages each tile's Q and dO by tensor maps (tq, tdo:
// tma.cuh, 64-row boxes stepping the dilation), the loader's threads only the owner K, V
// (once) and the tile's lse and delta; a stage is full after their 128 arrivals, thread 0's
// and the maps' bytes. Region rows past the group arrive as the tensor's rows (zeros past its
// end), not zeros: their scores are masked, as those of rows outside a key's reach are.
template <typename T, int D, int BQ, int STAGES, int RANK, int T0, int T1, int T2, bool ATOMIC,
          bool BIAS, bool TMA = false, int WG = 2>
__device__ __forceinline__ void bwd_kv(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const T* __restrict__ d_o,
                                       const float* __restrict__ lse,
                                       const float* __restrict__ delta, T* __restrict__ dk,
                                       T* __restrict__ dv, float* __restrict__ dq_ws,
                                       const T* __restrict__ rpb, const NAParams& p,
                                       const TmaMap* tq = nullptr, const TmaMap* tdo = nullptr,
                                       T* __restrict__ ds_ws = nullptr, int hk_base = 0,
                                       int ws_heads = 0) {
  constexpr int NT = 128, OWN = 64 * WG;
  static_assert(T0 * T1 * T2 == OWN && (RANK > 1 || T0 == OWN) && (RANK > 2 || T2 == 1),
                "the key tile is 64 * WG keys over the rank's axes");
  static_assert(STAGES >= 2, "two stages at least");
  static_assert(!ATOMIC || BQ == 64, "the dS^T tile is one 64-column block");
  static_assert(!(ATOMIC && BIAS) || !TMA, "the dS workspace variant loads by cp.async");
  static_assert(!TMA || (RANK == 1 && BQ == 64), "TMA loads rank 1's 64-row query tiles");
  static_assert(WG == 2 || (WG == 1 && !ATOMIC && !BIAS && !TMA && (D <= 64 || BQ <= 32)),
                "one compute warpgroup: head dim 64 (128: 32-query tiles), deterministic, no "
                "bias, cp.async loads");
  typedef BwdSmem<D, BQ, STAGES, true, ATOMIC, OWN> Smem;
  // Registers (loader, compute): two warpgroups one CTA an SM; one: two CTAs an SM, so
  // loader + compute within 2 x 128.
  constexpr int kLoaderRegs = WG == 1 ? 40 : BwdRegs::loader;
  constexpr int kComputeRegs = WG == 1 ? 216 : BwdRegs::compute;
  static_assert(WG != 1 || kLoaderRegs + kComputeRegs <= 2 * 128, "over the CTA's registers");
  extern __shared__ unsigned char smem_raw[];
  Smem sm;
  sm.init(smem_raw);

  // The geometry lives in shared memory: its fields are read where used (the tile loop
  // needs a few, the epilogue the rest), not held in registers over the whole walk.
  __shared__ BwdGeom<RANK, T0, T1, T2, true> G;
  __shared__ int live;
  // The CTA's keys belong to kv head hk; its walk visits the query tiles of each of the
  // kv head's `group` query heads in turn (GQA; group = 1 otherwise), so dK and dV sum over
  // them in registers, in a fixed order.
  const int hk = blockIdx.y + hk_base, b = blockIdx.z, hd = (int)p.head_dim;
  const int group = (int)p.heads_per_kv;
  const int tid = threadIdx.x, lane = tid % 32, quad = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;

  const T* kb = k + b * p.k[0] + hk * p.k[4];
  const T* vb = v + b * p.v[0] + hk * p.v[4];
  // Query-side bases of the group's first head; head g of the group adds g times the stride.
  const i64 h0 = (i64)hk * group;
  const T* qb = q + b * p.q[0] + h0 * p.q[4];
  const T* dob = d_o + b * p.d_o[0] + h0 * p.d_o[4];
  const float* lseb = lse + b * p.lse[0] + h0 * p.lse[4];
  const float* deltab = delta + b * p.delta[0] + h0 * p.delta[4];

  if (!begin_cta<STAGES, NT + (TMA ? 1 : 0), 128 * WG, TMA>(G, live, sm.full, sm.empty, p))
    return;
  const int num_tiles = (G.total + BQ - 1) / BQ;

  if (wg < 0) {  // the loader: K, V with tile 0, then each query tile once its slot is free
    regs_dec<kLoaderRegs>();
    if (TMA && tid == 0) {
      tma_prefetch(tq);
      tma_prefetch(tdo);
    }
    load_rows<T, D, OWN, NT>(sm.own0, kb, p.k, sm.own1, vb, p.v, G, p, -1, hd, tid);
    int j = 0;  // the step: query tile jt of head g, in walk order
    for (int g = 0; g < group; ++g)
      for (int jt = 0; jt < num_tiles; ++jt, ++j) {
        if (j >= STAGES) mbar_wait(sm.empty + 8 * (j % STAGES), (j / STAGES + 1) & 1);
        if constexpr (TMA) {
          if (tid == 0) {
            const unsigned full = sm.full + 8 * (j % STAGES);
            const int d0 = (int)p.dilation[0];
            const int x[3] = {G.g[0] + d0 * (G.rs[0] + jt * BQ), 0, 0};
            mbar_expect_tx(full, 2 * Smem::TILE);
            tma_tile<D, BQ, 1>(sm.tile0(j), tq, full, x, (int)h0 + g, b, d0);
            tma_tile<D, BQ, 1>(sm.tile1(j), tdo, full, x, (int)h0 + g, b, d0);
          }
        } else {
          load_rows<T, D, BQ, NT>(sm.tile0(j), qb + g * p.q[4], p.q, sm.tile1(j),
                                  dob + g * p.d_o[4], p.d_o, G, p, jt * BQ, hd, tid);
        }
        load_row_values<BQ>(sm.vec0(j), lseb + g * p.lse[4], sm.vec1(j),
                            deltab + g * p.delta[4], G, p, jt * BQ, tid);
        cp_async_arrive(sm.full + 8 * (j % STAGES));
      }
    cp_async_wait_all();
    return;
  }

  regs_inc<kComputeRegs>();
  // This thread's two key rows and the queries that reach them (region coordinates).
  const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
  int wl[2][3], wn[2][3];
  G.row_reach(p, row0, wl[0], wn[0]);
  G.row_reach(p, row0 + 8, wl[1], wn[1]);
  // ATOMIC: whether the two key rows lie in the group. A row past it has a zero K row and the
  // last row's reach, so its P^T is exp2(-lse log2 e), which a very negative lse takes past
  // the 16-bit range: its dS^T row is stored as zeros, else Inf x 0 in the dQ GEMM is NaN.
  bool own_ok[2] = {true, true};
  if constexpr (ATOMIC) {
    int c[3];
    G.own_row(row0, c, own_ok[0]);
    G.own_row(row0 + 8, c, own_ok[1]);
  }
  const float sl = p.scale * 1.4426950408889634f;  // scale * log2(e)
  const unsigned k_wg = sm.own0 + wg * 64 * 128, v_wg = sm.own1 + wg * 64 * 128;

  // BIAS: bias_row[r] is key row r's term of its score's box index (KeyBiasBox), qidx each
  // region query's place in the box (rank 2, 3; after the box).
  const unsigned btab = sm.empty + 8 * STAGES;
  unsigned bias_row[2] = {btab, btab}, qidx = btab;
  if constexpr (BIAS) {
    KeyBiasBox bb;
    bb.init(G, p);
    row_terms(bb, G, p, row0, btab, bias_row);
    qidx = btab + 4 * bb.vol;
    if (RANK > 1)
      bb.stage_places(reinterpret_cast<int*>(smem_raw + (qidx - smem_u32(smem_raw))), G,
                      tid - 128, 256);
    if constexpr (ATOMIC) {
      // Each region query's workspace row minus its window origin's term, after the places
      // (published by stage_bias(0)'s barrier).
      const unsigned qb = qidx + (RANK > 1 ? 4 * G.total : 0);
      DsWs::stage(reinterpret_cast<int*>(smem_raw + (qb - smem_u32(smem_raw))), G, p,
                  tid - 128, 256);
    }
  }
  // The box of query head h0 + g: staged once every compute thread is done with the last
  // (the box worked out again: kept over the walk it spilled).
  auto stage_bias = [&](int g) {
    if (g > 0) named_sync(4, 256);
    KeyBiasBox bb;
    bb.init(G, p);
    bb.template stage<RANK>(reinterpret_cast<float*>(smem_raw + (btab - smem_u32(smem_raw))),
                            rpb, (int)h0 + g, p, tid - 128, 256);
    named_sync(4, 256);
  };

  float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  // PIPE (head dim 64): the next step's S^T and dP^T GEMMs are queued behind this step's
  // dV, dK (and dQ) GEMMs, so the tensor cores need not wait for this warpgroup's work
  // between them (the atomic variant's dQ staging runs under them). At 128 their
  // accumulators would not fit beside dK and dV.
  constexpr bool PIPE = D <= 64;
  constexpr bool SPLIT = Smem::SPLIT_DQ;
  const int steps = group * num_tiles;  // query tile jt of head g is step g * num_tiles + jt
  const int wrow = ((tid / 32) % 4) * 16 + lane / 4, wwarp = (tid / 32) % 4;
  typedef typename Kind<T>::type kind;
  float acc_s[BQ / 2], acc_dp[BQ / 2];
  auto issue_ss = [&](int jj) {  // S^T = K Q^T, dP^T = V dO^T of step jj, once resident
    mbar_wait(sm.full + 8 * (jj % STAGES), (jj / STAGES) & 1);
    fence_proxy_async();
    wgmma_fence();
    gemm_ss<T, D, BQ, OWN>(acc_s, k_wg, sm.tile0(jj));
    gemm_ss<T, D, BQ, OWN>(acc_dp, v_wg, sm.tile1(jj));
    wgmma_commit();
  };
  if (PIPE) issue_ss(0);
  for (int j = 0; j < steps; ++j) {
    const int g = j / num_tiles, jt = j - g * num_tiles;
    const unsigned sq = sm.tile0(j), sdo = sm.tile1(j);
    if (!PIPE) issue_ss(j);
    if (BIAS && jt == 0) stage_bias(g);
    wgmma_wait<0>();
    fence_regs(acc_s);
    fence_regs(acc_dp);
    // Column 8 i + 2 quad + e is query jt * BQ + that: its lse and delta from the slot.
    const float* lse_s = reinterpret_cast<const float*>(smem_raw + (sm.vec0(j) - smem_u32(smem_raw)));
    const float* dl_s = reinterpret_cast<const float*>(smem_raw + (sm.vec1(j) - smem_u32(smem_raw)));
    // ATOMIC and BIAS: which of the thread's scores go to the dS workspace (bit i: score i).
    unsigned wmask = 0;
    if constexpr (BIAS) {
      // P^T = exp2(S^T scale log2 e + bias - lse log2 e) inside each key's reach, else 0
      // (the bias read only there: branch-free, the D128 kernels stay within their registers).
      const int* const places = reinterpret_cast<const int*>(smem_raw + (qidx - smem_u32(smem_raw)));
      auto visit = [&](int i, int r, bool in, int f) {
        const int col = f - jt * BQ, place = RANK == 1 ? f : (in ? places[f] : 0);
        const float b = in ? lds_f32(bias_row[r] - 4 * place) : negative_infinity<float>();
        const float pe = fast_exp2(fmaf(lse_s[col], -1.4426950408889634f, fmaf(acc_s[i], sl, b)));
        acc_s[i] = pe;
        acc_dp[i] = pe * (acc_dp[i] - dl_s[col]);
        if constexpr (ATOMIC) wmask |= (in && own_ok[r] ? 1u : 0u) << i;
      };
      if (G.needs_mask(jt * BQ, BQ))
        walk_scores<BQ, RANK>(jt * BQ, quad, G.rk, G.inner, wl, wn, visit);
      else
        walk_flat<BQ>(jt * BQ, quad, visit);
    } else {
      if (G.needs_mask(jt * BQ, BQ))
        mask_scores<BQ, RANK>(acc_s, jt * BQ, quad, G.rk, G.inner, wl, wn);
#pragma unroll
      for (int i = 0; i < BQ / 8; ++i) {
        const float2 l2 = *reinterpret_cast<const float2*>(lse_s + 8 * i + 2 * quad);
        const float2 d2 = *reinterpret_cast<const float2*>(dl_s + 8 * i + 2 * quad);
        const float ll[2] = {l2.x * 1.4426950408889634f, l2.y * 1.4426950408889634f};
        const float dd[2] = {d2.x, d2.y};
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float pe = fast_exp2(fmaf(acc_s[4 * i + x], sl, -ll[x % 2]));
          acc_s[4 * i + x] = pe;
          acc_dp[4 * i + x] = pe * (acc_dp[4 * i + x] - dd[x % 2]);
        }
      }
    }
    unsigned pa[BQ / 16][4], da[BQ / 16][4];
    pack_a<T, BQ>(acc_s, pa);
    pack_a<T, BQ>(acc_dp, da);
    wgmma_fence();
    gemm_rs<T, D, BQ>(acc_dv, pa, sdo);
    gemm_rs<T, D, BQ>(acc_dk, da, sq);
    wgmma_commit();
    float acc_q[32];  // ATOMIC: this step's dQ columns (64 queries x 64)
    if constexpr (ATOMIC) {
      // dS^T as stored: key rows of this warpgroup, query columns (stored while the RS GEMMs
      // read the same registers: that kept NVRTC 13.0's 1-D D128 kernel within 232).
      const unsigned ds_wg = sm.ds_tile(j, wg);
#pragma unroll
      for (int s = 0; s < BQ / 16; ++s)
#pragma unroll
        for (int x = 0; x < 4; ++x)
          asm volatile("st.shared.b32 [%0], %1;\n"
                       :: "r"(ds_wg + swz128(wrow + 8 * (x % 2), 2 * s + x / 2) + 4 * quad),
                          "r"(own_ok[x % 2] ? da[s][x] : 0u) : "memory");
      fence_proxy_async();
      // The staging tile is free once the previous step's bulk adds have read it (warps 0
      // and 1 issued them); the barrier says so, and publishes the dS^T tiles.
      if (wwarp < 2) bulk_wait_read();
      if (SPLIT)
        named_sync(3, 256);  // both warpgroups' dS^T of this step
      else
        named_sync(1 + wg, 128);
      // dQ's GEMM queued behind the dK/dV ones (the tensor cores run them in order).
#pragma unroll
      for (int i = 0; i < 32; ++i) acc_q[i] = 0.f;
      constexpr int KSTEPS = SPLIT ? 8 : 4;  // 16 keys a step
      // The operands' addresses, opaque to the compiler: else it keeps all 2 x KSTEPS
      // descriptors live over the walk (D128: a 20-36 byte spill).
      unsigned a_ds = sm.ds_tile(j, SPLIT ? 0 : wg), b_k = SPLIT ? sm.own0 + wg * (128 * 128) : k_wg;
      asm volatile("" : "+r"(a_ds), "+r"(b_k));
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s)
        SSTT64::run(acc_q, desc128(a_ds + (s / 4) * Smem::DS_TILE + (s % 4) * 2048, 64 * 128, 1024),
                    desc128(b_k + s * 2048, 128 * 128, 1024), s > 0, kind());
      wgmma_commit();
    }
    if (PIPE && j + 1 < steps) {
      issue_ss(j + 1);
      wgmma_wait<1>();  // this step's GEMMs done; the next step's S^T, dP^T may run on
    } else {
      wgmma_wait<0>();
    }
    fence_regs(acc_dv);
    fence_regs(acc_dk);
    if constexpr (ATOMIC) {
      fence_regs(acc_q);
      // Accumulator d[4 i + 2 h + e] is query row wrow + 8 h, column 8 i + 2 quad + e; the
      // staging tile holds the rows as dq_ws_row lays them out, by their key.
      const unsigned st_wg = sm.stage + wg * Smem::STAGE;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int row = wrow + 8 * h2;
        int c[3];
        G.other(jt * BQ + row, c);  // (rows past the region: any key)
        const int m = dq_ws_key(c);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                       :: "r"(st_wg + row * 256 + ((i ^ m) * 8 + 2 * quad) * 4),
                          "f"(acc_q[4 * i + 2 * h2]), "f"(acc_q[4 * i + 2 * h2 + 1]) : "memory");
      }
      fence_proxy_async();
      named_sync(1 + wg, 128);
      if (wwarp < 2) {  // the lane of a run's first row adds the run (rows of one region row)
        const int row = 32 * wwarp + lane, f = jt * BQ + row;
        constexpr int LAST = RANK - 1;
        int c[3];
        G.other(f, c);
        const int pos = c[LAST] - G.rs[LAST];  // along the region row
        if (f < G.total && (row == 0 || pos == 0)) {
          const int len = min(min(G.rk[LAST] - pos, BQ - row), G.total - f);
          bulk_add_f32(dq_ws + dq_ws_row<D>(p, b, h0 + g, G.g, SPLIT ? wg : 0, c),
                       st_wg + row * 256, 256u * (unsigned)len);
        }
        bulk_commit();
      }
      if constexpr (BIAS) {
        // dS to the workspace, as the GEMMs took it: read back from this thread's own places
        // in its warpgroup's dS^T tile (the tile is rewritten two steps on, by this thread:
        // reading it here keeps the packed dS out of the registers over the dQ GEMM). Score i
        // is half i % 2 of fragment (i / 8, (i / 2) % 4), query column jt * BQ + 8 (i / 4) +
        // 2 quad + i % 2, key row (i / 2) % 2.
        // (Worked out from opaque copies, so that none of it is hoisted over the dQ GEMM's
        // accumulators: there it spilled.)
        int etid = tid, eh = h0 + g - hk_base * group;
        unsigned eq = qidx;
        asm volatile("" : "+r"(etid), "+r"(eh), "+r"(eq));
        unsigned short* const ws_g = reinterpret_cast<unsigned short*>(ds_ws) +
                                     DsWs::head_row(p, b, eh, ws_heads);
        const unsigned qb = eq + (RANK > 1 ? 4 * G.total : 0);
        const int* rows = reinterpret_cast<const int*>(smem_raw + (qb - smem_u32(smem_raw)));
        int kslot[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          int c[3];
          bool valid;
          G.own_row((etid / 128 - 1) * 64 + ((etid / 32) % 4) * 16 + (etid % 32) / 4 + 8 * rr, c,
                    valid);
          kslot[rr] = DsWs::key_term<RANK>(p, c);
        }
        const unsigned ds_wg = sm.ds_tile(j, wg);
#pragma unroll 1
        for (int i8 = 0; i8 < BQ / 8; ++i8)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int row = rows[jt * BQ + 8 * i8 + 2 * quad + e];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int i = 4 * i8 + 2 * r + e, s8 = i / 8, x = (i / 2) % 4;
              const unsigned w =
                  lds_u32(ds_wg + swz128(wrow + 8 * (x % 2), 2 * s8 + x / 2) + 4 * quad);
              st_global_u16_if(ws_g + (unsigned)(row + kslot[r]), e ? w >> 16 : w,
                               (wmask >> i) & 1u);
            }
          }
      }
    }
    mbar_arrive(sm.empty + 8 * (j % STAGES));
  }
  if (ATOMIC && (tid / 32) % 4 < 2) bulk_wait();  // the bulk adds done before the CTA ends

  // Epilogue: dK = scale * dS^T Q, dV as accumulated, for keys inside the group, through
  // this warpgroup's own K and V rows in shared memory (epilogue.cuh): its GEMMs are done
  // with them (the split dQ GEMM of ATOMIC reads both warpgroups' K rows: once both are).
  // The head-dim-64 ATOMIC pass (not a default: atomic_pays) stores from the accumulators
  // as before: through shared memory its 3-D kernel spilled 16 bytes (NVRTC 13.0).
  if constexpr (ATOMIC && D == 64) {
    // (The row is worked out again from an opaque thread index: carried over the walk it
    // spilled.)
    int etid = tid;
    asm volatile("" : "+r"(etid));
    const int erow = wg * 64 + ((etid / 32) % 4) * 16 + (etid % 32) / 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int c[3];
      bool valid;
      G.own_row(erow + 8 * r, c, valid);
      if (!valid) continue;
      T* at_k = dk + b * p.dk[0] + hk * p.dk[4] + G.offset(p, p.dk, c[0], c[1], c[2]);
      T* at_v = dv + b * p.dv[0] + hk * p.dv[4] + G.offset(p, p.dv, c[0], c[1], c[2]);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const int col = 8 * i + 2 * quad;
        if (col < hd) {
          pack_store(at_k + col, acc_dk[4 * i + 2 * r] * p.scale, acc_dk[4 * i + 2 * r + 1] * p.scale);
          pack_store(at_v + col, acc_dv[4 * i + 2 * r], acc_dv[4 * i + 2 * r + 1]);
        }
      }
    }
  } else {
    if constexpr (ATOMIC && SPLIT) named_sync(10, 256);
    const float sk[2] = {p.scale, p.scale}, sv[2] = {1.f, 1.f};
    store_tile_rows<T, D>(acc_dk, sk, k_wg, OWN * 128, 8 + wg, hd, [&](int r) {
      return G.row_at(p, dk + b * p.dk[0] + hk * p.dk[4], p.dk, wg * 64 + r);
    });
    store_tile_rows<T, D>(acc_dv, sv, v_wg, OWN * 128, 8 + wg, hd, [&](int r) {
      return G.row_at(p, dv + b * p.dv[0] + hk * p.dv[4], p.dv, wg * 64 + r);
    });
  }
}

// dQ: queries own the CTA (the forward's query boxes of 64 * WG, WG compute warpgroups of 64),
// the region is their windows' keys, walked in BN-key tiles: per tile S = Q K^T and dP = dO
// V^T, P = exp2(S scale log2 e - lse log2 e), dS = P (dP - delta), dQ += dS K (K N-major).
// WG 1 (no bias): 64-query boxes (1-D 64, 2-D 8 x 8, 3-D 2 x 4 x 8), two CTAs an SM; a small
// window's region is then fewer key tiles a query, and one CTA's loads and epilogue run under
// the other's GEMMs (as the forward's 64-query boxes).
// BIAS: S gets rpb[h, key - query + kernel - 1] (BiasBox, as the forward stages it, after the
// mbarriers; then a float32 box of its gradient and, rank 2, 3, each region key's place), and
// the pass sums dS per box entry (each warp's dS through a scratch tile, added column by
// column with shared-memory atomics: the order varies run to run) and writes the CTA's box
// to bias_part [B, H, CTAs, box], which na_bwd_fused_rpb reduces.
template <typename T, int D, int BN, int STAGES, int RANK, int T0, int T1, int T2, bool BIAS,
          int WG = 2>
__device__ __forceinline__ void bwd_q(const T* __restrict__ q, const T* __restrict__ k,
                                      const T* __restrict__ v, const T* __restrict__ d_o,
                                      const float* __restrict__ lse,
                                      const float* __restrict__ delta, T* __restrict__ dq,
                                      const T* __restrict__ rpb, float* __restrict__ bias_part,
                                      const NAParams& p) {
  constexpr int NT = 128, OWN = 64 * WG;
  static_assert(T0 * T1 * T2 == OWN && (RANK > 1 || T0 == OWN) && (RANK > 2 || T2 == 1),
                "the query tile is 64 * WG queries over the rank's axes");
  static_assert(STAGES >= 2, "two stages at least");
  static_assert(WG == 2 || (WG == 1 && !BIAS), "a bias takes two compute warpgroups");
  typedef BwdSmem<D, BN, STAGES, false, false, OWN> Smem;
  // Registers (loader, compute): two warpgroups as the dK/dV pass; one: two CTAs an SM, so
  // loader + compute within 2 x 128.
  constexpr int kLoaderRegs = WG == 1 ? 40 : BwdRegs::loader;
  constexpr int kComputeRegs = WG == 1 ? 216 : BwdRegs::compute;
  static_assert(WG != 1 || kLoaderRegs + kComputeRegs <= 2 * 128, "over the CTA's registers");
  extern __shared__ unsigned char smem_raw[];
  Smem sm;
  sm.init(smem_raw);

  // The geometry lives in shared memory: its fields are read where used (the tile loop
  // needs a few, the epilogue the rest), not held in registers over the whole walk.
  __shared__ BwdGeom<RANK, T0, T1, T2, false> G;
  __shared__ int live;
  const int h = blockIdx.y, b = blockIdx.z, hd = (int)p.head_dim;
  const int tid = threadIdx.x, lane = tid % 32, quad = lane % 4;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;

  const int hk = h / (int)p.heads_per_kv;  // the kv head this query head reads (GQA)
  const T* qb = q + b * p.q[0] + h * p.q[4];
  const T* kb = k + b * p.k[0] + hk * p.k[4];
  const T* vb = v + b * p.v[0] + hk * p.v[4];
  const T* dob = d_o + b * p.d_o[0] + h * p.d_o[4];

  if (!begin_cta<STAGES, NT, 128 * WG>(G, live, sm.full, sm.empty, p)) return;
  const int num_tiles = (G.total + BN - 1) / BN;

  if (wg < 0) {  // the loader: Q, dO with tile 0, then each key tile once its slot is free
    regs_dec<kLoaderRegs>();
    load_rows<T, D, OWN, NT>(sm.own0, qb, p.q, sm.own1, dob, p.d_o, G, p, -1, hd, tid);
    for (int j = 0; j < num_tiles; ++j) {
      if (j >= STAGES) mbar_wait(sm.empty + 8 * (j % STAGES), (j / STAGES + 1) & 1);
      load_rows<T, D, BN, NT>(sm.tile0(j), kb, p.k, sm.tile1(j), vb, p.v, G, p, j * BN, hd,
                              tid);
      cp_async_arrive(sm.full + 8 * (j % STAGES));
    }
    cp_async_wait_all();
    return;
  }

  regs_inc<kComputeRegs>();
  const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
  int wl[2][3], wn[2][3];
  G.row_reach(p, row0, wl[0], wn[0]);
  G.row_reach(p, row0 + 8, wl[1], wn[1]);
  float ll[2], dd[2];  // the rows' lse (log2 units) and delta; rows past the group: 0
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int c[3];
    bool valid;
    G.own_row(row0 + 8 * r, c, valid);
    ll[r] = valid ? lse[b * p.lse[0] + h * p.lse[4] + G.offset(p, p.lse, c[0], c[1], c[2])] *
                        1.4426950408889634f
                  : 0.f;
    dd[r] = valid ? delta[b * p.delta[0] + h * p.delta[4] + G.offset(p, p.delta, c[0], c[1], c[2])]
                  : 0.f;
  }
  const float sl = p.scale * 1.4426950408889634f;
  const unsigned q_wg = sm.own0 + wg * 64 * 128, do_wg = sm.own1 + wg * 64 * 128;

  // BIAS: bias_row[r] is query row r's entry of the bias box for the region's origin, the
  // gradient box (gbox) follows the table, then kidx (each region key's place, rank 2, 3),
  // then per compute warp a float32 scratch tile of 16 x BN dS (rows SCR_ROW apart: the
  // accumulator's 8-byte stores take two wavefronts, the lanes' diagonal reads one) and its
  // rows' gradient-box terms.
  constexpr int SCR_ROW = BN + 8;
  constexpr unsigned SCR_WARP = 16 * SCR_ROW * 4 + 64;  // the tile, then its 16 row terms
  const unsigned btab = sm.empty + 8 * STAGES;
  BiasBox bb;
  unsigned bias_row[2] = {btab, btab}, gbox = btab, kidx = btab, scratch = btab;
  if constexpr (BIAS) {
    bb.init(G, p);
    row_terms(bb, G, p, row0, btab, bias_row);
    gbox = btab + 4 * bb.vol;
    kidx = gbox + 4 * bb.vol;
    scratch = (kidx + 4 * (RANK > 1 ? G.total : 0) + 15u) & ~15u;
    bb.template stage<RANK>(reinterpret_cast<float*>(smem_raw + (btab - smem_u32(smem_raw))),
                            rpb, h, p, tid - 128, 256);
    float* const gb = reinterpret_cast<float*>(smem_raw + (gbox - smem_u32(smem_raw)));
    for (int i = tid - 128; i < bb.vol; i += 256) gb[i] = 0.f;
    if (RANK > 1)
      bb.stage_places(reinterpret_cast<int*>(smem_raw + (kidx - smem_u32(smem_raw))), G,
                      tid - 128, 256);
    named_sync(1, 256);
  }
  const unsigned to_grad = gbox - btab;  // a score's gradient entry: its table entry + this

  float acc_dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dq[i] = 0.f;

  for (int j = 0; j < num_tiles; ++j) {
    mbar_wait(sm.full + 8 * (j % STAGES), (j / STAGES) & 1);
    fence_proxy_async();
    const unsigned sk = sm.tile0(j), sv = sm.tile1(j);
    float acc_s[BN / 2], acc_dp[BN / 2];
    wgmma_fence();
    gemm_ss<T, D, BN, OWN>(acc_s, q_wg, sk);
    gemm_ss<T, D, BN, OWN>(acc_dp, do_wg, sv);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc_s);
    fence_regs(acc_dp);
    const int* const places = reinterpret_cast<const int*>(smem_raw + (kidx - smem_u32(smem_raw)));
    if constexpr (BIAS) {
      // dS = P (dP - delta) of score i (row r) with bias entry b (log2 units).
      auto ds = [&](int i, int r, float b) {
        return fast_exp2(fmaf(acc_s[i], sl, b) - ll[r]) * (acc_dp[i] - dd[r]);
      };
      // ... inside each query's window, else exactly 0.
      auto visit = [&](int i, int r, bool in, int f) {
        const unsigned at = bias_row[r] + 4 * (RANK == 1 ? f : (in ? places[f] : 0));
        const float b = in ? lds_f32(at) : negative_infinity<float>();
        acc_dp[i] = in ? ds(i, r, b) : 0.f;
      };
      if (G.needs_mask(j * BN, BN)) {
        walk_scores<BN, RANK>(j * BN, quad, G.rk, G.inner, wl, wn, visit);
      } else if constexpr (RANK == 1) {
        // Every score in reach: row g + 8's entry at a column is row g's eight columns
        // before (its row term is 8 less), so the lane loads row g's entries and reuses
        // them, and row g + 8's own for the tile's first 8 columns only. (Row g + 8 past the
        // group: any finite entry serves, its dS is 0.)
        const unsigned a0 = bias_row[0] + 4 * (j * BN + 2 * quad);
        const unsigned a1 = bias_row[1] + 4 * (j * BN + 2 * quad);
        float ent[BN / 8 + 1][2];
        ent[0][0] = lds_f32(a1);
        ent[0][1] = lds_f32(a1 + 4);
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          ent[i + 1][0] = lds_f32(a0 + 32 * i);
          ent[i + 1][1] = lds_f32(a0 + 32 * i + 4);
        }
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
          const int r = (i / 2) % 2;
          acc_dp[i] = ds(i, r, ent[i / 4 + 1 - r][i % 2]);
        }
      } else {
        walk_flat<BN>(j * BN, quad, visit);
      }
    } else {
      if (G.needs_mask(j * BN, BN))
        mask_scores<BN, RANK>(acc_s, j * BN, quad, G.rk, G.inner, wl, wn);
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const int r = (i / 2) % 2;
        const float pe = fast_exp2(fmaf(acc_s[i], sl, -ll[r]));
        acc_dp[i] = pe * (acc_dp[i] - dd[r]);
      }
    }
    unsigned da[BN / 16][4];
    pack_a<T, BN>(acc_dp, da);
    wgmma_fence();
    gemm_rs<T, D, BN>(acc_dq, da, sk);
    wgmma_commit();
    if constexpr (BIAS) {
      // The bias gradient, while the dQ GEMM runs: the warp's dS (16 rows x BN, float32) to
      // its scratch tile, with its rows' box terms, then into the box in an order where a
      // warp's adds never share a word (the shared-memory float add is a compare-and-swap
      // loop on sm_90: score by score, in the accumulator's own order, 4 lanes would contend
      // for each word). Rows past the group and scores outside the windows hold 0 and add
      // nothing.
      const unsigned scr = scratch + (tid / 32 - 4) * SCR_WARP, terms = scr + 16 * SCR_ROW * 4;
      __syncwarp();  // the warp's walk of the last tile has read the scratch tile
      const int lo = j * BN;
      if constexpr (RANK == 1) {
        // Row g + 8's score at column c lies on row g's diagonal at column c - 8, so the
        // lane first adds those pairs: an 8-row tile, row g, column 8 J + 2 quad + e holding
        // row g's score at column 8 (J - 1) + 2 quad + e plus row g + 8's at 8 J + 2 quad + e
        // (diagonal d = column - 8 - g). Lane l then sums diagonals d + 8 = l - 7, l + 25,
        // ... over the 8 rows in registers and adds each once: along one the entry (row term
        // + key place) is the same for every row inside the group (the row term falls by one
        // per row, the key place rises by one per column), row 0's term plus lo + d.
#pragma unroll
        for (int J = 0; J <= BN / 8; ++J) {
          const float u0 =
              (J > 0 ? acc_dp[4 * (J - 1)] : 0.f) + (J < BN / 8 ? acc_dp[4 * J + 2] : 0.f);
          const float u1 =
              (J > 0 ? acc_dp[4 * (J - 1) + 1] : 0.f) + (J < BN / 8 ? acc_dp[4 * J + 3] : 0.f);
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                       :: "r"(scr + ((lane / 4) * SCR_ROW + 8 * J + 2 * quad) * 4), "f"(u0),
                          "f"(u1) : "memory");
        }
        const unsigned row0_term = __shfl_sync(0xffffffffu, bias_row[0] + to_grad, 0);
        __syncwarp();
#pragma unroll 1
        for (int d8 = lane - 7; d8 < BN + 8; d8 += 32) {
          float sum = 0.f;
#pragma unroll
          for (int g = 0; g < 8; ++g) {
            const int c = d8 + g;
            if ((unsigned)c < (unsigned)(BN + 8)) sum += lds_f32(scr + (g * SCR_ROW + c) * 4);
          }
          if (sum != 0.f) red_add_f32(row0_term + 4 * (lo + d8 - 8), sum);
        }
      } else {
        if constexpr (RANK == 2 && T1 == 16) {
          // The warp's rows are 16 queries along axis 1: row g + 8's term is row g's minus 8,
          // so its score at column f has row g's gradient entry at column f - 8 wherever
          // their places differ by 8 (both in one region row, or rows whose places run on).
          // The lane holds both: it moves the first onto the second, and the column walk
          // below skips the zeros left (half its shared-memory adds in a region's interior).
          int pl[BN / 8][2];
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int f = lo + 8 * i + 2 * quad + e;
              pl[i][e] = f < G.total ? places[f] : -(1 << 20);
            }
#pragma unroll
          for (int i = 1; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (pl[i][e] - pl[i - 1][e] == 8) {
                acc_dp[4 * (i - 1) + e] += acc_dp[4 * i + 2 + e];
                acc_dp[4 * i + 2 + e] = 0.f;
              }
        }
        // The warp's 16 x BN dS to its scratch tile with the rows' box terms; lane l then
        // adds columns l, l + 32, ... row by row: one row's keys have distinct offsets, so
        // the lanes' words differ. (Diagonal runs as in 1-D break at every key row of the
        // region here and measured slower: NOTES-hopper-bwd.md, bias section.)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n"
                         :: "r"(scr + ((lane / 4 + 8 * r) * SCR_ROW + 8 * i + 2 * quad) * 4),
                            "f"(acc_dp[4 * i + 2 * r]), "f"(acc_dp[4 * i + 2 * r + 1]) : "memory");
        if (quad == 0)
          asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n"
                       :: "r"(terms + 8 * (lane / 4)), "r"(bias_row[0] + to_grad),
                          "r"(bias_row[1] + to_grad) : "memory");
        __syncwarp();
        int place[BN / 32];
#pragma unroll
        for (int m = 0; m < BN / 32; ++m) {
          const int f = lo + lane + 32 * m;
          place[m] = f < G.total ? places[f] : 0;
        }
#pragma unroll 4
        for (int rr = 0; rr < 16; ++rr) {
          // row rr's term: lane 4 (rr % 8) held it as its row rr / 8
          const unsigned row = lds_u32(terms + 8 * (rr % 8) + 4 * (rr / 8));
#pragma unroll
          for (int m = 0; m < BN / 32; ++m) {
            const float x = lds_f32(scr + (rr * SCR_ROW + lane + 32 * m) * 4);
            if (x != 0.f) red_add_f32(row + 4 * place[m], x);
          }
        }
      }
    }
    wgmma_wait<0>();
    fence_regs(acc_dq);
    mbar_arrive(sm.empty + 8 * (j % STAGES));
  }

  if constexpr (BIAS) {  // the CTA's gradient box, once every compute thread has added to it
    named_sync(1, 256);
    float* dst = bias_part + (((i64)b * p.heads + h) * gridDim.x + blockIdx.x) * bb.vol;
    for (int i = tid - 128; i < bb.vol; i += 256) dst[i] = lds_f32(gbox + 4 * i);
  }

  // dQ through this warpgroup's own Q rows in shared memory (epilogue.cuh; its GEMMs are
  // done with them).
  const float sq[2] = {p.scale, p.scale};
  store_tile_rows<T, D>(acc_dq, sq, q_wg, OWN * 128, 8 + wg, hd, [&](int r) {
    return G.row_at(p, dq + b * p.dq[0] + h * p.dq[4], p.dq, wg * 64 + r);
  });
}

}  // namespace hopper

template <typename T, int D>
__global__ void __launch_bounds__(256)
na_bwd_hopper_delta(const T* __restrict__ d_o, const T* __restrict__ o,
                    float* __restrict__ delta, float* __restrict__ dq_ws, const NAParams p) {
  hopper::delta_rows<T, D>(d_o, o, delta, dq_ws, p);
}

template <typename T, int D>
__global__ void __launch_bounds__(256)
na_bwd_hopper_dq(const float* __restrict__ dq_ws, T* __restrict__ dq, const NAParams p) {
  hopper::dq_rows<T, D>(dq_ws, dq, p);
}

// The dK/dV pass with dQ added in it and a bias: dS to the workspace ds_ws (DsWs) of the
// query heads of kv heads [hk_base, hk_base + gridDim.y).
template <typename T, int D, int BQ, int STAGES, int RANK, int T0, int T1, int T2>
__global__ void __launch_bounds__(384, 1)
na_bwd_hopper_kv_ds(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const T* __restrict__ d_o, const float* __restrict__ lse,
                    const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                    float* __restrict__ dq_ws, const T* __restrict__ rpb, T* __restrict__ ds_ws,
                    const int hk_base, const NAParams p) {
  hopper::bwd_kv<T, D, BQ, STAGES, RANK, T0, T1, T2, true, true, false, 2>(
      q, k, v, d_o, lse, delta, dk, dv, dq_ws, rpb, p, nullptr, nullptr, ds_ws, hk_base,
      (int)(gridDim.y * p.heads_per_kv));
}

// ---- The bias gradient from the dS workspace (hopper::DsWs) ----------------------------
// Query x's slot t (per axis t_a < its window's length) is bias entry t + s(x) per axis,
// s(x) = window start - x + kernel - 1 (in-group): a table offset sb(x) plus the slot's.
// na_bwd_ds_rpb: CTA (chunk, slot range) of batch blockIdx.z, head h_base + blockIdx.y (the
// workspace's head blockIdx.y of gridDim.y) sums the rows of tokens [chunk DS_CHUNK,
// +DS_CHUNK) over slots [range DS_SLOTS, +DS_SLOTS) per table entry into part [B, H, chunks
// x ranges, entries] (every entry written), which mma_backward.cu's na_bwd_rpb_sum adds up.
// Queries with the interior's offset and a full window add in registers (each thread its
// slots), the others one at a time into the CTA's table in shared memory, a barrier apart;
// then the registers join the table: a fixed order, so the same workspace gives the same bits
// every run. The rows' loads go DS_ROWS at a time, ahead of their adds.
constexpr int DS_CHUNK = 256, DS_THREADS = 256, DS_PER_THREAD = 4, DS_ROWS = 8;
constexpr int DS_SLOTS = DS_THREADS * DS_PER_THREAD;

template <typename T>
__global__ void __launch_bounds__(DS_THREADS)
na_bwd_ds_rpb(const T* __restrict__ ws, float* __restrict__ part, const int entries,
              const int h_base, const NAParams p) {
  extern __shared__ float tab[];  // entries floats, then a record per query of the chunk
  int4* rec = reinterpret_cast<int4*>(tab + ((entries + 3) & ~3));
  const int kvol = (int)p.num_neighbors;
  const int ranges = (kvol + DS_SLOTS - 1) / DS_SLOTS;
  const int chunk = blockIdx.x / ranges, range = blockIdx.x - chunk * ranges;
  const int h = h_base + blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
  const i64 tokens = p.extent[0] * p.extent[1] * p.extent[2];
  int kern[3], ts[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) kern[a] = (int)p.kernel[a];
  ts[2] = 1;
  ts[1] = 2 * kern[2] - 1;
  ts[0] = ts[1] * (2 * kern[1] - 1);
  // The interior's offset: that of the middle of group 0 per axis.
  int star = 0;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const Axis ax = axis_of(p, a);
    const int glen = ax.group_len(0), mid = glen / 2;
    int s0, e0;
    ax.window(mid, glen, s0, e0);
    star += (s0 - mid + kern[a] - 1) * ts[a];
  }
  for (int i = tid; i < entries; i += DS_THREADS) tab[i] = 0.f;
  const i64 first = (i64)chunk * DS_CHUNK;
  const int n = (int)min((i64)DS_CHUNK, tokens - first);
  if (tid < n) {
    i64 x = first + tid;
    int c[3];
    c[2] = (int)(x % p.extent[2]);
    x /= p.extent[2];
    c[1] = (int)(x % p.extent[1]);
    c[0] = (int)(x / p.extent[1]);
    int sb, len[3];
    hopper::DsWs::query_entry(p, c, ts, sb, len);
    const bool full = len[0] == kern[0] && len[1] == kern[1] && len[2] == kern[2];
    rec[tid] = make_int4(full && sb == star ? -1 : sb, len[0], len[1], len[2]);
  }
  // This thread's slots t = range DS_SLOTS + tid + DS_THREADS u: per axis and as table offsets.
  int sl[DS_PER_THREAD][3], so[DS_PER_THREAD], st[DS_PER_THREAD];
  float acc[DS_PER_THREAD];
#pragma unroll
  for (int u = 0; u < DS_PER_THREAD; ++u) {
    const int t = range * DS_SLOTS + tid + DS_THREADS * u;
    st[u] = t < kvol ? t : -1;
    const int tt = t < kvol ? t : 0;
    sl[u][2] = tt % kern[2];
    sl[u][1] = (tt / kern[2]) % kern[1];
    sl[u][0] = tt / (kern[1] * kern[2]);
    so[u] = sl[u][0] * ts[0] + sl[u][1] * ts[1] + sl[u][2];
    acc[u] = 0.f;
  }
  __syncthreads();
  const T* row = ws + ((i64)b * gridDim.y + blockIdx.y) * tokens * kvol + first * kvol;
  // DS_ROWS rows at a time: their loads first (in flight together), then the adds in order.
  for (int q0 = 0; q0 < n; q0 += DS_ROWS, row += DS_ROWS * kvol) {
    float x[DS_ROWS][DS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < DS_ROWS; ++i)
#pragma unroll
      for (int u = 0; u < DS_PER_THREAD; ++u)
        x[i][u] = q0 + i < n && st[u] >= 0 ? to_float(row[i * kvol + st[u]]) : 0.f;
#pragma unroll
    for (int i = 0; i < DS_ROWS; ++i) {
      if (q0 + i >= n) break;
      const int4 r = rec[q0 + i];
      if (r.x < 0) {
#pragma unroll
        for (int u = 0; u < DS_PER_THREAD; ++u) acc[u] += x[i][u];
      } else {
#pragma unroll
        for (int u = 0; u < DS_PER_THREAD; ++u)
          if (st[u] >= 0 && sl[u][0] < r.y && sl[u][1] < r.z && sl[u][2] < r.w)
            tab[r.x + so[u]] += x[i][u];
        __syncthreads();
      }
    }
  }
#pragma unroll
  for (int u = 0; u < DS_PER_THREAD; ++u)
    if (st[u] >= 0) tab[star + so[u]] += acc[u];
  __syncthreads();
  float* dst = part + (((i64)b * p.heads + h) * gridDim.x + blockIdx.x) * entries;
  for (int i = tid; i < entries; i += DS_THREADS) dst[i] = tab[i];
}

template <typename T, int D, int BQ, int STAGES, int RANK, int T0, int T1, int T2, bool ATOMIC,
          bool BIAS, int WG = 2>
__global__ void __launch_bounds__(128 * (WG + 1), WG == 1 ? 2 : 1)
na_bwd_hopper_kv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ d_o, const float* __restrict__ lse,
                 const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                 float* __restrict__ dq_ws, const T* __restrict__ rpb, const NAParams p) {
  hopper::bwd_kv<T, D, BQ, STAGES, RANK, T0, T1, T2, ATOMIC, BIAS, false, WG>(
      q, k, v, d_o, lse, delta, dk, dv, dq_ws, rpb, p);
}

// The same dK/dV pass with each query tile's Q and dO staged by TMA (rank 1): tq, tdo map q
// and d_o (tma.cuh).
template <typename T, int D, int BQ, int STAGES, int RANK, int T0, int T1, int T2, bool ATOMIC,
          bool BIAS>
__global__ void __launch_bounds__(384, 1)
na_bwd_hopper_kv_tma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const T* __restrict__ d_o, const float* __restrict__ lse,
                     const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                     float* __restrict__ dq_ws, const T* __restrict__ rpb, const NAParams p,
                     const __grid_constant__ hopper::TmaMap tq,
                     const __grid_constant__ hopper::TmaMap tdo) {
  hopper::bwd_kv<T, D, BQ, STAGES, RANK, T0, T1, T2, ATOMIC, BIAS, true>(
      q, k, v, d_o, lse, delta, dk, dv, dq_ws, rpb, p, &tq, &tdo);
}

template <typename T, int D, int BN, int STAGES, int RANK, int T0, int T1, int T2, bool BIAS,
          int WG = 2>
__global__ void __launch_bounds__(128 * (WG + 1), WG == 1 ? 2 : 1)
na_bwd_hopper_q(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ d_o, const float* __restrict__ lse,
                const float* __restrict__ delta, T* __restrict__ dq, const T* __restrict__ rpb,
                float* __restrict__ bias_part, const NAParams p) {
  hopper::bwd_q<T, D, BN, STAGES, RANK, T0, T1, T2, BIAS, WG>(q, k, v, d_o, lse, delta, dq,
                                                              rpb, bias_part, p);
}

}  // namespace natten
