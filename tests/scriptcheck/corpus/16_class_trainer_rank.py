# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""A class-based trainer: ranks kept on self, checkpoint written by a method called under rank 0."""
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


@dataclass
class Config:
    epochs: int = 10
    batch_size: int = 64
    lr: float = 1e-3
    ckpt_dir: str = "checkpoints"
    save_every: int = 2


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank)
        torch.cuda.set_device(self.device)
        model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 10)).to(self.device)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        data = TensorDataset(torch.randn(8192, 128), torch.randint(0, 10, (8192,)))
        self.sampler = DistributedSampler(data, num_replicas=self.world_size, rank=self.rank)
        self.loader = DataLoader(data, batch_size=cfg.batch_size, sampler=self.sampler, pin_memory=True)

    def save(self, epoch: int) -> None:
        path = Path(self.cfg.ckpt_dir) / f"epoch{epoch:03d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict()}, path)

    def fit(self) -> None:
        for epoch in range(self.cfg.epochs):
            self.sampler.set_epoch(epoch)
            for x, y in self.loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                loss = nn.functional.cross_entropy(self.model(x), y)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
            if self.rank == 0 and (epoch + 1) % self.cfg.save_every == 0:
                self.save(epoch)
            dist.barrier()


def main() -> None:
    dist.init_process_group("nccl")
    try:
        Trainer(Config()).fit()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
