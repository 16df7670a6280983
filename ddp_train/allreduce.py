"""Allreduce smoke test across nodes: checks the sum on every rank and measures bus bandwidth.

Run it under torchrun on every node (gloo without a GPU, nccl with one), e.g.

    torchrun --nnodes 3 --nproc-per-node 1 --node-rank I --master-addr A --master-port 29500 \\
        -m ddp_train.allreduce --size-mb 64

Each rank prints one line, `ddp-allreduce rank=0 world_size=3 host=node0 backend=gloo ...
algbw_GBps=0.412 busbw_GBps=0.549 ok=1`; the exit status is 0 only if the reduced values were right.
Bus bandwidth follows nccl-tests: algbw * 2(n-1)/n for n ranks.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

LINE_TAG = "ddp-allreduce"
# Per backend: (size in MiB, timed iterations, warmup iterations). NCCL needs bigger messages than gloo
# on CPU before its bandwidth stops being latency-bound.
DEFAULTS = {"gloo": (16.0, 10, 2), "nccl": (256.0, 20, 5)}
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """Allreduce bus bandwidth (nccl-tests): the algorithm bandwidth times 2(n-1)/n."""
    return algbw * 2 * (world_size - 1) / world_size


def pick_backend(requested: str) -> str:
    """`auto` means nccl when CUDA and NCCL are usable here, else gloo."""
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddp_train.allreduce", description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, help="tensor size in MiB (float32); gloo 16, nccl 256")
    p.add_argument("--iters", type=int, help="timed allreduce calls; gloo 10, nccl 20")
    p.add_argument("--warmup", type=int, help="untimed allreduce calls before timing; gloo 2, nccl 5")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--timeout-s", type=float, default=120.0, help="process group timeout")
    args = p.parse_args(argv)
    args.backend = pick_backend(args.backend)
    size_mb, iters, warmup = DEFAULTS[args.backend]
    args.size_mb = size_mb if args.size_mb is None else args.size_mb
    args.iters = iters if args.iters is None else args.iters
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.size_mb <= 0 or args.iters < 1 or args.warmup < 0 or args.timeout_s <= 0:
        p.error("--size-mb and --timeout-s must be > 0, --iters >= 1, --warmup >= 0")
    return args


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> int:
    """Check one allreduce, time `iters` more, print this rank's line; 0 if the sum was right."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    backend = args.backend
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        numel = max(1, int(args.size_mb * 2**20) // 4)
        tensor = torch.full((numel,), float(rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(tensor)
        ok = bool(torch.all(tensor == world_size * (world_size + 1) / 2).item())

        tensor.zero_()
        for _ in range(args.warmup):
            dist.all_reduce(tensor)
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(tensor)
        _synchronize(device)
        avg_s = (time.perf_counter() - start) / args.iters

        nbytes = numel * tensor.element_size()
        algbw = nbytes / avg_s / 1e9
        line = (
            f"{LINE_TAG} rank={rank} world_size={world_size} local_rank={local_rank} "
            f"host={socket.gethostname()} backend={backend} device={device} bytes={nbytes} "
            f"iters={args.iters} avg_ms={avg_s * 1e3:.3f} algbw_GBps={algbw:.3f} "
            f"busbw_GBps={bus_bandwidth(algbw, world_size):.3f} ok={int(ok)}\n"
        )
        # One write per line: ranks share stdout, and print() may write the newline separately.
        sys.stdout.write(line)
        sys.stdout.flush()
        dist.barrier()
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        print(f"ddp_train.allreduce: run it under torchrun ({', '.join(missing)} not set)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
