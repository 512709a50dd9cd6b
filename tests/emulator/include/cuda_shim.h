// CPU stand-ins for the CUDA built-ins that natten's naive kernels use (tests/emulator only),
// and the engine that runs a kernel's grid on the CPU. Included before the real kernel source.
//
// Two execution modes:
//  * serial: every CUDA thread runs to completion, one after another, within one block; blocks
//    are spread over a few worker threads (blocks are independent in CUDA as well). Any
//    warp-level intrinsic called in this mode is an error.
//  * lockstep warps: 32 std::threads, one per lane, walk every (block, warp) of the grid in
//    the same order; __shfl_down_sync exchanges values through a barrier. Each exchange checks
//    that all 32 lanes are at the same shuffle of the same warp (a divergent shuffle, undefined
//    behaviour on a GPU, is reported), and lanes compare shuffle counts at the end of each warp.
// Errors are reported through emu_last_error() (see harness.cpp), never by aborting.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

using std::max;
using std::min;
using std::exp;
using std::exp2;
using std::fmax;
using std::log2;
using std::ceil;
inline float exp2f(float x) { return std::exp2(x); }
inline float log2f(float x) { return std::log2(x); }
inline float expf(float x) { return std::exp(x); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float fminf(float a, float b) { return std::fmin(a, b); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __int_as_float(unsigned u) { return __int_as_float((int)u); }

namespace emu {

// First error of the current launch (0: none) and its message.
inline std::atomic<int> error{0};
inline char message[512];
inline void fail(int code, const char* text) {
  int expected = 0;
  if (error.compare_exchange_strong(expected, code))
    std::snprintf(message, sizeof(message), "%s", text);
}

// A reusable barrier whose participants may leave (C++17 has no std::barrier).
class Barrier {
 public:
  explicit Barrier(int n) : expected_(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(m_);
    const unsigned long phase = phase_;
    if (++arrived_ == expected_) {
      next_phase();
    } else {
      cv_.wait(lock, [&] { return phase_ != phase; });
    }
  }
  void arrive_and_drop() {
    std::lock_guard<std::mutex> lock(m_);
    if (--expected_ > 0 && arrived_ == expected_) next_phase();
  }

 private:
  void next_phase() {
    arrived_ = 0;
    ++phase_;
    cv_.notify_all();
  }
  std::mutex m_;
  std::condition_variable cv_;
  int expected_, arrived_ = 0;
  unsigned long phase_ = 0;
};

// What a lane publishes at each exchange: the value, and where it stands in the grid.
struct Slot {
  uint64_t bits;
  long long item;  // linear (block, warp) index
  int seq;         // shuffles so far in this warp; -1 - count at the end of the warp
};

struct Warp {
  Barrier bar{32};
  Slot slot[32];
};

struct Lane {
  Warp* warp;
  long long item;
  int seq;
};
inline thread_local Lane* lane_ctx = nullptr;  // null in serial mode

// Publish (value, position), wait for the warp, check everyone is at the same place.
inline bool exchange(Lane& me, uint64_t bits, int seq) {
  const int lane = (int)(threadIdx.x % 32);
  me.warp->slot[lane] = Slot{bits, me.item, seq};
  me.warp->bar.arrive_and_wait();
  for (int l = 0; l < 32; ++l) {
    const Slot& s = me.warp->slot[l];
    if (s.item != me.item || s.seq != seq) {
      char text[256];
      std::snprintf(text, sizeof(text),
                    "divergent warp: lane %d of warp item %lld at %s %d, lane %d at item %lld "
                    "step %d (every lane must reach each __shfl_*_sync)",
                    lane, me.item, seq < 0 ? "warp end after shuffles" : "shuffle",
                    seq < 0 ? -1 - seq : seq, l, s.item, s.seq);
      fail(3, text);
      return false;
    }
  }
  return true;
}

}  // namespace emu

template <typename V>
inline V __shfl_down_sync(unsigned mask, V v, int delta) {
  static_assert(sizeof(V) <= 8, "shuffled type too wide");
  emu::Lane* me = emu::lane_ctx;
  if (me == nullptr) {
    emu::fail(2, "__shfl_down_sync called by a kernel the harness runs in serial mode; "
                 "register it with EMU_WARP_KERNEL in tests/emulator/harness.cpp");
    return v;
  }
  if (mask != 0xffffffffu) emu::fail(4, "__shfl_down_sync with a partial mask (not emulated)");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  const int lane = (int)(threadIdx.x % 32);
  V result = v;
  if (emu::exchange(*me, bits, me->seq) && lane + delta < 32 && delta >= 0) {
    std::memcpy(&result, &me->warp->slot[lane + delta].bits, sizeof(V));
  }
  ++me->seq;
  me->warp->bar.arrive_and_wait();  // everyone has read before the slots are reused
  return result;
}

namespace emu {

inline std::mutex launch_mutex;  // one launch at a time (gridDim/blockDim are global)

template <typename F>
void launch_serial(int grid, int block, const F& body) {
  const int workers = (int)std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  auto work = [&](int first) {
    for (int b = first; b < grid; b += workers) {
      blockIdx.x = (unsigned)b;
      for (int t = 0; t < block; ++t) {
        threadIdx.x = (unsigned)t;
        body();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers && w < grid; ++w) pool.emplace_back(work, w);
  work(0);
  for (auto& t : pool) t.join();
}

template <typename F>
void launch_warps(int grid, int block, const F& body) {
  Warp warp;
  const int warps = block / 32;
  auto lane_main = [&](int lane) {
    Lane me{&warp, 0, 0};
    lane_ctx = &me;
    for (long long item = 0; item < (long long)grid * warps && error.load() == 0; ++item) {
      blockIdx.x = (unsigned)(item / warps);
      threadIdx.x = (unsigned)((item % warps) * 32 + lane);
      me.item = item;
      me.seq = 0;
      body();
      // Every lane made the same number of shuffles in this warp.
      exchange(me, 0, -1 - me.seq);
      warp.bar.arrive_and_wait();
    }
    lane_ctx = nullptr;
    warp.bar.arrive_and_drop();
  };
  std::vector<std::thread> lanes;
  for (int l = 0; l < 32; ++l) lanes.emplace_back(lane_main, l);
  for (auto& t : lanes) t.join();
}

// Run `body` (one CUDA thread's work) over a 1-D grid of 1-D blocks.
template <typename F>
int launch(int grid, int block, bool warp_mode, const F& body) {
  if (grid < 1 || block < 1 || block > 1024 || (warp_mode && block % 32 != 0)) {
    fail(5, "bad launch shape (grid >= 1, 1 <= block <= 1024, warp kernels: block % 32 == 0)");
    return error.load();
  }
  gridDim = dim3{(unsigned)grid, 1, 1};
  blockDim = dim3{(unsigned)block, 1, 1};
  if (warp_mode) {
    launch_warps(grid, block, body);
  } else {
    launch_serial(grid, block, body);
  }
  return error.load();
}

}  // namespace emu
