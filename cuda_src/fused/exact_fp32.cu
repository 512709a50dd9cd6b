// Exact-float32 fused neighborhood attention (FFMA only, no TF32): forward (out, lse) and backward (delta = rowsum(dO * O), dQ query-parallel, dK/dV key-parallel; no atomics).
// A CTA of 128 threads owns a box of rows (queries; keys for dK/dV) of one (batch, head, dilation group); each group of G lanes owns a micro-tile of 4 rows, each lane a strided quarter of the head dim; the other side streams through shared memory in slabs of the CTA's halo, and each group walks only the union of its rows' windows (inverse windows for dK/dV).
// Reads q, k, v, out, d_out, lse through NAParams strides (last dim contiguous, 16-byte rows; the launcher copies otherwise); writes out, lse, delta, dq, dk, dv (float32).
// Takes the NAParams every family takes (inert axes padded at the back) and a TilePlan in the problem's axis order. The forward, dQ and dK/dV kernels work in a front-padded view of both, derived at entry from the common NAParams (front_padded): the problem's axis a is the view's axis a + 3 - rank and the vacated front axes are inert, so axis 2 is always the innermost real axis and the micro-tiles sit on axes 1 and 2. They are instantiated per rank (RANK, equal to TilePlan::rank), so that the view folds into fixed parameter fields: a run-time rank keeps the selected fields in registers, and the kernels, at 230-255 registers, spill. The delta kernel walks every row in either padding and reads NAParams as it is.
#include "natten/common.cuh"
#include "natten/mma.cuh"

namespace natten {
namespace fp32 {

constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Launch plan chosen by the launcher (twin of exact_fp32.PLAN_DTYPE), in the problem's axis
// order with inert axes (all 1) at the back, as in NAParams; the kernels read its
// front_padded view.
struct TilePlan {
  int cta[3];    // micro-tiles per CTA along each axis
  int slab[3];   // extents of one shared-memory slab (in-group cells) along each axis
  int tiles[3];  // CTAs along each axis (over the longest dilation group)
  int rank;      // of the problem (the kernels' RANK): axes rank..2 are inert
};

// Axis a of the front-padded view of per-axis values x in the problem's order (axes rank..2
// inert): x[a - (3 - rank)] where that is a real axis, else `inert`. rank is a compile-time
// constant at every call (the kernels' RANK), so this is one fixed field.
template <typename T>
__device__ __forceinline__ T front_axis(const T* x, int a, int rank, T inert) {
  return a >= 3 - rank ? x[a - (3 - rank)] : inert;
}

// Tensor strides over (batch, axis0, axis1, axis2, head, last) in the front-padded view.
__device__ __forceinline__ void front_strides(i64 (&to)[6], const i64 (&from)[6], int rank) {
#pragma unroll
  for (int a = 0; a < 3; ++a) to[1 + a] = front_axis(from + 1, a, rank, 0ll);
}

// The kernels' view of the common (back-padded) NAParams: the problem's axis a moves to axis
// a + 3 - rank (extent, kernel, stride, dilation, causal, and stride 1 + a of every tensor),
// the vacated front axes are inert (extent, kernel, stride, dilation 1, causal 0, strides 0).
__device__ __forceinline__ NAParams front_padded(const NAParams& p, int rank) {
  NAParams f = p;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    f.extent[a] = front_axis(p.extent, a, rank, 1ll);
    f.kernel[a] = front_axis(p.kernel, a, rank, 1ll);
    f.stride[a] = front_axis(p.stride, a, rank, 1ll);
    f.dilation[a] = front_axis(p.dilation, a, rank, 1ll);
    f.causal[a] = front_axis(p.causal, a, rank, 0ll);
  }
  front_strides(f.q, p.q, rank);
  front_strides(f.k, p.k, rank);
  front_strides(f.v, p.v, rank);
  front_strides(f.o, p.o, rank);
  front_strides(f.d_o, p.d_o, rank);
  front_strides(f.dq, p.dq, rank);
  front_strides(f.dk, p.dk, rank);
  front_strides(f.dv, p.dv, rank);
  front_strides(f.lse, p.lse, rank);
  front_strides(f.delta, p.delta, rank);
  front_strides(f.attn, p.attn, rank);
  front_strides(f.d_attn, p.d_attn, rank);
  front_strides(f.rpb, p.rpb, rank);
  front_strides(f.d_rpb, p.d_rpb, rank);
  return f;
}

// The same view of a TilePlan (inert axes: one micro-tile, slab cell and CTA).
__device__ __forceinline__ TilePlan front_padded(const TilePlan& tp, int rank) {
  TilePlan f = tp;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    f.cta[a] = front_axis(tp.cta, a, rank, 1);
    f.slab[a] = front_axis(tp.slab, a, rank, 1);
    f.tiles[a] = front_axis(tp.tiles, a, rank, 1);
  }
  return f;
}

// Row padding (floats) of shared-memory rows. Within a quarter warp (one 128-byte wavefront of
// a 16-byte load), groups whose micro-tiles are neighbors along axis 2 read rows MT2 apart; the
// pad puts them on distinct banks where 16-byte rows allow it (G >= 2 with MT2 = 2, G >= 4
// with MT2 = 4).
template <int G, int MT2> struct RowPad { enum { value = (G == 4 && MT2 == 2) ? 8 : 4 }; };

__device__ __forceinline__ float dot4(float acc, float4 a, float4 b) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

__device__ __forceinline__ void axpy4(float4& acc, float a, float4 x) {
  acc.x = fmaf(a, x.x, acc.x);
  acc.y = fmaf(a, x.y, acc.y);
  acc.z = fmaf(a, x.z, acc.z);
  acc.w = fmaf(a, x.w, acc.w);
}

__device__ __forceinline__ float4 scale4(float4 x, float a) {
  return make_float4(x.x * a, x.y * a, x.z * a, x.w * a);
}

// Sum over the G consecutive lanes of a group (G a power of two, groups aligned).
template <int G> __device__ __forceinline__ float group_sum(float x, unsigned mask) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) x += __shfl_xor_sync(mask, x, off, G);
  return x;
}

template <int G> __device__ __forceinline__ unsigned group_mask() {
  const int lane = threadIdx.x & 31;
  return G == 32 ? 0xffffffffu : (((1u << (G & 31)) - 1u) << (lane & ~(G - 1)));
}

// The CTA's batch, head, dilation group per axis and first in-group row per axis.
struct Cta {
  Axis ax[3];
  int g[3], glen[3], first[3];
  int b, h;

  __device__ __forceinline__ Cta(const NAParams& p, const TilePlan& tp, const int (&mt)[3]) {
    int r = blockIdx.x;
    int t[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      t[a] = r % tp.tiles[a];
      r /= tp.tiles[a];
    }
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      ax[a] = axis_of(p, a);
      g[a] = r % ax[a].dilation;
      r /= ax[a].dilation;
    }
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      glen[a] = ax[a].group_len(g[a]);
      first[a] = t[a] * tp.cta[a] * mt[a];
    }
    h = blockIdx.y;
    b = blockIdx.z;
  }

  // Full-axis coordinate of in-group index i on axis a.
  __device__ __forceinline__ i64 coord(int a, int i) const {
    return g[a] + (i64)ax[a].dilation * i;
  }

  __device__ __forceinline__ i64 offset(const i64* st, int i0, int i1, int i2, int e) const {
    return offset_at(st, h, i0, i1, i2, e);
  }

  // The same in head `head` of the tensor (the other side of a grouped-query problem).
  __device__ __forceinline__ i64 offset_at(const i64* st, int head, int i0, int i1, int i2,
                                           int e) const {
    return offset6(st, b, coord(0, i0), coord(1, i1), coord(2, i2), head, e);
  }

  // Window (INVERSE: inverse window) of in-group row i on axis a, clamped into the group.
  template <bool INVERSE>
  __device__ __forceinline__ void span(int a, int i, int& lo, int& hi) const {
    i = min(i, glen[a] - 1);
    if (INVERSE) ax[a].inverse_window(i, glen[a], lo, hi);
    else ax[a].window(i, glen[a], lo, hi);
  }

  // Union of the spans of the CTA's rows along axis a (rows per axis = rows[a]).
  template <bool INVERSE>
  __device__ __forceinline__ void halo(int a, int rows, int& lo, int& hi) const {
    int l0, h0, l1, h1;
    span<INVERSE>(a, first[a], l0, h0);
    span<INVERSE>(a, first[a] + rows - 1, l1, h1);
    lo = l0;
    hi = h1;
  }
};

// The micro-tile of one lane group: rows r0 x r1[MT1] x r2[MT2] (clamped into the group;
// `store` says whether each row exists), and the span of each row per axis.
template <int MT1, int MT2, bool INVERSE>
struct Micro {
  int r0, r1[MT1], r2[MT2];
  bool ok0, ok1[MT1], ok2[MT2];
  int lo0, hi0, lo1[MT1], hi1[MT1], lo2[MT2], hi2[MT2];
  int ulo[3], uhi[3];  // union of the spans (the box this group walks)

  __device__ __forceinline__ Micro(const Cta& c, const TilePlan& tp, int gid) {
    const int c2 = gid % tp.cta[2];
    const int c1 = (gid / tp.cta[2]) % tp.cta[1];
    const int c0 = gid / (tp.cta[2] * tp.cta[1]);
    const int raw0 = c.first[0] + c0;
    ok0 = raw0 < c.glen[0];
    r0 = min(raw0, c.glen[0] - 1);
    c.template span<INVERSE>(0, r0, lo0, hi0);
#pragma unroll
    for (int m = 0; m < MT1; ++m) {
      const int raw = c.first[1] + c1 * MT1 + m;
      ok1[m] = raw < c.glen[1];
      r1[m] = min(raw, c.glen[1] - 1);
      c.template span<INVERSE>(1, r1[m], lo1[m], hi1[m]);
    }
#pragma unroll
    for (int m = 0; m < MT2; ++m) {
      const int raw = c.first[2] + c2 * MT2 + m;
      ok2[m] = raw < c.glen[2];
      r2[m] = min(raw, c.glen[2] - 1);
      c.template span<INVERSE>(2, r2[m], lo2[m], hi2[m]);
    }
    ulo[0] = lo0;
    uhi[0] = hi0;
    ulo[1] = lo1[0];
    uhi[1] = hi1[MT1 - 1];
    ulo[2] = lo2[0];
    uhi[2] = hi2[MT2 - 1];
  }

  // Walks NB cells of the box [lo, hi) from cursor j (row-major, advancing j): their rows in
  // the slab at origin o with extents S, and bit (m * NB + kk) set where cell kk lies in
  // row m's span (m = m1 * MT2 + m2). Cells past `left` are out (index 0, no bits).
  template <int NB>
  __device__ __forceinline__ unsigned chunk(int (&j)[3], const int (&lo)[3], const int (&hi)[3],
                                            const int (&o)[3], const int* S, int left,
                                            int (&cell)[NB]) const {
    unsigned bits = 0;
#pragma unroll
    for (int kk = 0; kk < NB; ++kk) {
      const bool in = kk < left;
      cell[kk] = in ? ((j[0] - o[0]) * S[1] + (j[1] - o[1])) * S[2] + (j[2] - o[2]) : 0;
#pragma unroll
      for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
        for (int m2 = 0; m2 < MT2; ++m2) {
          const bool hit = in && j[1] >= lo1[m1] && j[1] < hi1[m1] && j[2] >= lo2[m2] &&
                           j[2] < hi2[m2];
          bits |= (unsigned)hit << ((m1 * MT2 + m2) * NB + kk);
        }
      }
      if (++j[2] == hi[2]) {
        j[2] = lo[2];
        if (++j[1] == hi[1]) {
          j[1] = lo[1];
          ++j[0];
        }
      }
    }
    return bits;
  }
};

// Copies cells o + [0, n) of two (batch, head, group) tensors, in head `head`, into shared
// rows of RS floats
// (row (c0 * S1 + c1) * S2 + c2 holds cell o + c) by cp.async; head-dim columns at or past D
// are zero. Each thread keeps one 16-byte column and walks the cells kThreads / F apart.
template <int DP, int RS>
__device__ __forceinline__ void load_slab(float* dst_a, const float* __restrict__ src_a,
                                          const i64* st_a, float* dst_b,
                                          const float* __restrict__ src_b, const i64* st_b,
                                          const Cta& c, int head, const int (&o)[3],
                                          const int (&n)[3], const int* S, int D) {
  constexpr int F = DP / 4, STEP = kThreads / F;
  static_assert(kThreads % F == 0, "a thread keeps one column");
  const int col = 4 * (threadIdx.x % F);
  const bool live = col < D;
  const int total = n[0] * n[1] * n[2];
  // Element offsets: the slab origin, plus one in-group step (dilation times the tensor's axis
  // stride) per axis.
  const float* base_a = src_a + c.offset_at(st_a, head, o[0], o[1], o[2], col);
  const float* base_b = src_b + c.offset_at(st_b, head, o[0], o[1], o[2], col);
  i64 step_a[3], step_b[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    step_a[a] = c.ax[a].dilation * st_a[1 + a];
    step_b[a] = c.ax[a].dilation * st_b[1 + a];
  }
  int cell = threadIdx.x / F;
  int c2 = cell % n[2], c1 = (cell / n[2]) % n[1], c0 = cell / (n[2] * n[1]);
  for (; cell < total; cell += STEP) {
    const int row = ((c0 * S[1] + c1) * S[2] + c2) * RS + col;
    const float* from_a = base_a + (c0 * step_a[0] + c1 * step_a[1] + c2 * step_a[2]);
    const float* from_b = base_b + (c0 * step_b[0] + c1 * step_b[1] + c2 * step_b[2]);
    tc::cp_async16(dst_a + row, live ? from_a : src_a, live);
    tc::cp_async16(dst_b + row, live ? from_b : src_b, live);
    for (c2 += STEP; c2 >= n[2]; c2 -= n[2]) {
      if (++c1 == n[1]) {
        c1 = 0;
        ++c0;
      }
    }
  }
  tc::cp_async_commit();
}

// Per-row scalars of a slab in head `head`: lse in base 2, and delta.
__device__ __forceinline__ void load_slab_rows(float* lse2_s, float* delta_s,
                                               const float* __restrict__ lse,
                                               const float* __restrict__ delta,
                                               const NAParams& p, const Cta& c, int head,
                                               const int (&o)[3], const int (&n)[3],
                                               const int* S) {
  const int total = n[0] * n[1] * n[2];
  for (int e = threadIdx.x; e < total; e += kThreads) {
    const int c2 = e % n[2];
    const int c1 = (e / n[2]) % n[1];
    const int c0 = e / (n[2] * n[1]);
    const int row = (c0 * S[1] + c1) * S[2] + c2;
    lse2_s[row] = lse[c.offset_at(p.lse, head, o[0] + c0, o[1] + c1, o[2] + c2, 0)] * kLog2e;
    delta_s[row] = delta[c.offset_at(p.delta, head, o[0] + c0, o[1] + c1, o[2] + c2, 0)];
  }
}

// The slab box at origin o (clipped to the halo [hlo, hhi)) and this group's walk box in it.
struct SlabBox {
  int n[3], lo[3], hi[3];
  int count;  // cells of the walk box (0: nothing to walk)

  __device__ __forceinline__ SlabBox(const int (&o)[3], const int (&hhi)[3], const int* S,
                                     const int (&ulo)[3], const int (&uhi)[3]) {
    count = 1;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      n[a] = min(S[a], hhi[a] - o[a]);
      lo[a] = max(ulo[a], o[a]);
      hi[a] = min(uhi[a], o[a] + n[a]);
      count *= max(hi[a] - lo[a], 0);
    }
  }
};

}  // namespace fp32
}  // namespace natten

using namespace natten;
using namespace natten::fp32;

// Forward. RANK: of the problem; G: lanes per group (G * 16 >= head dim); MT1 x MT2: micro-tile
// of queries on axes 1 and 2 of the front-padded view. Each lane holds 16 head-dim columns
// (float4 columns lane_g + G t) of its 4 queries.
template <int RANK, int G, int MT1, int MT2>
__global__ void __launch_bounds__(kThreads)
na_fwd_fp32(const float* __restrict__ q, const float* __restrict__ k,
            const float* __restrict__ v, float* __restrict__ out, float* __restrict__ lse,
            const NAParams params, const TilePlan plan) {
  const NAParams p = front_padded(params, RANK);  // the front-padded view (see the top)
  const TilePlan tp = front_padded(plan, RANK);
  constexpr int DL = 16, F = DL / 4, NB = 4, MQ = MT1 * MT2;
  constexpr int DP = DL * G, RS = DP + RowPad<G, MT2>::value;
  static_assert(MQ * NB <= 32, "mask bits");
  extern __shared__ float4 smem4[];
  float* ks = reinterpret_cast<float*>(smem4);
  float* vs = ks + tp.slab[0] * tp.slab[1] * tp.slab[2] * RS;

  const int mt[3] = {1, MT1, MT2};
  const Cta c(p, tp, mt);
  const int kv_head = c.h / (int)p.heads_per_kv;  // grouped-query attention: k, v's head
  const int D = (int)p.head_dim;
  const int lane_g = threadIdx.x % G;
  const unsigned gmask = group_mask<G>();
  const Micro<MT1, MT2, false> mi(c, tp, threadIdx.x / G);

  const float qscale = p.scale * kLog2e;
  float4 qr[MQ][F], acc[MQ][F];
  float m_run[MQ], l_run[MQ];
#pragma unroll
  for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
    for (int m2 = 0; m2 < MT2; ++m2) {
      const int m = m1 * MT2 + m2;
      m_run[m] = negative_infinity<float>();
      l_run[m] = 0.f;
#pragma unroll
      for (int t = 0; t < F; ++t) {
        const int col = 4 * (lane_g + G * t);
        qr[m][t] = col < D ? scale4(*reinterpret_cast<const float4*>(
                                        q + c.offset(p.q, mi.r0, mi.r1[m1], mi.r2[m2], col)),
                                    qscale)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
        acc[m][t] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }

  int hlo[3], hhi[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) c.halo<false>(a, tp.cta[a] * mt[a], hlo[a], hhi[a]);

  for (int o0 = hlo[0]; o0 < hhi[0]; o0 += tp.slab[0]) {
    for (int o1 = hlo[1]; o1 < hhi[1]; o1 += tp.slab[1]) {
      for (int o2 = hlo[2]; o2 < hhi[2]; o2 += tp.slab[2]) {
        const int o[3] = {o0, o1, o2};
        const SlabBox sb(o, hhi, tp.slab, mi.ulo, mi.uhi);
        __syncthreads();  // the previous slab is consumed
        load_slab<DP, RS>(ks, k, p.k, vs, v, p.v, c, kv_head, o, sb.n, tp.slab, D);
        tc::cp_async_wait<0>();
        __syncthreads();
        int j[3] = {sb.lo[0], sb.lo[1], sb.lo[2]};
        for (int done = 0; done < sb.count; done += NB) {
          int cell[NB];
          const unsigned bits = mi.template chunk<NB>(j, sb.lo, sb.hi, o, tp.slab,
                                                      sb.count - done, cell);
          float s[MQ][NB];
#pragma unroll
          for (int kk = 0; kk < NB; ++kk) {
#pragma unroll
            for (int m = 0; m < MQ; ++m) s[m][kk] = 0.f;
#pragma unroll
            for (int t = 0; t < F; ++t) {
              const float4 kv =
                  *reinterpret_cast<const float4*>(ks + cell[kk] * RS + 4 * (lane_g + G * t));
#pragma unroll
              for (int m = 0; m < MQ; ++m) s[m][kk] = dot4(s[m][kk], qr[m][t], kv);
            }
          }
#pragma unroll
          for (int m = 0; m < MQ; ++m) {
#pragma unroll
            for (int kk = 0; kk < NB; ++kk) s[m][kk] = group_sum<G>(s[m][kk], gmask);
          }
          // Online softmax (base 2); s becomes the probabilities, unnormalized.
#pragma unroll
          for (int m = 0; m < MQ; ++m) {
            float mx = m_run[m];
#pragma unroll
            for (int kk = 0; kk < NB; ++kk)
              if ((bits >> (m * NB + kk)) & 1u) mx = fmaxf(mx, s[m][kk]);
            if (mx > m_run[m]) {  // rescale only when the running max moves (group-uniform)
              const float alpha = exp2f(m_run[m] - mx);
              l_run[m] *= alpha;
#pragma unroll
              for (int t = 0; t < F; ++t) acc[m][t] = scale4(acc[m][t], alpha);
              m_run[m] = mx;
            }
            const float base = mx == negative_infinity<float>() ? 0.f : mx;
#pragma unroll
            for (int kk = 0; kk < NB; ++kk) {
              s[m][kk] = ((bits >> (m * NB + kk)) & 1u) ? exp2f(s[m][kk] - base) : 0.f;
              l_run[m] += s[m][kk];
            }
          }
#pragma unroll
          for (int kk = 0; kk < NB; ++kk) {
#pragma unroll
            for (int t = 0; t < F; ++t) {
              const float4 vv =
                  *reinterpret_cast<const float4*>(vs + cell[kk] * RS + 4 * (lane_g + G * t));
#pragma unroll
              for (int m = 0; m < MQ; ++m) axpy4(acc[m][t], s[m][kk], vv);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
    for (int m2 = 0; m2 < MT2; ++m2) {
      const int m = m1 * MT2 + m2;
      if (!(mi.ok0 && mi.ok1[m1] && mi.ok2[m2])) continue;
      const float inv = 1.f / l_run[m];
#pragma unroll
      for (int t = 0; t < F; ++t) {
        const int col = 4 * (lane_g + G * t);
        if (col < D)
          *reinterpret_cast<float4*>(out + c.offset(p.o, mi.r0, mi.r1[m1], mi.r2[m2], col)) =
              scale4(acc[m][t], inv);
      }
      if (lane_g == 0)
        lse[c.offset(p.lse, mi.r0, mi.r1[m1], mi.r2[m2], 0)] =
            (m_run[m] + log2f(l_run[m])) * kLn2;
    }
  }
}

// delta = rowsum(dO * O) per (batch, token, head), 8 lanes per row.
__global__ void __launch_bounds__(kThreads)
na_bwd_delta_fp32(const float* __restrict__ out, const float* __restrict__ d_out,
                  float* __restrict__ delta, const NAParams p) {
  const i64 row = ((i64)blockIdx.x * kThreads + threadIdx.x) / 8;
  const int lane8 = threadIdx.x % 8;
  const i64 rows = p.batch * p.extent[0] * p.extent[1] * p.extent[2] * p.heads;
  const bool live = row < rows;
  i64 r = live ? row : 0;
  const i64 h = r % p.heads;
  r /= p.heads;
  const i64 x2 = r % p.extent[2];
  r /= p.extent[2];
  const i64 x1 = r % p.extent[1];
  r /= p.extent[1];
  const i64 x0 = r % p.extent[0];
  const i64 b = r / p.extent[0];
  float sum = 0.f;
  if (live) {
    for (int col = 4 * lane8; col < p.head_dim; col += 32) {
      const float4 o4 = *reinterpret_cast<const float4*>(out + offset6(p.o, b, x0, x1, x2, h, col));
      const float4 d4 =
          *reinterpret_cast<const float4*>(d_out + offset6(p.d_o, b, x0, x1, x2, h, col));
      sum = dot4(sum, o4, d4);
    }
  }
  sum = group_sum<8>(sum, 0xffffffffu);
  if (live && lane8 == 0) delta[offset6(p.delta, b, x0, x1, x2, h, 0)] = sum;
}

// Partial dot products over the lane's columns of the backward passes' two products: s[m][kk] =
// <ar[m], row of cell kk in as>, dp[m][kk] = <br[m], row of cell kk in bs> (the lane group
// adds the partials up).
template <int G, int F, int RS, int MQ, int NB>
__device__ __forceinline__ void slab_dots(float (&s)[MQ][NB], float (&dp)[MQ][NB],
                                          const float4 (&ar)[MQ][F], const float4 (&br)[MQ][F],
                                          const float* as, const float* bs,
                                          const int (&cell)[NB], int lane_g) {
#pragma unroll
  for (int kk = 0; kk < NB; ++kk) {
#pragma unroll
    for (int m = 0; m < MQ; ++m) s[m][kk] = dp[m][kk] = 0.f;
#pragma unroll
    for (int t = 0; t < F; ++t) {
      const int at = cell[kk] * RS + 4 * (lane_g + G * t);
      const float4 av = *reinterpret_cast<const float4*>(as + at);
      const float4 bv = *reinterpret_cast<const float4*>(bs + at);
#pragma unroll
      for (int m = 0; m < MQ; ++m) {
        s[m][kk] = dot4(s[m][kk], ar[m][t], av);
        dp[m][kk] = dot4(dp[m][kk], br[m][t], bv);
      }
    }
  }
}

// dQ = scale * sum_j dS_ij k_j, dS = P (dP - delta), over each query's window. RANK: of the
// problem; G: lanes per group (G * 16 >= head dim); each lane holds 16 columns of its MT1 x MT2
// queries' q, dO, dQ.
template <int RANK, int G, int MT1, int MT2>
__global__ void __launch_bounds__(kThreads, 2)
na_bwd_dq_fp32(const float* __restrict__ q, const float* __restrict__ k,
               const float* __restrict__ v, const float* __restrict__ d_out,
               const float* __restrict__ lse, const float* __restrict__ delta,
               float* __restrict__ dq, const NAParams params, const TilePlan plan) {
  const NAParams p = front_padded(params, RANK);  // the front-padded view (see the top)
  const TilePlan tp = front_padded(plan, RANK);
  constexpr int DL = 16, F = DL / 4, NB = 4, MQ = MT1 * MT2;
  constexpr int DP = DL * G, RS = DP + RowPad<G, MT2>::value;
  static_assert(MQ * NB <= 32, "mask bits");
  extern __shared__ float4 smem4[];
  float* ks = reinterpret_cast<float*>(smem4);
  float* vs = ks + tp.slab[0] * tp.slab[1] * tp.slab[2] * RS;

  const int mt[3] = {1, MT1, MT2};
  const Cta c(p, tp, mt);
  const int kv_head = c.h / (int)p.heads_per_kv;  // grouped-query attention: k, v's head
  const int D = (int)p.head_dim;
  const int lane_g = threadIdx.x % G;
  const unsigned gmask = group_mask<G>();
  const Micro<MT1, MT2, false> mi(c, tp, threadIdx.x / G);

  const float qscale = p.scale * kLog2e;
  float4 qr[MQ][F], dor[MQ][F], acc[MQ][F];
  float lse2[MQ], dl[MQ];
#pragma unroll
  for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
    for (int m2 = 0; m2 < MT2; ++m2) {
      const int m = m1 * MT2 + m2;
      lse2[m] = lse[c.offset(p.lse, mi.r0, mi.r1[m1], mi.r2[m2], 0)] * kLog2e;
      dl[m] = delta[c.offset(p.delta, mi.r0, mi.r1[m1], mi.r2[m2], 0)];
#pragma unroll
      for (int t = 0; t < F; ++t) {
        const int col = 4 * (lane_g + G * t);
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        qr[m][t] = col < D ? scale4(*reinterpret_cast<const float4*>(
                                        q + c.offset(p.q, mi.r0, mi.r1[m1], mi.r2[m2], col)),
                                    qscale)
                           : zero;
        dor[m][t] = col < D ? *reinterpret_cast<const float4*>(
                                  d_out + c.offset(p.d_o, mi.r0, mi.r1[m1], mi.r2[m2], col))
                            : zero;
        acc[m][t] = zero;
      }
    }
  }

  int hlo[3], hhi[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) c.halo<false>(a, tp.cta[a] * mt[a], hlo[a], hhi[a]);

  for (int o0 = hlo[0]; o0 < hhi[0]; o0 += tp.slab[0]) {
    for (int o1 = hlo[1]; o1 < hhi[1]; o1 += tp.slab[1]) {
      for (int o2 = hlo[2]; o2 < hhi[2]; o2 += tp.slab[2]) {
        const int o[3] = {o0, o1, o2};
        const SlabBox sb(o, hhi, tp.slab, mi.ulo, mi.uhi);
        __syncthreads();
        load_slab<DP, RS>(ks, k, p.k, vs, v, p.v, c, kv_head, o, sb.n, tp.slab, D);
        tc::cp_async_wait<0>();
        __syncthreads();
        int j[3] = {sb.lo[0], sb.lo[1], sb.lo[2]};
        for (int done = 0; done < sb.count; done += NB) {
          int cell[NB];
          const unsigned bits = mi.template chunk<NB>(j, sb.lo, sb.hi, o, tp.slab,
                                                      sb.count - done, cell);
          float s[MQ][NB], dp[MQ][NB];
          slab_dots<G, F, RS>(s, dp, qr, dor, ks, vs, cell, lane_g);
#pragma unroll
          for (int m = 0; m < MQ; ++m) {
#pragma unroll
            for (int kk = 0; kk < NB; ++kk) {
              const float sv = group_sum<G>(s[m][kk], gmask);
              const float dpv = group_sum<G>(dp[m][kk], gmask);
              const float pv = ((bits >> (m * NB + kk)) & 1u) ? exp2f(sv - lse2[m]) : 0.f;
              s[m][kk] = pv * (dpv - dl[m]);
            }
          }
#pragma unroll
          for (int kk = 0; kk < NB; ++kk) {
#pragma unroll
            for (int t = 0; t < F; ++t) {
              const float4 kv =
                  *reinterpret_cast<const float4*>(ks + cell[kk] * RS + 4 * (lane_g + G * t));
#pragma unroll
              for (int m = 0; m < MQ; ++m) axpy4(acc[m][t], s[m][kk], kv);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
    for (int m2 = 0; m2 < MT2; ++m2) {
      const int m = m1 * MT2 + m2;
      if (!(mi.ok0 && mi.ok1[m1] && mi.ok2[m2])) continue;
#pragma unroll
      for (int t = 0; t < F; ++t) {
        const int col = 4 * (lane_g + G * t);
        if (col < D)
          *reinterpret_cast<float4*>(dq + c.offset(p.dq, mi.r0, mi.r1[m1], mi.r2[m2], col)) =
              scale4(acc[m][t], p.scale);
      }
    }
  }
}

// dK = scale * sum_i dS_ij q_i and dV = sum_i P_ij dO_i over each key's inverse window, the
// queries whose windows hold it. RANK: of the problem; G: lanes per group (G * 8 >= head dim);
// rows are keys, each lane holds 8 columns of its MT1 x MT2 keys' k, v, dK and dV; slabs hold
// q, dO, lse and delta of the queries.
template <int RANK, int G, int MT1, int MT2>
__global__ void __launch_bounds__(kThreads)
na_bwd_dkv_fp32(const float* __restrict__ q, const float* __restrict__ k,
                const float* __restrict__ v, const float* __restrict__ d_out,
                const float* __restrict__ lse, const float* __restrict__ delta,
                float* __restrict__ dk, float* __restrict__ dv, const NAParams params,
                const TilePlan plan) {
  const NAParams p = front_padded(params, RANK);  // the front-padded view (see the top)
  const TilePlan tp = front_padded(plan, RANK);
  constexpr int DL = 8, F = DL / 4, NB = 2, MQ = MT1 * MT2;
  constexpr int DP = DL * G, RS = DP + RowPad<G, MT2>::value;
  static_assert(MQ * NB <= 32, "mask bits");
  extern __shared__ float4 smem4[];
  const int cells = tp.slab[0] * tp.slab[1] * tp.slab[2];
  float* qs = reinterpret_cast<float*>(smem4);
  float* dos = qs + cells * RS;
  float* lse2_s = dos + cells * RS;
  float* delta_s = lse2_s + cells;

  const int mt[3] = {1, MT1, MT2};
  const Cta c(p, tp, mt);  // c.h: a kv head; its group's query heads fill the slabs in turn
  const int D = (int)p.head_dim;
  const int lane_g = threadIdx.x % G;
  const unsigned gmask = group_mask<G>();
  const Micro<MT1, MT2, true> mi(c, tp, threadIdx.x / G);

  const float kscale = p.scale * kLog2e;
  float4 kr[MQ][F], vr[MQ][F], dka[MQ][F], dva[MQ][F];
#pragma unroll
  for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
    for (int m2 = 0; m2 < MT2; ++m2) {
      const int m = m1 * MT2 + m2;
#pragma unroll
      for (int t = 0; t < F; ++t) {
        const int col = 4 * (lane_g + G * t);
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        kr[m][t] = col < D ? scale4(*reinterpret_cast<const float4*>(
                                        k + c.offset(p.k, mi.r0, mi.r1[m1], mi.r2[m2], col)),
                                    kscale)
                           : zero;
        vr[m][t] = col < D ? *reinterpret_cast<const float4*>(
                                 v + c.offset(p.v, mi.r0, mi.r1[m1], mi.r2[m2], col))
                           : zero;
        dka[m][t] = dva[m][t] = zero;
      }
    }
  }

  int hlo[3], hhi[3];
#pragma unroll
  for (int a = 0; a < 3; ++a) c.halo<true>(a, tp.cta[a] * mt[a], hlo[a], hhi[a]);

  // Grouped-query attention: the query heads of this kv head's group in turn, accumulating
  // into the same registers (a fixed order: deterministic, no atomics).
#pragma unroll 1
  for (int qh = c.h * (int)p.heads_per_kv; qh < (c.h + 1) * (int)p.heads_per_kv; ++qh) {
    for (int o0 = hlo[0]; o0 < hhi[0]; o0 += tp.slab[0]) {
      for (int o1 = hlo[1]; o1 < hhi[1]; o1 += tp.slab[1]) {
        for (int o2 = hlo[2]; o2 < hhi[2]; o2 += tp.slab[2]) {
          const int o[3] = {o0, o1, o2};
          const SlabBox sb(o, hhi, tp.slab, mi.ulo, mi.uhi);
          __syncthreads();
          load_slab<DP, RS>(qs, q, p.q, dos, d_out, p.d_o, c, qh, o, sb.n, tp.slab, D);
          load_slab_rows(lse2_s, delta_s, lse, delta, p, c, qh, o, sb.n, tp.slab);
          tc::cp_async_wait<0>();
          __syncthreads();
          int j[3] = {sb.lo[0], sb.lo[1], sb.lo[2]};
          for (int done = 0; done < sb.count; done += NB) {
            int cell[NB];
            const unsigned bits = mi.template chunk<NB>(j, sb.lo, sb.hi, o, tp.slab,
                                                        sb.count - done, cell);
            float s[MQ][NB], dp[MQ][NB];
            slab_dots<G, F, RS>(s, dp, kr, vr, qs, dos, cell, lane_g);
#pragma unroll
            for (int kk = 0; kk < NB; ++kk) {
              const float l2 = lse2_s[cell[kk]], de = delta_s[cell[kk]];
#pragma unroll
              for (int m = 0; m < MQ; ++m) {
                const float sv = group_sum<G>(s[m][kk], gmask);
                const float dpv = group_sum<G>(dp[m][kk], gmask);
                const float pv = ((bits >> (m * NB + kk)) & 1u) ? exp2f(sv - l2) : 0.f;
                s[m][kk] = pv;
                dp[m][kk] = pv * (dpv - de);
              }
            }
#pragma unroll
            for (int kk = 0; kk < NB; ++kk) {
#pragma unroll
              for (int t = 0; t < F; ++t) {
                const int at = cell[kk] * RS + 4 * (lane_g + G * t);
                const float4 qv = *reinterpret_cast<const float4*>(qs + at);
                const float4 dov = *reinterpret_cast<const float4*>(dos + at);
#pragma unroll
                for (int m = 0; m < MQ; ++m) {
                  axpy4(dva[m][t], s[m][kk], dov);
                  axpy4(dka[m][t], dp[m][kk], qv);
                }
              }
            }
          }
        }
      }
    }
  }  // query heads of the group

#pragma unroll
  for (int m1 = 0; m1 < MT1; ++m1) {
#pragma unroll
    for (int m2 = 0; m2 < MT2; ++m2) {
      const int m = m1 * MT2 + m2;
      if (!(mi.ok0 && mi.ok1[m1] && mi.ok2[m2])) continue;
#pragma unroll
      for (int t = 0; t < F; ++t) {
        const int col = 4 * (lane_g + G * t);
        if (col < D) {
          *reinterpret_cast<float4*>(dk + c.offset(p.dk, mi.r0, mi.r1[m1], mi.r2[m2], col)) =
              scale4(dka[m][t], p.scale);
          *reinterpret_cast<float4*>(dv + c.offset(p.dv, mi.r0, mi.r1[m1], mi.r2[m2], col)) =
              dva[m][t];
        }
      }
    }
  }
}
