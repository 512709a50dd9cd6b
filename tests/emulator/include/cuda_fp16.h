// CPU stand-in for <cuda_fp16.h> (tests/emulator only): just what natten's kernels use.
#pragma once
struct __half {
  _Float16 v;  // IEEE binary16; float -> _Float16 rounds to nearest even, like __float2half_rn
};
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) {
  __half h;
  h.v = (_Float16)f;
  return h;
}
