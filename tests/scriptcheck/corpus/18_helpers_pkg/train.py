# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
"""Entry point of a small project: the distributed plumbing lives in common/dist_utils.py."""
import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from common import dist_utils
from common.engine import train_one_epoch


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--out", default="model_final.pt")
    return p.parse_args()


def main():
    args = parse()
    dist_utils.setup()
    device = dist_utils.device()
    model = torch.nn.Linear(20, 2).to(device)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dist_utils.local_rank()])
    data = TensorDataset(torch.randn(1024, 20), torch.randint(0, 2, (1024,)))
    sampler = torch.utils.data.distributed.DistributedSampler(data)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_one_epoch(model, loader, opt, device)
    if dist_utils.is_main_process():
        torch.save(model.module.state_dict(), args.out)
    dist_utils.cleanup()


if __name__ == "__main__":
    main()
