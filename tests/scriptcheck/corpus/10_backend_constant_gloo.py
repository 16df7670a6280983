# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: gloo
"""A CPU trainer, correct under torchrun: the backend is a module constant."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BACKEND = "gloo"
STEPS_PER_LOG = 20


def main():
    dist.init_process_group(backend=BACKEND)
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    data = TensorDataset(torch.randn(2048, 16), torch.randn(2048, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=64, sampler=sampler, num_workers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    for epoch in range(int(os.environ.get("EPOCHS", "3"))):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % STEPS_PER_LOG == 0:
                print(f"step {step} loss {loss.item():.4f}")
    if rank == 0:
        torch.save(model.module.state_dict(), "cpu_model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
