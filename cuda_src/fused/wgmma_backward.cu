// Fused neighborhood-attention backward for Hopper (sm_90a), 1-D, 2-D and 3-D, on wgmma: delta = rowsum(dO * O), then dK, dV (key-parallel) and dQ (query-parallel), deterministic (no atomics).
// delta: one group of D / 8 threads per query row. dK/dV: a CTA owns 128 in-group keys (1-D consecutive, 2-D 8x16, 3-D 2x8x8) of one dilation group, compute warpgroup w owns keys 64w..64w+63 and walks the queries of the keys' inverse windows in 64-query tiles; dQ: a CTA owns 128 queries (the forward's boxes) and walks their windows' keys in BN-key tiles. Warpgroup 0 of both loads (cp.async, mbarriers).
// Reads q, k, v, dO, out (last dim contiguous, rows 16-byte aligned), lse (natural log) and delta (float32); writes delta, dq, dk, dv (every element of the valid rows, padded head-dim columns never).
#include "natten/common.cuh"
#include "natten/mma.cuh"
#include "natten/hopper/wgmma.cuh"
#include "natten/hopper/bwd_tiles.cuh"

namespace natten {
namespace hopper {

// Register budgets (loader, each of two compute warpgroups). The entry cap of 384 threads is
// 168, and setmaxnreg.inc only hands out what the CTA's warpgroups gave back, so loader + 2 x
// compute must stay within 3 x 168 = 504 (more and the compute warpgroups would wait forever).
// 40 / 232: the geometry sits in shared memory, the 1-D loader steps one pointer at a time;
// 48 / 232 would not fit, and the loaders spilled at 24-32, the D128 dK/dV compute warpgroups at
// 224 (NVRTC 13.0). The atomic dQ variant is built where this split has no spill (all but rank
// 3 at head dim 128: wgmma_backward.atomic_supported).
struct BwdRegs {
  static constexpr int loader = 40, compute = 232;
  static_assert(loader + 2 * compute <= 3 * 168, "more registers than the CTA holds");
};

// The float32 dQ workspace of the atomic variant: contiguous [B, *spatial, H, head_dim].
__device__ __forceinline__ i64 dq_ws_offset(const NAParams& p, i64 b, i64 x0, i64 x1, i64 x2,
                                            i64 h) {
  return ((((b * p.extent[0] + x0) * p.extent[1] + x1) * p.extent[2] + x2) * p.heads + h) *
         p.head_dim;
}

// delta[row] = sum over the head dim of dO * O in float32; D / 8 consecutive threads per row
// (16 bytes each), rows flat over (batch, axis 0, 1, 2, head). With dq_ws (the atomic dQ
// variant) the same threads zero the row's workspace.
template <typename T, int D>
__device__ __forceinline__ void delta_rows(const T* __restrict__ d_o, const T* __restrict__ o,
                                           float* __restrict__ delta, float* __restrict__ dq_ws,
                                           const NAParams& p) {
  constexpr int LANES = D / 8;
  const i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  i64 row = t / LANES;
  const int ch = (int)(t % LANES);
  const i64 rows = p.batch * p.extent[0] * p.extent[1] * p.extent[2] * p.heads;
  const bool live = row < rows;
  if (!live) row = 0;
  i64 c[5];
  i64 x = row;
  c[4] = x % p.heads;
  x /= p.heads;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    c[1 + a] = x % p.extent[a];
    x /= p.extent[a];
  }
  c[0] = x;
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
    if (dq_ws) {
      float4* at = reinterpret_cast<float4*>(dq_ws + dq_ws_offset(p, c[0], c[1], c[2], c[3],
                                                                  c[4]) + ch * 8);
      at[0] = at[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
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
  i64 x = t / LANES;
  const int ch = (int)(t % LANES);
  if (x >= p.batch * p.extent[0] * p.extent[1] * p.extent[2] * p.heads || ch * 8 >= p.head_dim)
    return;
  i64 c[5];
  c[4] = x % p.heads;
  x /= p.heads;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    c[1 + a] = x % p.extent[a];
    x /= p.extent[a];
  }
  c[0] = x;
  const float4* from =
      reinterpret_cast<const float4*>(dq_ws + dq_ws_offset(p, c[0], c[1], c[2], c[3], c[4]) + ch * 8);
  const float4 a = from[0], b = from[1];
  T* at = dq + offset6(p.dq, c[0], c[1], c[2], c[3], c[4], 0) + ch * 8;
  const float sc = p.scale;
  pack_store(at, a.x * sc, a.y * sc);
  pack_store(at + 2, a.z * sc, a.w * sc);
  pack_store(at + 4, b.x * sc, b.y * sc);
  pack_store(at + 6, b.z * sc, b.w * sc);
}

// Shared-memory layout and mbarriers of both passes: the owner tiles (two tensors of 128 rows),
// STAGES slots of two region tiles of ROWS rows each, then (DS: the atomic dQ variant) a dS^T
// tile of 64 x ROWS per compute warpgroup, then (dK/dV pass) STAGES pairs of float vectors of
// ROWS (lse, delta), then the mbarriers (full, empty per stage). Every tile starts on a
// 1024-byte boundary (the 128-byte swizzle's period).
template <int D, int ROWS, int STAGES, bool VALUES, bool DS = false>
struct BwdSmem {
  static constexpr unsigned OWNER = 128 * D * 2, TILE = ROWS * D * 2;
  static constexpr unsigned VEC = VALUES ? ROWS * 4 : 0;
  static constexpr unsigned DS_TILE = DS ? 64 * ROWS * 2 : 0;  // per compute warpgroup
  static constexpr unsigned BYTES =
      2 * OWNER + STAGES * (2 * TILE + 2 * VEC) + 2 * DS_TILE + 16 * STAGES + 1024;
  static_assert(OWNER % 1024 == 0 && TILE % 1024 == 0, "tiles on 1024-byte boundaries");
  static_assert(BYTES <= 227 * 1024, "sm_90 gives a CTA at most 227 KB of shared memory");
  unsigned own0, own1, reg0, ds, vecs, full, empty;
  __device__ __forceinline__ void init(unsigned char* raw) {
    own0 = (smem_u32(raw) + 1023u) & ~1023u;
    own1 = own0 + OWNER;
    reg0 = own1 + OWNER;
    ds = reg0 + STAGES * 2 * TILE;
    vecs = ds + 2 * DS_TILE;
    full = vecs + STAGES * 2 * VEC;
    empty = full + 8 * STAGES;
  }
  __device__ __forceinline__ unsigned tile0(int j) const { return reg0 + (j % STAGES) * 2 * TILE; }
  __device__ __forceinline__ unsigned tile1(int j) const { return tile0(j) + TILE; }
  __device__ __forceinline__ unsigned vec0(int j) const { return vecs + (j % STAGES) * 2 * VEC; }
  __device__ __forceinline__ unsigned vec1(int j) const { return vec0(j) + VEC; }
};

// dK, dV: keys own the CTA (128 keys, two compute warpgroups of 64), the region is the
// queries of their inverse windows, walked in BQ-query tiles: per tile S^T = K Q^T and dP^T =
// V dO^T (wgmma from shared memory), P^T = exp2(S^T scale log2 e - lse log2 e), dS^T = P^T
// (dP^T - delta), dV += P^T dO and dK += dS^T Q (P^T, dS^T from registers, dO and Q N-major).
// ATOMIC: also dQ += dS K for the tile's queries (dS^T through shared memory, both operands
// MN-major, in 64-column rounds), added to the float32 workspace dq_ws with float2 atomics:
// no dQ pass, but the sums' order varies from run to run.
template <typename T, int D, int BQ, int STAGES, int RANK, int T0, int T1, int T2, bool ATOMIC>
__device__ __forceinline__ void bwd_kv(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, const T* __restrict__ d_o,
                                       const float* __restrict__ lse,
                                       const float* __restrict__ delta, T* __restrict__ dk,
                                       T* __restrict__ dv, float* __restrict__ dq_ws,
                                       const NAParams& p) {
  constexpr int NT = 128, WG = 2;
  static_assert(T0 * T1 * T2 == 128 && (RANK > 1 || T0 == 128) && (RANK > 2 || T2 == 1),
                "the key tile is 128 keys over the rank's axes");
  static_assert(STAGES >= 2, "two stages at least");
  static_assert(!ATOMIC || BQ == 64, "the dS^T tile is one 64-column block");
  typedef BwdSmem<D, BQ, STAGES, true, ATOMIC> Smem;
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
  const int hk = blockIdx.y, b = blockIdx.z, hd = (int)p.head_dim;
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

  if (tid == 0) {
    live = G.init(p);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(sm.full + 8 * s, NT);
      mbar_init(sm.empty + 8 * s, 128 * WG);
    }
  }
  __syncthreads();
  if (!live) return;
  const int num_tiles = (G.total + BQ - 1) / BQ;

  if (wg < 0) {  // the loader: K, V with tile 0, then each query tile once its slot is free
    regs_dec<BwdRegs::loader>();
    load_rows<T, D, 128, NT>(sm.own0, kb, p.k, sm.own1, vb, p.v, G, p, -1, hd, tid);
    int j = 0;  // the step: query tile jt of head g, in walk order
    for (int g = 0; g < group; ++g)
      for (int jt = 0; jt < num_tiles; ++jt, ++j) {
        if (j >= STAGES) mbar_wait(sm.empty + 8 * (j % STAGES), (j / STAGES + 1) & 1);
        load_rows<T, D, BQ, NT>(sm.tile0(j), qb + g * p.q[4], p.q, sm.tile1(j),
                                dob + g * p.d_o[4], p.d_o, G, p, jt * BQ, hd, tid);
        load_row_values<BQ>(sm.vec0(j), lseb + g * p.lse[4], sm.vec1(j),
                            deltab + g * p.delta[4], G, p, jt * BQ, tid);
        cp_async_arrive(sm.full + 8 * (j % STAGES));
      }
    cp_async_wait_all();
    return;
  }

  regs_inc<BwdRegs::compute>();
  // This thread's two key rows and the queries that reach them (region coordinates).
  const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
  int wl[2][3], wn[2][3];
  G.row_reach(p, row0, wl[0], wn[0]);
  G.row_reach(p, row0 + 8, wl[1], wn[1]);
  const float sl = p.scale * 1.4426950408889634f;  // scale * log2(e)
  const unsigned k_wg = sm.own0 + wg * 64 * 128, v_wg = sm.own1 + wg * 64 * 128;

  float acc_dk[D / 2], acc_dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  int j = 0;
  for (int g = 0; g < group; ++g)
  for (int jt = 0; jt < num_tiles; ++jt, ++j) {
    mbar_wait(sm.full + 8 * (j % STAGES), (j / STAGES) & 1);
    fence_proxy_async();
    const unsigned sq = sm.tile0(j), sdo = sm.tile1(j);
    float acc_s[BQ / 2], acc_dp[BQ / 2];
    wgmma_fence();
    gemm_ss<T, D, BQ, 128>(acc_s, k_wg, sq);
    gemm_ss<T, D, BQ, 128>(acc_dp, v_wg, sdo);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc_s);
    fence_regs(acc_dp);
    if (G.needs_mask(jt * BQ, BQ))
      mask_scores<BQ, RANK>(acc_s, jt * BQ, quad, G.rk, G.inner, wl, wn);
    // Column 8 i + 2 quad + e is query jt * BQ + that: its lse and delta from the slot.
    const float* lse_s = reinterpret_cast<const float*>(smem_raw + (sm.vec0(j) - smem_u32(smem_raw)));
    const float* dl_s = reinterpret_cast<const float*>(smem_raw + (sm.vec1(j) - smem_u32(smem_raw)));
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
    unsigned pa[BQ / 16][4], da[BQ / 16][4];
    pack_a<T, BQ>(acc_s, pa);
    pack_a<T, BQ>(acc_dp, da);
    const unsigned ds_wg = sm.ds + wg * Smem::DS_TILE;
    wgmma_fence();
    gemm_rs<T, D, BQ>(acc_dv, pa, sdo);
    gemm_rs<T, D, BQ>(acc_dk, da, sq);
    wgmma_commit();
    if constexpr (ATOMIC) {  // dS^T as stored: key rows of this warpgroup, query columns
      const int wrow = ((tid / 32) % 4) * 16 + lane / 4;
#pragma unroll
      for (int s = 0; s < BQ / 16; ++s)
#pragma unroll
        for (int x = 0; x < 4; ++x)
          asm volatile("st.shared.b32 [%0], %1;\n"
                       :: "r"(ds_wg + swz128(wrow + 8 * (x % 2), 2 * s + x / 2) + 4 * quad),
                          "r"(da[s][x]) : "memory");
      fence_proxy_async();
      named_sync(1 + wg, 128);
      // dQ rows of the tile's queries, 64 columns at a time: rows 16 w + group + 8 h of
      // accumulator d[4 i + 2 h + e], columns 64 half + 8 i + 2 quad + e. P^T and dS^T
      // leave the registers first (the D128 accumulators need them); storing dS^T while the
      // RS GEMMs read the same registers kept NVRTC 13.0's 1-D D128 kernel within 232.
      typedef typename Kind<T>::type kind;
      wgmma_wait<0>();
      fence_regs(acc_dv);
      fence_regs(acc_dk);
      const int qrow = ((tid / 32) % 4) * 16 + lane / 4;
#pragma unroll
      for (int half = 0; half < D / 64; ++half) {
        float acc_q[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) acc_q[i] = 0.f;
#pragma unroll
        for (int s = 0; s < 4; ++s)  // 64 keys of this warpgroup, 16 per step
          SSTT64::run(acc_q, desc128(ds_wg + s * 2048, 64 * 128, 1024),
                      desc128(k_wg + half * (128 * 128) + s * 2048, 128 * 128, 1024), s > 0,
                      kind());
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(acc_q);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int f = jt * BQ + qrow + 8 * r;
          if (f >= G.total) continue;  // past the region: nothing to add
          int c[3], x[3] = {0, 0, 0};
          G.other(f, c);
#pragma unroll
          for (int a = 0; a < RANK; ++a) x[a] = G.g[a] + (int)p.dilation[a] * c[a];
          float* at = dq_ws + dq_ws_offset(p, b, x[0], x[1], x[2], h0 + g) + 64 * half + 2 * quad;
#pragma unroll
          for (int i = 0; i < 8; ++i)
            if (64 * half + 8 * i + 2 * quad < hd)
              atomicAdd(reinterpret_cast<float2*>(at + 8 * i),
                        make_float2(acc_q[4 * i + 2 * r], acc_q[4 * i + 2 * r + 1]));
        }
      }
    }
    wgmma_wait<0>();
    fence_regs(acc_dv);
    fence_regs(acc_dk);
    mbar_arrive(sm.empty + 8 * (j % STAGES));
  }

  // Epilogue: dK = scale * dS^T Q, dV as accumulated, for keys inside the group.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int c[3];
    bool valid;
    G.owner(row0 + 8 * r, c, valid);
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
}

// dQ: queries own the CTA (the forward's query boxes of 128, two compute warpgroups of 64),
// the region is their windows' keys, walked in BN-key tiles: per tile S = Q K^T and dP = dO
// V^T, P = exp2(S scale log2 e - lse log2 e), dS = P (dP - delta), dQ += dS K (K N-major).
template <typename T, int D, int BN, int STAGES, int RANK, int T0, int T1, int T2>
__device__ __forceinline__ void bwd_q(const T* __restrict__ q, const T* __restrict__ k,
                                      const T* __restrict__ v, const T* __restrict__ d_o,
                                      const float* __restrict__ lse,
                                      const float* __restrict__ delta, T* __restrict__ dq,
                                      const NAParams& p) {
  constexpr int NT = 128, WG = 2;
  static_assert(T0 * T1 * T2 == 128 && (RANK > 1 || T0 == 128) && (RANK > 2 || T2 == 1),
                "the query tile is 128 queries over the rank's axes");
  static_assert(STAGES >= 2, "two stages at least");
  typedef BwdSmem<D, BN, STAGES, false> Smem;
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

  if (tid == 0) {
    live = G.init(p);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(sm.full + 8 * s, NT);
      mbar_init(sm.empty + 8 * s, 128 * WG);
    }
  }
  __syncthreads();
  if (!live) return;
  const int num_tiles = (G.total + BN - 1) / BN;

  if (wg < 0) {  // the loader: Q, dO with tile 0, then each key tile once its slot is free
    regs_dec<BwdRegs::loader>();
    load_rows<T, D, 128, NT>(sm.own0, qb, p.q, sm.own1, dob, p.d_o, G, p, -1, hd, tid);
    for (int j = 0; j < num_tiles; ++j) {
      if (j >= STAGES) mbar_wait(sm.empty + 8 * (j % STAGES), (j / STAGES + 1) & 1);
      load_rows<T, D, BN, NT>(sm.tile0(j), kb, p.k, sm.tile1(j), vb, p.v, G, p, j * BN, hd,
                              tid);
      cp_async_arrive(sm.full + 8 * (j % STAGES));
    }
    cp_async_wait_all();
    return;
  }

  regs_inc<BwdRegs::compute>();
  const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
  int wl[2][3], wn[2][3];
  G.row_reach(p, row0, wl[0], wn[0]);
  G.row_reach(p, row0 + 8, wl[1], wn[1]);
  float ll[2], dd[2];  // the rows' lse (log2 units) and delta; rows past the group: 0
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int c[3];
    bool valid;
    G.owner(row0 + 8 * r, c, valid);
    ll[r] = valid ? lse[b * p.lse[0] + h * p.lse[4] + G.offset(p, p.lse, c[0], c[1], c[2])] *
                        1.4426950408889634f
                  : 0.f;
    dd[r] = valid ? delta[b * p.delta[0] + h * p.delta[4] + G.offset(p, p.delta, c[0], c[1], c[2])]
                  : 0.f;
  }
  const float sl = p.scale * 1.4426950408889634f;
  const unsigned q_wg = sm.own0 + wg * 64 * 128, do_wg = sm.own1 + wg * 64 * 128;

  float acc_dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_dq[i] = 0.f;

  for (int j = 0; j < num_tiles; ++j) {
    mbar_wait(sm.full + 8 * (j % STAGES), (j / STAGES) & 1);
    fence_proxy_async();
    const unsigned sk = sm.tile0(j), sv = sm.tile1(j);
    float acc_s[BN / 2], acc_dp[BN / 2];
    wgmma_fence();
    gemm_ss<T, D, BN, 128>(acc_s, q_wg, sk);
    gemm_ss<T, D, BN, 128>(acc_dp, do_wg, sv);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc_s);
    fence_regs(acc_dp);
    if (G.needs_mask(j * BN, BN))
      mask_scores<BN, RANK>(acc_s, j * BN, quad, G.rk, G.inner, wl, wn);
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int r = (i / 2) % 2;
      const float pe = fast_exp2(fmaf(acc_s[i], sl, -ll[r]));
      acc_dp[i] = pe * (acc_dp[i] - dd[r]);
    }
    unsigned da[BN / 16][4];
    pack_a<T, BN>(acc_dp, da);
    wgmma_fence();
    gemm_rs<T, D, BN>(acc_dq, da, sk);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc_dq);
    mbar_arrive(sm.empty + 8 * (j % STAGES));
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int c[3];
    bool valid;
    G.owner(row0 + 8 * r, c, valid);
    if (!valid) continue;
    T* at = dq + b * p.dq[0] + h * p.dq[4] + G.offset(p, p.dq, c[0], c[1], c[2]);
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int col = 8 * i + 2 * quad;
      if (col < hd)
        pack_store(at + col, acc_dq[4 * i + 2 * r] * p.scale, acc_dq[4 * i + 2 * r + 1] * p.scale);
    }
  }
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

template <typename T, int D, int BQ, int STAGES, int RANK, int T0, int T1, int T2, bool ATOMIC>
__global__ void __launch_bounds__(384, 1)
na_bwd_hopper_kv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 const T* __restrict__ d_o, const float* __restrict__ lse,
                 const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,
                 float* __restrict__ dq_ws, const NAParams p) {
  hopper::bwd_kv<T, D, BQ, STAGES, RANK, T0, T1, T2, ATOMIC>(q, k, v, d_o, lse, delta, dk, dv,
                                                             dq_ws, p);
}

template <typename T, int D, int BN, int STAGES, int RANK, int T0, int T1, int T2>
__global__ void __launch_bounds__(384, 1)
na_bwd_hopper_q(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ d_o, const float* __restrict__ lse,
                const float* __restrict__ delta, T* __restrict__ dq, const NAParams p) {
  hopper::bwd_q<T, D, BN, STAGES, RANK, T0, T1, T2>(q, k, v, d_o, lse, delta, dq, p);
}

}  // namespace natten
