// Geometry, loaders and score masks of the Hopper (sm_90a) fused NA backward. No kernels.
// A CTA owns a box of in-group coordinates of one dilation group per axis (the owner tile:
// queries in the dQ pass, keys in the dK/dV pass) and walks the box of per-axis ranges that
// its rows reach (the region: the keys of the queries' windows, or the queries of the keys'
// inverse windows, both contiguous and monotone per axis), in flat row-major tiles.
#pragma once

#include "../common.cuh"
#include "wgmma.cuh"

namespace natten {
namespace hopper {

// Per axis, the other side's range of in-group index i: its window [s, e) (INV false: i is a
// query) or the queries whose windows hold it [lo, hi) (INV true: i is a key).
template <bool INV>
__device__ __forceinline__ void reach(const Axis& ax, int i, int glen, int& s, int& e) {
  if (INV)
    ax.inverse_window(i, glen, s, e);
  else
    ax.window(i, glen, s, e);
}

// Owner box T0 x T1 x T2 (rank padded to 3 with inert axes) and its region.
template <int RANK, int T0, int T1, int T2, bool INV>
struct BwdGeom {
  int g[3], o0[3], glen[3], rs[3], rk[3];
  int ilo[3], ihi[3];  // per axis, the region coordinates every owner row reaches
  int total;           // rows of the region
  int inner;           // region rows per axis-0 row (rk1 * rk2)
  bool rows_only;      // every owner row reaches all of axes 1 and 2: masks depend on rows only

  __device__ __forceinline__ bool init(const NAParams& p) {
    const int tdim[3] = {T0, T1, T2};
    int x = blockIdx.x, tile[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      const Axis ax = axis_of(p, a);
      const int n = (ax.group_len(0) + tdim[a] - 1) / tdim[a];  // group 0 is the longest
      tile[a] = x % n;
      x /= n;
    }
    bool spans = true;
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      const Axis ax = axis_of(p, a);
      g[a] = x % ax.dilation;
      x /= ax.dilation;
      glen[a] = ax.group_len(g[a]);
      o0[a] = tile[a] * tdim[a];
      if (o0[a] >= glen[a]) return false;
      int fs, fe, ls, le;
      reach<INV>(ax, o0[a], glen[a], fs, fe);
      reach<INV>(ax, min(o0[a] + tdim[a], glen[a]) - 1, glen[a], ls, le);
      rs[a] = fs;
      rk[a] = max(le - fs, 0);
      ilo[a] = ls - fs;
      ihi[a] = fe - fs;
      if (a > 0 && (ls > fs || fe < le)) spans = false;
    }
    rows_only = spans;
    inner = rk[1] * rk[2];
    total = rk[0] * inner;
    return true;
  }

  // Whether some score of the region tile [lo, lo + n) needs a mask.
  __device__ __forceinline__ bool needs_mask(int lo, int n) const {
    if (ilo[0] >= ihi[0]) return true;
    if (RANK == 1) return lo < ilo[0] || lo + n > ihi[0];
    if (!rows_only) return true;
    return lo < ilo[0] * inner || lo + n > ihi[0] * inner;
  }

  // Element offset of in-group coordinates c (axes beyond RANK are 0) in a tensor of strides st.
  __device__ __forceinline__ i64 offset(const NAParams& p, const i64* st, int c0, int c1,
                                        int c2) const {
    const int c[3] = {c0, c1, c2};
    i64 off = 0;
#pragma unroll
    for (int a = 0; a < RANK; ++a) off += (i64)(g[a] + p.dilation[a] * c[a]) * st[1 + a];
    return off;
  }

  // In-group coordinates of row r of the owner tile (valid: inside the group on every axis).
  __device__ __forceinline__ void owner(int r, int (&c)[3], bool& valid) const {
    const int l[3] = {r / (T1 * T2), (r / T2) % T1, r % T2};
    valid = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      c[a] = o0[a] + l[a];
      valid = valid && c[a] < glen[a];
    }
  }

  // In-group coordinates of flat region index f (valid when f < total).
  __device__ __forceinline__ void other(int f, int (&c)[3]) const {
    c[0] = f / inner;
    const int rem = f - c[0] * inner;
    c[1] = RANK == 3 ? rem / rk[2] : rem;
    c[2] = RANK == 3 ? rem - c[1] * rk[2] : 0;
#pragma unroll
    for (int a = 0; a < 3; ++a) c[a] += rs[a];
  }

  // A thread's owner row r: its reach in region coordinates, [wl, wl + wn) per axis (rows past
  // the group take the last row's, their results are never stored).
  __device__ __forceinline__ void row_reach(const NAParams& p, int r, int (&wl)[3],
                                            int (&wn)[3]) const {
    int c[3];
    bool valid;
    owner(r, c, valid);
#pragma unroll
    for (int a = 0; a < RANK; ++a) {
      int s0, e0;
      reach<INV>(axis_of(p, a), min(c[a], glen[a] - 1), glen[a], s0, e0);
      wl[a] = s0 - rs[a];
      wn[a] = max(e0 - s0, 0);
    }
#pragma unroll
    for (int a = RANK; a < 3; ++a) {
      wl[a] = 0;
      wn[a] = 1;
    }
  }
};

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
    const i64 step0 = p.dilation[0] * st0[1], step1 = p.dilation[0] * st1[1];
    const T* from0 = base0 + G.g[0] * st0[1] + (i64)(first + r) * step0 + ch * 8;
    const T* from1 = base1 + G.g[0] * st1[1] + (i64)(first + r) * step1 + ch * 8;
#pragma unroll 2
    for (; r < ROWS; r += STEP) {
      const bool ok = col_ok && first + r < end;
      cp_async16(dst0 + at, ok ? from0 : base0, ok);
      cp_async16(dst1 + at, ok ? from1 : base1, ok);
      at += STEP * 128;
      from0 += STEP * step0;
      from1 += STEP * step1;
    }
  } else {
#pragma unroll 1
    for (; r < ROWS; r += STEP) {
      int c[3];
      bool ok;
      if (flat < 0) {
        G.owner(r, c, ok);
      } else {
        ok = flat + r < G.total;
        G.other(flat + r, c);
      }
      ok = ok && col_ok;
      cp_async16(dst0 + at, ok ? base0 + G.offset(p, st0, c[0], c[1], c[2]) + ch * 8 : base0,
                 ok);
      cp_async16(dst1 + at, ok ? base1 + G.offset(p, st1, c[0], c[1], c[2]) + ch * 8 : base1,
                 ok);
      at += STEP * 128;
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

// Scores of accumulator columns (region rows [lo, lo + N) over a thread's two owner rows)
// outside each row's reach become -inf: rank 1 compares the flat index, ranks 2 and 3 carry
// the column's region coordinates forward (columns 8 i + 2 quad + e, steps 1 and 7 along the
// last axis of the rank).
template <int N, int RANK>
__device__ __forceinline__ void mask_scores(float (&acc)[N / 2], int lo, int quad,
                                            const int (&rk)[3], int inner,
                                            const int (&wl)[2][3], const int (&wn)[2][3]) {
  if (RANK == 1) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const int col = lo + (i / 4) * 8 + 2 * quad + (i % 2), r = (i / 2) % 2;
      if ((unsigned)(col - wl[r][0]) >= (unsigned)wn[r][0]) acc[i] = negative_infinity<float>();
    }
    return;
  }
  constexpr int LAST = RANK - 1;
  int c[3];
  const int f0 = lo + 2 * quad;
  c[0] = f0 / inner;
  const int rem = f0 - c[0] * inner;
  c[1] = RANK == 3 ? rem / rk[2] : rem;
  c[2] = RANK == 3 ? rem - c[1] * rk[2] : 0;
#pragma unroll
  for (int jn = 0; jn < N / 8; ++jn) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        bool in = true;
#pragma unroll
        for (int a = 0; a < RANK; ++a)
          in = in && (unsigned)(c[a] - wl[r][a]) < (unsigned)wn[r][a];
        if (!in) acc[4 * jn + 2 * r + e] = negative_infinity<float>();
      }
      c[LAST] += e == 0 ? 1 : 7;
      while (c[LAST] >= rk[LAST]) {
        c[LAST] -= rk[LAST];
        if (RANK == 3) {
          if (++c[1] >= rk[1]) {
            c[1] = 0;
            ++c[0];
          }
        } else {
          ++c[0];
        }
      }
    }
  }
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
