// Building blocks of the fused tensor-core backward (na_fused_bwd.cu): per-axis spans of the
// rows a tile of owners reaches, gathered-row descriptors, and one warp's 16x16 step.
// No kernels here. Coordinates are in-group indices of one dilation group.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace natten {
namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;

// One gathered row of the current slab, as seen by the element mask: its slab row and, per
// axis, an in-group interval [lo, hi). An owner row carries an interval too; the pair
// (owner, gathered) attends iff the intervals meet on every axis. For the dK/dV pass the
// owner is a key (point interval [j, j+1)) and the gathered row a query (its window); for
// the dQ pass the owner is a query (its window) and the gathered row a key (a point).
// Padding entries carry row 0 and empty intervals, so they never attend.
struct RowDesc {
  int row;
  int lo0, hi0, lo1, hi1, lo2, hi2;
  int pad_;
};

__device__ __forceinline__ bool meets(const int (&own)[3][2], const RowDesc& d) {
  return max(own[0][0], d.lo0) < min(own[0][1], d.hi0) &&
         max(own[1][0], d.lo1) < min(own[1][1], d.hi1) &&
         max(own[2][0], d.lo2) < min(own[2][1], d.hi2);
}

// In-group interval that owner index i contributes on one axis: a key is the point [i, i+1),
// a query its window.
template <bool OwnerIsKey>
__device__ __forceinline__ void owner_interval(const Axis& ax, int glen, int i, int& lo, int& hi) {
  if (OwnerIsKey) {
    lo = i;
    hi = i + 1;
  } else {
    ax.window(i, glen, lo, hi);
  }
}

// Gathered rows reached by the owners first..last (inclusive) of one axis: the union of the
// queries seeing those keys (dK/dV pass), or of the keys those queries see (dQ pass). Window
// bounds and inverse bounds never decrease with the index and consecutive ranges touch, so
// the union is [bound of first, bound of last).
template <bool OwnerIsKey>
__device__ __forceinline__ void reach(const Axis& ax, int glen, int first, int last, int& lo,
                                      int& hi) {
  int a, b;
  if (OwnerIsKey) {
    ax.inverse_window(first, glen, lo, a);
    ax.inverse_window(last, glen, b, hi);
  } else {
    ax.window(first, glen, lo, a);
    ax.window(last, glen, b, hi);
  }
}

// Fragment-level pieces of one warp step. Row-major 16-bit tiles in shared memory with row
// stride RS elements; `row` pointers already carry each lane's ldmatrix row and column half.
template <typename T> struct Step {
  typedef typename tc::MmaKind<T>::tag Tag;

  // C[2 n-tiles] += A(16 x Dp) * B(16 gathered rows x Dp)^T, A and B row-major in smem.
  // a_row: lane's row of A (row (m%2)*8 + l%8, column half m/2); b_row: lane's gathered row
  // ((m/2)*8 + l%8, column half m%2), m = lane / 8.
  template <int Dp>
  static __device__ __forceinline__ void abt(float (&c)[2][4], const T* a_row, const T* b_row) {
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      unsigned a[4], b[4];
      tc::ldmatrix_x4(a, a_row + kk * 16);
      tc::ldmatrix_x4(b, b_row + kk * 16);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      tc::mma16816(c[0], a, b0, Tag());
      tc::mma16816(c[1], a, b1, Tag());
    }
  }

  // acc[DC/8] += A(16 x 16, fragments) * B(16 gathered rows, columns col0..col0+DC); the lane's
  // transposed-load row is ((m%2)*8 + l%8, column half m/2).
  template <int DC>
  static __device__ __forceinline__ void ab(float (&acc)[DC / 8][4], const unsigned (&a)[4],
                                            const T* bt_row) {
#pragma unroll
    for (int nn = 0; nn < DC / 16; ++nn) {
      unsigned b[4];
      tc::ldmatrix_x4_trans(b, bt_row + nn * 16);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      tc::mma16816(acc[2 * nn], a, b0, Tag());
      tc::mma16816(acc[2 * nn + 1], a, b1, Tag());
    }
  }

  // A fragment (16 x 16) from the accumulators of two 16x8 n-tiles.
  static __device__ __forceinline__ void to_a(unsigned (&a)[4], const float (&c)[2][4]) {
    a[0] = tc::pack2(c[0][0], c[0][1], Tag());
    a[1] = tc::pack2(c[0][2], c[0][3], Tag());
    a[2] = tc::pack2(c[1][0], c[1][1], Tag());
    a[3] = tc::pack2(c[1][2], c[1][3], Tag());
  }
};

}  // namespace bwd
}  // namespace natten
