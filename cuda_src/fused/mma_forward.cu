// Fused neighborhood-attention forward on tensor cores: out = softmax(scale * q k^T) v over each query's window, and lse (natural log), flash-style (online softmax, nothing in memory).
// One CTA = a box of queries of one dilation group, head and batch; each warp owns a compact 16-query patch (the m16 rows of its mma) and walks only its patch's key halo, line by line in 8-key groups (2-D, 3-D) or flat 16 keys at a time, gathering key rows from shared memory (ldmatrix or per-lane loads take any row).
// Reads q, k, v (k, v of the head's kv head under GQA; last dim contiguous, rows 16-byte aligned; the CTA's key halo staged in shared memory by cp.async, streamed in double-buffered chunks when it does not fit), with BIAS the relative positional bias rpb [H, 2k-1, ...] (any strides), and with EXTRA the additional tokens xk, xv [B, T, H_x, D] that every query attends to (staged after the halo in the same buffers, as further chunks); writes out and lse (float32).
#include "natten/common.cuh"
#include "natten/mma.cuh"
#include "natten/fused_tile.cuh"
#include "natten/fused_fwd_lines.cuh"

namespace natten {
namespace fused_fwd {

template <typename T> struct Elem;
template <> struct Elem<__half> { enum { tf32 = 0, per_chunk = 8 }; };
template <> struct Elem<__nv_bfloat16> { enum { tf32 = 0, per_chunk = 8 }; };
template <> struct Elem<float> { enum { tf32 = 1, per_chunk = 4 }; };

// CTAs per SM the compiler must fit (caps registers at 64K / (threads * ctas)): head dim 32
// with up to 32 keys per iteration fits 128 registers (4 CTAs of 128 threads) without
// spilling, 170 (3 CTAs) with a bias or the additional tokens' walk; wider iterations and
// larger head dims need more.
__host__ __device__ constexpr int min_ctas(int threads, int dp, int kb, bool bias) {
  return dp <= 32 && kb <= 2 ? (bias ? 384 : 512) / threads : 1;
}

// How the CTA stages its key halo (twin of mma_forward.HALO_CHUNKS): chunk_keys keys per
// shared-memory buffer, stages 1 (the whole halo resident) or 2 (chunks double-buffered).
struct HaloChunks {
  int chunk_keys;
  int stages;
};

// Coordinates (a0, a1, a2) of flat index t of a warp's row-major halo box of dims n; axes
// past the rank are inert (size 1, coordinate 0) and cost nothing.
template <int RANK>
struct Split {
  int n1n2, n2;
  float inv12, inv2;
  __device__ __forceinline__ void operator()(int t, int& a0, int& a1, int& a2) const {
    if (RANK == 1) {
      a0 = t; a1 = 0; a2 = 0;
    } else if (RANK == 2) {
      a0 = fused::div_small(t, inv12);
      a1 = t - a0 * n1n2;
      a2 = 0;
    } else {
      a0 = fused::div_small(t, inv12);
      const int r = t - a0 * n1n2;
      a1 = fused::div_small(r, inv2);
      a2 = r - a1 * n2;
    }
  }
};

}  // namespace fused_fwd
}  // namespace natten

using namespace natten;
using namespace natten::fused_fwd;

// T: element type; RANK: axes in use (the others are inert); DP: padded head dim (32, 64, 128, 256); P*: warp patch (P0 P1 P2 = 16);
// W*: warps per CTA along each axis (the CTA's query box is (W0 P0, W1 P1, W2 P2)); KB: 16-key
// sub-blocks a warp takes per iteration (independent mma chains, one softmax reduction); LINES
// (2-D, 3-D): walk the warp halo line by line in 8-key groups (LineWalk), else in flat row-major
// order; BIAS: add rpb[head, key - query + kernel - 1] (in-group offsets per axis) to each
// score (stride 1 only: the launcher refuses others); EXTRA: after the halo, every warp also
// walks the p.extra_tokens additional tokens (flat, 16 keys at a time, nothing masked but
// the last chunk's tail), chunk_keys of them per chunk.
template <typename T, int RANK, int DP, int P0, int P1, int P2, int W0, int W1, int W2, int KB,
          bool LINES, bool BIAS, bool EXTRA>
__global__ void __launch_bounds__(32 * W0 * W1 * W2, natten::fused_fwd::min_ctas(32 * W0 * W1 * W2, DP, KB, BIAS || EXTRA))
na_fwd_fused(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             T* __restrict__ out, float* __restrict__ lse, const T* __restrict__ rpb,
             const T* __restrict__ xk, const T* __restrict__ xv, const NAParams p,
             const fused_fwd::HaloChunks hc) {
  static_assert(P0 * P1 * P2 == 16, "a warp patch holds 16 queries");
  static_assert(!LINES || RANK >= 2, "the line walk is for 2-D and 3-D");
  const int chunk_keys = hc.chunk_keys, stages = hc.stages;
  constexpr int NW = W0 * W1 * W2, NT = 32 * NW;
  constexpr int EPC = Elem<T>::per_chunk;  // elements per 16-byte chunk
  constexpr int CPR = DP / EPC;            // 16-byte chunks per shared-memory row
  constexpr bool TF32 = Elem<T>::tf32;
  constexpr bool Q_IN_REGS = DP * sizeof(T) <= 256;
  constexpr int NPASS = DP > 128 ? 2 : 1, DO = DP / NPASS;
  constexpr int TQ[3] = {W0 * P0, W1 * P1, W2 * P2};
  const float NEG_INF = negative_infinity<float>();

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const q_s = reinterpret_cast<T*>(smem_raw);
  T* const kv_s = q_s + NW * 16 * DP;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int head = (int)(blockIdx.x % (unsigned)p.heads);
  const int batch = blockIdx.z;

  // ---- CTA geometry: group, query box and key halo per axis (in-group indices) ----
  Axis ax[3];
  int grp[3], glen[3], q0[3], hs[3], hl[3];
  {
    unsigned id = blockIdx.x / (unsigned)p.heads;
    int u[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      ax[a] = axis_of(p, a);
      if (a >= RANK) { grp[a] = 0; q0[a] = 0; continue; }
      const int gmax = ax[a].longest_group();
      const int ntile = (gmax + TQ[a] - 1) / TQ[a];
      const unsigned span = (unsigned)(ntile * ax[a].dilation);
      u[a] = (int)(id % span);
      id /= span;
      grp[a] = u[a] / ntile;
      q0[a] = (u[a] - grp[a] * ntile) * TQ[a];
    }
    bool empty = false;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      glen[a] = a < RANK ? ax[a].group_len(grp[a]) : 1;
      empty |= q0[a] >= glen[a];
    }
    if (empty) return;  // a shorter dilation group has one tile fewer
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      if (a >= RANK) { hs[a] = 0; hl[a] = 1; continue; }
      int e;
      fused::halo_of(ax[a], glen[a], q0[a], min(q0[a] + TQ[a] - 1, glen[a] - 1), hs[a], e);
      hl[a] = e - hs[a];
    }
  }
  const int total = hl[0] * hl[1] * hl[2];
  // Keys per chunk: the line walk cuts chunks at CTA-halo lines, so that no warp line
  // straddles two chunks (the launcher makes chunk_keys at least one line).
  const int ck = LINES ? chunk_keys / hl[RANK - 1] * hl[RANK - 1] : chunk_keys;
  const int nchunks = (total + ck - 1) / ck;
  // Chunks of additional tokens follow the halo's: chunks [nchunks, nall).
  const int ntok = EXTRA ? (int)p.extra_tokens : 0;
  const int nall = EXTRA ? nchunks + (ntok + chunk_keys - 1) / chunk_keys : nchunks;

  // ---- warp geometry: patch, its key halo box inside the CTA halo, common box ----
  const int wa[3] = {warp / (W1 * W2), (warp / W2) % W1, warp % W2};
  const int PQ[3] = {P0, P1, P2};
  int pq[3], wo[3], wn[3], clo[3], chi[3];
  bool warp_active = true;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    if (a >= RANK) { pq[a] = 0; wo[a] = 0; wn[a] = 1; clo[a] = 0; chi[a] = 1; continue; }
    pq[a] = q0[a] + wa[a] * PQ[a];
    warp_active &= pq[a] < glen[a];
    const int first = min(pq[a], glen[a] - 1), last = min(pq[a] + PQ[a] - 1, glen[a] - 1);
    int s, e;
    fused::halo_of(ax[a], glen[a], first, last, s, e);
    wo[a] = s - hs[a];
    wn[a] = e - s;
    fused::common_of(ax[a], glen[a], first, last, clo[a], chi[a]);
    clo[a] -= s;
    chi[a] -= s;
  }
  constexpr int CA = RANK - 1;  // column axis of the line walk
  LineWalk<RANK> walk;
  if constexpr (LINES) walk.init(wo, wn, hl);
  Split<RANK> split;
  split.n2 = wn[2];
  split.n1n2 = wn[1] * wn[2];
  split.inv2 = 1.0f / (float)split.n2;
  split.inv12 = 1.0f / (float)split.n1n2;
  const int hl12 = hl[1] * hl[2];
  Split<RANK> hsplit;  // the CTA halo box
  hsplit.n2 = hl[2];
  hsplit.n1n2 = hl12;
  hsplit.inv2 = 1.0f / (float)hl[2];
  hsplit.inv12 = 1.0f / (float)hl12;

  // ---- the thread's two query rows (group, group + 8) ----
  // They differ on one axis only (AX8, where the patch's row-major order steps by 8); on the
  // others they share a window. Windows are kept relative to the warp halo as (lo, size).
  constexpr int AX8 = P1 * P2 <= 8 ? 0 : (P2 <= 8 ? 1 : 2);
  const int group = lane >> 2, quad = lane & 3;
  int wlo[3], wsz[3], wlo8, wsz8;  // window of row group; AX8 window of row group + 8
  int qc[3], qc8;                  // coordinates of row group; AX8 coordinate of group + 8
  bool row_ok[2] = {true, true};
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int r = group + 8 * ri;
    const int rc[3] = {r / (P1 * P2), (r / P2) % P1, r % P2};
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      if (a >= RANK) {
        if (ri == 0) { wlo[a] = 0; wsz[a] = 1; qc[a] = 0; }
        continue;
      }
      const int ig = pq[a] + rc[a];
      row_ok[ri] &= ig < glen[a];
      if (ri == 1 && a != AX8) continue;
      const int igc = min(ig, glen[a] - 1);
      int s, e;
      ax[a].window(igc, glen[a], s, e);
      const int lo = s - (hs[a] + wo[a]), c = grp[a] + ax[a].dilation * igc;
      if (ri == 0) { wlo[a] = lo; wsz[a] = e - s; qc[a] = c; }
      else { wlo8 = lo; wsz8 = e - s; qc8 = c; }
    }
  }

  // Relative positional bias: the head's table [2k-1, ...] is copied into shared memory after
  // the key buffers, in log2 units (row-major, strides ts); the entry of row ri and the key at
  // warp-halo coordinates (a0, a1, a2) is brow[ri] + sum over axes of a * ts, brow holding the
  // warp halo's origin and the row's (query - kernel + 1) terms.
  int brow[2] = {0, 0};
  float* const btab = reinterpret_cast<float*>(kv_s + stages * 2 * chunk_keys * DP);
  const int tn1 = RANK > 1 ? 2 * ax[1].kernel - 1 : 1, tn2 = RANK > 2 ? 2 * ax[2].kernel - 1 : 1;
  auto rs = [&](int a) { return a == 0 ? tn1 * tn2 : a == 1 ? tn2 : 1; };
  if constexpr (BIAS) {
    const int tvol = (2 * ax[0].kernel - 1) * tn1 * tn2;
    for (int i = tid; i < tvol; i += NT) {
      const int o0 = i / (tn1 * tn2), r = i - o0 * tn1 * tn2, o1 = r / tn2, o2 = r - o1 * tn2;
      btab[i] = to_float(rpb[head * p.rpb[0] + o0 * p.rpb[1] + o1 * p.rpb[2] + o2 * p.rpb[3]]) *
                1.4426950408889634f;
    }
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int r = group + 8 * ri;
      const int rc[3] = {r / (P1 * P2), (r / P2) % P1, r % P2};
#pragma unroll
      for (int a = 0; a < RANK; ++a)
        brow[ri] += (hs[a] + wo[a] - min(pq[a] + rc[a], glen[a] - 1) + ax[a].kernel - 1) * rs(a);
    }
  }
  // Adds that bias to score x (log2 units; the first chunk's barrier orders the copy before
  // any use); masked scores stay -inf (their table index may lie outside the table).
  auto add_bias = [&](float& x, int ri, int a0, int a1, int a2) {
    if (x != NEG_INF) x += btab[brow[ri] + a0 * rs(0) + a1 * rs(1) + a2 * rs(2)];
  };

  const i64 hd = p.head_dim;
  // Grouped-query attention: this head's keys and values are those of kv head
  // head / heads_per_kv (the same head without GQA); unsigned 32-bit division (the signed
  // one cost 8 bytes of spill at head dim 32 on sm_80).
  const i64 kv_head = (unsigned)head / (unsigned)p.heads_per_kv;
  const i64 kbase = batch * p.k[0] + kv_head * p.k[4];
  const i64 vbase = batch * p.v[0] + kv_head * p.v[4];
  const T* const qw = q_s + warp * 16 * DP;
  const i64 xhead = (unsigned)head / (unsigned)(EXTRA ? p.heads_per_extra : 1);
  const i64 xkbase = batch * p.xk[0] + xhead * p.xk[4];
  const i64 xvbase = batch * p.xv[0] + xhead * p.xv[4];

  // ---- stage this warp's 16 query rows (zero-padded to DP) ----
#pragma unroll
  for (int i = lane; i < 16 * CPR; i += 32) {
    const int r = i / CPR, c = i % CPR;
    const int rc[3] = {r / (P1 * P2), (r / P2) % P1, r % P2};
    int x[3];
#pragma unroll
    for (int a = 0; a < 3; ++a)
      x[a] = a < RANK ? grp[a] + ax[a].dilation * min(pq[a] + rc[a], glen[a] - 1) : 0;
    const i64 off = offset6(p.q, batch, x[0], x[1], x[2], head, (i64)c * EPC);
    const bool ok = (i64)c * EPC < hd;
    tc::cp_async16(q_s + warp * 16 * DP + r * DP + fused::swizzle_chunk<CPR>(r, c) * EPC,
                   ok ? q + off : q, ok);
  }
  tc::cp_async_commit();

  // Stage chunk ch of the CTA halo (flat keys [ch * ck, ...)) into buffer ch % stages; past
  // the halo's chunks, additional tokens [(ch - nchunks) * chunk_keys, ...).
  auto load_chunk = [&](int ch) {
    T* const ks = kv_s + (ch % stages) * 2 * chunk_keys * DP;
    T* const vs = ks + chunk_keys * DP;
    if (EXTRA && ch >= nchunks) {
      const int x0 = (ch - nchunks) * chunk_keys, nk = min(chunk_keys, ntok - x0);
      for (int i = tid; i < nk * CPR; i += NT) {
        const int r = i / CPR, c = i % CPR;
        const bool ok = (i64)c * EPC < hd;
        const int dst = r * DP + fused::swizzle_chunk<CPR>(r, c) * EPC;
        const i64 e = (i64)c * EPC, tok = x0 + r;
        tc::cp_async16(ks + dst, ok ? xk + xkbase + tok * p.xk[1] + e : xk, ok);
        tc::cp_async16(vs + dst, ok ? xv + xvbase + tok * p.xv[1] + e : xv, ok);
      }
      return;
    }
    // Each thread copies one fixed 16-byte column (hc) of every RSTEP-th row (no division
    // per copy); a row's tensor offsets are 32 x 64-bit products of its halo
    // coordinates.
    static_assert(NT % CPR == 0, "a CTA's threads cover whole rows");
    constexpr int RSTEP = NT / CPR;
    const int hc = threadIdx.x % CPR, f0 = ch * ck, nk = min(ck, total - f0);
    const bool hok = hc * EPC < hd;
#pragma unroll 1
    for (int r = threadIdx.x / CPR; r < nk; r += RSTEP) {
      int x[3];
      hsplit(f0 + r, x[0], x[1], x[2]);
      i64 off_k = kbase + hc * EPC, off_v = vbase + hc * EPC;
#pragma unroll
      for (int a = 0; a < RANK; ++a) {
        const unsigned c = grp[a] + ax[a].dilation * (hs[a] + x[a]);  // (>= 0)
        off_k += (i64)c * p.k[1 + a];
        off_v += (i64)c * p.v[1 + a];
      }
      const int dst = r * DP + fused::swizzle_chunk<CPR>(r, hc) * EPC;
      tc::cp_async16(ks + dst, hok ? k + off_k : k, hok);
      tc::cp_async16(vs + dst, hok ? v + off_v : v, hok);
    }
  };

  const float scale_log2 = p.scale * 1.4426950408889634f;
  constexpr int QREGS = Q_IN_REGS ? (TF32 ? DP / 8 : DP / 16) : 1;
  unsigned qf[QREGS][4];
  const int kib = ((lane >> 3) & 1) * 8 + (lane & 7);  // key of the block this lane addresses
  const int csel = lane >> 4;                          // chunk offset this lane addresses

  // Q A-fragment of k-step kk (16 columns for 16-bit types, 8 for TF32).
  auto q_frag = [&](int kk, unsigned (&a)[4]) {
    if constexpr (TF32) {
      const float* qr0 = reinterpret_cast<const float*>(qw) + group * DP;
      const float* qr1 = qr0 + 8 * DP;
      const int c0 = kk * 8 + quad, c1 = c0 + 4;
      a[0] = tc::to_tf32(qr0[fused::swizzle_chunk<CPR>(group, c0 / 4) * 4 + c0 % 4]);
      a[1] = tc::to_tf32(qr1[fused::swizzle_chunk<CPR>(group + 8, c0 / 4) * 4 + c0 % 4]);
      a[2] = tc::to_tf32(qr0[fused::swizzle_chunk<CPR>(group, c1 / 4) * 4 + c1 % 4]);
      a[3] = tc::to_tf32(qr1[fused::swizzle_chunk<CPR>(group + 8, c1 / 4) * 4 + c1 % 4]);
    } else {
      tc::ldmatrix_x4(a, qw + kib * DP + fused::swizzle_chunk<CPR>(kib, 2 * kk + csel) * EPC);
    }
  };

  // Output columns [pass * DO, pass * DO + DO): one pass keeps all of them in registers up to
  // DP 128; DP 256 takes two passes over the keys (recomputing the scores) to avoid spills.
  for (int pass = 0; pass < NPASS; ++pass) {
    float acc[DO / 8][4];
#pragma unroll
    for (int n = 0; n < DO / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};

    load_chunk(0);
    tc::cp_async_commit();

    for (int ch = 0; ch < nall; ++ch) {
      if (stages == 2 && ch + 1 < nall) {
        load_chunk(ch + 1);
        tc::cp_async_commit();
        tc::cp_async_wait<1>();
      } else {
        tc::cp_async_wait<0>();
      }
      __syncthreads();
      if constexpr (Q_IN_REGS) {
        if (ch == 0) {
#pragma unroll
          for (int kk = 0; kk < QREGS; ++kk) q_frag(kk, qf[kk]);
        }
      }

      const T* const ks = kv_s + (ch % stages) * 2 * chunk_keys * DP;
      const T* const vs = ks + chunk_keys * DP;
      const int f0 = ch * ck, f1 = min(f0 + ck, total);
      // A chunk of additional tokens: every warp takes all of its rows [0, it_hi), flat.
      const bool xch = EXTRA && ch >= nchunks;
      const bool lines = LINES && !xch;
      // The warp's part of this chunk: flat walk, halo indices [it_lo, it_hi); line walk,
      // 8-key groups [it_lo, it_hi) of whole lines.
      int it_lo, it_hi;
      if (xch) {
        it_lo = 0;
        it_hi = min(chunk_keys, ntok - (ch - nchunks) * chunk_keys);
      } else if constexpr (LINES) {
        walk.range(wo, wn, hl, f0, f1, nchunks == 1, it_lo, it_hi);
      } else {
        it_lo = fused::count_before(wo, wn, hl, f0);
        it_hi = fused::count_before(wo, wn, hl, f1);
      }
      const int t_hi = it_hi;

      // Shared-memory row of the key at warp-halo coordinates (a0, a1, a2).
      auto row_at = [&](int a0, int a1, int a2) {
        return (a0 + wo[0]) * hl12 + (a1 + wo[1]) * hl[2] + (a2 + wo[2]) - f0;
      };
      // ... and at warp-halo flat index t (clamped into this chunk's run).
      auto row_of = [&](int t) {
        int a0, a1, a2;
        split(min(t, t_hi - 1), a0, a1, a2);
        return row_at(a0, a1, a2);
      };

      // One iteration: KB sub-blocks of 16 keys, 8-key groups j = 0 .. 2 KB - 1: flat walk,
      // warp-halo flat indices [t0 + 8 j, +8); line walk, groups t0 + j.
      const int step = lines ? 2 * KB : 16 * KB;
      for (int t0 = warp_active ? it_lo : it_hi; t0 < it_hi; t0 += step) {
        float s[2 * KB][4];  // s[j][e]: row group + 8 (e >> 1), key 2 quad + (e & 1) of group j
#pragma unroll
        for (int j = 0; j < 2 * KB; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;

        // Line walk: per group, line coordinates, first column, chunk row of column 0.
        int gl0[2 * KB], gl1[2 * KB], gcol[2 * KB], grow[2 * KB];
        if (lines) {
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) {
            walk.group(min(t0 + j, it_hi - 1), gl0[j], gl1[j], gcol[j], grow[j]);
            grow[j] -= f0;
          }
        }
        // Shared-memory row of key c (0..7) of group j (line walk: padding columns past the
        // line's end read its last key, masked).
        auto key_row = [&](int j, int c) {
          if (lines) return grow[j] + min(gcol[j] + c, wn[CA] - 1);
          if (xch) return min(t0 + 8 * j + c, t_hi - 1);
          return row_of(t0 + 8 * j + c);
        };

        // Rows this lane addresses (key kib of each sub-block), and (flat walk) whether every
        // key of the iteration lies inside every query's window (then nothing is masked; the
        // line walk always masks: its groups of 8 rarely lie inside every window).
        int krow[KB];
        bool inside = true;
#pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
          const int t = t0 + 16 * kb + kib;
          if (lines) {
            krow[kb] = kib < 8 ? key_row(2 * kb, kib) : key_row(2 * kb + 1, kib - 8);
            __builtin_assume(krow[kb] >= 0);
          } else if (xch) {
            krow[kb] = min(t, t_hi - 1);
            inside &= t < t_hi;
          } else {
            int a0, a1, a2;
            split(min(t, t_hi - 1), a0, a1, a2);
            krow[kb] = row_at(a0, a1, a2);
            inside &= t < t_hi && a0 >= clo[0] && a0 < chi[0] && a1 >= clo[1] && a1 < chi[1] &&
                      a2 >= clo[2] && a2 < chi[2];
          }
        }
        if (!lines) inside = __all_sync(0xffffffffu, inside);

        // ---- S = Q K^T ----
        if constexpr (TF32) {
          const float* const kf = reinterpret_cast<const float*>(ks);
          int kr[2 * KB];  // rows of keys group and group + 8 of each sub-block
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) kr[j] = key_row(j, group);
          // Fully unrolled, DP 256 hoists every k-step's loads and spills; 4 at a time fits.
#pragma unroll(DP > 128 ? 4 : DP / 8)
          for (int kk = 0; kk < DP / 8; ++kk) {
            unsigned a[4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
              for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
            } else {
              q_frag(kk, a);
            }
            const int c0 = kk * 8 + quad, c1 = c0 + 4;
#pragma unroll
            for (int j = 0; j < 2 * KB; ++j) {
              unsigned b[2];
              b[0] = tc::to_tf32(kf[kr[j] * DP + fused::swizzle_chunk<CPR>(kr[j], c0 / 4) * 4 + c0 % 4]);
              b[1] = tc::to_tf32(kf[kr[j] * DP + fused::swizzle_chunk<CPR>(kr[j], c1 / 4) * 4 + c1 % 4]);
              tc::mma1688_tf32(s[j], a, b);
            }
          }
        } else {
#pragma unroll
          for (int kk = 0; kk < DP / 16; ++kk) {
            unsigned a[4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
              for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
            } else {
              q_frag(kk, a);
            }
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
              unsigned b[4];
              tc::ldmatrix_x4(b, ks + krow[kb] * DP +
                                     fused::swizzle_chunk<CPR>(krow[kb], 2 * kk + csel) * EPC);
              const unsigned b0[2] = {b[0], b[2]}, b1[2] = {b[1], b[3]};
              typename tc::MmaKind<T>::tag tag;
              tc::mma16816(s[2 * kb], a, b0, tag);
              tc::mma16816(s[2 * kb + 1], a, b1, tag);
            }
          }
        }

        // ---- scale, mask ----
#pragma unroll
        for (int j = 0; j < 2 * KB; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
        if (xch) {
          if (!inside) {   // the last chunk's tail
#pragma unroll
            for (int j = 0; j < 2 * KB; ++j) {
              const int t = t0 + 8 * j + 2 * quad;
              if (t >= t_hi) s[j][0] = s[j][2] = NEG_INF;
              if (t + 1 >= t_hi) s[j][1] = s[j][3] = NEG_INF;
            }
          }
        } else if (lines) {
          // Row ri sees key column c of group j when its window on the line axes holds the
          // group's line and its window on the column axis holds c (windows lie inside the
          // warp halo, so padding columns are masked too).
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) {
#pragma unroll
            for (int ri = 0; ri < 2; ++ri) {
              const int wl0 = ri && AX8 == 0 ? wlo8 : wlo[0], ws0 = ri && AX8 == 0 ? wsz8 : wsz[0];
              const int wl1 = ri && AX8 == 1 ? wlo8 : wlo[1], ws1 = ri && AX8 == 1 ? wsz8 : wsz[1];
              const int wlc = ri && AX8 == CA ? wlo8 : wlo[CA], wsc = ri && AX8 == CA ? wsz8 : wsz[CA];
              bool line_ok = t0 + j < it_hi && (unsigned)(gl0[j] - wl0) < (unsigned)ws0;
              if (RANK == 3) line_ok &= (unsigned)(gl1[j] - wl1) < (unsigned)ws1;
              const unsigned n = line_ok ? wsc : 0u;
              const unsigned d = gcol[j] + 2 * quad - wlc;
              if (!(d < n)) s[j][2 * ri] = NEG_INF;
              if (!(d + 1 < n)) s[j][2 * ri + 1] = NEG_INF;
            }
          }
        } else if (!inside) {
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) {
            const int t = t0 + 8 * j + 2 * quad;
            int b[3];
            split(min(t, t_hi - 1), b[0], b[1], b[2]);
            int c[3] = {b[0], b[1], b[2] + 1};  // key t + 1
            if (c[2] == wn[2]) {
              c[2] = 0;
              if (++c[1] == wn[1]) { c[1] = 0; ++c[0]; }
            }
            bool sh0 = t < t_hi, sh1 = t + 1 < t_hi;  // shared axes (both rows)
#pragma unroll
            for (int a = 0; a < 3; ++a) {
              if (a == AX8) continue;
              sh0 &= (unsigned)(b[a] - wlo[a]) < (unsigned)wsz[a];
              sh1 &= (unsigned)(c[a] - wlo[a]) < (unsigned)wsz[a];
            }
            if (!(sh0 && (unsigned)(b[AX8] - wlo[AX8]) < (unsigned)wsz[AX8])) s[j][0] = NEG_INF;
            if (!(sh1 && (unsigned)(c[AX8] - wlo[AX8]) < (unsigned)wsz[AX8])) s[j][1] = NEG_INF;
            if (!(sh0 && (unsigned)(b[AX8] - wlo8) < (unsigned)wsz8)) s[j][2] = NEG_INF;
            if (!(sh1 && (unsigned)(c[AX8] - wlo8) < (unsigned)wsz8)) s[j][3] = NEG_INF;
          }
        }

        // ---- relative positional bias (not on additional tokens) ----
        if (BIAS && !xch) {
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) {
            int b[3], c[3];  // warp-halo coordinates of keys 2 quad and 2 quad + 1 of group j
            if constexpr (LINES) {
              b[0] = gl0[j];
              b[1] = RANK == 3 ? gl1[j] : gcol[j] + 2 * quad;
              b[2] = RANK == 3 ? gcol[j] + 2 * quad : 0;
              c[0] = b[0]; c[1] = b[1]; c[2] = b[2];
              ++c[CA];
            } else {
              const int t = t0 + 8 * j + 2 * quad;
              split(min(t, t_hi - 1), b[0], b[1], b[2]);
              c[0] = b[0]; c[1] = b[1]; c[2] = b[2] + 1;
              if (c[2] == wn[2]) {
                c[2] = 0;
                if (++c[1] == wn[1]) { c[1] = 0; ++c[0]; }
              }
            }
            add_bias(s[j][0], 0, b[0], b[1], b[2]);
            add_bias(s[j][1], 0, c[0], c[1], c[2]);
            add_bias(s[j][2], 1, b[0], b[1], b[2]);
            add_bias(s[j][3], 1, c[0], c[1], c[2]);
          }
        }

        // ---- online softmax (rows group, group + 8) ----
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          float mx = NEG_INF;
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * ri], s[j][2 * ri + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[ri], mx);
          const float m_ref = m_new == NEG_INF ? 0.f : m_new;  // all masked so far: p = 0
          const float alpha = fast_exp2(m_run[ri] - m_ref);
          m_run[ri] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) {
            s[j][2 * ri] = fast_exp2(s[j][2 * ri] - m_ref);
            s[j][2 * ri + 1] = fast_exp2(s[j][2 * ri + 1] - m_ref);
            sum += s[j][2 * ri] + s[j][2 * ri + 1];
          }
          l_run[ri] = l_run[ri] * alpha + sum;
#pragma unroll
          for (int n = 0; n < DO / 8; ++n) {
            acc[n][2 * ri] *= alpha;
            acc[n][2 * ri + 1] *= alpha;
          }
        }

        // ---- O += P V ----
        if constexpr (TF32) {
          // k-slot quad <-> key 2 quad, k-slot quad + 4 <-> key 2 quad + 1 (both operands agree).
          const float* const vf = reinterpret_cast<const float*>(vs);
#pragma unroll
          for (int j = 0; j < 2 * KB; ++j) {
            const unsigned a[4] = {tc::to_tf32(s[j][0]), tc::to_tf32(s[j][2]),
                                   tc::to_tf32(s[j][1]), tc::to_tf32(s[j][3])};
            const int r0 = key_row(j, 2 * quad), r1 = key_row(j, 2 * quad + 1);
#pragma unroll
            for (int n = 0; n < DO / 8; ++n) {
              const int col = pass * DO + n * 8 + group;
              unsigned b[2];
              b[0] = tc::to_tf32(vf[r0 * DP + fused::swizzle_chunk<CPR>(r0, col / 4) * 4 + col % 4]);
              b[1] = tc::to_tf32(vf[r1 * DP + fused::swizzle_chunk<CPR>(r1, col / 4) * 4 + col % 4]);
              tc::mma1688_tf32(acc[n], a, b);
            }
          }
        } else {
          typename tc::MmaKind<T>::tag tag;
#pragma unroll
          for (int kb = 0; kb < KB; ++kb) {
            const unsigned a[4] = {
                tc::pack2(s[2 * kb][0], s[2 * kb][1], tag), tc::pack2(s[2 * kb][2], s[2 * kb][3], tag),
                tc::pack2(s[2 * kb + 1][0], s[2 * kb + 1][1], tag),
                tc::pack2(s[2 * kb + 1][2], s[2 * kb + 1][3], tag)};
#pragma unroll
            for (int n2 = 0; n2 < DO / 16; ++n2) {
              unsigned b[4];
              const int cc = pass * (DO / EPC) + 2 * n2 + csel;
              tc::ldmatrix_x4_trans(b, vs + krow[kb] * DP + fused::swizzle_chunk<CPR>(krow[kb], cc) * EPC);
              const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
              tc::mma16816(acc[2 * n2], a, b0, tag);
              tc::mma16816(acc[2 * n2 + 1], a, b1, tag);
            }
          }
        }
      }
      __syncthreads();  // every warp is done with this buffer before it is refilled
      if (stages == 1 && ch + 1 < nall) {
        load_chunk(ch + 1);
        tc::cp_async_commit();
      }
    }

    // ---- epilogue: normalize, store this pass's output columns, and lse ----
    if (warp_active) {
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        float l = l_run[ri];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!row_ok[ri]) continue;
        int x[3] = {qc[0], qc[1], qc[2]};
        if (ri == 1) x[AX8] = qc8;
        const float inv = 1.f / l;
        const i64 obase = offset6(p.o, batch, x[0], x[1], x[2], head, 0);
#pragma unroll
        for (int n = 0; n < DO / 8; ++n) {
          const int col = pass * DO + n * 8 + 2 * quad;
          if (col < hd) pack_store(out + obase + col, acc[n][2 * ri] * inv, acc[n][2 * ri + 1] * inv);
        }
        if (pass == 0 && quad == 0)
          lse[offset6(p.lse, batch, x[0], x[1], x[2], head, 0)] =
              (m_run[ri] + __log2f(l)) * 0.6931471805599453f;
      }
    }
  }
}
