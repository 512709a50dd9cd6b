// Warp-level tensor-core building blocks (inline PTX, sm_80+): mma.sync, ldmatrix, cp.async.
// No kernels here; shared by the tiled and fused backends. Needs no <mma.h>. Also the fused
// kernels' epilogue helpers (fast_exp2, pack_store).
// Fragment layouts (lane = 4 * group + quad, group = lane / 4, quad = lane % 4):
//   m16n8k16 (f16/bf16) A 16x16 row-major: a[0] = (group, 2q..2q+1), a[1] = (group+8, 2q..),
//     a[2] = (group, 2q+8..), a[3] = (group+8, 2q+8..); B 16x8: b[0] = (k 2q..2q+1, n group),
//     b[1] = (k 2q+8.., n group); C/D 16x8 f32: c[0..1] = (group, 2q..2q+1),
//     c[2..3] = (group+8, 2q..2q+1).
//   m16n8k8 (tf32) A 16x8: a[0] = (group, q), a[1] = (group+8, q), a[2] = (group, q+4),
//     a[3] = (group+8, q+4); B 8x8: b[0] = (k q, n group), b[1] = (k q+4, n group); C as above.
#pragma once

#include "common.cuh"

namespace natten {
namespace tc {

struct F16Tag {};
struct BF16Tag {};

template <typename T> struct MmaKind;
template <> struct MmaKind<__half> { typedef F16Tag tag; };
template <> struct MmaKind<__nv_bfloat16> { typedef BF16Tag tag; };

// D += A * B, 16x8x16, f32 accumulators.
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2], F16Tag) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4],
                                         const unsigned (&b)[2], BF16Tag) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D += A * B, 16x8x8, tf32 operands (as produced by to_tf32), f32 accumulators.
__device__ __forceinline__ void mma1688_tf32(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// Two floats packed into one register of two 16-bit values (low half = first).
__device__ __forceinline__ unsigned pack2(float lo, float hi, F16Tag) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, BF16Tag) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// ldmatrix: lane l supplies the address of row (l % 8) of matrix (l / 8); register m of
// each lane receives row group, columns 2q..2q+1 of matrix m (transposed with .trans).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

// 16-byte global->shared copy that bypasses registers; when !valid the destination is
// zero-filled (src-size 0) and the source is not read.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

}  // namespace tc

// Epilogue helpers of the fused kernels (forward and backward).
// 2^x on the special-function unit (flushes denormals; underflows to 0 like exp2f). Softmax
// weights below 2^-126 of the row maximum are zero either way at 16-bit precision.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two adjacent row elements (col, col + 1; col even, row aligned to the pair) in one store.
__device__ __forceinline__ void pack_store(__half* at, float x, float y) {
  *reinterpret_cast<__half2*>(at) = __floats2half2_rn(x, y);
}
__device__ __forceinline__ void pack_store(__nv_bfloat16* at, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(x, y);
}
__device__ __forceinline__ void pack_store(float* at, float x, float y) {
  *reinterpret_cast<float2*>(at) = make_float2(x, y);
}

}  // namespace natten
