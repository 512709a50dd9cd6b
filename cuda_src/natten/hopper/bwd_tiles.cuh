// Loaders and GEMM steps of the Hopper (sm_90a) fused NA backward: cp.async tile copies into
// 128-byte-swizzled shared memory over the geometry of bwd_geom.cuh, and the wgmma sequences
// of one tile (layouts in wgmma.cuh). No kernels.
#pragma once

#include "../common.cuh"
#include "../mma.cuh"
#include "wgmma.cuh"
#include "bwd_geom.cuh"

namespace natten {
namespace hopper {

// Rank 1: rows first + r, first + r + STEP, ... (below ROWS) of one tensor whose in-group rows
// are `step` elements apart, to dst (this thread's first chunk), one pointer stepping; rows at
// or past `end` and columns past the head dim are zero-filled. One tensor at a time keeps the
// loader within its 40 registers.
template <typename T, int ROWS, int NT, int CPR>
__device__ __forceinline__ void load_strided(unsigned dst, const T* base, i64 step, int first,
                                             int end, bool col_ok, int ch, int r) {
  constexpr int STEP = NT / CPR;
  const T* from = base + (i64)(first + r) * step + ch * 8;
#pragma unroll 2
  for (; r < ROWS; r += STEP) {
    const bool ok = col_ok && first + r < end;
    cp_async16(dst, ok ? from : base, ok);
    dst += STEP * 128;
    from += STEP * step;
  }
}

// Copies ROWS rows of two tensors at the same coordinates into two swizzled ROWS x D tiles
// (layout in wgmma.cuh): owner rows (flat < 0) or region rows [flat, flat + ROWS). Rows past
// the group or the region and columns at or past head_dim are zero-filled, so padded rows and
// dims add nothing. Thread t copies 16-byte chunk t % (D / 8) of
// rows t / (D / 8) + i * STEP (STEP a multiple of 8: the swizzle term is fixed per thread).
// Rank 1 steps the pointers (one dilation group is a strided row sequence).
template <typename T, int D, int ROWS, int NT, int RANK, int T0, int T1, int T2, bool INV>
__device__ __forceinline__ void load_rows(unsigned dst0, const T* base0, const i64* st0,
                                          unsigned dst1, const T* base1, const i64* st1,
                                          const BwdGeom<RANK, T0, T1, T2, INV>& G,
                                          const NAParams& p, int flat, int head_dim, int tid) {
  constexpr int CPR = D / 8, STEP = NT / CPR;
  static_assert(NT % CPR == 0 && STEP % 8 == 0, "rows per pass must be a multiple of 8");
  const int ch = tid % CPR;
  int r = tid / CPR;
  unsigned at = (ch / 8) * (ROWS * 128) + swz128(r, ch % 8);
  const bool col_ok = ch * 8 < head_dim;
  if constexpr (RANK == 1) {
    const int first = flat < 0 ? G.o0[0] : G.rs[0] + flat;
    const int end = flat < 0 ? G.glen[0] : G.rs[0] + G.rk[0];
    load_strided<T, ROWS, NT, D / 8>(dst0 + at, base0 + G.g[0] * st0[1], p.dilation[0] * st0[1],
                                     first, end, col_ok, ch, r);
    load_strided<T, ROWS, NT, D / 8>(dst1 + at, base1 + G.g[0] * st1[1], p.dilation[0] * st1[1],
                                     first, end, col_ok, ch, r);
  } else {
    // Tensor coordinates of tile row rr (false: past the group or the region).
    auto row_coords = [&](int rr, int (&c)[3]) {
      bool ok;
      if (flat < 0) {
        G.own_row(rr, c, ok);
      } else {
        ok = flat + rr < G.total;
        G.other(flat + rr, c);
      }
      return ok;
    };
    if constexpr (ROWS <= NT) {  // each row's coordinates and offsets once
      copy_rows2<T, D, ROWS, NT>(dst0, base0, dst1, base1, head_dim, tid,
                                 [&](int rr, long long& o0, long long& o1) {
        int c[3];
        const bool ok = row_coords(rr, c);
        if (ok) {
          o0 = G.offset(p, st0, c[0], c[1], c[2]);
          o1 = G.offset(p, st1, c[0], c[1], c[2]);
        }
        return ok;
      });
    } else {
#pragma unroll 1
      for (; r < ROWS; r += STEP) {
        int c[3];
        const bool ok = row_coords(r, c) && col_ok;
        cp_async16(dst0 + at, ok ? base0 + G.offset(p, st0, c[0], c[1], c[2]) + ch * 8 : base0,
                   ok);
        cp_async16(dst1 + at, ok ? base1 + G.offset(p, st1, c[0], c[1], c[2]) + ch * 8 : base1,
                   ok);
        at += STEP * 128;
      }
    }
  }
}

// Region rows [flat, flat + N) of two float32 row vectors (lse and delta, strides over the
// canonical axes without the last) into two float arrays in shared memory: thread t < N
// copies lse of row t, N <= t < 2N delta of row t - N; rows past the region are zero.
template <int N, int RANK, int T0, int T1, int T2, bool INV>
__device__ __forceinline__ void load_row_values(unsigned dst_lse, const float* lse_bh,
                                                unsigned dst_delta, const float* delta_bh,
                                                const BwdGeom<RANK, T0, T1, T2, INV>& G,
                                                const NAParams& p, int flat, int tid) {
  static_assert(N % 16 == 0, "whole wgmma K steps of queries");
  if (tid >= 2 * N) return;
  const bool is_lse = tid < N;
  const int r = is_lse ? tid : tid - N;
  const bool ok = flat + r < G.total;
  const float* base = is_lse ? lse_bh : delta_bh;
  const i64* st = is_lse ? p.lse : p.delta;
  const float* src;
  if (RANK == 1) {
    src = base + (i64)(G.g[0] + p.dilation[0] * (G.rs[0] + flat + r)) * st[1];
  } else {
    int c[3];
    G.other(ok ? flat + r : 0, c);
    src = base + G.offset(p, st, c[0], c[1], c[2]);
  }
  const unsigned dst = (is_lse ? dst_lse : dst_delta) + 4 * r;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
               :: "r"(dst), "l"(ok ? src : base), "r"(ok ? 4 : 0) : "memory");
}

// Accumulator chunks 2s, 2s+1 packed in order are A step s of the next GEMM (wgmma.cuh).
template <typename T, int N>
__device__ __forceinline__ void pack_a(const float (&acc)[N / 2], unsigned (&a)[N / 16][4]) {
  typedef typename tc::MmaKind<T>::tag tag;
#pragma unroll
  for (int s = 0; s < N / 16; ++s)
#pragma unroll
    for (int x = 0; x < 4; ++x) a[s][x] = tc::pack2(acc[8 * s + 2 * x], acc[8 * s + 2 * x + 1], tag());
}

// acc (+)= A B^T over D: A rows a_rows (this warpgroup's 64, K-major, in a tile of A_TILE rows),
// B the N x D tile b (K-major); both 128-byte swizzled.
template <typename T, int D, int N, int A_TILE>
__device__ __forceinline__ void gemm_ss(float (&acc)[N / 2], unsigned a_rows, unsigned b) {
  typedef typename Kind<T>::type kind;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const unsigned koff = (kk % 4) * 32;
    SS<N>::run(acc, desc128(a_rows + (kk / 4) * (A_TILE * 128) + koff, 16, 1024),
               desc128(b + (kk / 4) * (N * 128) + koff, 16, 1024), kk > 0, kind());
  }
}

// acc += A B: A (64 x K, K = rows of b) from registers, B the K x D tile b read N-major.
template <typename T, int D, int K>
__device__ __forceinline__ void gemm_rs(float (&acc)[D / 2], const unsigned (&a)[K / 16][4],
                                        unsigned b) {
  typedef typename Kind<T>::type kind;
#pragma unroll
  for (int s = 0; s < K / 16; ++s) RS<D>::run(acc, a[s], desc128(b + s * 2048, K * 128, 1024), kind());
}

}  // namespace hopper
}  // namespace natten
