"""The C1 baseline: a seed-style plain DDP loop (init_process_group + DDP + DistributedSampler only).

Same model, data and batch as the trainer (built from the same config by ddp_train's builders), nothing
else: no grad clipping, schedule, checkpoints or logging. Run under torchrun; rank 0 prints
`SEED {"samples_per_s": [...]}` with the throughput of each window of `--window` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_train.config import load_config
from ddp_train.data import build_dataset
from ddp_train.models import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--window", type=int, default=10)
    a = p.parse_args()
    cfg = load_config(a.config, a.set)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.seed)
    model = DDP(build_model(cfg))
    dataset = build_dataset(cfg)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.train.batch_size, sampler=sampler, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    step, epoch, windows, t0 = 0, 0, [], time.perf_counter()
    while step < cfg.train.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % a.window == 0:
                now = time.perf_counter()
                windows.append(a.window * cfg.train.batch_size * world / (now - t0))
                t0 = now
            if step >= cfg.train.max_steps:
                break
        epoch += 1
    if rank == 0:
        print("SEED " + json.dumps({"samples_per_s": windows, "loss": loss.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
