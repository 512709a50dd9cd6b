// Building blocks of the fused tensor-core backward (fused/mma_backward.cu): per-axis spans of the
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

// Relative positional bias (the BIAS instantiations). Each CTA copies its query head's table
// into shared memory; a score's index there is the gathered row's part minus the owner row's
// part (BiasDesc.t - owner t), and in the dQ pass its slot in
// the CTA's accumulator box the same difference of the box parts (.a). Box: per axis the
// offsets key - query + kernel - 1 that one dQ CTA's queries reach, min(2k - 1, k + tile - 1)
// of them from the CTA's origin (the offset of its last query's first key, the smallest).
struct BiasDesc {
  int t, a;
};
// One pass's launch geometry (the launcher's PASS_GEOM), per padded axis: the CTA tile and
// the warp patch (powers of two), log2 of the patch, tiles per dilation group and the
// offset of the axis's window table; then the rows of one gathered slab and the first
// (batch, owner head) of the launch's grid y.
struct PassGeom {
  int tile[3], patch[3], lpatch[3], ntile[3], tab_off[3];
  int slab_rows, bh0;
};
// The additional tokens' dK/dV launch (the launcher's EXTRA_GEOM): query tokens per split
// (grid z), rows of one gathered slab, the first (batch, extra head) of grid y; and for the
// sum of the splits' partial sums: the number of splits and the padded head dim.
struct ExtraGeom {
  int split_rows, slab_rows, bh0;
  int splits, dp;
};
struct BiasGeom {
  int dim[3];      // accumulator box extents per axis (1 on inert axes)
  int bst[3];      // its row-major strides
  int tile[3];     // dQ CTA tile per axis (TILES in the launcher)
  int ntile[3];    // tiles per dilation group per axis
  int tab_off[3];  // axis offsets into the window table
  int vol;         // dim[0] * dim[1] * dim[2]
  int ctas;        // dQ CTAs of head-dim chunk 0 per (batch, head): tiles x dilation groups
  int tst[3];      // row-major strides of one head's table [2k-1, ...] (its shared-memory copy)
  int tvol;        // entries of one head's table
  int wdim[3];     // one warp's accumulator box per axis (the offsets its patch reaches)
  int wbst[3];     // its row-major strides (wbst[2] = 1)
  int wvol;        // wdim[0] * wdim[1] * wdim[2]
  int wcopies;     // copies of each warp's box (1 or 4: owner row r adds into copy r % 4)
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

// floor(n / m) for 0 <= n < 2^21 and m >= 1 through a float reciprocal (a few instructions
// instead of an integer division's ~25): (n + 0.5) / m lies at least 0.5 / m from an
// integer, and the two roundings (of 1 / m and of the product) move it by less than
// (n + 0.5) / m * 2^-22.9 < 0.25 / m. Slab rows and step counts stay far below 2^21.
struct FastDiv {
  int m;
  float rm;
  __device__ __forceinline__ explicit FastDiv(int m_)
      : m(m_), rm(__frcp_rn((float)max(m_, 1))) {}
  __device__ __forceinline__ int div(int n) const {
    return __float2int_rz(__fmul_rn(__int2float_rn(n) + 0.5f, rm));
  }
};

// 4-byte global->shared copy (cp.async.ca; the 16-byte one is in mma.cuh).
__device__ __forceinline__ void cp_async4(unsigned smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(smem), "l"(gmem));
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

__device__ __forceinline__ float lds_f32(unsigned addr) {
  float x;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
  return x;
}

// Fragment-level pieces of one warp step: 16 owner rows (the m16 rows) against 32 gathered
// rows. Tiles are row-major in shared memory with RB bytes per row; addresses are 32-bit
// shared byte addresses. Rows holds the lane's gathered-row addresses for the step.
//   abt: C[4 n-tiles of 8 gathered rows] += Own(16 x Dp) * Gathered(32 x Dp)^T
//   ab:  acc[DC/8 n-tiles of columns] += X(16 x 32, the C layout of abt) * Gathered(32 x DC)
template <typename T> struct Step {  // float16 / bfloat16: m16n8k16 with ldmatrix
  typedef typename tc::MmaKind<T>::tag Tag;
  struct Rows {
    unsigned g[2];   // abt: gathered row 16h + (m/2)*8 + l%8, column half m%2 (m = lane / 8)
    unsigned gt[2];  // ab (transposed): row 16s + (m%2)*8 + l%8, column half m/2, at col0
  };

  // Lane's ldmatrix row of the owner tile: (m%2)*8 + l%8, column half m/2.
  static __device__ __forceinline__ unsigned own_lane(int lane, unsigned RB) {
    const int m = lane >> 3;
    return ((m & 1) * 8 + (lane & 7)) * RB + (m >> 1) * 16;
  }

  static __device__ __forceinline__ Rows rows(const RowDesc* wd, int lane, unsigned base,
                                              unsigned RB, int col0) {
    const int m = lane >> 3;
    Rows r;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.g[h] = base + wd[h * 16 + (m >> 1) * 8 + (lane & 7)].row * RB + (m & 1) * 16;
      r.gt[h] = base + wd[h * 16 + (m & 1) * 8 + (lane & 7)].row * RB + (m >> 1) * 16 +
                col0 * (int)sizeof(T);
    }
    return r;
  }

  static __device__ __forceinline__ Rows shifted(Rows r, unsigned by) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r.g[h] += by;
      r.gt[h] += by;
    }
    return r;
  }

  template <int Dp>
  static __device__ __forceinline__ void abt(float (&c)[4][4], unsigned own, const Rows& r,
                                             unsigned) {
#pragma unroll
    for (int kk = 0; kk < Dp / 16; ++kk) {
      unsigned a[4];
      ldsm_x4(a, own + kk * 32);
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {
        unsigned b[4];
        ldsm_x4(b, r.g[hb] + kk * 32);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma16816(c[2 * hb], a, b0, Tag());
        tc::mma16816(c[2 * hb + 1], a, b1, Tag());
      }
    }
  }

  template <int DC>
  static __device__ __forceinline__ void ab(float (&acc)[DC / 8][4], const float (&x)[4][4],
                                            const Rows& r, unsigned) {
    unsigned a[2][4];  // A fragments of the two 16-row k-steps, straight from C
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      a[ks][0] = tc::pack2(x[2 * ks][0], x[2 * ks][1], Tag());
      a[ks][1] = tc::pack2(x[2 * ks][2], x[2 * ks][3], Tag());
      a[ks][2] = tc::pack2(x[2 * ks + 1][0], x[2 * ks + 1][1], Tag());
      a[ks][3] = tc::pack2(x[2 * ks + 1][2], x[2 * ks + 1][3], Tag());
    }
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int nn = 0; nn < DC / 16; ++nn) {
        unsigned b[4];
        ldsm_x4_trans(b, r.gt[ks] + nn * 32);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        tc::mma16816(acc[2 * nn], a[ks], b0, Tag());
        tc::mma16816(acc[2 * nn + 1], a[ks], b1, Tag());
      }
  }
};

template <> struct Step<float> {  // TF32: m16n8k8, fragments from plain shared loads
  struct Rows {
    unsigned g[4];      // abt: gathered row 8t + group, column quad
    unsigned gt[4][2];  // ab: gathered rows 8s + quad and 8s + quad + 4, column col0 + group
  };

  static __device__ __forceinline__ unsigned own_lane(int lane, unsigned RB) {
    return (lane >> 2) * RB + (lane & 3) * 4;
  }

  static __device__ __forceinline__ Rows rows(const RowDesc* wd, int lane, unsigned base,
                                              unsigned RB, int col0) {
    const int group = lane >> 2, quad = lane & 3;
    Rows r;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      r.g[t] = base + wd[t * 8 + group].row * RB + quad * 4;
      r.gt[t][0] = base + wd[t * 8 + quad].row * RB + (col0 + group) * 4;
      r.gt[t][1] = base + wd[t * 8 + quad + 4].row * RB + (col0 + group) * 4;
    }
    return r;
  }

  static __device__ __forceinline__ Rows shifted(Rows r, unsigned by) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      r.g[t] += by;
      r.gt[t][0] += by;
      r.gt[t][1] += by;
    }
    return r;
  }

  template <int Dp>
  static __device__ __forceinline__ void abt(float (&c)[4][4], unsigned own, const Rows& r,
                                             unsigned RB) {
#pragma unroll
    for (int kk = 0; kk < Dp / 8; ++kk) {
      const unsigned a[4] = {tc::to_tf32(lds_f32(own + kk * 32)),
                             tc::to_tf32(lds_f32(own + 8 * RB + kk * 32)),
                             tc::to_tf32(lds_f32(own + kk * 32 + 16)),
                             tc::to_tf32(lds_f32(own + 8 * RB + kk * 32 + 16))};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const unsigned b[2] = {tc::to_tf32(lds_f32(r.g[t] + kk * 32)),
                               tc::to_tf32(lds_f32(r.g[t] + kk * 32 + 16))};
        tc::mma1688_tf32(c[t], a, b);
      }
    }
  }

  template <int DC>
  static __device__ __forceinline__ void ab(float (&acc)[DC / 8][4], const float (&x)[4][4],
                                            const Rows& r, unsigned) {
    const int lane = threadIdx.x & 31, quad = lane & 3;
    // A (16 x 8 per k-step) wants columns quad and quad + 4, held by lanes of the same group
    // at quad / 2 and 2 + quad / 2, element quad % 2 of each pair.
    const int src_lo = (lane & ~3) | (quad >> 1), src_hi = src_lo + 2;
    const bool odd = quad & 1;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      float v[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        v[e] = __shfl_sync(0xffffffffu, x[ks][e], src_lo);
        v[4 + e] = __shfl_sync(0xffffffffu, x[ks][e], src_hi);
      }
      const unsigned a[4] = {tc::to_tf32(odd ? v[1] : v[0]), tc::to_tf32(odd ? v[3] : v[2]),
                             tc::to_tf32(odd ? v[5] : v[4]), tc::to_tf32(odd ? v[7] : v[6])};
#pragma unroll
      for (int j = 0; j < DC / 8; ++j) {
        const unsigned b[2] = {tc::to_tf32(lds_f32(r.gt[ks][0] + j * 32)),
                               tc::to_tf32(lds_f32(r.gt[ks][1] + j * 32))};
        tc::mma1688_tf32(acc[j], a, b);
      }
    }
  }
};

}  // namespace bwd
}  // namespace natten
