# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
"""A vision-transformer trainer in the DeiT/MAE style: argparse main, helpers in misc.py, an EMA copy."""
import argparse
import copy
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

import misc


def get_args_parser():
    parser = argparse.ArgumentParser("ViT training", add_help=False)
    parser.add_argument("--batch-size", default=64, type=int)
    parser.add_argument("--epochs", default=300, type=int)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--output_dir", default="", help="path where to save, empty for no saving")
    parser.add_argument("--device", default="cuda", help="device to use for training / testing")
    parser.add_argument("--world_size", default=1, type=int, help="number of distributed processes")
    parser.add_argument("--dist_url", default="env://", help="url used to set up distributed training")
    parser.add_argument("--model-ema-decay", type=float, default=0.99996)
    return parser


def main(args):
    misc.init_distributed_mode(args)
    device = torch.device(args.device)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.GELU(), nn.Linear(512, 100))
    model.to(device)
    model_ema = copy.deepcopy(model)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    output_dir = Path(args.output_dir)
    for epoch in range(args.epochs):
        model.train()
        for _ in range(10):
            images = torch.randn(args.batch_size, 3, 32, 32, device=device)
            targets = torch.randint(0, 100, (args.batch_size,), device=device)
            loss = nn.functional.cross_entropy(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        misc.copy_ema_weights(model_ema, model_without_ddp.state_dict())
        if args.output_dir:
            misc.save_on_master({"model": model_without_ddp.state_dict(), "epoch": epoch},
                                output_dir / "checkpoint.pth")
            if misc.is_main_process():
                with (output_dir / "log.txt").open("a") as f:
                    f.write(json.dumps({"epoch": epoch, "loss": loss.item()}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser("ViT training", parents=[get_args_parser()])
    args = parser.parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    main(args)
