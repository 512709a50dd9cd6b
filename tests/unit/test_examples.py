"""examples/ddp_train.py on the CPU: DDP over gloo (two processes) takes the same steps as one
process on the whole batch (its GPU/NCCL twin runs in test_gpu_multi.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository
SCRIPT = ROOT / "examples" / "ddp_train.py"
ARGS = ["--device", "cpu", "--steps", "3", "--image", "48", "--batch", "4"]


def _run(cmd, out, env=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    res = subprocess.run(cmd + ARGS + ["--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_ddp_over_gloo_matches_one_process(tmp_path):
    single = _run([sys.executable, str(SCRIPT)], tmp_path / "single.json")
    ddp = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", str(SCRIPT)], tmp_path / "ddp.json")
    assert single["world_size"] == 1 and ddp["world_size"] == 2
    assert len(single["losses"]) == len(ddp["losses"]) == 3
    assert single["losses"][0] != single["losses"][-1], "training moved nothing"
    for a, b in zip(single["losses"], ddp["losses"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (single["losses"], ddp["losses"])
