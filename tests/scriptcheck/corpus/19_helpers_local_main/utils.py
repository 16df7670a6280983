import os

import torch
import torch.distributed as dist


def init_distributed_mode():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    dist.barrier()


def get_local_rank():
    return int(os.environ["LOCAL_RANK"])


def is_local_main_process():
    return get_local_rank() == 0


def save_on_node_master(*args, **kwargs):
    if get_local_rank() == 0:
        torch.save(*args, **kwargs)
