# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""A timm-style trainer: the checkpoint saver object exists only on the primary rank."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from checkpoint import CheckpointSaver


def is_primary(args):
    return args.rank == 0


def init_distributed_device(args):
    args.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    args.rank = int(os.environ.get("RANK", "0"))
    args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.distributed:
        torch.cuda.set_device(args.local_rank)
        dist.init_process_group("nccl")
    return torch.device("cuda", args.local_rank)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--output", default="./output/train")
    parser.add_argument("--local_rank", default=0, type=int)
    args = parser.parse_args()
    device = init_distributed_device(args)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 1000)).to(device)
    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    saver = None
    if is_primary(args):
        os.makedirs(args.output, exist_ok=True)
        saver = CheckpointSaver(model, optimizer, checkpoint_dir=args.output, max_history=3)
    for epoch in range(args.epochs):
        images = torch.randn(32, 3, 64, 64, device=device)
        targets = torch.randint(0, 1000, (32,), device=device)
        loss = nn.functional.cross_entropy(model(images), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if saver is not None:
            best_metric, best_path = saver.save_checkpoint(epoch, metric=loss.item())
            print(f"epoch {epoch}: best {best_metric:.4f} at {best_path}")
    if args.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
