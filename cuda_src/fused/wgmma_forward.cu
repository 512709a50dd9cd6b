// Fused neighborhood-attention forward for Hopper (sm_90a), 1-D, 2-D and 3-D: out = softmax(scale q k^T) v over each query's window and lse (natural log), flash-style on wgmma.
// One CTA = a box of 64 * WG in-group queries (1-D: consecutive; 2-D 8x16; 3-D 2x8x8) of one dilation group per axis, head and batch; warpgroup 0 loads (cp.async, mbarriers), compute warpgroup w owns query rows 64w..64w+63 (one m64 wgmma row block), all walk the box's key region in 128-key tiles.
// Reads q, k, v (last dim contiguous, rows 16-byte aligned) through a STAGES-deep pipeline into 128-byte-swizzled shared memory; wgmma reads Q, K (K-major) and V (N-major) from there, P from registers; writes out and lse (float32).
#include "natten/common.cuh"
#include "natten/mma.cuh"
#include "natten/hopper/wgmma.cuh"
#include "natten/hopper/tile_box.cuh"
#include "natten/hopper/bias_box.cuh"
#include "natten/hopper/tma.cuh"
#include "natten/hopper/epilogue.cuh"

namespace natten {
namespace hopper {

// Register budgets of the 1-D loader and compute warpgroups (two compute warpgroups). NVRTC
// before 13.1 spills the D128 loader at 24 registers (8 bytes, in the tests' compile check):
// there it gets 32 and the compute warpgroups 232 (the 2-D kernels' split), which 13.1 and
// later do not need.
#if __CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ < 1301
constexpr int kLoaderRegs1D = 32, kComputeRegs1D = 232;
#else
constexpr int kLoaderRegs1D = 24, kComputeRegs1D = 240;
#endif

// Copies rows [row0, row0 + ROWS) of a row-major [*, head_dim] matrix (row stride `stride`
// elements) into a swizzled tile of ROWS x D (layout in wgmma.cuh); rows at or past `rows`
// and columns at or past head_dim are zero-filled, so padded keys and dims add nothing.
// Thread t always copies 16-byte chunk t % (D / 8) of rows t / (D / 8) + i * STEP: STEP is a
// multiple of 8, so the swizzle term is the same for all its rows and the addresses just step.
template <typename T, int D, int ROWS, int NT, int UNROLL>
__device__ __forceinline__ void load_tile(unsigned dst, const T* src, i64 stride, int row0,
                                          int rows, int head_dim, int tid) {
  constexpr int CPR = D / 8, STEP = NT / CPR;
  static_assert(NT % CPR == 0 && (STEP % 8 == 0 || 8 % STEP == 0), "rows per pass");
  const int ch = tid % CPR;
  int r = tid / CPR;
  unsigned at = dst + (ch / 8) * (ROWS * 128) + swz128(r, ch % 8);
  const T* from = src + (i64)(row0 + r) * stride + ch * 8;
  const bool col_ok = ch * 8 < head_dim;
#pragma unroll UNROLL
  for (; r < ROWS; r += STEP) {
    const bool ok = col_ok && row0 + r < rows;
    if constexpr (STEP % 8 != 0)   // (head dim 256: the swizzle term changes row to row)
      at = dst + (ch / 8) * (ROWS * 128) + swz128(r, ch % 8);
    cp_async16(at, ok ? from : src, ok);
    at += STEP * 128;
    from += STEP * stride;
  }
}

// Where a CTA's query tile and its key region lie. The query tile is a T0 x T1 x T2 box of
// in-group coordinates of one dilation group per axis (rank padded to 3 with inert axes);
// its key region is the box of per-axis ranges [start(first query), end(last query)) (windows
// are monotone in the query index), walked in row-major order (flat index f) in BN-key
// tiles, or (BOX, rank 2 and 3) in key boxes of the query box's shape, padded past the region
// (no index arithmetic per key, and boxes inside every window need no mask). Region
// coordinates are relative to the region's start.
template <int RANK, int T0, int T1, int T2>
struct Geom : TileBox<RANK, T0, T1, T2> {  // o0: the query box's origin
  typedef TileBox<RANK, T0, T1, T2> Box;
  using Box::g, Box::o0, Box::glen, Box::rs, Box::rk, Box::ilo, Box::ihi, Box::own_row;
  using Box::total, Box::inner, Box::size_region, Box::region_at;
  int nb[3];       // key boxes per axis
  bool rows_only;  // windows all span axes 1 and 2 of the region: masks depend on rows only

  __device__ __forceinline__ bool init(const NAParams& p) {
    const int tdim[3] = {T0, T1, T2};
    int x = blockIdx.x, tile[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      const Axis ax = axis_of(p, a);
      const int n = (ax.group_len(0) + tdim[a] - 1) / tdim[a];  // group 0 is the longest
      tile[a] = x % n;
      // Along a causal axis later queries have longer windows: the grid runs those tiles
      // first, so that the short ones fill the last wave.
      if (ax.causal) tile[a] = n - 1 - tile[a];
      x /= n;
    }
    bool spans = true;
#pragma unroll
    for (int a = 2; a >= 0; --a) {
      const Axis ax = axis_of(p, a);
      g[a] = x % ax.dilation;
      x /= ax.dilation;
      glen[a] = ax.group_len(g[a]);
      o0[a] = tile[a] * tdim[a];
      if (o0[a] >= glen[a]) return false;
      int fs, fe, ls, le;
      ax.window(o0[a], glen[a], fs, fe);
      ax.window(min(o0[a] + tdim[a], glen[a]) - 1, glen[a], ls, le);
      rs[a] = fs;
      rk[a] = le - fs;
      ilo[a] = ls - fs;
      ihi[a] = fe - fs;
      nb[a] = (rk[a] + tdim[a] - 1) / tdim[a];
      if (a > 0 && (ls > fs || fe < le)) spans = false;
    }
    rows_only = spans;
    size_region();
    return true;
  }

  // Whether some score of the tile of region keys [lo, lo + bn) needs a mask.
  __device__ __forceinline__ bool needs_mask(int lo, int bn) const {
    if (RANK == 1) return lo < ilo[0] || lo + bn > ihi[0];
    if (!rows_only) return true;
    return lo < ilo[0] * inner || lo + bn > ihi[0] * inner;
  }

  // Box walk: origin (region coordinates) of key box j, and whether it needs a mask.
  __device__ __forceinline__ void box_origin(int j, int (&org)[3]) const {
    org[2] = (j % nb[2]) * T2;
    org[1] = ((j / nb[2]) % nb[1]) * T1;
    org[0] = (j / (nb[1] * nb[2])) * T0;
  }
  __device__ __forceinline__ bool box_needs_mask(const int (&org)[3]) const {
    const int tdim[3] = {T0, T1, T2};
    bool inside = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) inside = inside && org[a] >= ilo[a] && org[a] + tdim[a] <= ihi[a];
    return !inside;
  }
};

// Rows of the query tile (lo < 0; one matrix) or of a key tile (keys and values together, one
// index computation for both: region keys [lo, lo + ROWS), or with BOX key box lo) at their
// tensor addresses, for rank 2 and 3 (rank 1 steps one pointer: load_tile); keys past the
// region and queries past a group are zero-filled.
template <typename T, int D, int ROWS, int NT, bool BOX, int RANK, int T0, int T1, int T2>
__device__ __forceinline__ void load_rows(unsigned dst0, const T* base0, const i64* st0,
                                          unsigned dst1, const T* base1, const i64* st1,
                                          const Geom<RANK, T0, T1, T2>& G, const NAParams& p,
                                          int lo, int head_dim, int tid) {
  constexpr int CPR = D / 8, STEP = NT / CPR;
  static_assert(NT % CPR == 0 && (STEP % 8 == 0 || 8 % STEP == 0), "rows per pass");
  int org[3] = {0, 0, 0};
  if (BOX && lo >= 0) G.box_origin(lo, org);
  // Tensor coordinates of tile row r (false: past the group or the region).
  auto row_coords = [&](int r, int (&c)[3]) {
    bool ok = true;
    if (lo < 0) {
      G.own_row(r, c, ok);
      return ok;
    }
    if (BOX) {
      const int l[3] = {r / (T1 * T2), (r / T2) % T1, r % T2};
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        c[a] = org[a] + l[a];
        ok = ok && c[a] < G.rk[a];
      }
    } else {
      ok = lo + r < G.total;
      G.region_at(lo + r, c);
    }
#pragma unroll
    for (int a = 0; a < 3; ++a) c[a] += G.rs[a];
    return ok;
  };
  if constexpr (ROWS <= NT) {
    if (lo >= 0) {  // a key tile: each row's coordinates and offsets once
      copy_rows2<T, D, ROWS, NT>(dst0, base0, dst1, base1, head_dim, tid,
                                 [&](int r, long long& o0, long long& o1) {
        int c[3];
        const bool ok = row_coords(r, c);
        if (ok) {
          o0 = G.offset(p, st0, c[0], c[1], c[2]);
          o1 = G.offset(p, st1, c[0], c[1], c[2]);
        }
        return ok;
      });
      return;
    }
  }
  const int ch = tid % CPR;
  int r = tid / CPR;
  unsigned at = (ch / 8) * (ROWS * 128) + swz128(r, ch % 8);
  const bool col_ok = ch * 8 < head_dim;
#pragma unroll 1
  for (; r < ROWS; r += STEP) {
    int c[3];
    const bool ok = row_coords(r, c) && col_ok;
    if constexpr (STEP % 8 != 0) at = (ch / 8) * (ROWS * 128) + swz128(r, ch % 8);
    cp_async16(dst0 + at, ok ? base0 + G.offset(p, st0, c[0], c[1], c[2]) + ch * 8 : base0, ok);
    if (lo >= 0)
      cp_async16(dst1 + at, ok ? base1 + G.offset(p, st1, c[0], c[1], c[2]) + ch * 8 : base1,
                 ok);
    at += STEP * 128;
  }
}

// One warpgroup's share of a query tile: the S and O accumulators, the running row maxima
// (raw scores) and partial row sums of its thread's two rows, and the steps of one key tile.
template <typename T, int D, int BN>
struct RowBlock {
  typedef typename Kind<T>::type kind;
  float acc_o[D / 2], acc_s[BN / 2];
  float m[2], l[2];
  unsigned pa[BN / 16][4];  // P as the A operand of O += P V

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;
    m[0] = m[1] = negative_infinity<float>();
    l[0] = l[1] = 0.f;
  }

  // S = Q K^T (onto: S += Q K^T, onto what acc_s holds); q_wg: this warpgroup's 64 rows of
  // Q, k_tile: the BN x D key tile.
  __device__ __forceinline__ void issue_qk(unsigned q_wg, unsigned k_tile, int bm,
                                           bool onto = false) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const unsigned koff = (kk % 4) * 32;
      SS<BN>::run(acc_s, desc128(q_wg + (kk / 4) * (bm * 128) + koff, 16, 1024),
                  desc128(k_tile + (kk / 4) * (BN * 128) + koff, 16, 1024), onto || kk > 0,
                  kind());
    }
  }

  // O += P V; v_tile: the BN x D value tile, read N-major (16 keys = 2048 bytes).
  __device__ __forceinline__ void issue_pv(unsigned v_tile) {
#pragma unroll
    for (int s = 0; s < BN / 16; ++s)
      RS<D>::run(acc_o, pa[s], desc128(v_tile + s * 2048, BN * 128, 1024), kind());
  }

  // The score walks below visit each of the thread's BN / 2 scores of a key tile as
  // f(i, r, in, key): accumulator index i, its row r (0, 1), whether the key lies in row r's
  // window, and the key's place along the bias box (region coordinates dotted with bst). A
  // visitor that reads neither leaves their arithmetic to dead-code elimination.

  // Region keys lo + column in flat order: rank 1 (row r's window is [ws[r], we[r]), region
  // coordinates), and the unmasked tiles of the rank 2, 3 flat walk (key: the flat index).
  template <class F>
  __device__ __forceinline__ void walk_1d(int lo, int quad, const int (&ws)[2],
                                          const int (&we)[2], F&& f) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int col = lo + (i / 4) * 8 + 2 * quad + (i % 2), r = (i / 2) % 2;
      f(i, r, col >= ws[r] && col < we[r], col);
    }
  }

  // Rank 2 and 3, flat walk: region keys [lo, lo + BN) in row-major order; row r's window is
  // [wl, wl + wn) per axis (region coordinates). The thread's columns 8i + 2 quad + e are
  // visited in order, their coordinates carried forward (steps of 1 and 7 along the last
  // axis of the rank).
  template <int RANK, class F>
  __device__ __forceinline__ void walk_nd(int lo, int quad, const int (&rk)[3], int inner,
                                          const int (&wl)[2][3], const int (&wn)[2][3],
                                          const int (&bst)[3], F&& f) {
    constexpr int LAST = RANK - 1;
    int c[3];
    const int f0 = lo + 2 * quad;
    c[0] = f0 / inner;
    const int rem = f0 - c[0] * inner;
    c[1] = RANK == 3 ? rem / rk[2] : rem;
    c[2] = RANK == 3 ? rem - c[1] * rk[2] : 0;
#pragma unroll
    for (int jn = 0; jn < BN / 8; ++jn) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int key = 0;
#pragma unroll
        for (int a = 0; a < RANK; ++a) key += a == LAST ? c[a] : c[a] * bst[a];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          bool in = true;
#pragma unroll
          for (int a = 0; a < RANK; ++a)
            in = in && (unsigned)(c[a] - wl[r][a]) < (unsigned)wn[r][a];
          f(4 * jn + 2 * r + e, r, in, key);
        }
        c[LAST] += e == 0 ? 1 : 7;
        while (c[LAST] >= rk[LAST]) {
          c[LAST] -= rk[LAST];
          if (RANK == 3) {
            if (++c[1] >= rk[1]) {
              c[1] = 0;
              ++c[0];
            }
          } else {
            ++c[0];
          }
        }
      }
    }
  }

  // Box walk (rank 2, 3): key box with region origin org, shaped T0 x T1 x T2 like the query
  // box; column 8 jn + 2 quad + e is box-local key (8 jn / TL spread over the outer axes,
  // 8 jn % TL + 2 quad + e on the last, TL its extent), so only the last axis costs run time.
  template <int RANK, int T0, int T1, int T2, class F>
  __device__ __forceinline__ void walk_box(const int (&org)[3], int quad, const int (&wl)[2][3],
                                           const int (&wn)[2][3], const int (&bst)[3], F&& f) {
    constexpr int TL = RANK == 3 ? T2 : T1;
    static_assert(TL % 8 == 0 && T0 * T1 * T2 == BN, "key boxes of BN keys, last axis by 8");
    int lo[2][3], kbase = 2 * quad;
#pragma unroll
    for (int a = 0; a < RANK; ++a) kbase += a == RANK - 1 ? org[a] : org[a] * bst[a];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int a = 0; a < RANK; ++a) lo[r][a] = wl[r][a] - org[a] - (a == RANK - 1 ? 2 * quad : 0);
#pragma unroll
    for (int jn = 0; jn < BN / 8; ++jn) {
      const int outer = 8 * jn / TL, last = 8 * jn % TL;
      const int l[3] = {RANK == 3 ? outer / T1 : outer, RANK == 3 ? outer % T1 : last, last};
      int key = kbase;
#pragma unroll
      for (int a = 0; a < RANK; ++a) key += a == RANK - 1 ? l[a] : l[a] * bst[a];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          bool in = true;
#pragma unroll
          for (int a = 0; a < RANK; ++a)
            in = in && (unsigned)(l[a] + (a == RANK - 1 ? e : 0) - lo[r][a]) < (unsigned)wn[r][a];
          f(4 * jn + 2 * r + e, r, in, key + e);
        }
      }
    }
  }

  // Online softmax of the tile in exp2 (sl = scale * log2 e): acc_s becomes P; returns the
  // factor by which each row's O must shrink. A row's BN values sit on the 4 lanes of a quad.
  __device__ __forceinline__ void softmax(float sl, float (&alpha)[2]) {
    const float neg_inf = negative_infinity<float>();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        mx = fmaxf(mx, fmaxf(acc_s[4 * i + 2 * r], acc_s[4 * i + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == neg_inf ? 0.f : mx * sl;
      alpha[r] = fast_exp2(m[r] * sl - base);
      m[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = fast_exp2(fmaf(acc_s[4 * i + 2 * r + e], sl, -base));
          acc_s[4 * i + 2 * r + e] = pe;
          sum += pe;
        }
      }
      l[r] = l[r] * alpha[r] + sum;
    }
  }

  __device__ __forceinline__ void rescale(const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
      for (int x = 0; x < 4; ++x) acc_o[4 * i + x] *= alpha[x / 2];
  }

  // Accumulator chunks 2s, 2s+1 packed in order are A step s (layouts in wgmma.cuh).
  __device__ __forceinline__ void pack_p() {
    typedef typename tc::MmaKind<T>::tag pack_tag;
#pragma unroll
    for (int s = 0; s < BN / 16; ++s)
#pragma unroll
      for (int x = 0; x < 4; ++x)
        pa[s][x] = tc::pack2(acc_s[8 * s + 2 * x], acc_s[8 * s + 2 * x + 1], pack_tag());
  }
};

// Warp specialization: warpgroup 0 only loads (cp.async, 128 threads, few registers),
// signalling each stage's arrival on an mbarrier (full) and waiting for the compute
// warpgroups to free it (empty); warpgroups 1..WG compute and never wait for each other.
// (Loading from the compute warpgroups with a CTA barrier per tile ran them in lock step:
// 2.9-3.9 ms against 2.3-2.7 dense at D64, NOTES-hopper-fwd.md v1/v2.)
// PIPE: each compute warpgroup issues S_j = Q K_j and O += P_{j-1} V_{j-1} together and runs
// the softmax of tile j while the second GEMM is in flight; else the two GEMMs and the
// softmax of a tile run one after the other.
// PP (ping-pong, with PIPE): the compute warpgroups take turns to issue their GEMMs (named
// barriers 1..WG), so that one's softmax runs while another's GEMMs hold the tensor cores,
// instead of all of them contending at once.
// BIAS: adds rpb[h, key - query + kernel - 1] (in-group offsets per axis) to each score
// (BiasBox; stride 1): staged as rpb / scale, it is what S's accumulator starts from.
// TMA: the loader is one thread that stages Q and each K/V tile by tensor maps (tq, tk, tv:
// tma.cuh) instead of the warpgroup's cp.async; rank 2 and 3 only with BOX (a key box is one
// TMA box per 64 columns), rank 1 with the map's element stride stepping the dilation.
template <typename T, int D, int WG, int BN, int STAGES, bool PIPE, bool PP, int RANK, int T0,
          int T1, int T2, bool BOX, bool BIAS, bool TMA>
__device__ __forceinline__ void fwd(const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ v, T* __restrict__ o,
                                    float* __restrict__ lse, const T* __restrict__ rpb,
                                    const NAParams& p, const TmaMap* tq, const TmaMap* tk,
                                    const TmaMap* tv) {
  constexpr int BM = 64 * WG, NT = 128;  // NT: threads that load (warpgroup 0)
  static_assert(STAGES >= 2, "two stages at least");
  static_assert(!PP || (PIPE && WG >= 2), "PP needs PIPE and two compute warpgroups");
  static_assert(T0 * T1 * T2 == BM && (RANK > 1 || T0 == BM) && (RANK > 2 || T2 == 1),
                "the query tile is BM queries over the rank's axes");
  static_assert(!BOX || (RANK > 1 && BM == BN), "key boxes (rank 2, 3) have the query box's shape");
  static_assert(!TMA || RANK == 1 || BOX, "TMA loads key boxes (rank 2, 3)");
  constexpr unsigned Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  constexpr int LOAD_UNROLL = 2;  // the loader runs on few registers

  // The swizzled tiles need 1024-byte alignment: the dynamic shared memory is declared so
  // (no padding to round up by, which would cost the 64-query box its third stage at two CTAs
  // an SM); a base that is not aligned after all stops the kernel rather than overrun.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned sq = smem_u32(smem_raw);
  if (sq & 1023u) __trap();
  const unsigned sk = sq + Q_BYTES, sv = sk + STAGES * KV_BYTES;
  const unsigned full = sv + STAGES * KV_BYTES, empty = full + 8 * STAGES;  // mbarriers
  const unsigned btab = empty + 8 * STAGES;  // the bias box, after the mbarriers

  Geom<RANK, T0, T1, T2> G;
  if (!G.init(p)) return;
  const int h = blockIdx.y, b = blockIdx.z, hd = (int)p.head_dim;
  const int tid = threadIdx.x, lane = tid % 32, quad = lane % 4;
  // Compute warpgroup (-1: the loader), read through a shuffle so that the compiler sees it
  // is warp-uniform (setmaxnreg only applies to branches it can prove are).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0) - 1;
  const int num_tiles = BOX ? G.nb[0] * G.nb[1] * G.nb[2] : (G.total + BN - 1) / BN;

  // Batch and head offsets; rank 1 also folds in the group and steps rows by dilation.
  const T* qb = q + b * p.q[0] + h * p.q[4];
  const T* kb;  // k and v of the kv head this query head reads, set by the loader
  const T* vb;
  const int d0 = (int)p.dilation[0];
  auto load_q = [&]() {
    if (RANK == 1)
      load_tile<T, D, BM, NT, LOAD_UNROLL>(sq, qb + G.g[0] * p.q[1], d0 * p.q[1], G.o0[0],
                                           G.glen[0], hd, tid);
    else
      load_rows<T, D, BM, NT, BOX>(sq, qb, p.q, sq, qb, p.q, G, p, -1, hd, tid);
  };
  auto load_kv = [&](int j) {  // key/value tile j into its slot
    const unsigned slot = (j % STAGES) * KV_BYTES;
    if (RANK == 1) {
      const int row0 = G.rs[0] + j * BN;
      load_tile<T, D, BN, NT, LOAD_UNROLL>(sk + slot, kb + G.g[0] * p.k[1], d0 * p.k[1], row0,
                                           G.glen[0], hd, tid);
      load_tile<T, D, BN, NT, LOAD_UNROLL>(sv + slot, vb + G.g[0] * p.v[1], d0 * p.v[1], row0,
                                           G.glen[0], hd, tid);
    } else {
      load_rows<T, D, BN, NT, BOX>(sk + slot, kb, p.k, sv + slot, vb, p.v, G, p,
                                   BOX ? j : j * BN, hd, tid);
    }
  };

  // Tile j resident for this warpgroup (the loader's cp.async writes, seen through the
  // mbarrier, made visible to the tensor cores' async proxy).
  auto acquire = [&](int j) {
    mbar_wait(full + 8 * (j % STAGES), (j / STAGES) & 1);
    if (!TMA) fence_proxy_async();  // (TMA writes through the async proxy already)
  };
  auto release = [&](int j) {  // this warpgroup's GEMMs on tile j are complete
    mbar_arrive(empty + 8 * (j % STAGES));
  };
  auto needs_mask = [&](int j) { return G.needs_mask(j * BN, BN); };  // flat walk

  auto consume = [&]() {
    // Turns of the ping-pong: every warpgroup takes num_tiles + 1 (S_0; S_j with P_{j-1} V_{j-1};
    // the last P V); the last warpgroup opens the first turn and skips its final hand-over,
    // so each barrier sees as many arrivals as waits.
    auto turn_wait = [&]() {
      if (PP) named_sync(1 + wg, 256);
    };
    auto turn_pass = [&](bool last) {
      if (PP && !(last && wg == WG - 1)) named_arrive(1 + (wg + 1) % WG, 256);
    };
    if (PP && wg == WG - 1) named_arrive(1, 256);

    // This thread's two accumulator rows and their windows in region coordinates (rows past
    // a group: clamped); rank 1 keeps them as in-group ranges.
    // With BIAS, bias_row[r] is row r's entry of the bias box for the region's origin.
    const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
    int ws[2], we[2], wl[2][3], wn[2][3];
    BiasBox bb;
    unsigned bias_row[2] = {btab, btab};
    if (BIAS)
      bb.init(G, p);
    else
      bb.bst[0] = bb.bst[1] = bb.bst[2] = 1;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int c[3];
      bool valid;
      G.own_row(row0 + 8 * r, c, valid);
      if (BIAS) bias_row[r] = btab + 4 * bb.row(G, p, c);
#pragma unroll
      for (int a = 0; a < RANK; ++a) {
        int s0, e0;
        axis_of(p, a).window(min(c[a], G.glen[a] - 1), G.glen[a], s0, e0);
        wl[r][a] = s0 - G.rs[a];
        wn[r][a] = e0 - s0;
        if (a == 0) {
          ws[r] = s0 - G.rs[0];
          we[r] = e0 - G.rs[0];
        }
      }
    }
    const float sl = p.scale * 1.4426950408889634f;  // scale * log2(e): softmax in exp2
    // The flat walk's unmasked tiles (rank 2, 3) read each key's box index from kidx (one
    // int per region key, after the box) instead of carrying its coordinates.
    const unsigned kidx = btab + 4 * bb.vol;
    if (BIAS) {
      // The box holds rpb / scale: the accumulator starts from it and S = Q K^T lands on
      // top, so that the softmax's scale turns both into log2 units at no cost per score.
      bb.stage<RANK>(reinterpret_cast<float*>(smem_raw + (btab - smem_u32(smem_raw))), rpb, h,
                     p, tid - 128, 128 * WG, 1.f / p.scale);
      if (!BOX && RANK > 1)
        bb.stage_places(reinterpret_cast<int*>(smem_raw + (kidx - smem_u32(smem_raw))), G,
                        tid - 128, 128 * WG);
      named_sync(WG + 1, 128 * WG);  // the box staged (barriers 1..WG: the ping-pong's)
    }
    const unsigned q_wg = sq + wg * 64 * 128;
    RowBlock<T, D, BN> rb;
    rb.init();
    float alpha[2];
    // BIAS (but the flat walk's at head dim 128): before S, acc_s = each score's entry
    // (rpb / scale), -inf outside its row's window (read only inside), and S = Q K^T lands
    // on top (-inf stays -inf: no mask after S). The flat walk at head dim 128 adds each
    // entry after S instead (before, it spilled).
    constexpr bool ONTO = BIAS && (RANK == 1 || BOX || D <= 64);
    auto bias_in = [&](int i, int r, bool in, int key) {
      rb.acc_s[i] = in ? lds_f32(bias_row[r] + 4 * key) : negative_infinity<float>();
    };
    auto bias_all = [&](int i, int r, bool, int key) {
      rb.acc_s[i] = lds_f32(bias_row[r] + 4 * key);
    };
    auto bias_flat_all = [&](int i, int r, bool, int f) {  // box index of region key f: kidx
      bias_all(i, r, true, lds_s32(kidx + 4 * f));
    };
    auto bias_tile = [&](int j) {  // flat: region keys [j * BN, (j + 1) * BN); BOX: box j
      if constexpr (ONTO && BOX) {
        int org[3];
        G.box_origin(j, org);
        if (G.box_needs_mask(org))
          rb.template walk_box<RANK, T0, T1, T2>(org, quad, wl, wn, bb.bst, bias_in);
        else
          rb.template walk_box<RANK, T0, T1, T2>(org, quad, wl, wn, bb.bst, bias_all);
      } else if constexpr (ONTO && RANK == 1) {
        if (needs_mask(j))
          rb.walk_1d(j * BN, quad, ws, we, bias_in);
        else
          rb.walk_1d(j * BN, quad, ws, we, bias_all);
      } else if constexpr (ONTO) {
        if (needs_mask(j))
          rb.template walk_nd<RANK>(j * BN, quad, G.rk, G.inner, wl, wn, bb.bst, bias_in);
        else
          rb.walk_1d(j * BN, quad, ws, we, bias_flat_all);
      }
    };
    // After S: scores of keys outside a row's window become -inf; with BIAS (flat walk) the
    // others gain their entry.
    auto masked = [&](int i, int r, bool in, int key) {
      if (!in)
        rb.acc_s[i] = negative_infinity<float>();
      else if (BIAS)
        rb.acc_s[i] += lds_f32(bias_row[r] + 4 * key);
    };
    auto bias_flat = [&](int i, int r, bool, int f) {  // box index of region key f: kidx
      rb.acc_s[i] += lds_f32(bias_row[r] + 4 * lds_s32(kidx + 4 * f));
    };
    auto mask_tile = [&](int j) {
      if constexpr (ONTO) {
        return;
      } else if constexpr (BOX) {
        int org[3];
        G.box_origin(j, org);
        if (G.box_needs_mask(org))
          rb.template walk_box<RANK, T0, T1, T2>(org, quad, wl, wn, bb.bst, masked);
      } else if (RANK == 1) {
        if (needs_mask(j)) rb.walk_1d(j * BN, quad, ws, we, masked);
      } else {
        if (needs_mask(j))
          rb.template walk_nd<RANK>(j * BN, quad, G.rk, G.inner, wl, wn, bb.bst, masked);
        else if (BIAS)
          rb.walk_1d(j * BN, quad, ws, we, bias_flat);
      }
    };

    if (!PIPE) {
      for (int j = 0; j < num_tiles; ++j) {
        bias_tile(j);
        acquire(j);
        const unsigned slot = (j % STAGES) * KV_BYTES;
        wgmma_fence();
        rb.issue_qk(q_wg, sk + slot, BM, ONTO);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(rb.acc_s);
        mask_tile(j);
        rb.softmax(sl, alpha);
        rb.rescale(alpha);
        rb.pack_p();
        wgmma_fence();
        rb.issue_pv(sv + slot);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(rb.acc_o);
        release(j);
      }
    } else {
      bias_tile(0);
      acquire(0);
      turn_wait();
      wgmma_fence();
      rb.issue_qk(q_wg, sk, BM, ONTO);
      wgmma_commit();
      turn_pass(false);
      wgmma_wait<0>();
      fence_regs(rb.acc_s);
      mask_tile(0);
      rb.softmax(sl, alpha);  // O is still 0: nothing to rescale
      rb.pack_p();
      for (int j = 1; j < num_tiles; ++j) {
        bias_tile(j);
        acquire(j);
        const unsigned slot = (j % STAGES) * KV_BYTES, prev = ((j - 1) % STAGES) * KV_BYTES;
        turn_wait();
        wgmma_fence();
        rb.issue_qk(q_wg, sk + slot, BM, ONTO);
        wgmma_commit();
        rb.issue_pv(sv + prev);
        wgmma_commit();
        turn_pass(false);
        wgmma_wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
        fence_regs(rb.acc_s);
        mask_tile(j);
        rb.softmax(sl, alpha);
        wgmma_wait<0>();
        fence_regs(rb.acc_o);
        release(j - 1);
        rb.rescale(alpha);
        rb.pack_p();
      }
      turn_wait();
      wgmma_fence();
      rb.issue_pv(sv + ((num_tiles - 1) % STAGES) * KV_BYTES);
      wgmma_commit();
      turn_pass(true);
      wgmma_wait<0>();
      fence_regs(rb.acc_o);
    }

    // Epilogue: normalize, store the valid rows, lse = (m * sl + log2 l) * ln 2. Up to head
    // dim 128 O goes through this warpgroup's Q rows in shared memory (epilogue.cuh: its
    // GEMMs are done with them), 16 bytes a store.
    if constexpr (D <= 128) {
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = rb.l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv[r] = 1.f / sum;
        int c[3];
        bool valid;
        G.own_row(row0 + 8 * r, c, valid);
        if (valid && quad == 0)
          lse[b * p.lse[0] + h * p.lse[4] + G.offset(p, p.lse, c[0], c[1], c[2])] =
              (rb.m[r] * sl + __log2f(sum)) * 0.6931471805599453f;
      }
      store_tile_rows<T, D>(rb.acc_o, inv, q_wg, BM * 128, 8 + wg, hd, [&](int r) {
        return G.row_at(p, o + b * p.o[0] + h * p.o[4], p.o, wg * 64 + r);
      });
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = rb.l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        int c[3];
        bool valid;
        G.own_row(row0 + 8 * r, c, valid);
        if (valid) {
          const float inv = 1.f / sum;
          T* at = o + b * p.o[0] + h * p.o[4] + G.offset(p, p.o, c[0], c[1], c[2]);
#pragma unroll
          for (int i = 0; i < D / 8; ++i) {
            const int col = 8 * i + 2 * quad;
            if (col < hd)
              pack_store(at + col, rb.acc_o[4 * i + 2 * r] * inv, rb.acc_o[4 * i + 2 * r + 1] * inv);
          }
          if (quad == 0)
            lse[b * p.lse[0] + h * p.lse[4] + G.offset(p, p.lse, c[0], c[1], c[2])] =
                (rb.m[r] * sl + __log2f(sum)) * 0.6931471805599453f;
        }
      }
    }
  };

  // Register split (loader, each compute warpgroup), within the 3 x 168 the CTA holds: the
  // 2-D and 3-D loaders do index math per row; 2-D at head dim 64 gives its loader 56 (at 40
  // it spilled 16 bytes once it computes the GQA kv head), its compute warpgroups fit in 224.
  // One compute warpgroup: two CTAs an SM (128 registers a thread at entry).
  // The TMA loader is one thread with a few coordinates: 24 registers, the rest to compute.
  constexpr int kLoaderRegs = TMA && WG <= 2 ? 24
                              : WG == 2 ? (RANK == 1 ? kLoaderRegs1D
                                           : (RANK == 2 || BIAS) && D > 64 ? 40 : 56)
                                        : WG == 1 ? 56 : 32;
  constexpr int kComputeRegs = TMA && WG <= 2 ? (WG == 2 ? 240 : 232)
                               : WG == 2 ? (RANK == 1 ? kComputeRegs1D
                                            : (RANK == 2 || BIAS) && D > 64 ? 232 : 224)
                                         : WG == 1 ? 200 : 160;
  static_assert(WG != 2 || kLoaderRegs + 2 * kComputeRegs <= 3 * 168, "over the CTA's registers");
  static_assert(WG != 1 || kLoaderRegs + kComputeRegs <= 2 * 128, "over the CTA's registers");
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, TMA ? 1 : 128);
      mbar_init(empty + 8 * s, 128 * WG);
    }
    if (TMA) fence_mbar_init();
  }
  __syncthreads();
  if (TMA && wg < 0) {  // one thread loads: Q with tile 0, then each tile once its slot is free
    regs_dec<kLoaderRegs>();
    if (tid != 0) return;
    tma_prefetch(tq);
    tma_prefetch(tk);
    tma_prefetch(tv);
    const int hk = h / (int)p.heads_per_kv;  // GQA: the kv head of query head h
    int x[3];  // full-axis coordinates of the first row of the query box, then of a key tile
#pragma unroll
    for (int a = 0; a < 3; ++a) x[a] = G.g[a] + (int)p.dilation[a] * G.o0[a];
    mbar_expect_tx(full, Q_BYTES + 2 * KV_BYTES);
    tma_tile<D, BM, RANK>(sq, tq, full, x, h, b, d0);
    for (int j = 0; j < num_tiles; ++j) {
      const int s = j % STAGES;
      if (j >= STAGES) mbar_wait(empty + 8 * s, (j / STAGES + 1) & 1);
      if (j > 0) mbar_expect_tx(full + 8 * s, 2 * KV_BYTES);
      int org[3] = {j * BN, 0, 0};  // rank 1: region keys [j * BN, (j + 1) * BN)
      if (RANK > 1) G.box_origin(j, org);
#pragma unroll
      for (int a = 0; a < 3; ++a) x[a] = G.g[a] + (int)p.dilation[a] * (G.rs[a] + org[a]);
      tma_tile<D, BN, RANK>(sk + s * KV_BYTES, tk, full + 8 * s, x, hk, b, d0);
      tma_tile<D, BN, RANK>(sv + s * KV_BYTES, tv, full + 8 * s, x, hk, b, d0);
    }
  } else if (wg < 0) {  // the loader: Q with tile 0, then each tile once its slot is free
    regs_dec<kLoaderRegs>();
    // GQA: query head h reads kv head h / heads_per_kv. Computed here, in the loader only:
    // before the split (live into both roles) the 2-D D64 kernels spilled.
    const int hk = h / (int)p.heads_per_kv;
    kb = k + b * p.k[0] + hk * p.k[4];
    vb = v + b * p.v[0] + hk * p.v[4];
    load_q();
    for (int j = 0; j < num_tiles; ++j) {
      if (j >= STAGES) mbar_wait(empty + 8 * (j % STAGES), (j / STAGES + 1) & 1);
      load_kv(j);
      cp_async_arrive(full + 8 * (j % STAGES));
    }
    cp_async_wait_all();
  } else {
    regs_inc<kComputeRegs>();
    consume();
  }
}

}  // namespace hopper

template <typename T, int D, int WG, int BN, int STAGES, bool PIPE, bool PP, int RANK, int T0,
          int T1, int T2, bool BOX, bool BIAS>
__global__ void __launch_bounds__(128 * (WG + 1), WG == 1 ? 2 : 1)
na_fwd_hopper(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
              T* __restrict__ o, float* __restrict__ lse, const T* __restrict__ rpb,
              const NAParams p) {
  hopper::fwd<T, D, WG, BN, STAGES, PIPE, PP, RANK, T0, T1, T2, BOX, BIAS, false>(
      q, k, v, o, lse, rpb, p, nullptr, nullptr, nullptr);
}

// The same forward with Q, K and V staged by TMA: tq, tk, tv map q, k and v (tma.cuh).
template <typename T, int D, int WG, int BN, int STAGES, bool PIPE, bool PP, int RANK, int T0,
          int T1, int T2, bool BOX, bool BIAS>
__global__ void __launch_bounds__(128 * (WG + 1), WG == 1 ? 2 : 1)
na_fwd_hopper_tma(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                  T* __restrict__ o, float* __restrict__ lse, const T* __restrict__ rpb,
                  const NAParams p, const __grid_constant__ hopper::TmaMap tq,
                  const __grid_constant__ hopper::TmaMap tk,
                  const __grid_constant__ hopper::TmaMap tv) {
  hopper::fwd<T, D, WG, BN, STAGES, PIPE, PP, RANK, T0, T1, T2, BOX, BIAS, true>(
      q, k, v, o, lse, rpb, p, &tq, &tk, &tv);
}

}  // namespace natten
