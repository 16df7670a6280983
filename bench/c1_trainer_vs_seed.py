"""C1: trainer throughput vs a seed-style plain DDP loop (bench/seed_loop.py), same run.

Both run the same GPT on the same synthetic data and batch (no grad clipping, validation or checkpoints
on either side), 2 ranks,
gloo, OMP_NUM_THREADS=1, under torchrun. Throughput = global samples/s per window of 10 steps, first
window (warm-up) dropped, median
over windows; the runs alternate (trainer, seed, trainer, seed, ...) so drift hits both alike.
Prints `C1 trainer/seed_loop samples_s ratio=R` last (R >= 1.0 means the trainer is not slower).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import REPO, median, ratio_line, result_lines, torchrun

MODEL = [
    "model.name=gpt",
    "model.gpt.n_layer=2",
    "model.gpt.n_head=4",
    "model.gpt.n_embd=128",
    "model.gpt.block_size=64",
    "model.gpt.vocab_size=256",
    "data.name=synthetic",
    "data.synthetic.num_samples=4096",
    "train.batch_size=16",
    "train.weight_decay=0.0",
    "train.grad_clip=0",  # the seed loop does not clip: both sides compute the same update
]


def trainer_run(work: Path, steps: int, i: int) -> list[float]:
    sets = [
        *MODEL,
        f"train.max_steps={steps}",
        "log.interval_steps=10",
        "checkpoint.interval_steps=0",
        "checkpoint.resume=never",
        "eval.interval_steps=0",  # the seed loop neither validates nor saves: neither side does here
        f"run.name=c1-{i}",
        "log.progress=never",
    ]
    torchrun(["-m", "ddp_train", *[a for s in sets for a in ("--set", s)]], cwd=work)
    records = [json.loads(x) for x in (work / "runs" / f"c1-{i}" / "metrics.jsonl").read_text().splitlines()]
    return [r["samples_per_s"] for r in records if r["step"] % 10 == 0][1:]


def seed_run(work: Path, steps: int) -> list[float]:
    sets = [*MODEL, f"train.max_steps={steps}"]
    _, out = torchrun(
        [str(REPO / "bench" / "seed_loop.py"), *[a for s in sets for a in ("--set", s)]], cwd=work
    )
    return result_lines(out, "SEED")[0]["samples_per_s"][1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    ours, seed = [], []
    with tempfile.TemporaryDirectory(prefix="c1-") as tmp:
        for i in range(a.repeats):
            ours += trainer_run(Path(tmp), a.steps, i)
            seed += seed_run(Path(tmp), a.steps)
    t, s = median(ours), median(seed)
    print(f"trainer samples/s median={t:.0f} ({len(ours)} windows); seed loop median={s:.0f} ({len(seed)})")
    print(ratio_line("C1", "trainer/seed_loop", "samples_s", t / s, trainer=f"{t:.0f}", seed=f"{s:.0f}"))


if __name__ == "__main__":
    main()
