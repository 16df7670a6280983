# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
"""Device-generic: the torch.accelerator API chooses the device index, nothing CUDA-specific."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    acc = torch.accelerator.current_accelerator()
    torch.accelerator.set_device_index(local_rank)
    device = torch.device(acc.type, local_rank)
    backend = dist.get_default_backend_for_device(device)
    dist.init_process_group(backend)
    model = DDP(torch.nn.Linear(30, 2).to(device))
    ds = TensorDataset(torch.randn(900, 30), torch.randint(0, 2, (900,)))
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=30, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
