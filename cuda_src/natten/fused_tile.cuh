// Tile and halo helpers of the fused kernels: swizzled shared-memory rows, key halos of query
// boxes, positions of a sub-box inside a larger row-major box. Pure integer helpers, no kernels.
// All boxes are 3-D (inert axes have size 1) and enumerated row-major (axis 2 fastest).
#pragma once

#include "common.cuh"

namespace natten {
namespace fused {

// Position of 16-byte chunk `chunk` of shared-memory row `row`, for rows of CPR chunks.
// XOR-swizzled so that 8 consecutive rows read at the same logical chunk (one ldmatrix
// matrix, or one quad-strided scalar load) land on 8 distinct 16-byte bank groups.
template <int CPR>
__device__ __forceinline__ int swizzle_chunk(int row, int chunk) {
  static_assert(CPR >= 2 && (CPR & (CPR - 1)) == 0, "rows must hold a power of two chunks");
  if (CPR >= 8) return chunk ^ (row & 7);
  return chunk ^ ((row / (8 / CPR)) & (CPR - 1));
}

// In-group key range [start, end) seen by the in-group queries [first, last] of one axis.
// Window starts and ends never decrease with the query, so the union is contiguous.
__device__ __forceinline__ void halo_of(const Axis& ax, int glen, int first, int last,
                                        int& start, int& end) {
  int s, e;
  ax.window(first, glen, start, e);
  ax.window(last, glen, s, end);
}

// Keys every query of [first, last] sees on one axis: [start(last), end(first)).
__device__ __forceinline__ void common_of(const Axis& ax, int glen, int first, int last,
                                          int& lo, int& hi) {
  int s, e;
  ax.window(first, glen, s, hi);
  ax.window(last, glen, lo, e);
}

// floor(t / n) for 0 <= t < 2^22, n >= 1, given inv = 1.0f / n (float rounding cannot cross
// an integer there: the true quotient of t + 0.5 stays 0.5 / n away from one).
__device__ __forceinline__ int div_small(int t, float inv) {
  return (int)(((float)t + 0.5f) * inv);
}

// Elements of the sub-box [o, o + n) of a row-major box of dims `big` whose flat index in the
// big box is below x. Row-major order of a sub-box agrees with the big box's, so the
// sub-box elements in any flat range [x0, x1) of the big box are the contiguous run
// [count_before(x0), count_before(x1)) of the sub-box's own row-major order.
__device__ __forceinline__ int count_before(const int (&o)[3], const int (&n)[3],
                                            const int (&big)[3], int x) {
  const int plane = big[1] * big[2];
  const int x0 = x / plane, r = x - x0 * plane;
  const int x1 = r / big[2], x2 = r - x1 * big[2];
  int c = min(max(x0 - o[0], 0), n[0]) * n[1] * n[2];
  if (x0 >= o[0] && x0 < o[0] + n[0]) {
    c += min(max(x1 - o[1], 0), n[1]) * n[2];
    if (x1 >= o[1] && x1 < o[1] + n[1]) c += min(max(x2 - o[2], 0), n[2]);
  }
  return c;
}

}  // namespace fused
}  // namespace natten
