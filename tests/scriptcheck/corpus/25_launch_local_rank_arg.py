# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: local-rank-arg 19
# expect: save-rank 44
# backend: nccl
"""Written for `python -m torch.distributed.launch`: --local_rank on the command line."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import torchvision
import torchvision.transforms as T


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()

    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor()])
    trainset = torchvision.datasets.CIFAR10(root="./data", train=True, download=False, transform=transform)
    sampler = torch.utils.data.distributed.DistributedSampler(trainset)
    loader = torch.utils.data.DataLoader(trainset, batch_size=args.batch_size, sampler=sampler, num_workers=4)
    model = torchvision.models.resnet18(num_classes=10).cuda(args.local_rank)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank], output_device=args.local_rank)
    criterion = nn.CrossEntropyLoss().cuda(args.local_rank)
    optimizer = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs, targets = inputs.cuda(args.local_rank), targets.cuda(args.local_rank)
            optimizer.zero_grad()
            loss = criterion(model(inputs), targets)
            loss.backward()
            optimizer.step()
        if args.local_rank == 0:
            print(f"epoch {epoch} loss {loss.item():.3f}")
            torch.save(model.module.state_dict(), "resnet18_cifar.pth")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
