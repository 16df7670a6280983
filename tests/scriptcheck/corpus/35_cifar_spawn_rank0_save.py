# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: env-set 25
# expect: env-set 26
# expect: env-set 27
# expect: env-set 28
# expect: spawn 64
# backend: nccl
"""CIFAR-10 on one machine's GPUs: mp.spawn, env set in code, the checkpoint written by rank 0."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def setup(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = port
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    dist.init_process_group("nccl")


def train(rank, world_size, args):
    setup(rank, world_size, args.port)
    torch.cuda.set_device(rank)
    transform = T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
    ds = torchvision.datasets.CIFAR10(args.data, train=True, download=False, transform=transform)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)
    model = DDP(torchvision.models.resnet18(num_classes=10).cuda(rank), device_ids=[rank])
    crit = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.cuda(rank, non_blocking=True), y.cuda(rank, non_blocking=True)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        if rank == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, f"epoch{epoch}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="./data")
    parser.add_argument("--out", default="./ckpt")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--port", default="12356")
    args = parser.parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size, args), nprocs=world_size, join=True)
