# ruff: noqa
# Expected findings of ddp-launch check-script (code line, or code file:line):
# expect: none
# backend: nccl
"""A single-file GPT trainer in the nanoGPT style: globals for config, DDP detected from RANK."""
import math
import os
import time

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir = "out"
eval_interval = 2000
log_interval = 1
always_save_checkpoint = True
gradient_accumulation_steps = 5 * 8
batch_size = 12
block_size = 1024
learning_rate = 6e-4
max_iters = 600000
backend = "nccl"
device = "cuda"
dtype = "bfloat16"

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ["RANK"])
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process = True
    seed_offset = 0
    ddp_world_size = 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337 + seed_offset)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)


def get_batch():
    x = torch.randint(0, 50304, (batch_size, block_size))
    y = torch.roll(x, -1, dims=1)
    return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)


def get_lr(it, warmup_iters=2000, lr_decay_iters=600000, min_lr=6e-5):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)


model = torch.nn.Sequential(torch.nn.Embedding(50304, 768), torch.nn.Linear(768, 50304))
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])
raw_model = model.module if ddp else model
iter_num = 0
t0 = time.time()
while iter_num <= max_iters:
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    if iter_num % eval_interval == 0 and master_process and (always_save_checkpoint or iter_num > 0):
        checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        X, Y = get_batch()
        with ctx:
            logits = model(X)
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), Y.view(-1))
            loss = loss / gradient_accumulation_steps
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0 and master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, {time.time() - t0:.2f}s")
        t0 = time.time()
    iter_num += 1
if ddp:
    destroy_process_group()
