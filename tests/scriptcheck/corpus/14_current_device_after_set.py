# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""current_device() after set_device: the GPU was chosen, reading it back is fine."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def setup():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return torch.cuda.current_device()


def main():
    gpu = setup()
    model = torch.nn.Linear(10, 10).cuda()
    ddp_model = DDP(model, device_ids=[torch.cuda.current_device()], output_device=gpu)
    ds = TensorDataset(torch.randn(512, 10), torch.randn(512, 10))
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(gpu), y.to(gpu)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp_model(x), y).backward()
            opt.step()
    if dist.get_rank() == 0:
        torch.save(ddp_model.module.state_dict(), "linear.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
