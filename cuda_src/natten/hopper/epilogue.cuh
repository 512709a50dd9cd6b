// Hopper epilogue: a warpgroup's accumulator tile stored to global memory through shared
// memory in 16-byte chunks. Stored straight from the accumulator each thread writes 4 bytes a
// column pair (D / 4 stores a row pair) and every store's address register waits for the
// previous store to have read it (Nsight Compute on the 1-D small-window backward: ~15% of its
// warps' samples on those address instructions, NOTES-hopper-bwd.md); through shared memory a
// thread stores D / 16 whole chunks of 16 bytes.
#pragma once

#include "natten/mma.cuh"
#include "natten/hopper/wgmma.cuh"

namespace natten {
namespace hopper {

// The warpgroup's 64 x D float accumulator `acc` (wgmma's layout, wgmma.cuh: row 16 w + group
// + 8 h, columns 8 j + 2 quad + e in acc[4 j + 2 h + e]) times scale[h], converted to T, into
// the shared tile at `tile` (64-column blocks `block` bytes apart, 128-byte rows in the 128-byte
// swizzle: the layout of a wgmma operand tile, so the warpgroup's own operand rows can take it
// once its GEMMs are done), then, after named barrier `bar` of the warpgroup's 128 threads,
// row r's chunks of columns below hd to row_at(r) (a T*; nullptr: row r is not stored). Every
// thread of the warpgroup calls it.
template <typename T, int D, class RowAt>
__device__ __forceinline__ void store_tile_rows(const float* acc, const float (&scale)[2],
                                                unsigned tile, unsigned block, int bar, int hd,
                                                RowAt row_at) {
  static_assert(D % 64 == 0, "whole 64-column blocks");
  typedef typename tc::MmaKind<T>::tag tag;
  const int t = threadIdx.x % 128, lane = t % 32, quad = lane % 4;
  const int wrow = (t / 32) * 16 + lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const unsigned at = tile + (j / 8) * block + swz128(wrow + 8 * h, j % 8) + 4 * quad;
      const unsigned x = tc::pack2(acc[4 * j + 2 * h] * scale[h], acc[4 * j + 2 * h + 1] * scale[h],
                                   tag());
      asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(at), "r"(x) : "memory");
    }
  named_sync(bar, 128);
  constexpr int C = D / 8, ROWS = 128 / C;  // chunks a row, rows a pass of the warpgroup
  const int ch = t % C;
  const unsigned col = (ch / 8) * block;
#pragma unroll
  for (int k = 0; k < 64 / ROWS; ++k) {
    const int r = t / C + ROWS * k;
    uint4 x;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                 : "r"(tile + col + swz128(r, ch % 8)));
    T* dst = row_at(r);
    if (dst != nullptr && ch * 8 < hd) *reinterpret_cast<uint4*>(dst + ch * 8) = x;
  }
}

}  // namespace hopper
}  // namespace natten
