// Window arithmetic of neighborhood attention, per axis (SPEC section 1); used by every kernel.
// Pure integer functions of one axis; callers loop over the (padded) rank.
// Coordinates are int32; nothing here touches memory.
#pragma once

namespace natten {

// One axis of the problem. Axes beyond the problem's rank are inert: extent 1, kernel 1,
// stride 1, dilation 1, not causal, which makes every window the single coordinate 0.
struct Axis {
  int extent, kernel, stride, dilation, causal;

  // Full-axis coordinate i is member in_group(i) of dilation group group_of(i); group g's
  // members are the coordinates g + dilation * ig.
  __device__ __forceinline__ int group_of(int i) const { return group_of(i, dilation); }
  __device__ __forceinline__ int in_group(int i) const { return in_group(i, dilation); }

  // Members of dilation group g: ceil((L - g) / d).
  __device__ __forceinline__ int group_len(int g) const {
    return dilation == 1 ? extent : (extent - g + dilation - 1) / dilation;
  }
  // Members of the longest group, group 0: ceil(L / d). No dilation-1 branch (group_len(0)
  // has one): callers size grids and tiles with it, off the per-element path.
  __device__ __forceinline__ int longest_group() const { return longest_group(extent, dilation); }

  // The same three rules in the caller's integer width, for addressing that stays 64-bit
  // throughout (the Hopper backward's float32 dQ workspace, indexed by i64 coordinates).
  template <typename I> static __device__ __forceinline__ I group_of(I i, I d) { return i % d; }
  template <typename I> static __device__ __forceinline__ I in_group(I i, I d) { return i / d; }
  template <typename I> static __device__ __forceinline__ I longest_group(I len, I d) {
    return (len + d - 1) / d;
  }

  // In-group window [start, end) of in-group query index ig, in a group of glen members.
  // Non-causal windows are shifted inward at borders (always `kernel` keys); causal windows
  // end at the query itself and are truncated at the start of the group.
  __device__ __forceinline__ void window(int ig, int glen, int& start, int& end) const {
    // stride 1 and dilation 1 are the common case: skip the integer divisions there.
    const int leader_base = stride == 1 ? ig : (ig / stride) * stride;
    if (causal) {
      const int leader = min(leader_base + stride - 1, glen - 1);
      start = max(leader - kernel + 1, 0);
      end = ig + 1;
    } else {
      const int leader = min(leader_base + stride / 2, glen - 1);
      start = min(max(leader - kernel / 2, 0), glen - kernel);
      end = start + kernel;
    }
  }

  // In-group query range [lo, hi) whose windows contain in-group key jg. Window starts and
  // ends never decrease with the query index, so the range is contiguous. Stride 1 has a
  // closed form (no bisection on a kernel's critical path): causal windows [i - k + 1, i]
  // hold jg for i in [jg, jg + k); non-causal ones start at clamp(i - k / 2, 0, glen - k),
  // so the first query whose start reaches t is 0 for t <= 0, i = t + k / 2 up to
  // t = glen - k, none past it. Other strides: two bisections.
  __device__ __forceinline__ void inverse_window(int jg, int glen, int& lo, int& hi) const {
    if (stride == 1 && glen >= kernel) {
      if (causal) {
        lo = jg;
        hi = min(jg + kernel, glen);
      } else {
        const int t = jg - kernel + 1;  // the earliest start that still holds jg
        lo = t <= 0 ? 0 : t + kernel / 2;
        hi = jg + 1 > glen - kernel ? glen : jg + 1 + kernel / 2;
      }
      return;
    }
    int a = 0, b = glen;  // first query whose window ends after jg
    while (a < b) {
      const int mid = (a + b) >> 1;
      int s, e;
      window(mid, glen, s, e);
      if (e > jg) b = mid; else a = mid + 1;
    }
    lo = a;
    a = lo; b = glen;     // first query whose window starts after jg
    while (a < b) {
      const int mid = (a + b) >> 1;
      int s, e;
      window(mid, glen, s, e);
      if (s > jg) b = mid; else a = mid + 1;
    }
    hi = a;
  }

  // Window of coordinate i in full-axis coordinates: its keys are first + dilation * t for
  // t in [0, count), and slot t of the unfused attention weights holds key first + dilation * t.
  __device__ __forceinline__ void query_window(int i, int& first, int& count) const {
    const int g = dilation == 1 ? 0 : group_of(i), ig = dilation == 1 ? i : in_group(i);
    int s, e;
    window(ig, group_len(g), s, e);
    first = g + dilation * s;
    count = e - s;
  }
};

}  // namespace natten
