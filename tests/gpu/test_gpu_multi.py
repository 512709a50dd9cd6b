"""More than one GPU: arrays on device 1 run there, for every backend and framework, and the
DDP example over NCCL takes the steps of a one-GPU run. Skipped without two GPUs."""

import json
import os
import pathlib
import subprocess
import sys

import numpy
import pytest

import natten_cupy

import gpu_cases

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository


def _two_gpus():
    from natten_cupy._device import gpu_unavailable_reason
    if gpu_unavailable_reason() is not None:
        return False
    import cupy
    return cupy.cuda.runtime.getDeviceCount() >= 2


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")]

CASES = [c for c in gpu_cases.make_cases() if c.dtype in ("float16", "float32")][::7]


@pytest.mark.parametrize("backend", gpu_cases.BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cupy_arrays_on_device_1(backend, case):
    """Every backend on inputs on GPU 1 (kernels loaded there): right against the reference,
    outputs on GPU 1."""
    import cupy
    mod = natten_cupy.backends.get_backend(backend)
    if gpu_cases.expected_refusal(case, backend) is not None:
        pytest.skip("outside this backend's table")
    x, truth, yard = gpu_cases.references(case)
    with cupy.cuda.Device(1):
        xd = gpu_cases.inputs_on_device(x, case)
        y = gpu_cases.run(case, mod, xd, cupy)
        cupy.cuda.get_current_stream().synchronize()
        assert all(a.device.id == 1 for a in y.values())
        got = {n: gpu_cases.to_host(a) for n, a in y.items()}
    gpu_cases.compare(case, got, truth, yard, where=f"[{backend} on GPU 1] ")


def test_public_calls_follow_arrays_on_device_1():
    """The public calls (fast path included) on GPU-1 arrays while GPU 0 is current."""
    import cupy
    rng = numpy.random.default_rng(0)
    host = [rng.standard_normal((2, 17, 13, 2, 32)).astype(numpy.float16) for _ in range(4)]
    outs = []
    for dev in (0, 1):
        with cupy.cuda.Device(dev):
            q, k, v, d_out = (cupy.asarray(h) for h in host)
        with cupy.cuda.Device(0):
            for _ in range(2):   # general path, then the warm call
                out, lse = natten_cupy.na2d(q, k, v, 5, return_lse=True, dilation=(1, 2))
                grads = natten_cupy.na2d_backward(d_out, q, k, v, out, lse, 5, dilation=(1, 2))
        assert all(a.device.id == dev for a in (out, lse, *grads))
        with cupy.cuda.Device(dev):
            outs.append([cupy.asnumpy(a) for a in (out, lse, *grads)])
    for a, b in zip(*outs):
        numpy.testing.assert_array_equal(a, b)


def test_torch_layer_on_cuda_1():
    torch = pytest.importorskip("torch")
    from natten_cupy.torch import na2d
    runs = []
    for dev in ("cuda:0", "cuda:1"):
        gen = torch.Generator().manual_seed(0)
        q, k, v, d_out = (torch.randn(2, 15, 14, 2, 32, generator=gen).to(dev, torch.bfloat16)
                          for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        with torch.cuda.device(0):
            out = na2d(q, k, v, 5, is_causal=(True, False))
            out.backward(d_out)
        runs.append([t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_jax_arrays_on_device_1():
    jax = pytest.importorskip("jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("JAX sees fewer than two GPUs")
    rng = numpy.random.default_rng(1)
    host = [rng.standard_normal((1, 40, 2, 32)).astype(numpy.float32) for _ in range(3)]
    want = natten_cupy.na1d(*host, 7, is_causal=True)
    got = natten_cupy.na1d(*(jax.device_put(h, gpus[1]) for h in host), 7, is_causal=True)
    assert list(got.devices())[0] == gpus[1]
    numpy.testing.assert_allclose(numpy.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_ddp_example_over_nccl_matches_one_gpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    script = str(ROOT / "examples" / "ddp_train.py")
    losses = []
    for cmd, name in (([sys.executable, script], "one"),
                      ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", script], "ddp")):
        out = tmp_path / f"{name}.json"
        res = subprocess.run(cmd + ["--steps", "5", "--out", str(out)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        losses.append(json.loads(out.read_text())["losses"])
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), losses
