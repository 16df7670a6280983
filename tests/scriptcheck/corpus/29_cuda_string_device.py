# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: cuda-device 11
# backend: nccl
"""A single-GPU script with DDP added around the model and nothing else changed."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

device = "cuda" if torch.cuda.is_available() else "cpu"


def train():
    dist.init_process_group("nccl")
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).to(device)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        batch = torch.randn(32, 256).to(device)
        loss = (model(batch) - batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 and dist.get_rank() == 0:
            print(step, loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
