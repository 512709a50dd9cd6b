"""Train a small neighborhood-attention vision model with PyTorch DDP, one process per GPU.

    torchrun --nproc_per_node=2 examples/ddp_train.py --steps 5      # DDP over NCCL, 2 GPUs
    python examples/ddp_train.py --steps 5                           # the same run on one GPU
    torchrun --nproc_per_node=2 examples/ddp_train.py --device cpu   # DDP over gloo, CPU

The model: a 4x4 patch embedding, two blocks of (LayerNorm, ``NeighborhoodAttention2D``, MLP)
with residuals, mean pooling and a linear classifier. The data are synthetic and seeded: each
step draws one global batch, and each of the N processes trains on its 1/N share, so that DDP
(which averages gradients over processes) takes the same steps as one process on the whole
batch. Every step prints the loss of the global batch; ``--out`` writes them as JSON, so the
losses of a DDP run and a one-process run can be compared.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from natten_cupy.torch import NeighborhoodAttention2D  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim, heads, kernel, dilation):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = NeighborhoodAttention2D(dim=dim, num_heads=heads, kernel_size=kernel,
                                            dilation=dilation)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyNAT(nn.Module):
    """[B, 3, H, W] images -> class logits, through two 2-D NA blocks on the patch grid."""

    def __init__(self, dim=64, heads=2, classes=10):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.blocks = nn.Sequential(Block(dim, heads, 5, 1), Block(dim, heads, 5, 2))
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.embed(images).permute(0, 2, 3, 1)          # [B, H/4, W/4, dim]
        return self.head(self.blocks(x).mean(dim=(1, 2)))


def batch(step, size, image, device, seed):
    """The global batch of ``step`` (the same in every process)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randn(size, 3, image, image, generator=g)
    y = torch.randint(0, 10, (size,), generator=g)
    return x.to(device), y.to(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    ap.add_argument("--batch", type=int, default=8,
                    help="global batch, split over the processes (default 8)")
    ap.add_argument("--image", type=int, default=64, help="image side in pixels (default 64)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: one GPU per process, NCCL; cpu: gloo (default cuda)")
    ap.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    ap.add_argument("--out", default=None, help="write the per-step losses here as JSON")
    args = ap.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} processes")

    torch.manual_seed(args.seed)
    model = TinyNAT().to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if args.device == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    share = args.batch // world
    losses = []
    for step in range(args.steps):
        x, y = batch(step, args.batch, args.image, device, args.seed)
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(float(global_loss))
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "device": args.device, "losses": losses}, f)
    if distributed:
        # every rank past its last collective (and rank 0 past its file) before the group
        # goes: a rank tearing gloo down while another still talks to it can abort at exit
        dist.barrier()
        dist.destroy_process_group()
        # Under load, torch's gloo threads can still be torn down by the interpreter's exit
        # ("terminate called without an active exception", an abort after all work is done);
        # leave without running those destructors once everything is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
