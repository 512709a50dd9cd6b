// The relative positional bias of the Hopper (sm_90a) fused NA kernels: the part of a head's
// table rpb[h, 2k-1, ...] that a CTA's scores reach, staged in shared memory (the backward's
// in log2 units, the forward's divided by the scale).
// The entry of a score (query i, key j; in-group coordinates per axis) is key - query +
// kernel - 1 per axis; a box is that offset minus its origin, row-major with strides bst
// (bst[RANK - 1] = 1), so that a score's place in the box is one owner-row term plus one
// region term (the region coordinates dotted with bst): + for the forward and the dQ pass
// (rows are queries), - for the dK/dV pass (rows are keys). No kernels.
#pragma once

#include "../common.cuh"
#include "tile_box.cuh"

namespace natten {
namespace hopper {

struct BiasBoxBase {
  int org[3], dim[3], bst[3], vol;

  // org and dim per axis from axis(a, org, dim) on the rank's axes (inert axes: 0 and 1),
  // then the row-major strides and the volume.
  template <int RANK, class F>
  __device__ __forceinline__ void shape(F&& axis) {
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      org[a] = 0;
      dim[a] = 1;
      if (a < RANK) axis(a, org[a], dim[a]);
    }
    bst[2] = 1;
    bst[1] = dim[2];
    bst[0] = dim[1] * dim[2];
    vol = dim[0] * bst[0];
  }

  // Owner row c's (in-group coordinates, clamped to the group) term of its scores' box
  // index: SIGN (region start - c) + kernel - 1 - org per axis, dotted with bst (SIGN +1:
  // rows are queries, -1: keys).
  template <int SIGN, int RANK, int T0, int T1, int T2>
  __device__ __forceinline__ int term(const TileBox<RANK, T0, T1, T2>& G, const NAParams& p,
                                      const int (&c)[3]) const {
    int at = 0;
#pragma unroll
    for (int a = 0; a < RANK; ++a)
      at += (SIGN * (G.rs[a] - min(c[a], G.glen[a] - 1)) + (int)p.kernel[a] - 1 - org[a]) *
            bst[a];
    return at;
  }

  // Each region row's place in the box (its region coordinates dotted with bst) into dst,
  // by threads [0, nt) of the caller's (ranks 2, 3; rank 1's place is the flat index).
  template <int RANK, int T0, int T1, int T2>
  __device__ __forceinline__ void stage_places(int* dst, const TileBox<RANK, T0, T1, T2>& G,
                                               int t, int nt) const {
    for (int f = t; f < G.total; f += nt) {
      int c[3];
      G.region_at(f, c);
      dst[f] = c[0] * bst[0] + c[1] * bst[1] + c[2] * bst[2];
    }
  }

  // The table's entries times mul into dst (by default log2 e: log2 units), by threads
  // [0, nt) of the caller's. Entries past the table are 0 (no score reads them).
  template <int RANK, typename T>
  __device__ __forceinline__ void stage(float* dst, const T* __restrict__ rpb, int h,
                                        const NAParams& p, int t, int nt,
                                        float mul = 1.4426950408889634f) const {
    for (int i = t; i < vol; i += nt) {
      const int o[3] = {i / bst[0], (i % bst[0]) / bst[1], i % bst[1]};
      bool ok = true;
      i64 off = h * p.rpb[0];
#pragma unroll
      for (int a = 0; a < RANK; ++a) {
        const int x = org[a] + o[a];
        ok = ok && x < 2 * (int)p.kernel[a] - 1;  // (org >= 0)
        off += x * p.rpb[1 + a];
      }
      dst[i] = ok ? to_float(rpb[off]) * mul : 0.f;
    }
  }
};

// Rows are queries (the forward's and the dQ pass's query box, keys the region): per axis
// the offsets from org, that of the last query's first key (a window's start minus its query
// never grows with the query: the smallest), over min(2k - 1, kernel + tile - 1) entries.
// The bias-gradient reduction (na_bwd_fused_rpb) locates the dQ pass's boxes the same way.
struct BiasBox : BiasBoxBase {
  template <int RANK, int T0, int T1, int T2>
  __device__ __forceinline__ void init(const TileBox<RANK, T0, T1, T2>& G, const NAParams& p) {
    const int tdim[3] = {T0, T1, T2};
    shape<RANK>([&](int a, int& o, int& d) {
      const Axis ax = axis_of(p, a);
      const int last = min(G.o0[a] + tdim[a], G.glen[a]) - 1;
      int s, e;
      ax.window(last, G.glen[a], s, e);
      o = s - last + ax.kernel - 1;
      d = min(2 * ax.kernel - 1, ax.kernel + tdim[a] - 1);
    });
  }

  // Row-major box index of query c's (in-group coordinates) offset to the region's origin.
  template <int RANK, int T0, int T1, int T2>
  __device__ __forceinline__ int row(const TileBox<RANK, T0, T1, T2>& G, const NAParams& p,
                                     const int (&c)[3]) const {
    return term<1>(G, p, c);
  }
};

// Rows are keys (the dK/dV pass's key box, queries the region [rs, rs + rk)): per axis the
// offsets a key of the box and a query of the region can have, [o0 - (rs + rk - 1),
// last - rs] + kernel - 1, within the table's [0, 2k - 1). A score's index is row(key) minus
// the query's region coordinates dotted with bst.
struct KeyBiasBox : BiasBoxBase {
  template <int RANK, int T0, int T1, int T2>
  __device__ __forceinline__ void init(const TileBox<RANK, T0, T1, T2>& G, const NAParams& p) {
    const int tdim[3] = {T0, T1, T2};
    shape<RANK>([&](int a, int& o, int& d) {
      const int kern = (int)p.kernel[a];
      const int last = min(G.o0[a] + tdim[a], G.glen[a]) - 1;
      o = max(G.o0[a] - (G.rs[a] + G.rk[a] - 1) + kern - 1, 0);
      d = max(min(2 * kern - 2, last - G.rs[a] + kern - 1) - o + 1, 1);
    });
  }

  // Key c's (in-group coordinates) term: its offset to the region's origin.
  template <int RANK, int T0, int T1, int T2>
  __device__ __forceinline__ int row(const TileBox<RANK, T0, T1, T2>& G, const NAParams& p,
                                     const int (&c)[3]) const {
    return term<-1>(G, p, c);
  }
};

// The shared-memory addresses of a thread's two owner rows' terms (rows row0, row0 + 8) in
// a box staged at base.
template <class Box, int RANK, int T0, int T1, int T2>
__device__ __forceinline__ void row_terms(const Box& bb, const TileBox<RANK, T0, T1, T2>& G,
                                          const NAParams& p, int row0, unsigned base,
                                          unsigned (&at)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int c[3];
    bool valid;
    G.own_row(row0 + 8 * r, c, valid);
    at[r] = base + 4 * bb.row(G, p, c);
  }
}

}  // namespace hopper
}  // namespace natten
