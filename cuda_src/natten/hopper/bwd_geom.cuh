// Geometry and score masks of the Hopper (sm_90a) fused NA backward: plain integer code (no
// PTX), so tests/unit/test_hopper_bwd_geometry.py compiles it for the CPU and checks every pair it
// lets through against the SPEC's neighborhoods. No kernels.
// A CTA owns a box of in-group coordinates of one dilation group per axis (the owner tile:
// queries in the dQ pass, keys in the dK/dV pass) and walks the box of per-axis ranges that
// its rows reach (the region: the keys of the queries' windows, or the queries of the keys'
// inverse windows, both contiguous and monotone per axis), in flat row-major tiles. Also
// where the dK/dV pass with a bias and dQ added in it puts each score's dS (DsWs).
#pragma once

#include "../common.cuh"
#include "tile_box.cuh"

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
struct BwdGeom : TileBox<RANK, T0, T1, T2> {
  typedef TileBox<RANK, T0, T1, T2> Box;
  using Box::g, Box::o0, Box::glen, Box::rs, Box::rk, Box::ilo, Box::ihi, Box::own_row;
  using Box::total, Box::inner, Box::size_region, Box::region_at;
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
    size_region();
    return true;
  }

  // Whether some score of the region tile [lo, lo + n) needs a mask.
  __device__ __forceinline__ bool needs_mask(int lo, int n) const {
    if (ilo[0] >= ihi[0]) return true;
    if (RANK == 1) return lo < ilo[0] || lo + n > ihi[0];
    if (!rows_only) return true;
    return lo < ilo[0] * inner || lo + n > ihi[0] * inner;
  }

  // In-group coordinates of flat region index f (valid when f < total).
  __device__ __forceinline__ void other(int f, int (&c)[3]) const {
    region_at(f, c);
#pragma unroll
    for (int a = 0; a < 3; ++a) c[a] += rs[a];
  }

  // A thread's owner row r: its reach in region coordinates, [wl, wl + wn) per axis (rows past
  // the group take the last row's, their results are never stored).
  __device__ __forceinline__ void row_reach(const NAParams& p, int r, int (&wl)[3],
                                            int (&wn)[3]) const {
    int c[3];
    bool valid;
    own_row(r, c, valid);
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

// The dS workspace of the dK/dV pass with dQ added in it and a bias (ATOMIC and BIAS):
// [B, heads, tokens, kernel volume] for a run of consecutive query heads (the launch's kv
// heads' query heads: a backward may take the heads in groups, one workspace), token rows row-major over the axes, each query's row holding
// the slots of its window row-major over the axes (slot t of an axis: the window's t-th key),
// as the unfused chain orders its attention weights. The slot of key c (in-group
// coordinates) in query x's window [s, e) is sum over the axes of (c - s) times the later
// axes' kernels: a key term plus a query term, each once per row.
struct DsWs {
  // Key c's term: c's coordinates, row-major over the kernel's axes.
  template <int RANK>
  static __device__ __forceinline__ int key_term(const NAParams& p, const int (&c)[3]) {
    int t = 0;
#pragma unroll
    for (int a = 0; a < RANK; ++a) t = t * (int)p.kernel[a] + c[a];
    return t;
  }
  // Head h (of the workspace's `heads`) of batch b: its first row.
  static __device__ __forceinline__ i64 head_row(const NAParams& p, i64 b, i64 h, i64 heads) {
    return ((b * heads + h) * (p.extent[0] * p.extent[1] * p.extent[2])) * p.num_neighbors;
  }
  // The bias entry of slot 0 of the window of query x (full-axis coordinates) as the table's
  // row-major offset (per axis: window start - x + kernel - 1, in-group; table strides ts),
  // and the window's length per axis: slot t of the query is entry sb + t's per-axis
  // offsets dotted with ts, valid where t < len on every axis.
  static __device__ __forceinline__ void query_entry(const NAParams& p, const int (&x)[3],
                                                     const int (&ts)[3], int& sb, int (&len)[3]) {
    sb = 0;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      const Axis ax = axis_of(p, a);
      const int ig = ax.in_group(x[a]);
      int s0, e0;
      ax.window(ig, ax.group_len(ax.group_of(x[a])), s0, e0);
      sb += (s0 - ig + ax.kernel - 1) * ts[a];
      len[a] = e0 - s0;
    }
  }
  // Each region query's row within its head minus its window origin's term (dst[f], flat
  // region index f; a head's rows hold fewer than 2^31 slots), by threads [t, nt) of the
  // caller's.
  template <int RANK, int T0, int T1, int T2, bool INV>
  static __device__ __forceinline__ void stage(int* dst, const BwdGeom<RANK, T0, T1, T2, INV>& G,
                                               const NAParams& p, int t, int nt) {
    for (int f = t; f < G.total; f += nt) {
      int c[3];
      G.other(f, c);
      i64 tok = 0;
      int org = 0;
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        const Axis ax = axis_of(p, a);
        int s0, e0;
        ax.window(c[a], G.glen[a], s0, e0);
        tok = tok * p.extent[a] + G.g[a] + (i64)ax.dilation * c[a];
        org = org * ax.kernel + s0;
      }
      dst[f] = (int)(tok * p.num_neighbors - org);
    }
  }
};

// A thread's N / 2 scores of a tile (accumulator columns: region rows [lo, lo + N); rows:
// its two owner rows) visited in order as f(i, r, in, col): accumulator index i, owner row
// r (0, 1), whether the column lies in row r's reach, and the column's flat region index.
// Rank 1 compares the flat index, ranks 2 and 3 carry the column's region coordinates
// forward (columns 8 i + 2 quad + e, steps 1 and 7 along the last axis of the rank).
template <int N, int RANK, class F>
__device__ __forceinline__ void walk_scores(int lo, int quad, const int (&rk)[3], int inner,
                                            const int (&wl)[2][3], const int (&wn)[2][3],
                                            F&& f) {
  if (RANK == 1) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const int col = lo + (i / 4) * 8 + 2 * quad + (i % 2), r = (i / 2) % 2;
      f(i, r, (unsigned)(col - wl[r][0]) < (unsigned)wn[r][0], col);
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
        f(4 * jn + 2 * r + e, r, in, f0 + 8 * jn + e);
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

// The same visit of a tile every column of which lies in both rows' reach: f(i, r, true, f)
// with f the column's flat region index.
template <int N, class F>
__device__ __forceinline__ void walk_flat(int lo, int quad, F&& f) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) f(i, (i / 2) % 2, true, lo + (i / 4) * 8 + 2 * quad + (i % 2));
}

// Scores of accumulator columns outside each owner row's reach become -inf (walk_scores).
template <int N, int RANK>
__device__ __forceinline__ void mask_scores(float (&acc)[N / 2], int lo, int quad,
                                            const int (&rk)[3], int inner,
                                            const int (&wl)[2][3], const int (&wn)[2][3]) {
  walk_scores<N, RANK>(lo, quad, rk, inner, wl, wn, [&](int i, int, bool in, int) {
    if (!in) acc[i] = negative_infinity<float>();
  });
}

}  // namespace hopper
}  // namespace natten
