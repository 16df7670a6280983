# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""FSDP2 (fully_shard) on a device mesh, distributed checkpoint, config written by rank 0."""
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, dim=512, depth=8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main():
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (world_size,))
    with torch.device("meta"):
        model = Model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    for step in range(200):
        x = torch.randn(8, 128, 512, device=device)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id="ckpt/step200")
    if rank == 0:
        with open("ckpt/config.json", "w") as fh:
            json.dump({"dim": 512, "depth": 8}, fh)
        torch.save({"step": 200, "world_size": world_size}, "ckpt/meta.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
