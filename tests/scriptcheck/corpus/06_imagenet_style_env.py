# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""ImageNet-style main rewritten for torchrun: the argparse options default to the environment."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms

parser = argparse.ArgumentParser(description="PyTorch ImageNet Training (torchrun)")
parser.add_argument("data", metavar="DIR", help="path to dataset")
parser.add_argument("-a", "--arch", default="resnet50")
parser.add_argument("-b", "--batch-size", default=64, type=int, help="per-GPU batch size")
parser.add_argument("--epochs", default=90, type=int)
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--world-size", default=-1, type=int, help="-1: from the environment")
parser.add_argument("--rank", default=-1, type=int, help="-1: from the environment")
parser.add_argument("--dist-url", default="env://", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--output", default="checkpoints")


def main():
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    model = models.__dict__[args.arch]().cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss().cuda()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    dataset = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.ToTensor()]))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                         num_workers=8, pin_memory=True)
    os.makedirs(args.output, exist_ok=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, target in loader:
            images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
            loss = criterion(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            torch.save({"epoch": epoch + 1, "state_dict": model.module.state_dict()},
                       os.path.join(args.output, "checkpoint.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
