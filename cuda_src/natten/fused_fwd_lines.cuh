// Line walk of a warp's key halo for the fused forward: the halo box is taken line by line (a
// line: the keys that differ only on the last axis in use, the column axis), each line cut into
// groups of 8 columns, the n8 of one mma. A group's keys then share every coordinate but the
// column, so a thread masks its scores with one interval test per column. No kernels here.
#pragma once

#include "fused_tile.cuh"

namespace natten {
namespace fused_fwd {

// Groups of 8 keys of a warp's halo box (dims wn, offset wo inside the CTA halo box hl), lines
// in row-major order; the last group of a line is padded past the line's end. RANK 2 or 3.
template <int RANK>
struct LineWalk {
  static constexpr int CA = RANK - 1;  // column axis
  int ng;        // groups per line
  float inv_ng;  // 1 / ng
  int n1;        // RANK 3: lines per axis-0 coordinate (wn[1])
  float inv_n1;  // 1 / n1
  int st0, st1;  // CTA-halo flat strides of line coordinates 0 and 1
  int base;      // CTA-halo flat index of the halo box's first key

  __device__ __forceinline__ void init(const int (&wo)[3], const int (&wn)[3],
                                       const int (&hl)[3]) {
    ng = (wn[CA] + 7) >> 3;
    inv_ng = 1.0f / (float)ng;
    n1 = wn[1];
    inv_n1 = 1.0f / (float)wn[1];
    st0 = hl[1] * hl[2];
    st1 = hl[2];
    base = wo[0] * st0 + wo[1] * st1 + wo[2];
  }

  // Line coordinates (l0, l1), first column and CTA-halo flat index of column 0 of group g.
  __device__ __forceinline__ void group(int g, int& l0, int& l1, int& col0, int& flat0) const {
    const int line = fused::div_small(g, inv_ng);
    col0 = 8 * (g - line * ng);
    if (RANK == 3) {
      l0 = fused::div_small(line, inv_n1);
      l1 = line - l0 * n1;
    } else {
      l0 = line; l1 = 0;
    }
    flat0 = base + l0 * st0 + l1 * st1;
  }

  // Groups [lo, hi) holding the keys of the CTA-halo flat range [f0, f1) (every group when
  // the range is the whole halo): whole lines, the range being cut at CTA-halo lines (a warp
  // line lies inside one).
  __device__ __forceinline__ void range(const int (&wo)[3], const int (&wn)[3],
                                        const int (&hl)[3], int f0, int f1, bool whole,
                                        int& lo, int& hi) const {
    if (whole) {
      lo = 0;
      hi = (RANK == 2 ? wn[0] : wn[0] * wn[1]) * ng;
    } else {
      int nl[3] = {wn[0], wn[1], wn[2]};
      nl[CA] = 1;  // the box of the lines' first keys
      lo = fused::count_before(wo, nl, hl, f0) * ng;
      hi = fused::count_before(wo, nl, hl, f1) * ng;
    }
  }
};

}  // namespace fused_fwd
}  // namespace natten
