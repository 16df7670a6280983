# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
"""Debuggable alone (`python train.py`) and under torchrun: defaults only where torchrun set nothing."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def init_dist():
    if "RANK" not in os.environ:
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "29555"
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ["LOCAL_RANK"] = "0"
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT", "29555")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def main():
    device = init_dist()
    model = DDP(torch.nn.Linear(6, 1).to(device))
    ds = TensorDataset(torch.randn(600, 6), torch.randn(600, 1))
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=20, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "reg.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
