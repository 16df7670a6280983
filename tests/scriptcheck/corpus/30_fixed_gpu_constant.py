# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: cuda-device 19
# backend: nccl
"""The GPU index kept in a constant from the one-GPU days, next to a correct set_device."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

GPU = 0
EPOCHS = 3


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    model = torch.nn.Linear(12, 12).cuda(GPU)
    model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(EPOCHS):
        x = torch.randn(16, 12).cuda()
        loss = model(x).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
