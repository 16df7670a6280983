# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
"""Detector training in the YOLOv5 style: ranks as module constants read with os.getenv, -1 when alone."""
import argparse
import os
from copy import deepcopy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

LOCAL_RANK = int(os.getenv("LOCAL_RANK", -1))
RANK = int(os.getenv("RANK", -1))
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))


def select_device(batch_size):
    if LOCAL_RANK != -1:
        assert batch_size % WORLD_SIZE == 0, f"--batch-size {batch_size} must be a multiple of WORLD_SIZE"
        assert torch.cuda.device_count() > LOCAL_RANK, "insufficient CUDA devices for DDP command"
        dist.init_process_group(backend="nccl" if dist.is_nccl_available() else "gloo")
        return torch.device("cuda", LOCAL_RANK)
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def train(opt, device):
    save_dir = Path(opt.save_dir)
    last, best = save_dir / "last.pt", save_dir / "best.pt"
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.SiLU(), nn.Conv2d(16, 85, 1)).to(device)
    if RANK != -1:
        model = DDP(model, device_ids=[LOCAL_RANK], output_device=LOCAL_RANK)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    best_fitness = float("inf")
    for epoch in range(opt.epochs):
        with torch.cuda.device(device):
            imgs = torch.randn(opt.batch_size // WORLD_SIZE, 3, 64, 64).cuda()
            loss = model(imgs).abs().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if RANK in {-1, 0}:
            fitness = loss.item()
            ckpt = {"epoch": epoch, "model": deepcopy(model.module if RANK != -1 else model).half()}
            torch.save(ckpt, last)
            if fitness < best_fitness:
                best_fitness = fitness
                torch.save(ckpt, best)
            del ckpt


def parse_opt():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="total batch size for all GPUs")
    parser.add_argument("--save-dir", default="runs/train/exp")
    return parser.parse_args()


if __name__ == "__main__":
    opt = parse_opt()
    Path(opt.save_dir).mkdir(parents=True, exist_ok=True)
    device = select_device(opt.batch_size)
    if LOCAL_RANK != -1:
        torch.cuda.set_device(LOCAL_RANK)
    train(opt, device)
    if WORLD_SIZE > 1 and RANK == 0:
        dist.destroy_process_group()
