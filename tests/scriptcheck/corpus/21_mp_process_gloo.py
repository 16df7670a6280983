# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: env-set 35
# expect: env-set 36
# expect: init-args 37
# expect: spawn 46
"""The point-to-point tutorial style: workers started with mp.Process, rendezvous on localhost."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, size):
    """All-reduce a tensor and train a tiny model by averaging gradients by hand."""
    group = dist.new_group(list(range(size)))
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    model = torch.nn.Linear(10, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        loss = model(torch.randn(8, 10)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad.data, op=dist.ReduceOp.SUM)
            p.grad.data /= float(size)
        opt.step()
    print("Rank ", rank, " has data ", tensor[0], "loss", loss.item())


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)


if __name__ == "__main__":
    world_size = 2
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
