# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: save-rank 17
# backend: nccl
"""A first DDP port of a single-GPU script: the checkpoint code was left as it was."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def save_checkpoint(model, optimizer, epoch, path="checkpoints/last.pt"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 3)).cuda(), device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ds = TensorDataset(torch.randn(3000, 40), torch.randint(0, 3, (3000,)))
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=64, sampler=sampler)
    for epoch in range(8):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        save_checkpoint(model.module, optimizer, epoch)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
