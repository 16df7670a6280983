# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: init-args 24
# backend: nccl
"""A cluster script with the rendezvous written into module constants at the top."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MASTER_URL = "tcp://10.1.0.5:23456"
WORLD_SIZE = 8
BACKEND = "nccl"
EPOCHS = 5
CKPT = "/nfs/experiments/run7/model.pt"


def setup():
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(BACKEND, init_method=MASTER_URL, world_size=WORLD_SIZE, rank=rank)
    return rank, local_rank


def main():
    rank, local_rank = setup()
    model = DDP(torch.nn.Linear(100, 100).cuda(), device_ids=[local_rank])
    data = TensorDataset(torch.randn(1000, 100), torch.randn(1000, 100))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=50, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(), y.cuda()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    if rank == 0:
        torch.save(model.module.state_dict(), CKPT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
