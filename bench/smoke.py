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
extern "C" __global__ void echo_params(unsigned char* out, long long* size, natten::NAParams p) {
  const unsigned char* base = reinterpret_cast<const unsigned char*>(&p);
  for (int i = 0; i < (int)sizeof(natten::NAParams); ++i) out[i] = base[i];
  size[0] = sizeof(natten::NAParams);
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
    # The struct's bytes as the kernel received them, against the host's record, byte by
    # byte (padding included: make_params zero-fills it); the sizes must agree first.
    nbytes = _params.PARAMS_DTYPE.itemsize
    out = cupy.full(nbytes + 64, 0xAB, dtype=cupy.uint8)
    size = cupy.zeros(1, dtype=cupy.int64)
    fn((1,), (1,), (out, size, p))
    got, device_size = out.get(), int(size.get()[0])
    want = numpy.frombuffer(p.tobytes(), dtype=numpy.uint8)
    same = device_size == nbytes and bool((got[:nbytes] == want).all())
    first = (int(numpy.flatnonzero(got[:nbytes] != want)[0]) if device_size == nbytes and not same
             else None)
    check("NAParams by value", same and float(p["scale"]) == 0.25,
          f"sizeof {device_size} (host {nbytes})"
          + (f", first differing byte {first}" if first is not None else ""))

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
