// CPU harness of cuda_src/natten/hopper/bwd_geom.cuh (tests/unit/test_hopper_bwd_geometry.py):
// runs the geometry and score masks of the Hopper fused backward for every CTA, thread and
// tile of a problem exactly as the kernels do (grid decode, owner rows of the accumulator
// layout, region walk in N-row tiles, needs_mask, mask_scores), and counts every (owner,
// other) pair a score lets through, by full-grid flat index. For each such pair it also
// checks the bias-table entry the kernels with a bias read (bias_box.cuh: BiasBox in the dQ
// pass, KeyBiasBox in the dK/dV pass, the region term as the kernels stage it) against the
// pair's offset key - query + kernel - 1, and records the largest box and region; and where
// the dK/dV pass with a bias and dQ added in it writes each pair's dS (run_ds). Built with
// the emulator's CUDA stand-ins (tests/emulator/include).
#include <vector>

#include "cuda_shim.h"
#include "natten/hopper/bias_box.cuh"
#include "natten/hopper/bwd_geom.cuh"

using natten::NAParams;
using natten::hopper::BiasBox;
using natten::hopper::BwdGeom;
using natten::hopper::DsWs;
using natten::hopper::KeyBiasBox;

namespace {

// The box of a CTA's pass: BiasBox when rows are queries, KeyBiasBox when they are keys.
template <bool INV> struct PassBox { typedef BiasBox type; };
template <> struct PassBox<true> { typedef KeyBiasBox type; };

}  // namespace

namespace {

template <int RANK, int T0, int T1, int T2, bool INV, int N, int WG = 2>
long long run(const NAParams& p, int ctas, int* pairs, long long points, long long* stats) {
  const int L[3] = {(int)p.extent[0], (int)p.extent[1], (int)p.extent[2]};
  auto flat = [&](const BwdGeom<RANK, T0, T1, T2, INV>& G, const int (&c)[3]) {
    long long f = 0;
    for (int a = 0; a < 3; ++a) f = f * L[a] + (G.g[a] + p.dilation[a] * c[a]);
    return f;
  };
  long long errors = 0;
  for (int cta = 0; cta < ctas; ++cta) {
    blockIdx.x = cta;
    BwdGeom<RANK, T0, T1, T2, INV> G;
    if (!G.init(p)) continue;
    ++stats[0];
    typename PassBox<INV>::type bb;
    bb.init(G, p);
    if (bb.vol > stats[4]) stats[4] = bb.vol;
    if (G.total > stats[5]) stats[5] = G.total;
    const int tiles = (G.total + N - 1) / N;
    stats[1] += tiles;
    for (int tid = 0; tid < 128 * WG; ++tid) {  // the compute warpgroups
      const int wg = tid / 128, lane = tid % 32, quad = lane % 4;
      const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
      int wl[2][3], wn[2][3];
      G.row_reach(p, row0, wl[0], wn[0]);
      G.row_reach(p, row0 + 8, wl[1], wn[1]);
      for (int j = 0; j < tiles; ++j) {
        float acc[N / 2];
        for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
        const bool masked = G.needs_mask(j * N, N);
        stats[2] += masked;
        if (masked) natten::hopper::mask_scores<N, RANK>(acc, j * N, quad, G.rk, G.inner, wl, wn);
        for (int i = 0; i < N / 2; ++i) {
          if (acc[i] != 0.f) continue;  // -inf: masked
          const int col = j * N + (i / 4) * 8 + 2 * quad + (i % 2), r = (i / 2) % 2;
          int co[3], cr[3];
          bool valid;
          G.own_row(row0 + 8 * r, co, valid);
          if (!valid) continue;  // rows past the group are never stored
          if (col >= G.total) {  // an unmasked score past the region
            ++errors;
            continue;
          }
          G.other(col, cr);
          for (int a = 0; a < 3; ++a)
            if (cr[a] < 0 || cr[a] >= G.glen[a]) ++errors;
          pairs[flat(G, co) * points + flat(G, cr)] += 1;
          // The bias entry: row term plus (dQ) or minus (dK/dV) the region term.
          int place = 0, want = 0;
          bool inside = true;
          for (int a = 0; a < RANK; ++a) {
            place += (cr[a] - G.rs[a]) * bb.bst[a];
            const int key = INV ? co[a] : cr[a], query = INV ? cr[a] : co[a];
            const int off = key - query + (int)p.kernel[a] - 1 - bb.org[a];
            inside = inside && off >= 0 && off < bb.dim[a];
            want += off * bb.bst[a];
          }
          const int got = INV ? bb.row(G, p, co) - place : bb.row(G, p, co) + place;
          if (!inside || got != want || got < 0 || got >= bb.vol) ++stats[3];
        }
      }
    }
  }
  return errors;
}

// The dK/dV pass with a bias and dQ added in it (two compute warpgroups, 64-query tiles):
// every surviving (key, query) pair's dS workspace index (DsWs: the query's staged row plus
// the key's term) must be the query's row times the kernel volume plus the key's slot in the
// query's window as the unfused chain numbers slots (Axis::query_window, full-axis); hits
// [points, kernel volume] counts the slots written. The slot's bias entry as the reduction
// takes it (DsWs::query_entry plus the slot's offsets) must be the pair's offset key - query +
// kernel - 1. Returns the pairs that break either.
template <int RANK, int T0, int T1, int T2>
long long run_ds(const NAParams& p, int ctas, int* hits) {
  constexpr int N = 64;
  const int L[3] = {(int)p.extent[0], (int)p.extent[1], (int)p.extent[2]};
  const int kvol = (int)p.num_neighbors;
  int ts[3], kst[3];
  ts[2] = 1;
  ts[1] = 2 * (int)p.kernel[2] - 1;
  ts[0] = ts[1] * (2 * (int)p.kernel[1] - 1);
  kst[2] = 1;
  kst[1] = (int)p.kernel[2];
  kst[0] = kst[1] * (int)p.kernel[1];
  std::vector<int> rows;
  long long errors = 0;
  for (int cta = 0; cta < ctas; ++cta) {
    blockIdx.x = cta;
    BwdGeom<RANK, T0, T1, T2, true> G;
    if (!G.init(p)) continue;
    rows.assign(G.total, 0);
    for (int t = 0; t < 7; ++t) DsWs::stage(rows.data(), G, p, t, 7);  // (threads in turn)
    const int tiles = (G.total + N - 1) / N;
    for (int tid = 0; tid < 256; ++tid) {
      const int wg = tid / 128, lane = tid % 32, quad = lane % 4;
      const int row0 = wg * 64 + ((tid / 32) % 4) * 16 + lane / 4;
      int wl[2][3], wn[2][3], kslot[2];
      G.row_reach(p, row0, wl[0], wn[0]);
      G.row_reach(p, row0 + 8, wl[1], wn[1]);
      for (int r = 0; r < 2; ++r) {
        int c[3];
        bool valid;
        G.own_row(row0 + 8 * r, c, valid);
        kslot[r] = DsWs::key_term<RANK>(p, c);
      }
      for (int j = 0; j < tiles; ++j) {
        natten::hopper::walk_scores<N, RANK>(j * N, quad, G.rk, G.inner, wl, wn,
                                             [&](int i, int r, bool in, int col) {
          int co[3], cr[3];
          bool valid;
          G.own_row(row0 + 8 * r, co, valid);
          if (!in || !valid) return;
          G.other(col, cr);
          long long tok = 0;
          int slot = 0, entry = 0, off = 0, full[3], key[3];
          for (int a = 0; a < 3; ++a) {
            full[a] = G.g[a] + (int)p.dilation[a] * cr[a];
            key[a] = G.g[a] + (int)p.dilation[a] * co[a];
            tok = tok * L[a] + full[a];
            const natten::Axis ax = natten::axis_of(p, a);
            int first, count;
            ax.query_window(full[a], first, count);
            const int t = (key[a] - first) / ax.dilation;
            if (t < 0 || t >= count) ++errors;
            slot += t * kst[a];
            off += (co[a] - cr[a] + ax.kernel - 1) * ts[a];
          }
          const long long idx = rows[col] + kslot[r];
          if (idx != tok * kvol + slot) {
            ++errors;
            return;
          }
          hits[idx] += 1;
          int sb, len[3];
          DsWs::query_entry(p, full, ts, sb, len);
          int rest = slot;
          for (int a = 0; a < 3; ++a) {
            const int t = rest / kst[a];
            rest -= t * kst[a];
            if (t >= len[a]) ++errors;
            entry += t * ts[a];
          }
          if (sb + entry != off) ++errors;
        });
      }
    }
  }
  return errors;
}

}  // namespace

extern "C" int emu_params_size() { return (int)sizeof(NAParams); }

// hits: [points, kernel volume] int32, zeroed by the caller.
extern "C" long long emu_bwd_ds_slots(int rank, const NAParams* p, int ctas, int* hits) {
  if (rank == 1) return run_ds<1, 128, 1, 1>(*p, ctas, hits);
  if (rank == 2) return run_ds<2, 8, 16, 1>(*p, ctas, hits);
  if (rank == 3) return run_ds<3, 2, 8, 8>(*p, ctas, hits);
  return -1;
}

// pairs: [points, points] int32, zeroed by the caller; stats: CTAs live, tiles, masked tiles,
// pairs whose bias entry is wrong or outside the box, the largest box, the largest region.
extern "C" long long emu_bwd_pairs(int rank, int inv, int n, const NAParams* p, int ctas,
                                   int* pairs, long long points, long long* stats) {
#define NA_CASE(R, T0, T1, T2, I, NN) \
  if (rank == R && inv == I && n == NN) return run<R, T0, T1, T2, I, NN>(*p, ctas, pairs, points, stats);
  NA_CASE(1, 128, 1, 1, 1, 64) NA_CASE(1, 128, 1, 1, 0, 64) NA_CASE(1, 128, 1, 1, 0, 128)
  NA_CASE(2, 8, 16, 1, 1, 64) NA_CASE(2, 8, 16, 1, 0, 64) NA_CASE(2, 8, 16, 1, 0, 128)
  NA_CASE(3, 2, 8, 8, 1, 64) NA_CASE(3, 2, 8, 8, 0, 64) NA_CASE(3, 2, 8, 8, 0, 128)
#undef NA_CASE
  return -1;
}

// The same for the passes with one compute warpgroup (64-row boxes, wgmma_backward's
// Q_BOX_ONE_WG): the dQ pass (inv 0, key tiles of n) and the dK/dV pass (inv 1, query
// tiles of n: 64, or 32 as at head dim 128).
extern "C" long long emu_bwd_pairs_one_wg(int rank, int inv, int n, const NAParams* p,
                                          int ctas, int* pairs, long long points,
                                          long long* stats) {
#define NA_CASE(R, T0, T1, T2, INV, NN)                                         \
  if (rank == R && inv == INV && n == NN)                                       \
    return run<R, T0, T1, T2, INV == 1, NN, 1>(*p, ctas, pairs, points, stats);
  NA_CASE(1, 64, 1, 1, 0, 64) NA_CASE(1, 64, 1, 1, 0, 128) NA_CASE(1, 64, 1, 1, 1, 64)
  NA_CASE(1, 64, 1, 1, 1, 32)
  NA_CASE(2, 8, 8, 1, 0, 64) NA_CASE(2, 8, 8, 1, 0, 128) NA_CASE(2, 8, 8, 1, 1, 64)
  NA_CASE(2, 8, 8, 1, 1, 32)
  NA_CASE(3, 2, 4, 8, 0, 64) NA_CASE(3, 2, 4, 8, 0, 128) NA_CASE(3, 2, 4, 8, 1, 64)
  NA_CASE(3, 2, 4, 8, 1, 32)
#undef NA_CASE
  return -1;
}
