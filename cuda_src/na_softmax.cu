// Softmax over the neighbor axis of unfused attention weights and its backward (float32 accumulation, float64 for double; -inf slots give 0).
// Short rows (na_softmax_rows_*): a warp stages 32 rows in shared memory and each lane owns one row; other rows: a group of G lanes owns a row (na_softmax_*).
// Reads the logits (forward) or the probabilities and their gradient (backward), rows contiguous; writes one array of the same shape.
//
// Lane groups: lane l of a group holds slots l, l + G, l + 2G, ... of its row, so a warp's
// loads cover consecutive rows. V > 0: a row has at most G * V slots and stays in registers
// (read once, one exp a slot); V = 0: longer rows are read twice (max, then sum and write).
// Row kernels: 16-byte copies in and out, and no shuffles or per-slot global addressing.
#include "natten/common.cuh"

namespace natten {
namespace softmax {

// The launch arguments of every softmax kernel.
struct SoftmaxArgs {
  long long rows;  // rows of K slots, contiguous
  double scale;    // multiplies the logits (forward) or the gradient (backward)
  int slots;       // K: slots of a row
  int lanes;       // G: lanes that share one row (a power of two up to 32; 1 in the row kernels)
};

__device__ __forceinline__ float exp_(float x) { return __expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }

// Sum / max over the G lanes of a group (xor shuffles stay inside aligned groups).
template <typename A>
__device__ __forceinline__ A group_sum(A v, int G) {
  for (int o = G / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename A>
__device__ __forceinline__ A group_max(A v, int G) {
  for (int o = G / 2; o > 0; o /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// probs[r, t] = exp(scale * x[r, t] - m_r) / sum_u exp(scale * x[r, u] - m_r); -inf slots
// (empty places of causal windows) give 0, and a row of only -inf gives zeros.
template <typename T, int V>
__global__ void __launch_bounds__(256)
na_softmax_forward(const T* __restrict__ x, T* __restrict__ probs, SoftmaxArgs args) {
  typedef typename Acc<T>::type A;
  const long long rows = args.rows;
  const int K = args.slots, G = args.lanes;
  const A scale = (A)args.scale, ninf = negative_infinity<A>();
  const int lane = threadIdx.x % G;
  // Every lane of a warp runs the same number of row steps (shuffles need the whole warp):
  // rows past the end run as empty rows and are not stored.
  const long long step = (long long)gridDim.x * (blockDim.x / G);
  for (long long r = (long long)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
       r - threadIdx.x % 32 / G < rows; r += step) {
    const bool live = r < rows;
    const T* row = x + (live ? r : 0) * K;
    T* out = probs + r * K;
    if constexpr (V > 0) {
      A v[V];
      A m = ninf;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int t = lane + G * i;
        v[i] = (live && t < K) ? (A)to_float(row[t]) * scale : ninf;
        m = fmax(m, v[i]);
      }
      m = group_max(m, G);
      const A base = m == ninf ? (A)0 : m;  // all -inf: every exp below is 0
      A s = 0;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        v[i] = exp_(v[i] - base);
        s += v[i];
      }
      s = group_sum(s, G);
      if (!live) continue;
      const A inv = s > 0 ? (A)1 / s : (A)0;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int t = lane + G * i;
        if (t < K) out[t] = store_as<T>(v[i] * inv);
      }
    } else {
      // Max first, then the sum: two reads, no rescaling exps.
      A m = ninf;
      if (live)
        for (int t = lane; t < K; t += G) m = fmax(m, (A)to_float(row[t]) * scale);
      m = group_max(m, G);
      const A base = m == ninf ? (A)0 : m;
      A s = 0;
      if (live)
        for (int t = lane; t < K; t += G) s += exp_((A)to_float(row[t]) * scale - base);
      s = group_sum(s, G);
      if (!live) continue;
      const A inv = s > 0 ? (A)1 / s : (A)0;
      for (int t = lane; t < K; t += G)
        out[t] = store_as<T>(exp_((A)to_float(row[t]) * scale - base) * inv);
    }
  }
}

// d_x[r, t] = scale * p[r, t] * (d_p[r, t] - sum_u p[r, u] * d_p[r, u]).
template <typename T, int V>
__global__ void __launch_bounds__(256)
na_softmax_backward(const T* __restrict__ p, const T* __restrict__ d_p, T* __restrict__ d_x,
                    SoftmaxArgs args) {
  typedef typename Acc<T>::type A;
  const long long rows = args.rows;
  const int K = args.slots, G = args.lanes;
  const A scale = (A)args.scale;
  const int lane = threadIdx.x % G;
  // Every lane of a warp runs the same number of row steps (shuffles need the whole warp):
  // rows past the end run as empty rows and are not stored.
  const long long step = (long long)gridDim.x * (blockDim.x / G);
  for (long long r = (long long)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
       r - threadIdx.x % 32 / G < rows; r += step) {
    const bool live = r < rows;
    const long long base = (live ? r : 0) * K;
    if constexpr (V > 0) {
      A pv[V], dv[V];
      A dot = 0;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int t = lane + G * i;
        const bool ok = live && t < K;
        pv[i] = ok ? (A)to_float(p[base + t]) : (A)0;
        dv[i] = ok ? (A)to_float(d_p[base + t]) : (A)0;
        dot += pv[i] * dv[i];
      }
      dot = group_sum(dot, G);
      if (!live) continue;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int t = lane + G * i;
        if (t < K) d_x[base + t] = store_as<T>(scale * pv[i] * (dv[i] - dot));
      }
    } else {
      A dot = 0;
      if (live)
        for (int t = lane; t < K; t += G) dot += (A)to_float(p[base + t]) * (A)to_float(d_p[base + t]);
      dot = group_sum(dot, G);
      if (!live) continue;
      for (int t = lane; t < K; t += G) {
        const A pv = (A)to_float(p[base + t]);
        d_x[base + t] = store_as<T>(scale * pv * ((A)to_float(d_p[base + t]) - dot));
      }
    }
  }
}

// ---- Short rows: one lane a row, 32 rows of a warp staged in shared memory ----------------
constexpr int kRowWarps = 4;  // warps per CTA of the row kernels

// n elements from global src to shared dst (or back): 16-byte units, then the tail.
// src and dst are 16-byte aligned (the launcher checks the arrays; chunk bases are multiples
// of 32 rows, i.e. of 32 * K elements, so of 16 bytes).
template <typename T>
__device__ __forceinline__ void copy_rows(T* dst, const T* src, int n, int lane) {
  constexpr int per = 16 / sizeof(T);
  const int nv = n / per;
  for (int i = lane; i < nv; i += 32)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  for (int e = nv * per + lane; e < n; e += 32) dst[e] = src[e];
}

// Slot t of a lane's row, visited at step j: lanes start at different slots (t = j + lane,
// wrapped) so that rows whose length is a multiple of the bank count do not all hit one bank.
// sk: the lane's first slot (lane % K).
__device__ __forceinline__ int skewed(int j, int sk, int K) {
  const int t = j + sk;
  return t >= K ? t - K : t;
}

template <typename T>
__global__ void __launch_bounds__(32 * kRowWarps)
na_softmax_rows_forward(const T* __restrict__ x, T* __restrict__ probs, SoftmaxArgs args) {
  typedef typename Acc<T>::type A;
  const long long rows = args.rows;
  const int K = args.slots;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* const tile = reinterpret_cast<T*>(smem_raw) + warp * 32 * K;
  const A scale = (A)args.scale, ninf = negative_infinity<A>();
  const int sk = lane % K;
  const long long chunks = (rows + 31) / 32;
  for (long long c = (long long)blockIdx.x * kRowWarps + warp; c < chunks;
       c += (long long)gridDim.x * kRowWarps) {
    const int n = (int)min(32LL, rows - c * 32) * K;
    copy_rows(tile, x + c * 32 * K, n, lane);
    __syncwarp();
    if (lane * K < n) {
      T* row = tile + lane * K;
      A m = ninf;
#pragma unroll 4
      for (int j = 0; j < K; ++j) m = fmax(m, (A)to_float(row[skewed(j, sk, K)]) * scale);
      const A base = m == ninf ? (A)0 : m;
      A s = 0;
#pragma unroll 4
      for (int j = 0; j < K; ++j) s += exp_((A)to_float(row[skewed(j, sk, K)]) * scale - base);
      const A inv = s > 0 ? (A)1 / s : (A)0;
#pragma unroll 4
      for (int j = 0; j < K; ++j) {
        const int t = skewed(j, sk, K);
        row[t] = store_as<T>(exp_((A)to_float(row[t]) * scale - base) * inv);
      }
    }
    __syncwarp();
    copy_rows(probs + c * 32 * K, tile, n, lane);
    __syncwarp();  // before the next chunk overwrites the tile
  }
}

// CUDA 13.0's sm_80 allocator gives the row backward 56 registers and spills 8 bytes unless
// asked for the 8 CTAs an SM that 64 registers allow (what later versions choose unasked).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900 && \
    __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ < 1301
#define NA_ROWS_BACKWARD_BOUNDS __launch_bounds__(32 * kRowWarps, 8)
#else
#define NA_ROWS_BACKWARD_BOUNDS __launch_bounds__(32 * kRowWarps)
#endif
template <typename T>
__global__ void NA_ROWS_BACKWARD_BOUNDS
na_softmax_rows_backward(const T* __restrict__ p, const T* __restrict__ d_p, T* __restrict__ d_x,
                         SoftmaxArgs args) {
  typedef typename Acc<T>::type A;
  const long long rows = args.rows;
  const int K = args.slots;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* const tp = reinterpret_cast<T*>(smem_raw) + warp * 64 * K;
  T* const td = tp + 32 * K;
  const A scale = (A)args.scale;
  const int sk = lane % K;
  const long long chunks = (rows + 31) / 32;
  for (long long c = (long long)blockIdx.x * kRowWarps + warp; c < chunks;
       c += (long long)gridDim.x * kRowWarps) {
    const int n = (int)min(32LL, rows - c * 32) * K;
    copy_rows(tp, p + c * 32 * K, n, lane);
    copy_rows(td, d_p + c * 32 * K, n, lane);
    __syncwarp();
    if (lane * K < n) {
      const T* prow = tp + lane * K;
      T* drow = td + lane * K;
      A dot = 0;
#pragma unroll 2
      for (int j = 0; j < K; ++j) {
        const int t = skewed(j, sk, K);
        dot += (A)to_float(prow[t]) * (A)to_float(drow[t]);
      }
#pragma unroll 2
      for (int j = 0; j < K; ++j) {
        const int t = skewed(j, sk, K);
        drow[t] = store_as<T>(scale * (A)to_float(prow[t]) * ((A)to_float(drow[t]) - dot));
      }
    }
    __syncwarp();
    copy_rows(d_x + c * 32 * K, td, n, lane);
    __syncwarp();
  }
}

}  // namespace softmax
}  // namespace natten
