# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""Runs under torchrun, and alone on a workstation by spawning its own workers as a fallback."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(local_rank: int, world_size: int) -> None:
    rank = int(os.environ.get("RANK", local_rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    model = DDP(torch.nn.Linear(32, 32).cuda(), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(100):
        loss = model(torch.randn(64, 32, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save(model.module.state_dict(), "fallback.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        worker(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    else:
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29501")
        n = torch.cuda.device_count()
        mp.spawn(worker, args=(n,), nprocs=n)
