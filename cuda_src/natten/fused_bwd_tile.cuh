// Building blocks of the fused tensor-core backward (na_fused_bwd.cu): per-axis spans of the
// rows a tile of owners reaches, gathered-row descriptors, and one warp's 16x32 step.
// No kernels here. Coordinates are in-group indices of one dilation group.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace natten {
namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;

// One gathered row of the current step, as one lane builds it for the whole warp: its slab
// row, which of the warp's 16 owner rows attend to it (bit r = owner row r), and for query
// rows of the dK/dV pass their lse (log2 units) and delta. Padding entries: row 0, no bits.
struct RowDesc {
  int row;
  unsigned mask;
  float l2, dl;
};

// Owner rows of a 16-row patch whose position on one axis lies in [x, y): the patch is
// row-major with `inner` rows per step on this axis and the pattern repeats every
// `inner * extent` rows, `rep` = sum of 1 << (i * inner * extent) over the repeats.
__device__ __forceinline__ unsigned axis_rows(int lo, int hi, int origin, int extent, int inner,
                                              unsigned rep) {
  const int x = min(max(lo - origin, 0), extent), y = min(max(hi - origin, 0), extent);
  if (y <= x) return 0u;
  return ((1u << (y * inner)) - (1u << (x * inner))) * rep;
}

// 2^x on the special-function unit (flushes denormals; P underflows to 0 like exp2f).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Per-axis window table, one entry per full-axis coordinate (built by the launcher from the
// same rules as window.cuh): the in-group window [x, y) of that coordinate as a query and the
// in-group range [z, w) of queries that see it as a key. A lookup replaces the bisections of
// Axis::inverse_window, which would sit on every CTA's critical path.
// A query's window and a key's inverse range are the two sides of one relation: key j lies
// in the window of query i iff i lies in the inverse range of j.
// Per axis the kernel keeps base = (axis's offset in the table) + dilation group, and d.
struct AxisTable {
  int base, d;
  __device__ __forceinline__ int4 at(const int4* tab, int i) const { return tab[base + d * i]; }
};

// Gathered rows reached by the owners first..last (inclusive) of one axis: the union of the
// queries seeing those keys (owners are keys), or of the keys those queries see. Window
// bounds and inverse bounds never decrease with the index and consecutive ranges touch, so
// the union is [bound of first, bound of last).
template <bool OwnerIsKey>
__device__ __forceinline__ void reach(const int4* tab, const AxisTable& ax, int first, int last,
                                      int& lo, int& hi) {
  const int4 a = ax.at(tab, first), b = ax.at(tab, last);
  lo = OwnerIsKey ? a.z : a.x;
  hi = OwnerIsKey ? b.w : b.y;
}

// ldmatrix on a 32-bit shared-memory byte address (mma.cuh's take generic pointers; keeping
// the eight row addresses of a step as 32-bit values saves registers).
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Fragment-level pieces of one warp step. Row-major 16-bit tiles in shared memory; row
// addresses (32-bit shared byte addresses) already carry each lane's ldmatrix row and column
// half.
template <typename T> struct Step {
  typedef typename tc::MmaKind<T>::tag Tag;

  // C[4 n-tiles] += A(16 x Dp) * B(32 gathered rows x Dp)^T, A and B row-major in smem.
  // a_row: lane's row of A (row (m%2)*8 + l%8, column half m/2); b_row[h]: lane's gathered
  // row 16h + (m/2)*8 + l%8, column half m%2 (m = lane / 8).
  template <int Dp>
  static __device__ __forceinline__ void abt(float (&c)[4][4], unsigned a_row,
                                             const unsigned (&b_row)[2]) {
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      unsigned a[4];
      ldsm_x4(a, a_row + kk * 32);
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        unsigned b[4];
        ldsm_x4(b, b_row[hb] + kk * 32);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma16816(c[2 * hb], a, b0, Tag());
        tc::mma16816(c[2 * hb + 1], a, b1, Tag());
      }
    }
  }

  // acc[DC/8] += A(16 x 32, two k-step fragments) * B(32 gathered rows, DC columns); bt_row[s]:
  // the lane's transposed-load row 16s + (m%2)*8 + l%8, column half m/2, at the first column.
  template <int DC>
  static __device__ __forceinline__ void ab(float (&acc)[DC / 8][4], const unsigned (&a)[2][4],
                                            const unsigned (&bt_row)[2]) {
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int nn = 0; nn < DC / 16; ++nn) {
        unsigned b[4];
        ldsm_x4_trans(b, bt_row[ks] + nn * 32);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma16816(acc[2 * nn], a[ks], b0, Tag());
        tc::mma16816(acc[2 * nn + 1], a[ks], b1, Tag());
      }
  }

  // A fragments (16 x 32 as two 16 x 16 k-steps) from the accumulators of four 16x8 n-tiles.
  static __device__ __forceinline__ void to_a(unsigned (&a)[2][4], const float (&c)[4][4]) {
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      a[ks][0] = tc::pack2(c[2 * ks][0], c[2 * ks][1], Tag());
      a[ks][1] = tc::pack2(c[2 * ks][2], c[2 * ks][3], Tag());
      a[ks][2] = tc::pack2(c[2 * ks + 1][0], c[2 * ks + 1][1], Tag());
      a[ks][3] = tc::pack2(c[2 * ks + 1][2], c[2 * ks + 1][3], Tag());
    }
  }
};

}  // namespace bwd
}  // namespace natten
