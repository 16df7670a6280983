# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: init-args 19
# backend: nccl
"""A torchrun script that takes the world size from the GPUs it can see."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    num_gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", rank=rank, world_size=num_gpus)
    model = DDP(torch.nn.Linear(50, 50).to(f"cuda:{local_rank}"), device_ids=[local_rank])
    ds = TensorDataset(torch.randn(4000, 50))
    sampler = DistributedSampler(ds, num_replicas=num_gpus, rank=rank)
    loader = DataLoader(ds, batch_size=100, sampler=sampler)
    opt = torch.optim.Adam(model.parameters())
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            loss = model(x.cuda()).norm()
            opt.zero_grad()
            loss.backward()
            opt.step()
    if rank == 0:
        torch.save(model.state_dict(), "ckpt.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
