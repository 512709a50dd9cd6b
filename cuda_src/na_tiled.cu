// Unfused NA on tensor cores: window scores (qk; d_attn of av_backward), sums weighted over the window (av, dq) or its inverse (dv, dk), rpb gradient.
// A warp owns a 16-row patch (1-D 16, 2-D 4x4, 3-D 1x4x4) of one batch and a few heads and walks the halo of columns its rows reach; lanes hold mma.sync fragments.
// Reads q/k/v/d_out rows (16-byte loads, L1) and attn/d_attn/rpb elements; writes attn/d_attn slots, out/dq/dk/dv rows; float32 atomics into d_rpb.
#include "natten/common.cuh"
#include "natten/mma.cuh"

namespace natten {
namespace tiled {

constexpr int kWarps = 4;  // warps per CTA; warps are independent (no shared memory)
// A warp runs several heads of one patch: the window arithmetic of a block of columns
// depends only on the geometry, so it is done once and reused for every head.

// ---- Geometry of one warp -------------------------------------------------------------
// All indices below are in dilation-group coordinates: per axis a warp's rows share one
// dilation group g, and in-group index x stands for coordinate g + dilation * x.
// Rows are the warp's 16-slot patch; columns are the halo: the in-group box that holds
// every window of the rows (forward), or every query whose window holds one of the rows
// (inverse). Window starts and ends never decrease with the query index, so the windows of
// the first and last row bound that box per axis.
struct Geometry {
  Axis ax[3];
  int g[3], glen[3];  // dilation group of the patch and its length
  int lo[3], n[3];    // rows: in-group [lo, lo + n), n <= pw
  int pw[3];          // patch width (product 16)
  int hs[3], hw[3];   // columns: in-group [hs, hs + hw)
  int b, h, nh;       // batch; heads h .. h + nh - 1
  int slice;          // head-dim slice (weighted sums)
  int cols;           // hw[0] * hw[1] * hw[2]
};

// Decode this warp's (batch, heads, d-slice, patch); false when the patch is empty.
// Warp order: d-slice fastest, then head group, then patch (last axis fastest), then batch,
// so a CTA's warps share rows of the same tokens and neighboring CTAs share halos in L2.
// `heads`: heads of the rows (p.heads; p.kv_heads for the inverse sums, whose rows are keys).
__device__ __forceinline__ bool setup_warp(const NAParams& p, bool inverse, int slices,
                                           int heads_per_warp, int heads, Geometry& G) {
  // Inert axes (kernel 1) trail the real ones.
  const int rank = p.kernel[2] > 1 ? 3 : (p.kernel[1] > 1 ? 2 : 1);
  G.pw[0] = rank == 1 ? 16 : (rank == 2 ? 4 : 1);
  G.pw[1] = rank == 1 ? 1 : 4;
  G.pw[2] = rank == 3 ? 4 : 1;
  i64 w = (i64)blockIdx.x * kWarps + threadIdx.x / 32;
  G.slice = (int)(w % slices); w /= slices;
  const int groups = (heads + heads_per_warp - 1) / heads_per_warp;
  G.h = (int)(w % groups) * heads_per_warp;
  w /= groups;
  G.nh = min(heads_per_warp, heads - G.h);
  int pa[3], npg[3];
  for (int a = 2; a >= 0; --a) {
    G.ax[a] = axis_of(p, a);
    G.ax[a].stride = 1;  // unfused ops run stride 1 (tiled.refuse): a constant the compiler folds
    const int glen0 = G.ax[a].group_len(0);  // the longest group
    npg[a] = (glen0 + G.pw[a] - 1) / G.pw[a];
    const i64 per = (i64)npg[a] * G.ax[a].dilation;
    pa[a] = (int)(w % per);
    w /= per;
  }
  if (w >= p.batch) return false;
  G.b = (int)w;
  G.cols = 1;
  for (int a = 0; a < 3; ++a) {
    const Axis& ax = G.ax[a];
    G.g[a] = pa[a] / npg[a];
    G.glen[a] = ax.group_len(G.g[a]);
    G.lo[a] = (pa[a] % npg[a]) * G.pw[a];
    G.n[a] = min(G.pw[a], G.glen[a] - G.lo[a]);
    if (G.n[a] <= 0) return false;
    int s0, e0, s1, e1;
    if (inverse) {
      ax.inverse_window(G.lo[a], G.glen[a], s0, e0);
      ax.inverse_window(G.lo[a] + G.n[a] - 1, G.glen[a], s1, e1);
    } else {
      ax.window(G.lo[a], G.glen[a], s0, e0);
      ax.window(G.lo[a] + G.n[a] - 1, G.glen[a], s1, e1);
    }
    G.hs[a] = s0;
    G.hw[a] = e1 - s0;
    G.cols *= G.hw[a];
  }
  return true;
}

// Row r (0..15) of the patch: in-group index per axis (clamped to the first row when the
// row lies past a partial patch, so that its loads stay in range) and whether it exists.
__device__ __forceinline__ bool patch_row(const Geometry& G, int r, int (&x)[3]) {
  const int o2 = r % G.pw[2], o1 = (r / G.pw[2]) % G.pw[1], o0 = r / (G.pw[1] * G.pw[2]);
  const bool ok = o0 < G.n[0] && o1 < G.n[1] && o2 < G.n[2];
  x[0] = G.lo[0] + (ok ? o0 : 0);
  x[1] = G.lo[1] + (ok ? o1 : 0);
  x[2] = G.lo[2] + (ok ? o2 : 0);
  return ok;
}

// Column c (< G.cols) of the halo: in-group index per axis (last axis fastest).
__device__ __forceinline__ void halo_col(const Geometry& G, int c, int (&y)[3]) {
  y[2] = G.hs[2] + c % G.hw[2];
  c /= G.hw[2];
  y[1] = G.hs[1] + c % G.hw[1];
  y[0] = G.hs[0] + c / G.hw[1];
}

// In-group coordinates of one halo column, moved along the halo without divisions: a step
// of `n` columns is its mixed-radix digits over (hw0, hw1, hw2), added with carries.
struct HaloPos {
  int y[3];
};

__device__ __forceinline__ void step_digits(const Geometry& G, int n, int (&st)[3]) {
  st[2] = n % G.hw[2];
  n /= G.hw[2];
  st[1] = n % G.hw[1];
  st[0] = n / G.hw[1];
}

// Each digit of st is below its radix and y[1], y[2] are in range, so one carry suffices.
// Past the last column y[0] leaves the halo; callers mask those columns.
__device__ __forceinline__ HaloPos advanced(const Geometry& G, const HaloPos& p,
                                            const int (&st)[3]) {
  HaloPos r;
  const int y2 = p.y[2] + st[2], c2 = y2 >= G.hs[2] + G.hw[2];
  r.y[2] = c2 ? y2 - G.hw[2] : y2;
  const int y1 = p.y[1] + st[1] + c2, c1 = y1 >= G.hs[1] + G.hw[1];
  r.y[1] = c1 ? y1 - G.hw[1] : y1;
  r.y[0] = p.y[0] + st[0] + c1;
  return r;
}

// Offset of the row at in-group index x, in head `head`, of tensor with strides st.
__device__ __forceinline__ i64 row_offset_at(const Geometry& G, const i64* st,
                                             const int (&x)[3], int head) {
  return offset6(st, G.b, G.g[0] + (i64)G.ax[0].dilation * x[0],
                 G.g[1] + (i64)G.ax[1].dilation * x[1], G.g[2] + (i64)G.ax[2].dilation * x[2],
                 head, 0);
}

// ... in the warp's first head.
__device__ __forceinline__ i64 row_offset(const Geometry& G, const i64* st, const int (&x)[3]) {
  return row_offset_at(G, st, x, G.h);
}

// Grouped-query attention: the kv head that query head h reads (unsigned division: h >= 0).
__device__ __forceinline__ int kv_head_of(const NAParams& p, int h) {
  return (int)((unsigned)h / (unsigned)p.heads_per_kv);
}

// Per-axis windows [s, e) of the query at in-group index x.
__device__ __forceinline__ void windows_of(const Geometry& G, const int (&x)[3], int (&s)[3],
                                           int (&e)[3]) {
  for (int a = 0; a < 3; ++a) G.ax[a].window(x[a], G.glen[a], s[a], e[a]);
}

// Slot of key y in the window [s, e) (row-major over per-axis slots), or -1 outside it.
__device__ __forceinline__ int slot_of(const Geometry& G, const int (&s)[3], const int (&e)[3],
                                       const int (&y)[3]) {
  int slot = 0;
  bool in = true;
  for (int a = 0; a < 3; ++a) {
    in = in && y[a] >= s[a] && y[a] < e[a];
    slot = slot * G.ax[a].kernel + (y[a] - s[a]);
  }
  return in ? slot : -1;
}

// ---- Element-type traits --------------------------------------------------------------
// The scores kernel contracts over the head dim in chunks of 32. Lane quad q loads the 8
// consecutive elements 8q..8q+7 of a chunk with one 16-byte access, for its A rows and its
// B column alike; the mma's logical k index is a permutation of the physical head-dim index,
// the same for A and B, so the dot products are unchanged.
// Exact float32 (EXACT) keeps the same lanes and loads but multiplies with FMAs: a lane holds
// plain floats of its 8 elements, and quad lanes add their partial sums with shuffles.
template <typename T, bool EXACT> struct Elem;

template <> struct Elem<__half, false> {
  typedef tc::F16Tag Tag;
  static constexpr int kRegs8 = 4;  // registers holding 8 elements
};
template <> struct Elem<__nv_bfloat16, false> {
  typedef tc::BF16Tag Tag;
  static constexpr int kRegs8 = 4;
};
template <> struct Elem<float, false> {  // TF32 tensor cores
  static constexpr int kRegs8 = 8;
};
template <> struct Elem<float, true> {   // exact float32 FMAs (registers hold float bits)
  static constexpr int kRegs8 = 8;
};

template <typename T> struct IsF32 { static constexpr bool value = false; };
template <> struct IsF32<float> { static constexpr bool value = true; };

template <typename T, bool EXACT>
__device__ __forceinline__ void load8(unsigned (&r)[Elem<T, EXACT>::kRegs8], const T* ptr,
                                      bool ok) {
  if constexpr (IsF32<T>::value) {
    float4 u = make_float4(0.f, 0.f, 0.f, 0.f), v = u;
    if (ok) {
      u = __ldg(reinterpret_cast<const float4*>(ptr));
      v = __ldg(reinterpret_cast<const float4*>(ptr) + 1);
    }
    const float f[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = EXACT ? __float_as_uint(f[i]) : tc::to_tf32(f[i]);
  } else {
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (ok) u = __ldg(reinterpret_cast<const uint4*>(ptr));
    r[0] = u.x; r[1] = u.y; r[2] = u.z; r[3] = u.w;
  }
}

// acc (16 rows x 8 columns) += A rows (group, group + 8) . B column (group), over the
// 32-element chunk each lane loaded with load8 (see the permutation above).
template <typename T>
__device__ __forceinline__ void mma_chunk32(float (&acc)[4],
                                            const unsigned (&a0)[Elem<T, false>::kRegs8],
                                            const unsigned (&a1)[Elem<T, false>::kRegs8],
                                            const unsigned (&b)[Elem<T, false>::kRegs8]) {
  if constexpr (IsF32<T>::value) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const unsigned a[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
      const unsigned bb[2] = {b[2 * s], b[2 * s + 1]};
      tc::mma1688_tf32(acc, a, bb);
    }
  } else {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const unsigned a[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
      const unsigned bb[2] = {b[2 * s], b[2 * s + 1]};
      tc::mma16816(acc, a, bb, typename Elem<T, false>::Tag());
    }
  }
}

// Exact float32: dot of the lane's 8 elements of a (as float bits) with 8 floats of b.
__device__ __forceinline__ float dot8(const unsigned (&a)[8], const unsigned (&b)[8], float acc) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(__uint_as_float(a[i]), __uint_as_float(b[i]), acc);
  return acc;
}

// Exact float32: part[ri][j] is this lane's partial sum of row group + 8 * ri, column j
// (0..7). Adds the four quad lanes' partials (reduce-scatter over two shuffle rounds) and
// leaves acc in the mma C layout: acc[2 * ri + h] = row group + 8 * ri, column 2 * quad + h.
__device__ __forceinline__ void quad_reduce(const float (&part)[2][8], float (&acc)[4], int quad) {
  float half[2][4];
  const bool hi2 = quad & 2, hi1 = quad & 1;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float send = hi2 ? part[ri][i] : part[ri][i + 4];
      const float keep = hi2 ? part[ri][i + 4] : part[ri][i];
      half[ri][i] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
    }
#pragma unroll
  for (int ri = 0; ri < 2; ++ri)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float send = hi1 ? half[ri][i] : half[ri][i + 2];
      const float keep = hi1 ? half[ri][i + 2] : half[ri][i];
      acc[2 * ri + i] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
    }
}

// Store 8 consecutive accumulators as elements of T (16-byte aligned destination).
template <typename T>
__device__ __forceinline__ void store8(T* ptr, const float (&v)[8]) {
  if constexpr (IsF32<T>::value) {
    reinterpret_cast<float4*>(ptr)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(ptr)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    typename Elem<T, false>::Tag tag;
    *reinterpret_cast<uint4*>(ptr) = make_uint4(tc::pack2(v[0], v[1], tag), tc::pack2(v[2], v[3], tag),
                                                tc::pack2(v[4], v[5], tag), tc::pack2(v[6], v[7], tag));
  }
}

// ---- Scores: out[i, t] = <A_i, B_j(i, t)> (+ rpb), empty causal slots = fill ------------
// qk: A = q, B = k, out = attn, fill = -inf. av_backward: A = d_out, B = v, out = d_attn,
// fill = 0, no rpb. Strides: A in p.q, B in p.k, out in p.attn, rpb in p.rpb.
// A warp walks the halo 8 keys at a time; per block it finds the slot of each of its lane's
// four results once, then for each of its heads_per_warp heads loads A and B fragments (DC
// chunks of 32 head-dim elements, A from L1 after the first head), runs the mma and writes
// each score only to its slot. Staged (dynamic shared memory of 16 * heads_per_warp * K
// elements per warp): scores land in shared memory [row][head][slot], prefilled with fill
// when a window is causal, and leave row by row in whole contiguous runs; otherwise they are
// stored to attn one by one and empty slots filled afterwards.
// EXACT (float32 only): every lane multiplies its 8 elements of all 8 keys of the block
// (key addresses come from the lanes that own them) and the quad adds up (quad_reduce).
// Tensor cores: HP heads at a time issue all their fragment loads before their mmas, so that
// HP loads are in flight at once instead of one (HP = 1: one head after the other).
struct ScoresArgs {
  float fill;          // value of the slots a causal window leaves empty
  int heads_per_warp;  // heads a warp runs (the last head group may have fewer)
  int staged;          // nonzero: scores go through shared memory (see above)
};

template <typename T, int DC, bool EXACT, int HP>
__global__ void __launch_bounds__(kWarps * 32,
                                  (!EXACT && HP * DC * Elem<T, EXACT>::kRegs8 <= 8) ? 3 : 2)
na_tiled_scores(const T* __restrict__ a_in, const T* __restrict__ b_in, const T* __restrict__ rpb,
                T* __restrict__ out, ScoresArgs args, NAParams p) {
  const float fill = args.fill;
  const int heads_per_warp = args.heads_per_warp, staged = args.staged;
  constexpr int R = Elem<T, EXACT>::kRegs8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Geometry G;
  if (!setup_warp(p, false, 1, heads_per_warp, (int)p.heads, G)) return;
  const int lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const int D = (int)p.head_dim;
  const int K = (int)p.num_neighbors;
  const bool causal = p.causal[0] | p.causal[1] | p.causal[2];
  const int srow = G.nh * K;  // staged elements per row
  T* stage = reinterpret_cast<T*>(smem_raw) + (threadIdx.x / 32) * 16 * heads_per_warp * K;
  if (staged && causal) {
    for (int i = lane; i < 16 * srow; i += 32) stage[i] = from_float<T>(fill);
    __syncwarp();
  }

  bool rok[2];
  int rx[2][3], ws[2][3], we[2][3];
  i64 out_row[2];
  const T* arow[2];
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    rok[ri] = patch_row(G, grp + 8 * ri, rx[ri]);
    windows_of(G, rx[ri], ws[ri], we[ri]);
    out_row[ri] = row_offset(G, p.attn, rx[ri]);
    arow[ri] = a_in + row_offset(G, p.q, rx[ri]) + 8 * quad;
  }

  int step8[3], step1[3];
  step_digits(G, 8, step8);
  step_digits(G, 1, step1);
  HaloPos bpos, epos;  // columns base + grp (B operand) and base + 2 * quad (results)
  halo_col(G, grp, bpos.y);
  halo_col(G, 2 * quad, epos.y);
  for (int base = 0; base < G.cols;
       base += 8, bpos = advanced(G, bpos, step8), epos = advanced(G, epos, step8)) {
    // Result e: row grp + 8 * (e / 2), column base + 2 * quad + e % 2; its slot (-1: none)
    // and its rpb offset without the head term.
    int slot[4];
    i64 rpo[4];
    const HaloPos enext = advanced(G, epos, step1);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = e / 2;
      const int(&y)[3] = ((e & 1) ? enext : epos).y;
      slot[e] = (rok[ri] && base + 2 * quad + (e & 1) < G.cols) ? slot_of(G, ws[ri], we[ri], y)
                                                                  : -1;
      rpo[e] = 0;
#pragma unroll
      for (int a = 0; a < 3; ++a)
        rpo[e] += (i64)(y[a] - rx[ri][a] + G.ax[a].kernel - 1) * p.rpb[1 + a];
    }
    // b (k, or v for d_attn) is key/value-side: head hh reads kv head kv_head_of(G.h + hh).
    const T* brow = b_in + row_offset_at(G, p.k, bpos.y, 0) + 8 * quad;
    const T* bj[8];  // EXACT: key j of the block, from the lanes that walk it
    if constexpr (EXACT) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        bj[j] = reinterpret_cast<const T*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(brow), 4 * j + quad));
    }

    // Score e of head hh: to its slot (staged or straight to attn), plus rpb.
    auto put = [&](int hh, const float (&acc)[4]) {
      const i64 ho = hh * p.attn[4], hr = (i64)(G.h + hh) * p.rpb[0];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (slot[e] < 0) continue;
        float v = acc[e];
        if (rpb != nullptr) v += to_float(rpb[hr + rpo[e]]);
        if (staged)
          stage[(grp + 8 * (e / 2)) * srow + hh * K + slot[e]] = from_float<T>(v);
        else
          out[out_row[e / 2] + ho + (i64)slot[e] * p.attn[5]] = from_float<T>(v);
      }
    };
    if constexpr (EXACT) {
      for (int hh = 0; hh < G.nh; ++hh) {
        const i64 ha = hh * p.q[4], hb = (i64)kv_head_of(p, G.h + hh) * p.k[4];
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        float part[2][8];
#pragma unroll
        for (int j = 0; j < 8; ++j) part[0][j] = part[1][j] = 0.f;
#pragma unroll 1
        for (int ch = 0; ch < DC; ++ch) {
          const int d0 = 32 * ch + 8 * quad;
          unsigned a0[R], a1[R];
          load8<T, EXACT>(a0, arow[0] + ha + 32 * ch, d0 < D);
          load8<T, EXACT>(a1, arow[1] + ha + 32 * ch, d0 < D);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            unsigned bfrag[R];
            load8<T, EXACT>(bfrag, bj[j] + hb + 32 * ch, base + j < G.cols && d0 < D);
            part[0][j] = dot8(a0, bfrag, part[0][j]);
            part[1][j] = dot8(a1, bfrag, part[1][j]);
          }
        }
        quad_reduce(part, acc, quad);
        put(hh, acc);
      }
    } else {
      const bool bok = base + grp < G.cols;
      for (int h0 = 0; h0 < G.nh; h0 += HP) {
        float acc[HP][4];
#pragma unroll
        for (int i = 0; i < HP; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll (HP > 1 ? 1 : 4)
        for (int ch = 0; ch < DC; ++ch) {
          const int d0 = 32 * ch + 8 * quad;
          unsigned a0[HP][R], a1[HP][R], bfrag[HP][R];
#pragma unroll
          for (int i = 0; i < HP; ++i) {
            const bool hok = h0 + i < G.nh;
            const i64 hh = h0 + i;
            load8<T, EXACT>(a0[i], arow[0] + hh * p.q[4] + 32 * ch, hok && d0 < D);
            load8<T, EXACT>(a1[i], arow[1] + hh * p.q[4] + 32 * ch, hok && d0 < D);
            load8<T, EXACT>(bfrag[i], brow + kv_head_of(p, G.h + hh) * p.k[4] + 32 * ch,
                            hok && bok && d0 < D);
          }
#pragma unroll
          for (int i = 0; i < HP; ++i) mma_chunk32<T>(acc[i], a0[i], a1[i], bfrag[i]);
        }
#pragma unroll
        for (int i = 0; i < HP; ++i)
          if (h0 + i < G.nh) put(h0 + i, acc[i]);
      }
    }
  }

  if (staged) {
    __syncwarp();
    for (int r = 0; r < 16; ++r) {
      int x[3];
      if (!patch_row(G, r, x)) continue;
      const i64 row = row_offset(G, p.attn, x);
      for (int hh = 0; hh < G.nh; ++hh)
        for (int t = lane; t < K; t += 32)
          out[row + hh * p.attn[4] + (i64)t * p.attn[5]] = stage[r * srow + hh * K + t];
    }
    return;
  }
  if (!causal) return;
  // Slots past a causal window's end hold no key: write fill there, lanes along the slots.
  const int k1 = G.ax[1].kernel, k2 = G.ax[2].kernel;
  for (int r = 0; r < 16; ++r) {
    int x[3], s[3], e[3];
    if (!patch_row(G, r, x)) continue;
    windows_of(G, x, s, e);
    const int n0 = e[0] - s[0], n1 = e[1] - s[1], n2 = e[2] - s[2];
    if (n0 * n1 * n2 == K) continue;
    const i64 row = row_offset(G, p.attn, x);
    for (int t = lane; t < K; t += 32) {
      const int t2 = t % k2, t1 = (t / k2) % k1, t0 = t / (k1 * k2);
      if (t0 < n0 && t1 < n1 && t2 < n2) continue;
      for (int hh = 0; hh < G.nh; ++hh)
        out[row + hh * p.attn[4] + (i64)t * p.attn[5]] = from_float<T>(fill);
    }
  }
}

// ---- Weighted sums: out_r = sum_c W(r, c) X_c over the halo columns c -----------------
// Forward (INVERSE false): rows are queries, columns keys, W(r, c) = weights[r, slot of c]
// (av: weights = attn, X = v, out; qk_backward dq: weights = d_attn, X = k, dq).
// Inverse: rows are keys, columns queries, W(r, c) = weights[c, slot of r in c's window]
// (av_backward dv: attn, X = d_out; qk_backward dk: d_attn, X = q).
// W is 0 wherever the key is outside the query's window, so empty causal slots are never
// read. Strides: weights in p.attn, X in p.v, out in p.o.
// mma A = W (16 rows x 16 columns), B = X (16 columns x 8 head-dim elements) per n-tile.
// Each warp covers one slice of 8 * NT head-dim elements: logical n-column m of n-tile t is
// physical element NT * m + t of the slice, so a lane loads NT consecutive elements of each of
// its four columns and ends holding 2 * NT consecutive outputs of each of its two rows.
// A warp runs HB heads (16 / NT on tensor cores: 64 accumulators per lane): per 16-column step it locates
// the weights once and reuses the offsets for every head. Staged (forward only; dynamic
// shared memory of 16 * HB * K elements per warp): the warp first copies its rows' weights
// [row][head][slot] into shared memory in contiguous runs and gathers from there.
// EXACT (float32 only): lanes find the same weights, then put the warp's 16 x 16 block of
// weights and the X rows of the step's 16 columns in shared memory, where every lane reads
// its two rows' weights (16-byte loads) and the column addresses (broadcast) and runs FMAs
// over the 2 * NT elements it stores. (Passing them around with shuffles instead kept the
// shuffle unit busier than the FMA pipes.)
// Registers: HB * NT * 4 accumulators a lane; up to 32 of them leave room for 3 CTAs an SM
// on sm_90, which measured faster there (NOTES-tiled.md, tiled.TC_ACCUMULATORS). Other
// architectures keep 2 CTAs, which needs no spills.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int kWeightedSmallCtas = 3;
#else
constexpr int kWeightedSmallCtas = 2;
#endif
// The 16-bit sums held to 3 CTAs (forward, 2 heads a warp) spill more than the 16 bytes
// accepted for them when compiled by an older CUDA: f16 before 13.1 (16 bytes), bf16 before
// 13.4 (32-40 bytes). There they keep 2 CTAs.
constexpr int kCudaVersion = __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__;
template <typename T> struct SmallCtasSince { static constexpr int value = 0; };
template <> struct SmallCtasSince<__half> { static constexpr int value = 1301; };
template <> struct SmallCtasSince<__nv_bfloat16> { static constexpr int value = 1304; };

struct WeightedArgs {
  int staged;  // nonzero: the forward sums copy their weights to shared memory first
};

template <typename T, int NT, bool INVERSE, bool EXACT, int HB>
__global__ void __launch_bounds__(kWarps * 32, (!EXACT && HB * NT <= 8 &&
                                                kCudaVersion >= SmallCtasSince<T>::value)
                                                   ? kWeightedSmallCtas : 2)
na_tiled_weighted(const T* __restrict__ w_in, const T* __restrict__ x_in, T* __restrict__ out,
                  WeightedArgs args, NAParams p) {
  const int staged = args.staged;
  constexpr bool F32 = IsF32<T>::value;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = (int)p.head_dim;
  const int slices = (D + 8 * NT - 1) / (8 * NT);
  Geometry G;
  // Inverse sums write the key/value side (dv, dk): rows over the kv heads.
  if (!setup_warp(p, INVERSE, slices, HB, INVERSE ? (int)p.kv_heads : (int)p.heads, G)) return;
  const int lane = threadIdx.x % 32, grp = lane / 4, quad = lane % 4;
  const int dbase = G.slice * 8 * NT;
  const int K = (int)p.num_neighbors;
  // EXACT: per warp, the weights [row][column] of the current head's 16-column step and the
  // X rows of the step's columns.
  __shared__ __align__(16) float ex_w[EXACT ? kWarps * 256 : 4];
  __shared__ unsigned long long ex_x[EXACT ? kWarps * 16 : 1];
  float* const wsm = ex_w + (EXACT ? (threadIdx.x / 32) * 256 : 0);
  unsigned long long* const xsm = ex_x + (EXACT ? (threadIdx.x / 32) * 16 : 0);

  // Weight of (row ri, slot t, head hh) at wsrc[wrow[ri] + t * wstep + hh * whead] (forward).
  const T* wsrc = w_in;
  i64 wstep = p.attn[5], whead = p.attn[4];
  if constexpr (!INVERSE) {
    if (staged) {
      const int srow = G.nh * K;
      T* stage = reinterpret_cast<T*>(smem_raw) + (threadIdx.x / 32) * 16 * HB * K;
      // Lanes stride over the flat [row][head][slot] index with 8 loads in flight each (one
      // load at a time left this copy waiting on memory latency for most of the kernel).
      // Row offsets come from shared memory (-1: the row lies past the patch: zeros).
      __shared__ i64 row_base[kWarps][16];
      i64* const rbase = row_base[threadIdx.x / 32];
      if (lane < 16) {
        int x[3];
        rbase[lane] = patch_row(G, lane, x) ? row_offset(G, p.attn, x) : (i64)-1;
      }
      __syncwarp();
      const int total = 16 * srow;
      int r = 0, hh = 0, t = lane;  // coordinates of flat index i = lane
      while (t >= K) {
        t -= K;
        if (++hh == G.nh) { hh = 0; ++r; }
      }
      for (int i0 = 0; i0 < total; i0 += 32 * 8) {
        T v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          v[u] = from_float<T>(0.f);
          if (i0 + 32 * u + lane < total) {
            const i64 rb = rbase[r];
            if (rb >= 0) v[u] = w_in[rb + hh * p.attn[4] + (i64)t * p.attn[5]];
          }
          t += 32;  // next flat index: carry slots into heads into rows
          while (t >= K) {
            t -= K;
            if (++hh == G.nh) { hh = 0; ++r; }
          }
        }
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (i0 + 32 * u + lane < total) stage[i0 + 32 * u + lane] = v[u];
      }
      __syncwarp();
      wsrc = stage;
      wstep = 1;
      whead = K;
    }
  }

  bool rok[2];
  int rx[2][3], ws[2][3], we[2][3];
  i64 wrow[2];
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    rok[ri] = patch_row(G, grp + 8 * ri, rx[ri]);
    if (!INVERSE) {
      windows_of(G, rx[ri], ws[ri], we[ri]);
      wrow[ri] = staged ? (i64)(grp + 8 * ri) * G.nh * K : row_offset(G, p.attn, rx[ri]);
    }
  }
  // The four columns of each 16-column step a lane feeds the mma (A's k index and B's rows).
  int cofs[4];
  if (F32 && !EXACT) { cofs[0] = quad; cofs[1] = quad + 4; cofs[2] = quad + 8; cofs[3] = quad + 12; }
  else { cofs[0] = 2 * quad; cofs[1] = 2 * quad + 1; cofs[2] = 2 * quad + 8; cofs[3] = 2 * quad + 9; }
  int step16[3];
  step_digits(G, 16, step16);
  HaloPos pos[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) halo_col(G, cofs[j], pos[j].y);

  float acc[HB][NT][4];
#pragma unroll
  for (int hh = 0; hh < HB; ++hh)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[hh][t][0] = acc[hh][t][1] = acc[hh][t][2] = acc[hh][t][3] = 0.f;

  // X elements per lane and column: NT, loaded in units of U (16 bytes, or 8 for NT = 4).
  constexpr int U = F32 ? 4 : (NT >= 8 ? 8 : 4);
  constexpr int XW = F32 ? NT : NT / 2;  // 32-bit words per column
  for (int base = 0; base < G.cols; base += 16) {
    // Head-independent part of the step: X rows of the lane's columns, weight offsets
    // (bit 2 * j + ri of wmask: weight (row ri, column j) lies in a window).
    const T* xrow[4];
    i64 woff[2][4];
    unsigned wmask = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool cok = base + cofs[j] < G.cols;
      const int(&y)[3] = pos[j].y;
      xrow[j] = x_in + row_offset_at(G, p.v, y, 0) + dbase;  // head added per head below
      if constexpr (EXACT)
        if (grp == 0) xsm[cofs[j]] = reinterpret_cast<unsigned long long>(xrow[j]);
      if (INVERSE) {
        int s[3], e[3];
        windows_of(G, y, s, e);
        const i64 wq = row_offset_at(G, p.attn, y, 0);  // query head added per head below
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const int slot = (cok && rok[ri]) ? slot_of(G, s, e, rx[ri]) : -1;
          woff[ri][j] = wq + (i64)slot * p.attn[5];
          wmask |= (slot >= 0 ? 1u : 0u) << (2 * j + ri);
        }
      } else {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const int slot = (cok && rok[ri]) ? slot_of(G, ws[ri], we[ri], y) : -1;
          woff[ri][j] = wrow[ri] + (i64)slot * wstep;
          wmask |= (slot >= 0 ? 1u : 0u) << (2 * j + ri);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) pos[j] = advanced(G, pos[j], step16);

#pragma unroll
    for (int hh = 0; hh < HB; ++hh) {
      if (hh >= G.nh) break;
      // Heads of X and of the weights for output head G.h + hh. Forward: X (v, k) is
      // key/value-side, read at the query head's kv head. Inverse (grouped-query attention):
      // the output is kv head G.h + hh, summed over its query heads in turn (fixed order, no
      // atomics); weights and X (d_out, q) are read at each.
#pragma unroll 1
      for (int g = 0; g < (INVERSE ? (int)p.heads_per_kv : 1); ++g) {
        const int qh = INVERSE ? (G.h + hh) * (int)p.heads_per_kv + g : G.h + hh;
        const i64 hx = (i64)(INVERSE ? qh : kv_head_of(p, qh)) * p.v[4];
        const i64 hw = INVERSE ? qh * whead : hh * whead;
        float wv[2][4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int ri = 0; ri < 2; ++ri)
            wv[ri][j] = (wmask >> (2 * j + ri) & 1u) ? to_float(wsrc[woff[ri][j] + hw]) : 0.f;

        if constexpr (EXACT) {
          // This lane's outputs: slice elements 2 * NT * quad + el, el < 2 * NT, kept in acc
          // as the epilogue reads them.
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            wsm[grp * 16 + cofs[j]] = wv[0][j];
            wsm[(grp + 8) * 16 + cofs[j]] = wv[1][j];
          }
          __syncwarp();
          const int d0 = 2 * NT * quad;
          const int left = G.cols - base;  // columns of this step that exist
#pragma unroll 1
          for (int c4 = 0; c4 < 4; ++c4) {
            const float4 wa = *reinterpret_cast<const float4*>(wsm + grp * 16 + 4 * c4);
            const float4 wb = *reinterpret_cast<const float4*>(wsm + (grp + 8) * 16 + 4 * c4);
            const float w0s[4] = {wa.x, wa.y, wa.z, wa.w}, w1s[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
              const int c = 4 * c4 + cc;
              const T* xr = reinterpret_cast<const T*>(xsm[c]) + hx;
#pragma unroll
              for (int u = 0; u < 2 * NT / 4; ++u) {
                float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
                if (c < left && dbase + d0 + 4 * u < D)
                  f = __ldg(reinterpret_cast<const float4*>(xr + d0 + 4 * u));
                const float xv[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                  const int el = 4 * u + m;
                  float& a0 = el < NT ? acc[hh][el][0] : acc[hh][el - NT][1];
                  float& a1 = el < NT ? acc[hh][el][2] : acc[hh][el - NT][3];
                  a0 = fmaf(w0s[cc], xv[m], a0);
                  a1 = fmaf(w1s[cc], xv[m], a1);
                }
              }
            }
          }
          __syncwarp();  // before the next head (or step) overwrites wsm and xsm
        } else {
          unsigned xw[4][XW];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const bool cok = base + cofs[j] < G.cols;
#pragma unroll
            for (int u = 0; u < NT / U; ++u) {
              const int d = NT * grp + U * u;
              const bool ok = cok && dbase + d < D;
              const T* src = xrow[j] + hx + d;
              if constexpr (F32) {
                float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
                if (ok) f = __ldg(reinterpret_cast<const float4*>(src));
                xw[j][4 * u] = tc::to_tf32(f.x); xw[j][4 * u + 1] = tc::to_tf32(f.y);
                xw[j][4 * u + 2] = tc::to_tf32(f.z); xw[j][4 * u + 3] = tc::to_tf32(f.w);
              } else if constexpr (U == 8) {
                uint4 f = make_uint4(0u, 0u, 0u, 0u);
                if (ok) f = __ldg(reinterpret_cast<const uint4*>(src));
                xw[j][4 * u] = f.x; xw[j][4 * u + 1] = f.y; xw[j][4 * u + 2] = f.z; xw[j][4 * u + 3] = f.w;
              } else {
                uint2 f = make_uint2(0u, 0u);
                if (ok) f = __ldg(reinterpret_cast<const uint2*>(src));
                xw[j][2 * u] = f.x; xw[j][2 * u + 1] = f.y;
              }
            }
          }
          if constexpr (F32) {
            const unsigned a0[4] = {tc::to_tf32(wv[0][0]), tc::to_tf32(wv[1][0]),
                                    tc::to_tf32(wv[0][1]), tc::to_tf32(wv[1][1])};
            const unsigned a1[4] = {tc::to_tf32(wv[0][2]), tc::to_tf32(wv[1][2]),
                                    tc::to_tf32(wv[0][3]), tc::to_tf32(wv[1][3])};
#pragma unroll
            for (int t = 0; t < NT; ++t) {
              const unsigned b0[2] = {xw[0][t], xw[1][t]};
              const unsigned b1[2] = {xw[2][t], xw[3][t]};
              tc::mma1688_tf32(acc[hh][t], a0, b0);
              tc::mma1688_tf32(acc[hh][t], a1, b1);
            }
          } else {
            typename Elem<T, false>::Tag tag;
            const unsigned a[4] = {tc::pack2(wv[0][0], wv[0][1], tag), tc::pack2(wv[1][0], wv[1][1], tag),
                                   tc::pack2(wv[0][2], wv[0][3], tag), tc::pack2(wv[1][2], wv[1][3], tag)};
#pragma unroll
            for (int t = 0; t < NT; ++t) {
              // Element t of a column is the low (t even) or high half of word t / 2.
              const unsigned sel = (t & 1) ? 0x7632u : 0x5410u;
              const unsigned b[2] = {__byte_perm(xw[0][t / 2], xw[1][t / 2], sel),
                                     __byte_perm(xw[2][t / 2], xw[3][t / 2], sel)};
              tc::mma16816(acc[hh][t], a, b, tag);
            }
          }
        }
      }  // query heads of the group
    }
  }

  // acc[hh][t][2 * ri + h]: head G.h + hh, row grp + 8 * ri, slice element
  // NT * (2 * quad + h) + t, so a lane holds 2 * NT consecutive elements of each row,
  // starting at 2 * NT * quad.
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    if (!rok[ri]) continue;
    T* orow = out + row_offset(G, p.o, rx[ri]) + dbase + 2 * NT * quad;
#pragma unroll
    for (int hh = 0; hh < HB; ++hh) {
      if (hh >= G.nh) break;
#pragma unroll
      for (int u = 0; u < 2 * NT / 8; ++u) {
        if (dbase + 2 * NT * quad + 8 * u >= D) break;
        float v[8];
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const int el = 8 * u + m;  // element of the lane's 2 * NT run
          v[m] = el < NT ? acc[hh][el][2 * ri] : acc[hh][el - NT][2 * ri + 1];
        }
        store8<T>(orow + hh * p.o[4] + 8 * u, v);
      }
    }
  }
}

// ---- Relative positional bias gradient ------------------------------------------------
// d_rpb[h, o] += sum over queries i and slots t whose key sits at relative offset o of
// d_attn[i, t]. One CTA per (chunk of query rows, head); a warp takes one row at a time and
// its lanes walk the slots (coalesced); partial sums of the offsets [r_begin, r_begin + r_count)
// collect in shared memory, then one float32 atomicAdd per offset and CTA goes to d_rpb
// (strides p.d_rpb). The order of those atomics varies, so the result is not bitwise
// deterministic. Rows are (batch, token) pairs, row-major over (batch, axis0, axis1, axis2).
struct RpbGradArgs {
  long long rows_per_cta;  // rows of one CTA (the last CTA may have fewer)
  int r_begin, r_count;    // offsets of this pass: [r_begin, r_begin + r_count)
};

template <typename T>
__global__ void __launch_bounds__(256)
na_tiled_rpb_grad(const T* __restrict__ d_attn, float* __restrict__ d_rpb, RpbGradArgs args,
                  NAParams p) {
  const long long rows_per_cta = args.rows_per_cta;
  const int r_begin = args.r_begin, r_count = args.r_count;
  extern __shared__ float part[];
  const int h = blockIdx.y;
  for (int i = threadIdx.x; i < r_count; i += blockDim.x) part[i] = 0.f;
  __syncthreads();

  Axis ax[3];
  int rs[3];  // strides of the flattened offset index over the (2k - 1)-wide axes
  for (int a = 0; a < 3; ++a) {
    ax[a] = axis_of(p, a);
    ax[a].stride = 1;
  }
  rs[2] = 1;
  rs[1] = 2 * ax[2].kernel - 1;
  rs[0] = rs[1] * (2 * ax[1].kernel - 1);
  const int K = (int)p.num_neighbors;
  const int k1 = ax[1].kernel, k2 = ax[2].kernel;
  const i64 rows = p.batch * p.extent[0] * p.extent[1] * p.extent[2];
  const i64 first = (i64)blockIdx.x * rows_per_cta;
  const i64 last = min(first + rows_per_cta, rows);
  const int lane = threadIdx.x % 32;
  // Per-axis slots of t = lane and of the step 32 (k0, k1, k2 mixed radix): the slot loop
  // adds the step with carries instead of dividing.
  const int l0[3] = {lane / (k1 * k2), (lane / k2) % k1, lane % k2};
  const int st[3] = {32 / (k1 * k2), (32 / k2) % k1, 32 % k2};
  for (i64 row = first + threadIdx.x / 32; row < last; row += blockDim.x / 32) {
    int x[3];
    i64 rest = row;
    x[2] = (int)(rest % p.extent[2]); rest /= p.extent[2];
    x[1] = (int)(rest % p.extent[1]); rest /= p.extent[1];
    x[0] = (int)(rest % p.extent[0]); rest /= p.extent[0];
    int base = 0, n[3];  // base: offset index of slot 0
    for (int a = 0; a < 3; ++a) {
      const int ig = ax[a].in_group(x[a]);
      int s, e;
      ax[a].window(ig, ax[a].group_len(ax[a].group_of(x[a])), s, e);
      n[a] = e - s;
      base += (s - ig + ax[a].kernel - 1) * rs[a];
    }
    const T* src = d_attn + offset6(p.d_attn, rest, x[0], x[1], x[2], h, 0);
    int t0 = l0[0], t1 = l0[1], t2 = l0[2];
    for (int t = lane; t < K; t += 32) {
      if (t0 < n[0] && t1 < n[1] && t2 < n[2]) {
        const int o = base + t0 * rs[0] + t1 * rs[1] + t2 - r_begin;
        if (o >= 0 && o < r_count) atomicAdd(&part[o], to_float(src[(i64)t * p.d_attn[5]]));
      }
      t2 += st[2];
      const int c2 = t2 >= k2;
      t2 -= c2 ? k2 : 0;
      t1 += st[1] + c2;
      const int c1 = t1 >= k1;
      t1 -= c1 ? k1 : 0;
      t0 += st[0] + c1;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < r_count; i += blockDim.x) {
    const float v = part[i];
    if (v == 0.f) continue;
    const int o = r_begin + i;
    const int o0 = o / rs[0], o1 = (o / rs[1]) % (2 * k1 - 1), o2 = o % rs[1];
    atomicAdd(&d_rpb[h * p.d_rpb[0] + o0 * p.d_rpb[1] + o1 * p.d_rpb[2] + o2 * p.d_rpb[3]], v);
  }
}

}  // namespace tiled
}  // namespace natten
