# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
"""A masked-autoencoder pretraining main in the MAE style: one init helper for torchrun, SLURM and ITP."""
import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from util import dist as misc


def get_args_parser():
    parser = argparse.ArgumentParser("MAE pre-training", add_help=False)
    parser.add_argument("--batch_size", default=64, type=int)
    parser.add_argument("--epochs", default=400, type=int)
    parser.add_argument("--mask_ratio", default=0.75, type=float)
    parser.add_argument("--blr", type=float, default=1.5e-4)
    parser.add_argument("--output_dir", default="./output_dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--world_size", default=1, type=int)
    parser.add_argument("--local_rank", default=-1, type=int)
    parser.add_argument("--dist_on_itp", action="store_true")
    parser.add_argument("--dist_url", default="env://")
    return parser


class TinyMAE(nn.Module):
    def __init__(self, dim=192):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(768, dim), nn.GELU(), nn.Linear(dim, dim))
        self.decoder = nn.Linear(dim, 768)

    def forward(self, patches, mask_ratio):
        keep = (torch.rand(patches.shape[:2], device=patches.device) > mask_ratio).unsqueeze(-1)
        pred = self.decoder(self.encoder(patches * keep))
        return ((pred - patches) ** 2 * (~keep)).mean()


def main(args):
    misc.init_distributed_mode(args)
    device = torch.device(args.device)
    torch.manual_seed(0 + (args.rank if args.distributed else 0))
    model = TinyMAE().to(device)
    model_without_ddp = model
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
        model_without_ddp = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.blr * args.batch_size / 256, betas=(0.9, 0.95))
    start_time = time.time()
    for epoch in range(args.epochs):
        patches = torch.randn(args.batch_size, 196, 768, device=device)
        loss = model(patches, args.mask_ratio)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.output_dir and (epoch % 20 == 0 or epoch + 1 == args.epochs):
            misc.save_on_master({"model": model_without_ddp.state_dict(), "epoch": epoch},
                                os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
        if args.output_dir and misc.is_main_process():
            with open(os.path.join(args.output_dir, "log.txt"), mode="a") as f:
                f.write(json.dumps({"epoch": epoch, "train_loss": loss.item()}) + "\n")
    total_time = str(datetime.timedelta(seconds=int(time.time() - start_time)))
    print(f"Training time {total_time}")


if __name__ == "__main__":
    args = get_args_parser().parse_args()
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    main(args)
