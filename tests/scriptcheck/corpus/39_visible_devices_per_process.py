# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""One GPU made visible per process from LOCAL_RANK, so every "cuda" below is that process's own GPU."""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("LOCAL_RANK", "0")

import torch  # noqa: E402  (after CUDA_VISIBLE_DEVICES on purpose)
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402


def evaluate(model, loader):
    model.eval()
    correct = total = 0
    with torch.no_grad(), torch.cuda.device(0):
        for x, y in loader:
            pred = model(x.cuda()).argmax(1)
            correct += (pred == y.cuda()).sum().item()
            total += y.numel()
    model.train()
    return correct / max(total, 1)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    model = DDP(torch.nn.Linear(64, 8).cuda(), device_ids=[0])
    ds = TensorDataset(torch.randn(2048, 64), torch.randint(0, 8, (2048,)))
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=64, sampler=sampler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(5):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
            opt.zero_grad()
            loss.backward()
            opt.step()
        acc = evaluate(model, loader)
        if rank == 0:
            print(f"epoch {epoch} acc {acc:.3f}")
            torch.save(model.module.state_dict(), "visible.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
