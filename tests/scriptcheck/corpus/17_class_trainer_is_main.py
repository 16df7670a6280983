# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""A trainer whose save method returns early off the main process."""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class Runner:
    def __init__(self, data_dir: str, out: str = "runs/mnist.pt") -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend="nccl")
        self.is_main = dist.get_rank() == 0
        self.out = out
        ds = datasets.MNIST(data_dir, train=True, download=self.is_main, transform=transforms.ToTensor())
        self.sampler = DistributedSampler(ds, shuffle=True, seed=42)
        self.loader = DataLoader(ds, batch_size=128, sampler=self.sampler, num_workers=4)
        net = nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
        self.net = DistributedDataParallel(net, device_ids=[self.local_rank])
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)

    def checkpoint(self, epoch: int) -> None:
        if not self.is_main:
            return
        os.makedirs(os.path.dirname(self.out), exist_ok=True)
        torch.save({"epoch": epoch, "net": self.net.module.state_dict()}, self.out)

    def run(self, epochs: int = 5) -> None:
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            self.net.train()
            for images, labels in self.loader:
                images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
                loss = nn.functional.cross_entropy(self.net(images), labels)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
            self.checkpoint(epoch)
        dist.destroy_process_group()


if __name__ == "__main__":
    Runner(os.environ.get("DATA_DIR", "data")).run()
