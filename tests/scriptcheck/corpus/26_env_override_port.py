# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: env-set 19
# backend: nccl
"""A torchrun script that still sets the port itself from an option (it overrides torchrun's)."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    os.environ["MASTER_PORT"] = str(args.port)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = DDP(torch.nn.Linear(8, 8).cuda(), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(args.steps):
        loss = model(torch.randn(4, 8, device="cuda")).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
