# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: set-epoch 17
# expect: sampler-shuffle 18
# backend: nccl
"""Sampler handling copied from a single-process loader: shuffle kept, set_epoch forgotten."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_loader(dataset, batch_size):
    sampler = DistributedSampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, sampler=sampler, drop_last=True)


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    ds = TensorDataset(torch.randn(5000, 20), torch.randint(0, 4, (5000,)))
    loader = make_loader(ds, 50)
    model = DDP(torch.nn.Linear(20, 4).cuda(), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(10):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
            opt.zero_grad()
            loss.backward()
            opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
