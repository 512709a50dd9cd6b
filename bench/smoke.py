"""Device smoke test of the launch plumbing: NAParams by value, streams, bfloat16 interop.

Run on a GPU machine: python3 bench/smoke.py. Prints one line per check and exits non-zero
if any fails. Cheap (seconds); the first thing to run on a new machine or CuPy version.
"""

import sys

import numpy

from natten_cupy import _compile, _env, _params
from natten_cupy._args import check_fused

PROBE = r'''
#include "natten/common.cuh"
extern "C" __global__ void echo_params(long long* out, float* scale, natten::NAParams p) {
  const long long* base = &p.extent[0];
  for (int i = 0; i < 19 + 14 * 6; ++i) out[i] = base[i];
  scale[0] = p.scale;
}
'''


def main():
    try:
        _env.require_gpu("bench/smoke.py", hint="Run it on a GPU machine.")
    except _env.NoGPUError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import cupy
    failures = 0

    def check(name, ok, detail=""):
        nonlocal failures
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")

    q = cupy.zeros((2, 5, 7, 3, 8), dtype=cupy.float16)[:, :, :, :, :]
    qt = cupy.zeros((2, 3, 5, 7, 8), dtype=cupy.float16).transpose(0, 2, 3, 1, 4)
    prob = check_fused(2, q, q, q, (3, 5), (1, 2), (1, 1), (False, True), 0.25, "auto")
    p = _params.make_params(prob, q=q, k=qt)
    mod = cupy.RawModule(code=PROBE, options=_compile.compile_options())
    fn = mod.get_function("echo_params")
    out = cupy.full(19 + 14 * 6, -1, dtype=cupy.int64)
    scale = cupy.zeros(1, dtype=cupy.float32)
    fn((1,), (1,), (out, scale, p))
    want = numpy.concatenate([numpy.asarray(p[f], dtype=numpy.int64).ravel()
                              for f in _params.PARAMS_DTYPE.names[:-3]])
    check("NAParams by value", bool((out.get() == want).all()) and float(scale.get()[0]) == 0.25,
          f"{out.get()[:20]}")

    try:
        import torch
        s = torch.cuda.Stream()
        cs = cupy.cuda.Stream.from_external(s)
        check("Stream.from_external(torch stream)", cs.ptr == s.cuda_stream)
        t = torch.randn(4, 4, device="cuda", dtype=torch.bfloat16)
        c = cupy.from_dlpack(t)
        back = torch.from_dlpack(c)
        check("bfloat16 torch->cupy->torch", c.dtype.name == "bfloat16"
              and bool((back == t).all()), str(c.dtype))
        tg = torch.randn(3, device="cuda", requires_grad=True)
        try:
            cupy.from_dlpack(tg)
            check("requires-grad DLPack refused", False)
        except (BufferError, RuntimeError, TypeError) as e:
            check("requires-grad DLPack refused", True, type(e).__name__)
    except ImportError:
        print("skip torch checks (no torch)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
