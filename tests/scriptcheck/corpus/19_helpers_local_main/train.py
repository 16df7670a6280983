# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: save-rank 29
# expect: save-rank utils.py:24
# backend: nccl
"""A detection-style trainer: helpers in utils.py, the checkpoint written per node by mistake."""
import os

import torch
import torch.distributed as dist

import utils


def main():
    utils.init_distributed_mode()
    model = torch.nn.Conv2d(3, 8, 3).cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[utils.get_local_rank()])
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)
    for epoch in range(12):
        for _ in range(100):
            images = torch.randn(4, 3, 64, 64).cuda()
            loss = model(images).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        utils.save_on_node_master(model.module.state_dict(), os.path.join("/mnt/shared/out", "model.pth"))
        if utils.is_local_main_process():
            torch.save({"epoch": epoch, "opt": opt.state_dict()}, "/mnt/shared/out/optimizer.pth")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
