"""C2: DDP communication overhead: step time with gradient sync / step time inside `no_sync()`.

2 ranks, gloo, OMP_NUM_THREADS=1, the bench GPT (as C1). For each bucket_cap_mb in {1, 5, 25, 100}:
median step time of synced steps and of no_sync steps, interleaved in blocks so drift hits both alike.
Prints the sweep, then `C2 ddp_sync/no_sync step_time ratio=R bucket_cap_mb=B` last, R for the bucket
size the trainer uses by default (dist.bucket_cap_mb in the trainer config schema; target R <= 1.15).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

BUCKETS = (1, 5, 25, 100)


def worker(steps: int, blocks: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_train.config import load_config
    from ddp_train.data import build_dataset
    from ddp_train.models import build_model

    sys.path.insert(0, str(Path(__file__).parent))
    from c1_trainer_vs_seed import MODEL

    cfg = load_config(None, MODEL)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = build_dataset(cfg)
    xs = torch.stack([data[i][0] for i in range(cfg.train.batch_size)])
    ys = torch.stack([data[i][1] for i in range(cfg.train.batch_size)])
    out = {}
    for cap in BUCKETS:
        torch.manual_seed(0)
        model = DDP(build_model(cfg), bucket_cap_mb=cap, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times: dict[str, list[float]] = {"sync": [], "no_sync": []}
        for block in range(blocks + 1):
            for mode in ("sync", "no_sync"):
                for _ in range(steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    with model.no_sync() if mode == "no_sync" else contextlib.nullcontext():
                        loss = model(xs, ys)
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if block:  # block 0 warms up
                        times[mode].append(time.perf_counter() - t0)
        out[cap] = {m: statistics.median(v) for m, v in times.items()}
    if rank == 0:
        print("C2RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.steps, a.blocks)
        return
    from common import REPO, ratio_line, result_lines, torchrun

    from ddp_train.config import load_config

    _, out = torchrun([__file__, "--worker", f"--steps={a.steps}", f"--blocks={a.blocks}"], cwd=REPO)
    res = {int(k): v for k, v in result_lines(out, "C2RESULT")[0].items()}
    for cap, t in res.items():
        print(
            f"bucket_cap_mb={cap:>3}  sync {t['sync'] * 1e3:7.2f} ms  no_sync {t['no_sync'] * 1e3:7.2f} ms  "
            f"ratio {t['sync'] / t['no_sync']:.3f}"
        )
    best = min(res, key=lambda c: res[c]["sync"])
    default = getattr(load_config(None, []).dist, "bucket_cap_mb", 25)
    t = res[default]
    print(
        ratio_line(
            "C2",
            "ddp_sync/no_sync",
            "step_time",
            t["sync"] / t["no_sync"],
            bucket_cap_mb=default,
            fastest_bucket_cap_mb=best,
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
