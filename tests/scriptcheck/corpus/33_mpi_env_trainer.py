# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: mpi-env 14
# expect: mpi-env 15
# expect: mpi-env 16
# backend: nccl
"""Written for mpirun (Open MPI): rank and size from OMPI_* variables."""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
world_size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))


def main():
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    model = DDP(torch.nn.Linear(16, 16).cuda(), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        loss = model(torch.randn(8, 16, device="cuda")).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save(model.module.state_dict(), "mpi.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
