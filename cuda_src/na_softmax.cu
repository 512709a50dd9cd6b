// Softmax over the neighbor axis of unfused attention weights, and its backward, one pass each.
// A row is the K weights of one (batch, token, head); a group of G lanes (a power of two up to
// 32) owns a row and strides over its slots. Rows are contiguous (the Python side hands over
// C-contiguous arrays), so a warp's loads cover consecutive rows: coalesced.
// Forward reads the row twice (the second pass hits L1 for the row sizes NA uses: K <= a few
// thousand) and writes it once; backward reads two rows twice and writes one.
#include "natten/common.cuh"

namespace natten {
namespace softmax {

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
  return __longlong_as_double(0xfff0000000000000ULL);
}

// Reduce over the G lanes of a group (xor shuffles stay inside aligned groups).
template <typename A>
__device__ __forceinline__ A group_sum(A v, int G) {
  for (int o = G / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Merge two (max, sum of exp(x - max)) pairs; an empty pair has max -inf and sum 0.
template <typename A>
__device__ __forceinline__ void merge(A& m, A& s, A m2, A s2) {
  const A mx = m > m2 ? m : m2;
  if (mx == neg_inf<A>()) return;  // both empty
  s = s * exp(m - mx) + s2 * exp(m2 - mx);
  m = mx;
}

__device__ __forceinline__ float exp_(float x) { return __expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }

// probs[r, t] = exp(scale * x[r, t] - m_r) / sum_t exp(scale * x[r, t] - m_r); a row whose
// entries are all -inf (cannot come out of qk) gives zeros. x and probs may alias.
template <typename T>
__global__ void __launch_bounds__(256)
na_softmax_forward(const T* x, T* probs, long long rows, int K, int G, float scale) {
  typedef typename Acc<T>::type A;
  const int lane = threadIdx.x % G;
  const long long groups = (long long)gridDim.x * (blockDim.x / G);
  for (long long r = (long long)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;; r += groups) {
    // Every lane of a warp runs the same number of iterations (shuffles need the whole warp):
    // rows past the end are processed as empty rows and not stored.
    const long long first = r - threadIdx.x % 32 / G;  // row of the warp's first group
    if (first >= rows) break;
    const bool live = r < rows;
    const T* row = x + (live ? r : 0) * K;
    A m = neg_inf<A>(), s = 0;
    if constexpr (sizeof(A) == 8) {
      // float64: max first, then the sum (double exp's slow path spills when it sits in the
      // online update's branches).
      if (live)
        #pragma unroll (sizeof(A) == 8 ? 1 : 4)
        for (int t = lane; t < K; t += G) m = fmax(m, (A)to_float(row[t]) * (A)scale);
      for (int o = G / 2; o > 0; o /= 2) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (live && m != neg_inf<A>())
        #pragma unroll (sizeof(A) == 8 ? 1 : 4)
        for (int t = lane; t < K; t += G) s += exp_((A)to_float(row[t]) * (A)scale - m);
      s = group_sum(s, G);
    } else {
      // Online (max, sum) per lane, then merged across the group.
      if (live) {
        #pragma unroll (sizeof(A) == 8 ? 1 : 4)
        for (int t = lane; t < K; t += G) {
          const A v = (A)to_float(row[t]) * (A)scale;
          if (v == neg_inf<A>()) continue;
          if (v > m) {
            s = s * exp_(m - v) + 1;
            m = v;
          } else {
            s += exp_(v - m);
          }
        }
      }
      for (int o = G / 2; o > 0; o /= 2) {
        const A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        merge(m, s, m2, s2);
      }
    }
    if (!live) continue;
    const A inv = s > 0 ? (A)1 / s : (A)0;
    T* out = probs + r * K;
    #pragma unroll (sizeof(A) == 8 ? 1 : 4)
    for (int t = lane; t < K; t += G) {
      const A v = (A)to_float(row[t]) * (A)scale;
      out[t] = store_as<T>(v == neg_inf<A>() ? (A)0 : exp_(v - m) * inv);
    }
  }
}

// d_x[r, t] = scale * p[r, t] * (d_p[r, t] - sum_u p[r, u] * d_p[r, u]). d_x may alias d_p.
template <typename T>
__global__ void __launch_bounds__(256)
na_softmax_backward(const T* p, const T* d_p, T* d_x, long long rows, int K, int G,
                    float scale) {
  typedef typename Acc<T>::type A;
  const int lane = threadIdx.x % G;
  const long long groups = (long long)gridDim.x * (blockDim.x / G);
  for (long long r = (long long)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;; r += groups) {
    const long long first = r - threadIdx.x % 32 / G;
    if (first >= rows) break;
    const bool live = r < rows;
    const long long base = (live ? r : 0) * K;
    A dot = 0;
    if (live)
      #pragma unroll (sizeof(A) == 8 ? 1 : 4)
      for (int t = lane; t < K; t += G) dot += (A)to_float(p[base + t]) * (A)to_float(d_p[base + t]);
    dot = group_sum(dot, G);
    if (!live) continue;
    #pragma unroll (sizeof(A) == 8 ? 1 : 4)
    for (int t = lane; t < K; t += G) {
      const A pv = (A)to_float(p[base + t]);
      d_x[base + t] = store_as<T>((A)scale * pv * ((A)to_float(d_p[base + t]) - dot));
    }
  }
}

}  // namespace softmax
}  // namespace natten
