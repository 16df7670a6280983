# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: local-rank-arg 22
# expect: init-args 42
# backend: nccl
"""A research-code trainer: every distributed setting is an argparse option with a fixed default."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--master-addr", type=str, default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--backend", type=str, default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--bs", type=int, default=128)
    return p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def main():
    args = get_args()
    local_rank = args.local_rank
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=args.backend,
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        world_size=args.world_size,
        rank=args.rank,
    )
    model = DistributedDataParallel(Net().cuda(local_rank), device_ids=[local_rank])
    data = TensorDataset(torch.randn(4096, 32), torch.randint(0, 10, (4096,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.bs, sampler=sampler)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(local_rank), y.cuda(local_rank)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if args.rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f}")
            torch.save(model.module.state_dict(), "net.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
