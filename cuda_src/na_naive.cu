// Naive neighborhood attention (backend "naive"): unfused qk, av and their backward, and fused forward/backward (online softmax), every element type, rank 1-3.
// Threads: one per output element, or per (row, head-dim chunk of 32, 16 for double) in the fused kernels, or one warp per rpb entry for d_rpb; a row is (batch, token, head); int64 grid-stride loops, no shared memory.
// Reads q, k, v, out, d_out, lse, attn, d_attn, rpb through the element strides of NAParams; writes attn, out, lse, delta and the gradients, and adds into the zeroed d_rpb.
#include "natten/common.cuh"

namespace natten {
namespace naive {

// Head-dim elements one thread accumulates in the fused kernels: bounds the register arrays
// for any head dim (a row with a longer head dim is split over several threads). Doubles take
// two registers each, so their chunk is half as wide (dk and dv together fit without spills).
template <typename A> struct Chunk { static constexpr int size = 32; };
template <> struct Chunk<double> { static constexpr int size = 16; };
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

__device__ __forceinline__ float exp2_of(float x) { return exp2f(x); }
__device__ __forceinline__ double exp2_of(double x) { return exp2(x); }
__device__ __forceinline__ float log2_of(float x) { return log2f(x); }
__device__ __forceinline__ double log2_of(double x) { return log2(x); }
__device__ __forceinline__ float max_of(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_of(double a, double b) { return fmax(a, b); }

// The softmax scale in the accumulation type. Double kernels read the unrounded double: the
// default D ** -0.5 is not a power of two for most head dims, and its float rounding alone
// costs about 1e-8 relative error.
template <typename A> __device__ __forceinline__ A scale_of(const NAParams& p);
template <> __device__ __forceinline__ float scale_of<float>(const NAParams& p) {
  return p.scale;
}
template <> __device__ __forceinline__ double scale_of<double>(const NAParams& p) {
  return p.scale_f64;
}

// Grid-stride loops over int64 work indices: the grid is only a size hint.
__device__ __forceinline__ i64 first_index() {
  return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ i64 index_step() { return (i64)gridDim.x * blockDim.x; }

__device__ __forceinline__ i64 num_rows(const NAParams& p) {
  return p.batch * p.extent[0] * p.extent[1] * p.extent[2] * p.heads;
}

// Rows of the key/value side (k, v, dk, dv): kv_heads per token (grouped-query attention).
__device__ __forceinline__ i64 num_kv_rows(const NAParams& p) {
  return p.batch * p.extent[0] * p.extent[1] * p.extent[2] * p.kv_heads;
}

// One row of a [B, *spatial, H, last] tensor: batch, token coordinates (inert axes 0), head.
struct Row {
  i64 b;
  int x[3];
  int h;
};

// Row of flattened index r over (batch, axis0, axis1, axis2, head), head fastest, for a
// tensor of `heads` heads (p.heads: the query side; p.kv_heads: k, v and their gradients).
template <int RANK>
__device__ __forceinline__ Row row_of(const NAParams& p, i64 r, i64 heads) {
  Row row;
  row.h = (int)(r % heads);
  r /= heads;
#pragma unroll
  for (int a = 2; a >= 0; --a) {
    if (a < RANK) {
      row.x[a] = (int)(r % p.extent[a]);
      r /= p.extent[a];
    } else {
      row.x[a] = 0;
    }
  }
  row.b = r;
  return row;
}

template <int RANK>
__device__ __forceinline__ Row row_of(const NAParams& p, i64 r) {
  return row_of<RANK>(p, r, p.heads);
}

// Offset of element e of the row at token y (batch and head taken from row).
__device__ __forceinline__ i64 at(const i64* st, const Row& row, const int y[3], i64 e) {
  return offset6(st, row.b, y[0], y[1], y[2], row.h, e);
}

// The key/value-side row that query row `row` reads: kv head h / heads_per_kv.
__device__ __forceinline__ Row kv_row(const NAParams& p, const Row& row) {
  Row r = row;
  r.h = (int)(row.h / p.heads_per_kv);
  return r;
}

// Query row g (0 .. heads_per_kv - 1) of the group that reads kv row `row`.
__device__ __forceinline__ Row group_row(const NAParams& p, const Row& row, int g) {
  Row r = row;
  r.h = (int)(row.h * p.heads_per_kv + g);
  return r;
}

// Forward window of a query, per axis: slot t holds key coordinate first + step * t, and
// slots t >= count are empty (count < kernel only in causal windows). Inert axes: 0, 1, 1, 1.
struct Window {
  int first[3], count[3], step[3], kernel[3];
};

// Calls f(y, t) for every key of window w: y its coordinates, t its slot (row-major over the
// per-axis slots), in slot order.
template <typename F>
__device__ __forceinline__ void for_each_key(const Window& w, F&& f) {
  int y[3];
  for (int t0 = 0; t0 < w.count[0]; ++t0) {
    y[0] = w.first[0] + w.step[0] * t0;
    for (int t1 = 0; t1 < w.count[1]; ++t1) {
      y[1] = w.first[1] + w.step[1] * t1;
      for (int t2 = 0; t2 < w.count[2]; ++t2) {
        y[2] = w.first[2] + w.step[2] * t2;
        f(y, ((i64)t0 * w.kernel[1] + t1) * w.kernel[2] + t2);
      }
    }
  }
}

template <int RANK>
__device__ __forceinline__ Window window_of(const NAParams& p, const int x[3]) {
  Window w;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    if (a < RANK) {
      const Axis ax = axis_of(p, a);
      ax.query_window(x[a], w.first[a], w.count[a]);
      w.step[a] = ax.dilation;
      w.kernel[a] = ax.kernel;
    } else {
      w.first[a] = 0;
      w.count[a] = 1;
      w.step[a] = 1;
      w.kernel[a] = 1;
    }
  }
  return w;
}

// Inverse window of a key, per axis: the queries whose windows hold it are the in-group
// indices [lo, hi) of its dilation group, coordinates group + step * index. jg and glen are
// the key's in-group index and the group's size (to find the key's slot in each window).
struct InverseWindow {
  int lo[3], hi[3], group[3], step[3], jg[3], glen[3];
};

template <int RANK>
__device__ __forceinline__ InverseWindow inverse_window_of(const NAParams& p, const int y[3]) {
  InverseWindow iw;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    if (a < RANK) {
      const Axis ax = axis_of(p, a);
      iw.group[a] = ax.group_of(y[a]);
      iw.jg[a] = ax.in_group(y[a]);
      iw.glen[a] = ax.group_len(iw.group[a]);
      iw.step[a] = ax.dilation;
      ax.inverse_window(iw.jg[a], iw.glen[a], iw.lo[a], iw.hi[a]);
    } else {
      iw.lo[a] = 0;
      iw.hi[a] = 1;
      iw.group[a] = 0;
      iw.step[a] = 1;
      iw.jg[a] = 0;
      iw.glen[a] = 1;
    }
  }
  return iw;
}

// Slot, on axis a, of the inverse window's key in the window of in-group query ig.
template <int RANK>
__device__ __forceinline__ int slot_in_window(const NAParams& p, const InverseWindow& iw, int a,
                                              int ig) {
  if (a >= RANK) return 0;
  int start, end;
  axis_of(p, a).window(ig, iw.glen[a], start, end);
  return iw.jg[a] - start;
}

// sum_e a[e * sa] * b[e * sb] over the head dim, in the accumulation type.
template <typename T>
__device__ __forceinline__ typename Acc<T>::type dot(const T* a, i64 sa, const T* b, i64 sb,
                                                     i64 n) {
  typename Acc<T>::type s = 0;
  for (i64 e = 0; e < n; ++e, a += sa, b += sb) s += to_float(*a) * to_float(*b);
  return s;
}

// ---- unfused building blocks ------------------------------------------------------------

// out[row, t] = <a[row], b[key in slot t]> (+ rpb[h, offset of that key]) for every slot t;
// `empty` at slots outside a causal window; b is key/value-side (kv head of the row's head).
// One thread per output element.
template <typename T, int RANK>
__device__ __forceinline__ void window_dots(const NAParams& p, const T* a, const i64* sa,
                                            const T* b, const i64* sb, const T* rpb, T* out,
                                            const i64* so, typename Acc<T>::type empty) {
  typedef typename Acc<T>::type A;
  const i64 K = p.num_neighbors;
  const i64 total = num_rows(p) * K;
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const int slot = (int)(idx % K);
    const Row row = row_of<RANK>(p, idx / K);
    const Window w = window_of<RANK>(p, row.x);
    int ts[3];  // per-axis slots, row-major
    int rest = slot;
#pragma unroll
    for (int ax = 2; ax >= 0; --ax) {
      ts[ax] = rest % w.kernel[ax];
      rest /= w.kernel[ax];
    }
    A value = empty;
    if (ts[0] < w.count[0] && ts[1] < w.count[1] && ts[2] < w.count[2]) {
      int y[3];
#pragma unroll
      for (int ax = 0; ax < 3; ++ax) y[ax] = w.first[ax] + w.step[ax] * ts[ax];
      value = dot(a + at(sa, row, row.x, 0), sa[5], b + at(sb, kv_row(p, row), y, 0), sb[5],
                  p.head_dim);
      if (rpb != nullptr) {
        // Same dilation group, so (y - x) / step is the exact in-group offset j' - i'.
        i64 r = row.h * p.rpb[0];
#pragma unroll
        for (int ax = 0; ax < RANK; ++ax)
          r += (i64)((y[ax] - row.x[ax]) / w.step[ax] + w.kernel[ax] - 1) * p.rpb[1 + ax];
        value += to_float(rpb[r]);
      }
    }
    out[at(so, row, row.x, slot)] = store_as<T>(value);
  }
}

// out[row, e] = sum over valid slots t of weights[row, t] * src[key in slot t, e]: av and the
// dq of qk (src key/value-side: v, k). One thread per output element; empty slots are never
// read.
template <typename T, int RANK>
__device__ __forceinline__ void window_weighted_sum(const NAParams& p, const T* weights,
                                                    const i64* sw, const T* src, const i64* ss,
                                                    T* out, const i64* so) {
  typedef typename Acc<T>::type A;
  const i64 D = p.head_dim;
  const i64 total = num_rows(p) * D;
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const i64 e = idx % D;
    const Row row = row_of<RANK>(p, idx / D);
    const Window w = window_of<RANK>(p, row.x);
    const T* wrow = weights + at(sw, row, row.x, 0);
    const Row kv = kv_row(p, row);
    A acc = 0;
    for_each_key(w, [&](const int (&y)[3], i64 t) {
      acc += to_float(wrow[t * sw[5]]) * to_float(src[at(ss, kv, y, e)]);
    });
    out[at(so, row, row.x, e)] = store_as<T>(acc);
  }
}

// out[key, e] = sum over queries i whose window holds the key of
// weights[i, slot of key in i's window] * src[i, e]: the dk of qk and the dv of av.
// One thread per output element of the key/value side, looping over the inverse window and
// over the query heads of the kv head's group (in order: deterministic, no atomics).
template <typename T, int RANK>
__device__ __forceinline__ void inverse_weighted_sum(const NAParams& p, const T* weights,
                                                     const i64* sw, const T* src, const i64* ss,
                                                     T* out, const i64* so) {
  typedef typename Acc<T>::type A;
  const i64 D = p.head_dim;
  const i64 total = num_kv_rows(p) * D;
  const int k1 = (int)p.kernel[1], k2 = (int)p.kernel[2];
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const i64 e = idx % D;
    const Row row = row_of<RANK>(p, idx / D, p.kv_heads);
    const InverseWindow iw = inverse_window_of<RANK>(p, row.x);
    A acc = 0;
    int x[3];
    for (int g = 0; g < (int)p.heads_per_kv; ++g) {
      const Row qrow = group_row(p, row, g);
      for (int i0 = iw.lo[0]; i0 < iw.hi[0]; ++i0) {
        x[0] = iw.group[0] + iw.step[0] * i0;
        const int s0 = slot_in_window<RANK>(p, iw, 0, i0);
        for (int i1 = iw.lo[1]; i1 < iw.hi[1]; ++i1) {
          x[1] = iw.group[1] + iw.step[1] * i1;
          const int s1 = slot_in_window<RANK>(p, iw, 1, i1);
          for (int i2 = iw.lo[2]; i2 < iw.hi[2]; ++i2) {
            x[2] = iw.group[2] + iw.step[2] * i2;
            const int s2 = slot_in_window<RANK>(p, iw, 2, i2);
            const i64 t = ((i64)s0 * k1 + s1) * k2 + s2;
            acc += to_float(weights[at(sw, qrow, x, t)]) * to_float(src[at(ss, qrow, x, e)]);
          }
        }
      }
    }
    out[at(so, row, row.x, e)] = store_as<T>(acc);
  }
}

// ---- unfused kernels --------------------------------------------------------------------

// attn = q k^T over each window (no scale) + rpb; -inf at empty causal slots.
// rpb may be null (no bias).
template <typename T, int RANK>
__global__ void na_qk_naive(const T* q, const T* k, const T* rpb, T* attn, NAParams p) {
  window_dots<T, RANK>(p, q, p.q, k, p.k, rpb, attn, p.attn,
                       negative_infinity<typename Acc<T>::type>());
}

// out = attn v over each window; empty causal slots are ignored whatever they hold.
template <typename T, int RANK>
__global__ void na_av_naive(const T* attn, const T* v, T* out, NAParams p) {
  window_weighted_sum<T, RANK>(p, attn, p.attn, v, p.v, out, p.o);
}

// dq = d_attn k over each window.
template <typename T, int RANK>
__global__ void na_qk_bwd_dq_naive(const T* d_attn, const T* k, T* dq, NAParams p) {
  window_weighted_sum<T, RANK>(p, d_attn, p.d_attn, k, p.k, dq, p.dq);
}

// dk = d_attn^T q over each inverse window.
template <typename T, int RANK>
__global__ void na_qk_bwd_dk_naive(const T* d_attn, const T* q, T* dk, NAParams p) {
  inverse_weighted_sum<T, RANK>(p, d_attn, p.d_attn, q, p.q, dk, p.dk);
}

// d_rpb[h, r] += sum over every (batch, query) whose window holds the key at offset r of
// value(row, slot t, key coordinates y). One warp per (head, rpb entry): lanes stride over
// the queries and the warp sums with shuffles, so the result is deterministic and needs
// neither atomics nor scratch.
template <typename T, int RANK, typename F>
__device__ __forceinline__ void rpb_sums(const NAParams& p, typename Acc<T>::type* d_rpb,
                                         F&& value) {
  typedef typename Acc<T>::type A;
  int span[3];  // 2k - 1 offsets per axis (1 on inert axes)
#pragma unroll
  for (int a = 0; a < 3; ++a) span[a] = 2 * (int)p.kernel[a] - 1;
  const i64 per_head = (i64)span[0] * span[1] * span[2];
  const i64 entries = p.heads * per_head;
  const i64 queries = p.batch * p.extent[0] * p.extent[1] * p.extent[2];
  const int lane = threadIdx.x % 32;
  // The warp index is uniform across a warp, so every lane reaches the shuffles.
  for (i64 entry = first_index() / 32; entry < entries; entry += index_step() / 32) {
    const int h = (int)(entry / per_head);
    int r = (int)(entry % per_head);
    int off[3], rel[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      off[a] = r % span[a];
      r /= span[a];
      rel[a] = off[a] - ((int)p.kernel[a] - 1);  // in-group j' - i'
    }
    A sum = 0;
    for (i64 qi = lane; qi < queries; qi += 32) {
      i64 rest = qi;
      Row row;
      row.h = h;
#pragma unroll
      for (int a = 2; a >= 0; --a) {
        if (a < RANK) {
          row.x[a] = (int)(rest % p.extent[a]);
          rest /= p.extent[a];
        } else {
          row.x[a] = 0;
        }
      }
      row.b = rest;
      bool valid = true;
      i64 t = 0;
      int y[3] = {0, 0, 0};
#pragma unroll
      for (int a = 0; a < RANK; ++a) {
        const Axis ax = axis_of(p, a);
        const int g = ax.group_of(row.x[a]);
        const int jg = ax.in_group(row.x[a]) + rel[a];
        int start, end;
        ax.window(ax.in_group(row.x[a]), ax.group_len(g), start, end);
        valid = valid && jg >= start && jg < end;
        t = t * ax.kernel + (jg - start);
        y[a] = g + ax.dilation * jg;
      }
      if (valid) sum += value(row, t, y);
    }
#pragma unroll
    for (int width = 16; width > 0; width >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, width);
    if (lane == 0) {
      i64 o = h * p.d_rpb[0];
#pragma unroll
      for (int a = 0; a < RANK; ++a) o += off[a] * p.d_rpb[1 + a];
      d_rpb[o] += sum;
    }
  }
}

// d_rpb[h, r] += sum of d_attn over every (batch, query) whose window holds offset r.
template <typename T, int RANK>
__global__ void na_qk_bwd_rpb_naive(const T* d_attn, typename Acc<T>::type* d_rpb,
                                    NAParams p) {
  rpb_sums<T, RANK>(p, d_rpb, [&](const Row& row, i64 t, const int (&)[3]) {
    return (typename Acc<T>::type)to_float(d_attn[at(p.d_attn, row, row.x, t)]);
  });
}

// d_attn = d_out v^T over each window; 0 at empty causal slots.
template <typename T, int RANK>
__global__ void na_av_bwd_dattn_naive(const T* d_out, const T* v, T* d_attn, NAParams p) {
  window_dots<T, RANK>(p, d_out, p.d_o, v, p.v, nullptr, d_attn, p.d_attn, 0);
}

// dv = attn^T d_out over each inverse window.
template <typename T, int RANK>
__global__ void na_av_bwd_dv_naive(const T* attn, const T* d_out, T* dv, NAParams p) {
  inverse_weighted_sum<T, RANK>(p, attn, p.attn, d_out, p.d_o, dv, p.dv);
}

// ---- fused kernels ----------------------------------------------------------------------

// Relative positional bias of query x and key y (full coordinates, one dilation group) for
// query head h: rpb[h, (y - x) / d + k - 1, ...]; 0 without a bias (rpb null).
template <typename T, typename A, int RANK>
__device__ __forceinline__ A rpb_at(const NAParams& p, const T* rpb, int h, const int (&x)[3],
                                    const int (&y)[3]) {
  if (rpb == nullptr) return (A)0;
  i64 o = h * p.rpb[0];
#pragma unroll
  for (int a = 0; a < RANK; ++a)
    o += ((y[a] - x[a]) / (int)p.dilation[a] + (int)p.kernel[a] - 1) * p.rpb[1 + a];
  return to_float(rpb[o]);
}

// Chunks of a head dim of `dim` elements per row; rows times chunks are the work items of the
// fused kernels (dim: the head dim of what a kernel writes: out has v_dim, dq head_dim, and
// dk, dv together the larger of the two).
template <int kChunk>
__device__ __forceinline__ int num_chunks(i64 dim) {
  return (int)((dim + kChunk - 1) / kChunk);
}

// out = softmax(scale q k^T) v over each window, online (one pass over the keys), and
// lse = log sum exp (natural log). Scores are kept in log2 units (scale * log2(e) folded in)
// so that exp2 serves; one thread per (row, chunk), chunk 0 also writes lse. rpb: relative
// positional bias added to the scores (null: none).
template <typename T, int RANK>
__global__ void na_fwd_naive(const T* q, const T* k, const T* v, T* out,
                             typename Acc<T>::type* lse, const T* rpb, NAParams p) {
  typedef typename Acc<T>::type A;
  constexpr int kChunk = Chunk<A>::size;
  const int chunks = num_chunks<kChunk>(p.v_dim);  // out's columns
  const i64 total = num_rows(p) * chunks;
  const A scale_log2 = scale_of<A>(p) * (A)kLog2e;
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const int c = (int)(idx % chunks);
    const Row row = row_of<RANK>(p, idx / chunks);
    const Window w = window_of<RANK>(p, row.x);
    const int e0 = c * kChunk;
    const int n = min(kChunk, (int)(p.v_dim - e0));
    const T* q_row = q + at(p.q, row, row.x, 0);
    const Row kv = kv_row(p, row);
    A m = negative_infinity<A>(), l = 0, acc[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) acc[j] = 0;
    for_each_key(w, [&](const int (&y)[3], i64) {
      const A s = dot(q_row, p.q[5], k + at(p.k, kv, y, 0), p.k[5], p.head_dim) * scale_log2 +
                  rpb_at<T, A, RANK>(p, rpb, row.h, row.x, y) * (A)kLog2e;
      const A m_new = max_of(m, s);
      const A correction = exp2_of(m - m_new);  // 0 on the first key (m = -inf)
      const A prob = exp2_of(s - m_new);
      l = l * correction + prob;
      const T* v_row = v + at(p.v, kv, y, e0);
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
        if (j < n) acc[j] = acc[j] * correction + prob * to_float(v_row[j * p.v[5]]);
      m = m_new;
    });
    const A inv_l = (A)1 / l;
    T* out_row = out + at(p.o, row, row.x, e0);
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      if (j < n) out_row[j * p.o[5]] = store_as<T>(acc[j] * inv_l);
    if (c == 0) lse[at(p.lse, row, row.x, 0)] = (m + log2_of(l)) * (A)kLn2;
  }
}

// delta = rowsum(d_out * out), the softmax-backward correction; one thread per row.
template <typename T, int RANK>
__global__ void na_bwd_delta_naive(const T* out, const T* d_out, typename Acc<T>::type* delta,
                                   NAParams p) {
  const i64 total = num_rows(p);
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const Row row = row_of<RANK>(p, idx);
    delta[at(p.delta, row, row.x, 0)] =
        dot(out + at(p.o, row, row.x, 0), p.o[5], d_out + at(p.d_o, row, row.x, 0), p.d_o[5],
            p.v_dim);
  }
}

// dq_i = scale * sum_j dS_ij k_j over the window, with P_ij = exp(scale q_i.k_j - lse_i)
// recomputed and dS_ij = P_ij (d_out_i.v_j - delta_i). One thread per (row, chunk).
template <typename T, int RANK>
__global__ void na_bwd_dq_naive(const T* q, const T* k, const T* v, const T* d_out,
                                const typename Acc<T>::type* lse,
                                const typename Acc<T>::type* delta, T* dq, const T* rpb,
                                NAParams p) {
  typedef typename Acc<T>::type A;
  constexpr int kChunk = Chunk<A>::size;
  const int chunks = num_chunks<kChunk>(p.head_dim);
  const i64 total = num_rows(p) * chunks;
  const A scale_log2 = scale_of<A>(p) * (A)kLog2e;
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const int c = (int)(idx % chunks);
    const Row row = row_of<RANK>(p, idx / chunks);
    const Window w = window_of<RANK>(p, row.x);
    const int e0 = c * kChunk;
    const int n = min(kChunk, (int)(p.head_dim - e0));
    const T* q_row = q + at(p.q, row, row.x, 0);
    const T* do_row = d_out + at(p.d_o, row, row.x, 0);
    const A lse_log2 = lse[at(p.lse, row, row.x, 0)] * (A)kLog2e;
    const A delta_i = delta[at(p.delta, row, row.x, 0)];
    const Row kv = kv_row(p, row);
    A acc[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) acc[j] = 0;
    for_each_key(w, [&](const int (&y)[3], i64) {
      const T* k_row = k + at(p.k, kv, y, 0);
      const A prob =
          exp2_of(dot(q_row, p.q[5], k_row, p.k[5], p.head_dim) * scale_log2 +
                  rpb_at<T, A, RANK>(p, rpb, row.h, row.x, y) * (A)kLog2e - lse_log2);
      const A d_score =
          prob * (dot(do_row, p.d_o[5], v + at(p.v, kv, y, 0), p.v[5], p.v_dim) - delta_i);
      const T* k_chunk = k_row + e0 * p.k[5];
#pragma unroll
      for (int j = 0; j < kChunk; ++j)
        if (j < n) acc[j] += d_score * to_float(k_chunk[j * p.k[5]]);
    });
    T* dq_row = dq + at(p.dq, row, row.x, e0);
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      if (j < n) dq_row[j * p.dq[5]] = store_as<T>(acc[j] * scale_of<A>(p));
  }
}

// dk_j = scale * sum_i dS_ij q_i and dv_j = sum_i P_ij d_out_i over the inverse window of
// key j and the query heads of its kv head's group (P and dS recomputed as in
// na_bwd_dq_naive). One thread per (key row, chunk), rows over the kv heads.
template <typename T, int RANK>
__global__ void na_bwd_dkdv_naive(const T* q, const T* k, const T* v, const T* d_out,
                                  const typename Acc<T>::type* lse,
                                  const typename Acc<T>::type* delta, T* dk, T* dv,
                                  const T* rpb, NAParams p) {
  typedef typename Acc<T>::type A;
  constexpr int kChunk = Chunk<A>::size;
  // dk has head_dim columns, dv v_dim: chunks cover the larger, each side stops at its own.
  const int chunks = num_chunks<kChunk>(max(p.head_dim, p.v_dim));
  const i64 total = num_kv_rows(p) * chunks;
  const A scale_log2 = scale_of<A>(p) * (A)kLog2e;
  for (i64 idx = first_index(); idx < total; idx += index_step()) {
    const int c = (int)(idx % chunks);
    const Row row = row_of<RANK>(p, idx / chunks, p.kv_heads);
    const InverseWindow iw = inverse_window_of<RANK>(p, row.x);
    const int e0 = c * kChunk;
    const int n = min(kChunk, (int)(p.head_dim - e0)), nv = min(kChunk, (int)(p.v_dim - e0));
    const T* k_row = k + at(p.k, row, row.x, 0);
    const T* v_row = v + at(p.v, row, row.x, 0);
    A acc_k[kChunk], acc_v[kChunk];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) acc_k[j] = acc_v[j] = 0;
    int x[3];
    // The bias of query (i0, i1, i2) (in-group indices) and this key: rpb[bias0 - sum i * s]
    // with bias0 = head * s_h + sum (key's in-group index + k - 1) * s.
    i64 key_part = 0;
#pragma unroll
    for (int a = 0; a < RANK; ++a)
      key_part += (row.x[a] / (int)p.dilation[a] + p.kernel[a] - 1) * p.rpb[1 + a];
    for (int g = 0; g < (int)p.heads_per_kv; ++g) {
      const Row qr = group_row(p, row, g);
      const i64 bias0 = key_part + qr.h * p.rpb[0];
      for (int i0 = iw.lo[0]; i0 < iw.hi[0]; ++i0) {
        x[0] = iw.group[0] + iw.step[0] * i0;
        for (int i1 = iw.lo[1]; i1 < iw.hi[1]; ++i1) {
          x[1] = iw.group[1] + iw.step[1] * i1;
          for (int i2 = iw.lo[2]; i2 < iw.hi[2]; ++i2) {
            x[2] = iw.group[2] + iw.step[2] * i2;
            const T* q_row = q + at(p.q, qr, x, 0);
            const T* do_row = d_out + at(p.d_o, qr, x, 0);
            const A bias = rpb == nullptr ? (A)0 : (A)to_float(
                rpb[bias0 - i0 * p.rpb[1] - i1 * p.rpb[2] - i2 * p.rpb[3]]);
            const A prob = exp2_of(dot(q_row, p.q[5], k_row, p.k[5], p.head_dim) * scale_log2 +
                                   bias * (A)kLog2e - lse[at(p.lse, qr, x, 0)] * (A)kLog2e);
            const A d_score = prob * (dot(do_row, p.d_o[5], v_row, p.v[5], p.v_dim) -
                                      delta[at(p.delta, qr, x, 0)]);
            const T* q_chunk = q_row + e0 * p.q[5];
            const T* do_chunk = do_row + e0 * p.d_o[5];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
              if (j < n) acc_k[j] += d_score * to_float(q_chunk[j * p.q[5]]);
              if (j < nv) acc_v[j] += prob * to_float(do_chunk[j * p.d_o[5]]);
            }
          }
        }
      }
    }
    T* dk_row = dk + at(p.dk, row, row.x, e0);
    T* dv_row = dv + at(p.dv, row, row.x, e0);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j < n) dk_row[j * p.dk[5]] = store_as<T>(acc_k[j] * scale_of<A>(p));
      if (j < nv) dv_row[j * p.dv[5]] = store_as<T>(acc_v[j]);
    }
  }
}

// Fused backward's d_rpb[h, r] += sum of dS_ij over the (query i, key j) pairs at offset r
// (dS recomputed as in na_bwd_dq_naive); d_rpb zeroed by the caller.
template <typename T, int RANK>
__global__ void na_bwd_rpb_naive(const T* q, const T* k, const T* v, const T* d_out,
                                 const typename Acc<T>::type* lse,
                                 const typename Acc<T>::type* delta, const T* rpb,
                                 typename Acc<T>::type* d_rpb, NAParams p) {
  typedef typename Acc<T>::type A;
  const A scale_log2 = scale_of<A>(p) * (A)kLog2e;
  rpb_sums<T, RANK>(p, d_rpb, [&](const Row& row, i64, const int (&y)[3]) {
    const Row kv = kv_row(p, row);
    const A prob = exp2_of(dot(q + at(p.q, row, row.x, 0), p.q[5], k + at(p.k, kv, y, 0),
                               p.k[5], p.head_dim) * scale_log2 +
                           rpb_at<T, A, RANK>(p, rpb, row.h, row.x, y) * (A)kLog2e -
                           lse[at(p.lse, row, row.x, 0)] * (A)kLog2e);
    return prob * (dot(d_out + at(p.d_o, row, row.x, 0), p.d_o[5], v + at(p.v, kv, y, 0),
                       p.v[5], p.v_dim) - delta[at(p.delta, row, row.x, 0)]);
  });
}

}  // namespace naive
}  // namespace natten

// Kernels are instantiated by name expression (natten_cupy.backends.naive), e.g.
// "na_fwd_naive<float, 2>"; the names live at global scope for that.
using natten::naive::na_qk_naive;
using natten::naive::na_av_naive;
using natten::naive::na_qk_bwd_dq_naive;
using natten::naive::na_qk_bwd_dk_naive;
using natten::naive::na_qk_bwd_rpb_naive;
using natten::naive::na_av_bwd_dattn_naive;
using natten::naive::na_av_bwd_dv_naive;
using natten::naive::na_fwd_naive;
using natten::naive::na_bwd_delta_naive;
using natten::naive::na_bwd_dq_naive;
using natten::naive::na_bwd_dkdv_naive;
using natten::naive::na_bwd_rpb_naive;
