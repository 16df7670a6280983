# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""Keeps a --local-rank option for old launchers, with the default read from torchrun's env."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Trainer:
    def __init__(self, args):
        self.args = args
        self.global_rank = int(os.environ["RANK"])
        self.gpu = args.local_rank
        torch.cuda.set_device(self.gpu)
        dist.init_process_group("nccl")
        self.model = DDP(torch.nn.Linear(24, 24).cuda(self.gpu), device_ids=[self.gpu])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr)
        ds = TensorDataset(torch.randn(960, 24), torch.randn(960, 24))
        self.sampler = DistributedSampler(ds)
        self.loader = DataLoader(ds, batch_size=48, sampler=self.sampler)

    def _snapshot(self, epoch):
        torch.save({"epoch": epoch, "model": self.model.module.state_dict()}, self.args.snapshot)

    def train(self):
        for epoch in range(self.args.epochs):
            self.sampler.set_epoch(epoch)
            for x, y in self.loader:
                loss = torch.nn.functional.mse_loss(self.model(x.cuda(self.gpu)), y.cuda(self.gpu))
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            if self.global_rank == 0:
                self._snapshot(epoch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--snapshot", default="snapshot.pt")
    Trainer(parser.parse_args()).train()
    dist.destroy_process_group()
