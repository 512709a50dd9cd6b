// What the Hopper (sm_90a) forward and backward CTAs' geometries share: the CTA's own rows,
// a T0 x T1 x T2 box of in-group coordinates of one dilation group per axis (rank padded to
// 3 with inert axes), and the box of per-axis ranges those rows reach (the region: keys of
// the queries' windows, or queries of the keys' inverse windows), with region coordinates
// relative to its start. Plain integer code (no PTX): the backward's CPU geometry test
// compiles it. The forward's Geom and the backward's BwdGeom derive from it.
#pragma once

#include "../common.cuh"

namespace natten {
namespace hopper {

template <int RANK, int T0, int T1, int T2>
struct TileBox {
  int g[3], o0[3], glen[3], rs[3], rk[3];  // group, box origin, group length, region
  int ilo[3], ihi[3];  // per axis, the region coordinates every row of the box reaches
  int total;           // rows of the region (keys forward, queries backward)
  int inner;           // region rows per axis-0 row (rk1 * rk2)

  // total and inner, once rk is known.
  __device__ __forceinline__ void size_region() {
    inner = rk[1] * rk[2];
    total = rk[0] * inner;
  }

  // Region coordinates of flat region index f (rank 1: f itself, without the integer
  // division by inner = 1 that the compiler cannot see).
  __device__ __forceinline__ void region_at(int f, int (&c)[3]) const {
    c[0] = RANK == 1 ? f : f / inner;
    const int rem = RANK == 1 ? 0 : f - c[0] * inner;
    c[1] = RANK == 3 ? rem / rk[2] : rem;
    c[2] = RANK == 3 ? rem - c[1] * rk[2] : 0;
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

  // Row r of the box in the tensor at `base` (this batch and head) of strides st; nullptr
  // where the row lies outside the group.
  template <typename T>
  __device__ __forceinline__ T* row_at(const NAParams& p, T* base, const i64* st, int r) const {
    int c[3];
    bool valid;
    own_row(r, c, valid);
    return valid ? base + offset(p, st, c[0], c[1], c[2]) : nullptr;
  }

  // In-group coordinates of row r of the box (valid: inside the group on every axis).
  __device__ __forceinline__ void own_row(int r, int (&c)[3], bool& valid) const {
    const int l[3] = {r / (T1 * T2), (r / T2) % T1, r % T2};
    valid = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      c[a] = o0[a] + l[a];
      valid = valid && c[a] < glen[a];
    }
  }
};

}  // namespace hopper
}  // namespace natten
