import os

import torch
import torch.distributed as dist


def local_rank() -> int:
    return int(os.environ["LOCAL_RANK"])


def setup() -> None:
    torch.cuda.set_device(local_rank())
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")


def device() -> torch.device:
    return torch.device("cuda", local_rank())


def is_main_process() -> bool:
    return dist.get_rank() == 0


def cleanup() -> None:
    dist.barrier()
    dist.destroy_process_group()
