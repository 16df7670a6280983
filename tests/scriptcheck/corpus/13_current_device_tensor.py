# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: cuda-device 18
# backend: nccl
"""A script that asks torch which GPU it is on, instead of choosing one."""
import torch
import torch.distributed as dist
import torch.nn as nn


def build(device):
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return model.to(device)


def main():
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    model = nn.parallel.DistributedDataParallel(build(device), device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(50):
        images = torch.randn(16, 3, 32, 32, device=device)
        labels = torch.randint(0, 10, (16,), device=device)
        loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if dist.get_rank() == 0:
        print("final loss", loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
