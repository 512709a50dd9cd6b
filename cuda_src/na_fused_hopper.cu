// Fused neighborhood-attention forward for Hopper (sm_90a), 1-D: out = softmax(scale q k^T) v over each query's window and lse (natural log), flash-style on wgmma.
// One CTA = BM = 64 * WG consecutive in-group queries of one dilation group, head and batch; warpgroup w owns queries 64w..64w+63 (one m64 wgmma row block), all warpgroups walk the CTA's key range [start(first query), end(last query)) in BN-key tiles.
// Reads q, k, v (last dim contiguous, rows 16-byte aligned) through a STAGES-deep cp.async pipeline into 128-byte-swizzled shared memory; wgmma reads Q, K (K-major) and V (N-major) from there, P from registers; writes out and lse (float32).
#include "natten/common.cuh"
#include "natten/mma.cuh"
#include "natten/hopper/wgmma.cuh"

namespace natten {
namespace hopper {

// Copies rows [row0, row0 + ROWS) of a row-major [*, head_dim] matrix (row stride `stride`
// elements) into a swizzled tile of ROWS x D (layout in wgmma.cuh); rows at or past `rows`
// and columns at or past head_dim are zero-filled, so padded keys and dims add nothing.
// Thread t always copies 16-byte chunk t % (D / 8) of rows t / (D / 8) + i * STEP: STEP is a
// multiple of 8, so the swizzle term is the same for all its rows and the addresses just step.
template <typename T, int D, int ROWS, int NT, int UNROLL>
__device__ __forceinline__ void load_tile(unsigned dst, const T* src, i64 stride, int row0,
                                          int rows, int head_dim, int tid) {
  constexpr int CPR = D / 8, STEP = NT / CPR;
  static_assert(NT % CPR == 0 && STEP % 8 == 0, "rows per pass must be a multiple of 8");
  const int ch = tid % CPR;
  int r = tid / CPR;
  unsigned at = dst + (ch / 8) * (ROWS * 128) + swz128(r, ch % 8);
  const T* from = src + (i64)(row0 + r) * stride + ch * 8;
  const bool col_ok = ch * 8 < head_dim;
#pragma unroll UNROLL
  for (; r < ROWS; r += STEP) {
    const bool ok = col_ok && row0 + r < rows;
    cp_async16(at, ok ? from : src, ok);
    at += STEP * 128;
    from += STEP * stride;
  }
}

// One warpgroup's share of a query tile: the S and O accumulators, the running row maxima
// (raw scores) and partial row sums of its thread's two rows, and the steps of one key tile.
template <typename T, int D, int BN>
struct RowBlock {
  typedef typename Kind<T>::type kind;
  float acc_o[D / 2], acc_s[BN / 2];
  float m[2], l[2];
  unsigned pa[BN / 16][4];  // P as the A operand of O += P V

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;
    m[0] = m[1] = negative_infinity<float>();
    l[0] = l[1] = 0.f;
  }

  // S = Q K^T; q_wg: this warpgroup's 64 rows of Q, k_tile: the BN x D key tile.
  __device__ __forceinline__ void issue_qk(unsigned q_wg, unsigned k_tile, int bm) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned koff = (kk % 4) * 32;
      SS<BN>::run(acc_s, desc128(q_wg + (kk / 4) * (bm * 128) + koff, 16, 1024),
                  desc128(k_tile + (kk / 4) * (BN * 128) + koff, 16, 1024), kk > 0, kind());
    }
  }

  // O += P V; v_tile: the BN x D value tile, read N-major (16 keys = 2048 bytes).
  __device__ __forceinline__ void issue_pv(unsigned v_tile) {
#pragma unroll
    for (int s = 0; s < BN / 16; ++s)
      RS<D>::run(acc_o, pa[s], desc128(v_tile + s * 2048, BN * 128, 1024), kind());
  }

  // Scores of keys outside a row's in-group window [ws, we) become -inf.
  __device__ __forceinline__ void mask(int lo, int quad, const int (&ws)[2], const int (&we)[2]) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int col = lo + (i / 4) * 8 + 2 * quad + (i % 2), r = (i / 2) % 2;
      if (col < ws[r] || col >= we[r]) acc_s[i] = negative_infinity<float>();
    }
  }

  // Online softmax of the tile in exp2 (sl = scale * log2 e): acc_s becomes P; returns the
  // factor by which each row's O must shrink. A row's BN values sit on the 4 lanes of a quad.
  __device__ __forceinline__ void softmax(float sl, float (&alpha)[2]) {
    const float neg_inf = negative_infinity<float>();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        mx = fmaxf(mx, fmaxf(acc_s[4 * i + 2 * r], acc_s[4 * i + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == neg_inf ? 0.f : mx * sl;
      alpha[r] = fast_exp2(m[r] * sl - base);
      m[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(fmaf(acc_s[4 * i + 2 * r + e], sl, -base));
          acc_s[4 * i + 2 * r + e] = pe;
          sum += pe;
        }
      }
      l[r] = l[r] * alpha[r] + sum;
    }
  }

  __device__ __forceinline__ void rescale(const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
      for (int x = 0; x < 4; ++x) acc_o[4 * i + x] *= alpha[x / 2];
  }

  // Accumulator chunks 2s, 2s+1 packed in order are A step s (layouts in wgmma.cuh).
  __device__ __forceinline__ void pack_p() {
    typedef typename tc::MmaKind<T>::tag pack_tag;
#pragma unroll
    for (int s = 0; s < BN / 16; ++s)
#pragma unroll
      for (int x = 0; x < 4; ++x)
        pa[s][x] = tc::pack2(acc_s[8 * s + 2 * x], acc_s[8 * s + 2 * x + 1], pack_tag());
  }
};

// PIPE: each warpgroup issues S_j = Q K_j and O += P_{j-1} V_{j-1} together and runs the
// softmax of tile j while the second GEMM is in flight; else the two GEMMs and the softmax
// of a tile run one after the other.
// WS (warp specialization): warpgroup 0 only loads (cp.async, 128 threads, few registers),
// signalling each stage's arrival on an mbarrier (full) and waiting for the consumers to free
// it (empty); warpgroups 1..WG compute and never wait for each other. Without WS every
// warpgroup loads a share of each tile and computes, with a CTA barrier per tile (PIPE then
// needs STAGES >= 3, since two tiles are read at once).
// PP (ping-pong, with WS and PIPE): the compute warpgroups take turns to issue their GEMMs
// (named barriers 1..WG), so that one's softmax runs while another's GEMMs hold the tensor
// cores, instead of all of them contending at once.
template <typename T, int D, int WG, int BN, int STAGES, bool PIPE, bool WS, bool PP>
__device__ __forceinline__ void fwd_1d(const T* __restrict__ q, const T* __restrict__ k,
                                       const T* __restrict__ v, T* __restrict__ o,
                                       float* __restrict__ lse, const NAParams& p) {
  constexpr int BM = 64 * WG, NT = WS ? 128 : 128 * WG;  // NT: threads that load
  // Without WS, tiles loaded ahead: a slot is free once every warpgroup waited on its GEMMs.
  constexpr int AHEAD = WS ? 1 : PIPE ? STAGES - 2 : STAGES - 1;
  static_assert(AHEAD >= 1 && STAGES >= 2, "PIPE without WS needs STAGES >= 3");
  static_assert(!PP || (WS && PIPE && WG >= 2), "PP needs WS, PIPE and two warpgroups");
  constexpr unsigned Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  constexpr int LOAD_UNROLL = WS ? 2 : 16;  // the loader runs on few registers

  extern __shared__ unsigned char smem_raw[];
  const unsigned sq = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const unsigned sk = sq + Q_BYTES, sv = sk + STAGES * KV_BYTES;
  const unsigned full = sv + STAGES * KV_BYTES, empty = full + 8 * STAGES;  // WS barriers

  const Axis ax = axis_of(p, 0);
  const int tiles = (ax.group_len(0) + BM - 1) / BM;  // group 0 is the longest
  const int g = blockIdx.x / tiles, q0 = (blockIdx.x % tiles) * BM;
  const int glen = ax.group_len(g);
  if (q0 >= glen) return;
  const int h = blockIdx.y, b = blockIdx.z, hd = (int)p.head_dim;
  const int tid = threadIdx.x, lane = tid % 32, quad = lane % 4;
  // Compute warpgroup (-1: the loader), read through a shuffle so that the compiler sees it
  // is warp-uniform (setmaxnreg only applies to branches it can prove are).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0) - (WS ? 1 : 0);

  // Key range of the CTA, and the part of it inside every query's window (no mask there).
  int first_s, first_e, last_s, last_e;
  ax.window(q0, glen, first_s, first_e);
  ax.window(min(q0 + BM, glen) - 1, glen, last_s, last_e);
  const int kv_lo = first_s, num_tiles = (last_e - first_s + BN - 1) / BN;

  const int d = ax.dilation;
  const T* qb = q + b * p.q[0] + g * p.q[1] + h * p.q[4];
  const T* kb = k + b * p.k[0] + g * p.k[1] + h * p.k[4];
  const T* vb = v + b * p.v[0] + g * p.v[1] + h * p.v[4];
  const i64 q_row = d * p.q[1], k_row = d * p.k[1], v_row = d * p.v[1];
  auto load_kv = [&](int j) {  // key/value tile j into its slot
    const unsigned slot = (j % STAGES) * KV_BYTES;
    load_tile<T, D, BN, NT, LOAD_UNROLL>(sk + slot, kb, k_row, kv_lo + j * BN, glen, hd, tid);
    load_tile<T, D, BN, NT, LOAD_UNROLL>(sv + slot, vb, v_row, kv_lo + j * BN, glen, hd, tid);
  };

  // Tile j resident for this warpgroup. Without WS the barrier also orders every warpgroup's
  // last GEMM on the slot that the next load (tile j + AHEAD) overwrites.
  auto acquire = [&](int j) {
    if (WS) {
      mbar_wait(full + 8 * (j % STAGES), (j / STAGES) & 1);
      fence_proxy_async();
    } else {
      cp_async_wait<AHEAD - 1>();
      fence_proxy_async();
      __syncthreads();
      if (j + AHEAD < num_tiles) load_kv(j + AHEAD);
      cp_async_commit();
    }
  };
  auto release = [&](int j) {  // this warpgroup's GEMMs on tile j are complete
    if (WS) mbar_arrive(empty + 8 * (j % STAGES));
  };
  auto needs_mask = [&](int j) {
    const int lo = kv_lo + j * BN;
    return lo < last_s || lo + BN > first_e;
  };

  auto consume = [&]() {
    // Turns of the ping-pong: every warpgroup takes num_tiles + 1 (S_0; S_j with P_{j-1} V_{j-1};
    // the last P V); the last warpgroup opens the first turn and skips its final hand-over,
    // so each barrier sees as many arrivals as waits.
    auto turn_wait = [&]() {
      if (PP) named_sync(1 + wg, 256);
    };
    auto turn_pass = [&](bool last) {
      if (PP && !(last && wg == WG - 1)) named_arrive(1 + (wg + 1) % WG, 256);
    };
    if (PP && wg == WG - 1) named_arrive(1, 256);

    // This thread's two accumulator rows and their windows (rows past the group: clamped).
    const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
    int ws[2], we[2];
    ax.window(min(q0 + row0, glen - 1), glen, ws[0], we[0]);
    ax.window(min(q0 + row0 + 8, glen - 1), glen, ws[1], we[1]);

    const float sl = p.scale * 1.4426950408889634f;  // scale * log2(e): softmax in exp2
    const unsigned q_wg = sq + wg * 64 * 128;
    RowBlock<T, D, BN> rb;
    rb.init();
    float alpha[2];

    if (!PIPE) {
      for (int j = 0; j < num_tiles; ++j) {
        acquire(j);
        const unsigned slot = (j % STAGES) * KV_BYTES;
        wgmma_fence();
        rb.issue_qk(q_wg, sk + slot, BM);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(rb.acc_s);
        if (needs_mask(j)) rb.mask(kv_lo + j * BN, quad, ws, we);
        rb.softmax(sl, alpha);
        rb.rescale(alpha);
        rb.pack_p();
        wgmma_fence();
        rb.issue_pv(sv + slot);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(rb.acc_o);
        release(j);
      }
    } else {
      acquire(0);
      turn_wait();
      wgmma_fence();
      rb.issue_qk(q_wg, sk, BM);
      wgmma_commit();
      turn_pass(false);
      wgmma_wait<0>();
      fence_regs(rb.acc_s);
      if (needs_mask(0)) rb.mask(kv_lo, quad, ws, we);
      rb.softmax(sl, alpha);  // O is still 0: nothing to rescale
      rb.pack_p();
      for (int j = 1; j < num_tiles; ++j) {
        acquire(j);
        const unsigned slot = (j % STAGES) * KV_BYTES, prev = ((j - 1) % STAGES) * KV_BYTES;
        turn_wait();
        wgmma_fence();
        rb.issue_qk(q_wg, sk + slot, BM);
        wgmma_commit();
        rb.issue_pv(sv + prev);
        wgmma_commit();
        turn_pass(false);
        wgmma_wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
        fence_regs(rb.acc_s);
        if (needs_mask(j)) rb.mask(kv_lo + j * BN, quad, ws, we);
        rb.softmax(sl, alpha);
        wgmma_wait<0>();
        fence_regs(rb.acc_o);
        release(j - 1);
        rb.rescale(alpha);
        rb.pack_p();
      }
      turn_wait();
      wgmma_fence();
      rb.issue_pv(sv + ((num_tiles - 1) % STAGES) * KV_BYTES);
      wgmma_commit();
      turn_pass(true);
      wgmma_wait<0>();
      fence_regs(rb.acc_o);
    }

    // Epilogue: normalize, store the valid rows, lse = (m * sl + log2 l) * ln 2.
    T* ob = o + b * p.o[0] + g * p.o[1] + h * p.o[4];
    const i64 o_row = d * p.o[1];
  #pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = rb.l[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int qi = q0 + row0 + 8 * r;
      if (qi < glen) {
        const float inv = 1.f / sum;
        T* at = ob + (i64)qi * o_row;
  #pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          const int col = 8 * i + 2 * quad;
          if (col < hd)
            pack_store(at + col, rb.acc_o[4 * i + 2 * r] * inv, rb.acc_o[4 * i + 2 * r + 1] * inv);
        }
        if (quad == 0)
          lse[b * p.lse[0] + (i64)(g + d * qi) * p.lse[1] + h * p.lse[4]] =
              (rb.m[r] * sl + __log2f(sum)) * 0.6931471805599453f;
      }
    }
  };

  if (WS) {
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(full + 8 * s, 128);
        mbar_init(empty + 8 * s, 128 * WG);
      }
    }
    __syncthreads();
    if (wg < 0) {  // the loader: Q with tile 0, then each tile once its slot is free
      regs_dec<WG == 2 ? 24 : 32>();
      load_tile<T, D, BM, NT, LOAD_UNROLL>(sq, qb, q_row, q0, glen, hd, tid);
      for (int j = 0; j < num_tiles; ++j) {
        if (j >= STAGES) mbar_wait(empty + 8 * (j % STAGES), (j / STAGES + 1) & 1);
        load_kv(j);
        cp_async_arrive(full + 8 * (j % STAGES));
      }
      cp_async_wait_all();
    } else {
      regs_inc<WG == 2 ? 240 : 160>();
      consume();
    }
  } else {
    load_tile<T, D, BM, NT, LOAD_UNROLL>(sq, qb, q_row, q0, glen, hd, tid);
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
      if (s < num_tiles) load_kv(s);
      cp_async_commit();
    }
    consume();
  }
}

}  // namespace hopper

template <typename T, int D, int WG, int BN, int STAGES, bool PIPE, bool WS, bool PP>
__global__ void __launch_bounds__(128 * (WG + WS), 1)
na_fwd_hopper(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              T* __restrict__ o, float* __restrict__ lse, const NAParams p) {
  hopper::fwd_1d<T, D, WG, BN, STAGES, PIPE, WS, PP>(q, k, v, o, lse, p);
}

}  // namespace natten
