// Host entry points for the CPU build of cuda_src/na_naive.cu (tests/emulator only).
//
// For every kernel K, element type T and rank R this exports
//   extern "C" int emu_K_<type>_R(int grid, int block, int nargs, void* const* args,
//                                 const long long* sizes)
// where args[i] is the address of a device pointer argument (an array's data, or null) or,
// for the by-value NAParams, the address of its bytes; sizes[i] is the element size of an
// array (0 for a null pointer) or the byte size of the struct. The argument count and every
// size are checked against the kernel's own signature before it runs. Returns 0, or an error
// code with emu_last_error() saying why. EMU_TYPES picks the element types of this object
// (one object per type, built in parallel).
#include "cuda_shim.h"

#include "na_naive.cu"

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

using natten::NAParams;

namespace {

template <typename X>
X unpack(void* const p) {
  if constexpr (std::is_pointer_v<X>) {
    return (X)p;
  } else {
    X x;
    std::memcpy(&x, p, sizeof(X));
    return x;
  }
}

template <typename X>
bool size_ok(long long size) {
  if constexpr (std::is_pointer_v<X>) {
    return size == 0 || size == (long long)sizeof(std::remove_pointer_t<X>);
  } else {
    return size == (long long)sizeof(X);
  }
}

template <typename... Args, std::size_t... I>
int run(void (*kernel)(Args...), bool warp_mode, int grid, int block, int nargs,
        void* const* args, const long long* sizes, std::index_sequence<I...>) {
  std::lock_guard<std::mutex> lock(emu::launch_mutex);
  emu::error = 0;
  if (nargs != (int)sizeof...(Args)) {
    char text[128];
    std::snprintf(text, sizeof(text), "kernel takes %d arguments, launch passed %d",
                  (int)sizeof...(Args), nargs);
    emu::fail(1, text);
    return 1;
  }
  const bool ok[] = {size_ok<Args>(sizes[I])...};
  for (int i = 0; i < nargs; ++i) {
    if (!ok[i]) {
      char text[160];
      std::snprintf(text, sizeof(text),
                    "argument %d: launch passed element/struct size %lld, which does not match "
                    "the kernel's parameter type", i, sizes[i]);
      emu::fail(6, text);
      return 6;
    }
  }
  const std::tuple<Args...> values{unpack<Args>(args[I])...};
  return emu::launch(grid, block, warp_mode, [&] { kernel(std::get<I>(values)...); });
}

template <typename... Args>
int run(void (*kernel)(Args...), bool warp_mode, int grid, int block, int nargs,
        void* const* args, const long long* sizes) {
  return run(kernel, warp_mode, grid, block, nargs, args, sizes,
             std::index_sequence_for<Args...>{});
}

}  // namespace

#if EMU_TYPES == 0  // once per library
extern "C" const char* emu_last_error() { return emu::message; }

// Byte offsets of NAParams' fields in declaration order, then its size (checked against
// natten_cupy/_params.py's PARAMS_DTYPE).
extern "C" int emu_params_layout(long long* out) {
  int n = 0;
#define EMU_FIELD(f) out[n++] = (long long)offsetof(NAParams, f);
  EMU_FIELD(extent) EMU_FIELD(kernel) EMU_FIELD(stride) EMU_FIELD(dilation) EMU_FIELD(causal)
  EMU_FIELD(batch) EMU_FIELD(heads) EMU_FIELD(head_dim) EMU_FIELD(num_neighbors)
  EMU_FIELD(kv_heads) EMU_FIELD(heads_per_kv) EMU_FIELD(v_dim)
  EMU_FIELD(q) EMU_FIELD(k) EMU_FIELD(v) EMU_FIELD(o) EMU_FIELD(d_o) EMU_FIELD(dq)
  EMU_FIELD(dk) EMU_FIELD(dv) EMU_FIELD(lse) EMU_FIELD(delta) EMU_FIELD(attn)
  EMU_FIELD(d_attn) EMU_FIELD(rpb) EMU_FIELD(d_rpb) EMU_FIELD(scale) EMU_FIELD(pad_)
  EMU_FIELD(scale_f64) EMU_FIELD(extra_tokens) EMU_FIELD(extra_heads)
  EMU_FIELD(heads_per_extra) EMU_FIELD(xk) EMU_FIELD(xv) EMU_FIELD(dxk) EMU_FIELD(dxv)
#undef EMU_FIELD
  out[n++] = (long long)sizeof(NAParams);
  return n;
}
#endif

#define EMU_ENTRY(K, WARP, T, TN, R)                                                          \
  extern "C" int emu_##K##_##TN##_##R(int grid, int block, int nargs, void* const* args,      \
                                      const long long* sizes) {                               \
    return run(&K<T, R>, WARP, grid, block, nargs, args, sizes);                              \
  }
#define EMU_RANKS(K, WARP, T, TN) \
  EMU_ENTRY(K, WARP, T, TN, 1) EMU_ENTRY(K, WARP, T, TN, 2) EMU_ENTRY(K, WARP, T, TN, 3)

// Kernels that use warp intrinsics run in lockstep-warp mode, every other one serially.
#define EMU_KERNEL(K, T, TN) EMU_RANKS(K, false, T, TN)
#define EMU_WARP_KERNEL(K, T, TN) EMU_RANKS(K, true, T, TN)
#define EMU_ALL(T, TN)                          \
  EMU_KERNEL(na_qk_naive, T, TN)                \
  EMU_KERNEL(na_av_naive, T, TN)                \
  EMU_KERNEL(na_qk_bwd_dq_naive, T, TN)         \
  EMU_KERNEL(na_qk_bwd_dk_naive, T, TN)         \
  EMU_WARP_KERNEL(na_qk_bwd_rpb_naive, T, TN)   \
  EMU_KERNEL(na_av_bwd_dattn_naive, T, TN)      \
  EMU_KERNEL(na_av_bwd_dv_naive, T, TN)         \
  EMU_KERNEL(na_fwd_naive, T, TN)               \
  EMU_KERNEL(na_bwd_delta_naive, T, TN)         \
  EMU_KERNEL(na_bwd_dq_naive, T, TN)            \
  EMU_KERNEL(na_bwd_dkdv_naive, T, TN)           \
  EMU_WARP_KERNEL(na_bwd_rpb_naive, T, TN)

#if EMU_TYPES == 0
EMU_ALL(double, double)
#elif EMU_TYPES == 1
EMU_ALL(float, float)
#elif EMU_TYPES == 2
EMU_ALL(__half, half)
#elif EMU_TYPES == 3
EMU_ALL(__nv_bfloat16, nv_bfloat16)
#else
#error "EMU_TYPES must be 0 (double), 1 (float), 2 (__half) or 3 (__nv_bfloat16)"
#endif
