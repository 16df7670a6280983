# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: init-args 38
# expect: save-rank 59
# backend: nccl
"""An older segmentation trainer: the rendezvous URL built with %-formatting from argparse options."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser(description="Semantic segmentation, distributed")
    parser.add_argument("--master-addr", default="192.168.1.10", help="address of the rank 0 machine")
    parser.add_argument("--master-port", default="23456")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--snapshot", default="snapshots/segnet.pth")
    return parser.parse_args()


def build_model(num_classes=21):
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.Conv2d(64, num_classes, 1))


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist_url = "tcp://%s:%s" % (args.master_addr, args.master_port)
    dist.init_process_group(backend="nccl", init_method=dist_url,
                            world_size=int(os.environ["WORLD_SIZE"]), rank=int(os.environ["RANK"]))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])
    data = TensorDataset(torch.randn(256, 3, 64, 64), torch.randint(0, 21, (256, 64, 64)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=args.workers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss(ignore_index=255)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for images, masks in loader:
            images, masks = images.cuda(non_blocking=True), masks.cuda(non_blocking=True)
            loss = criterion(model(images), masks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if args.local_rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f} ({time.time() - tic:.1f}s)")
            os.makedirs(os.path.dirname(args.snapshot), exist_ok=True)
            torch.save(model.module.state_dict(), args.snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
