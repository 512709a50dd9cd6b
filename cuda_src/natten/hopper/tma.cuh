// Tensor memory access (TMA, sm_90a) for the Hopper kernels: a tensor map passed by value as
// a kernel parameter, tile loads of up to five coordinates into shared memory that complete
// on an mbarrier, and the mbarrier's byte count. No kernels.
//
// A map (encoded on the host, natten_cupy/_tma.py) describes one operand as a tensor of up
// to five dimensions, innermost first, with 64-element (128-byte) boxes along the head dim and
// the 128-byte swizzle: a box of R rows lands as the R x 128-byte column block of wgmma.cuh's
// tile layout, rows in the box's row-major order. Elements outside the tensor (past a group's
// end, past the head dim) land as zeros, and every box counts its full size on the mbarrier.
#pragma once

namespace natten {
namespace hopper {

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned. Kernels take it as a
// `const __grid_constant__` parameter and pass its address (in the parameter space) to the loads.
struct alignas(64) TmaMap {
  unsigned long long word[16];
};

// Arrives on bar (one arrival) and adds `bytes` to the transaction count its phase waits for.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               :: "r"(bar), "r"(bytes) : "memory");
}

// mbarrier inits (generic proxy) visible to the TMA unit's complete_tx (async proxy).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void tma_prefetch(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" :: "l"(map) : "memory");
}

// Box of `map` at coordinates c (innermost first) into shared memory at dst, completing on bar.
__device__ __forceinline__ void tma_load4(unsigned dst, const TmaMap* map, unsigned bar, int c0,
                                          int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load5(unsigned dst, const TmaMap* map, unsigned bar, int c0,
                                          int c1, int c2, int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
               :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
               : "memory");
}

// Loads the ROWS x D tile whose rows are the box at full-axis coordinates x[0..RANK) (the
// box's first row; the map's element strides step each axis by its dilation) of head `head`
// and batch b: D / 64 boxes, one per column block, and at rank 1 one per 64 rows of those
// (the map's box: 64 rows at most 4 apart, d0 the dilation). Map dimensions, innermost first:
// rank 1 (column, head, axis 0, batch); rank 2 (column, head, axis 1, axis 0, batch);
// rank 3 (head * D + column, axis 2, axis 1, axis 0, batch): heads and columns as one
// dimension (the host encodes rank 3 only where a head's D columns are contiguous and the
// head dim is D).
template <int D, int ROWS, int RANK>
__device__ __forceinline__ void tma_tile(unsigned dst, const TmaMap* map, unsigned bar,
                                         const int (&x)[3], int head, int b, int d0) {
  static_assert(RANK > 1 || ROWS % 64 == 0, "rank 1 tiles are whole 64-row boxes");
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb) {
    const unsigned at = dst + cb * (ROWS * 128);
    if (RANK == 1) {
#pragma unroll
      for (int rb = 0; rb < ROWS / 64; ++rb)
        tma_load4(at + rb * (64 * 128), map, bar, 64 * cb, head, x[0] + rb * 64 * d0, b);
    } else if (RANK == 2) {
      tma_load5(at, map, bar, 64 * cb, head, x[1], x[0], b);
    } else {
      tma_load5(at, map, bar, head * D + 64 * cb, x[2], x[1], x[0], b);
    }
  }
}

}  // namespace hopper
}  // namespace natten
