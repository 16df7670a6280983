"""A rank's loader for test_train_loader_signals, run as a script in a session of its own.

`loader_rank.py fork|forkserver [--busy]`: installs the trainer's StopRequest, starts ShardedBatches
with 2 persistent workers, prints {"workers": [pids], "forkserver": pid}, then obeys stdin:
"after-stop" loads 12 more batches and prints what the rank saw; "close" closes the loader and prints
whether its workers are alive. --busy: worker 1 sleeps in __getitem__ after its first batch.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import sys
import time

import torch
from torch.utils.data import Dataset, get_worker_info

from ddp_train.data import ShardedBatches

BATCH = 4


class Items(Dataset):
    def __init__(self, busy: bool) -> None:
        self.busy, self.loaded = busy, 0

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        self.loaded += 1
        if self.busy and info is not None and info.id == 1 and self.loaded > BATCH:
            time.sleep(120)
        return torch.tensor([i])


def say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def main() -> int:
    from ddp_train.trainer import StopRequest  # here: a forkserver's worker imports this module again

    start, busy = sys.argv[1], "--busy" in sys.argv
    stop = StopRequest()
    stop.install()
    batches = ShardedBatches(Items(busy), BATCH, 0, 1, seed=0, num_workers=2, worker_start=start)
    batches.next()
    workers = batches._it._workers  # type: ignore[union-attr]
    server = multiprocessing.forkserver._forkserver._forkserver_pid if start == "forkserver" else None
    say(workers=[w.pid for w in workers], forkserver=server)
    for line in sys.stdin:
        if line.strip() == "after-stop":
            n = sum(1 for _ in range(12) if batches.next() is not None)
            say(signum=stop.signum, batches=n, alive=[w.is_alive() for w in workers])
        batches.close()
        say(closed=[w.is_alive() for w in workers])
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
