// Shared definitions for every natten_cupy kernel: the launch-argument struct, element types
// and their float conversions. Mirrors natten_cupy/_params.py field for field; change both.
// No kernels here.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "window.cuh"

namespace natten {

typedef long long i64;

// Everything a kernel needs besides its pointers, passed by value as one argument.
// Rank is padded to 3 with inert axes (see Axis). Strides are in elements, over the
// canonical axes (batch, axis0, axis1, axis2, head, last), last being head_dim (q, k, v, o
// and their gradients), the neighbor index (attn, d_attn) or unused (lse, delta).
// Inert axes and unused tensors have stride 0. rpb strides are over (head, r0, r1, r2, -, -).
struct NAParams {
  i64 extent[3], kernel[3], stride[3], dilation[3], causal[3];
  i64 batch, heads, head_dim, num_neighbors;  // num_neighbors = prod(kernel)
  // Grouped-query attention: k, v, dk, dv have kv_heads heads (dividing heads); query head h
  // reads kv head h / heads_per_kv, and a kv head's gradients sum over its heads_per_kv
  // query heads. Without GQA kv_heads = heads, heads_per_kv = 1.
  i64 kv_heads, heads_per_kv;
  // Head dim of v, out, d_out and dv in the fused ops (head_dim: that of q, k, dq, dk);
  // equal to head_dim unless the caller's values have their own.
  i64 v_dim;
  i64 q[6], k[6], v[6], o[6], d_o[6], dq[6], dk[6], dv[6];
  i64 lse[6], delta[6], attn[6], d_attn[6], rpb[6], d_rpb[6];
  float scale;        // softmax scale (D ** -0.5 unless given), read by the float kernels
  float pad_;
  double scale_f64;   // the same scale unrounded, read by the double kernels
  // Additional tokens of the fused ops, attended by every query: extra_tokens of them in
  // extra_heads heads (query head h reads extra head h / heads_per_extra); xk, xv, dxk, dxv
  // are [B, T, H_x, D] with strides as (batch, token, 0, 0, head, last). Last, so that the
  // fields above keep their offsets.
  i64 extra_tokens, extra_heads, heads_per_extra;
  i64 xk[6], xv[6], dxk[6], dxv[6];
};

__device__ __forceinline__ Axis axis_of(const NAParams& p, int a) {
  Axis ax;
  ax.extent = (int)p.extent[a];
  ax.kernel = (int)p.kernel[a];
  ax.stride = (int)p.stride[a];
  ax.dilation = (int)p.dilation[a];
  ax.causal = (int)p.causal[a];
  return ax;
}

// Offset of element (b, x0, x1, x2, h, e) of a tensor with strides st.
__device__ __forceinline__ i64 offset6(const i64* st, i64 b, i64 x0, i64 x1, i64 x2, i64 h,
                                       i64 e) {
  return b * st[0] + x0 * st[1] + x1 * st[2] + x2 * st[3] + h * st[4] + e * st[5];
}

// Float conversions for every element type; accumulation type per element type.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ double to_float(double x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// -inf in the accumulator type (float or double).
template <typename A> __device__ __forceinline__ A negative_infinity() {
  return (A)__int_as_float(0xff800000);
}

// Store an accumulator into an element of type T.
template <typename T, typename A> __device__ __forceinline__ T store_as(A x) {
  return from_float<T>((float)x);
}
template <> __device__ __forceinline__ double store_as<double, double>(double x) { return x; }

}  // namespace natten
