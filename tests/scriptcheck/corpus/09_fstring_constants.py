# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: init-args 20
# backend: nccl
"""Host and port as constants, the URL built with an f-string and passed along a variable."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn

HOST = "gpu-node01.cluster.local"
PORT = 29500


def init_distributed():
    url = f"tcp://{HOST}:{PORT}"
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=world_size)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return rank, world_size


def main():
    rank, world_size = init_distributed()
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        x = torch.randn(32, 64, device="cuda")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f} world {world_size}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
