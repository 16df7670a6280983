"""C12: what checkpoints cost the training loop, written in the step vs in a thread (issue #46), same run.

One rank on the CPU, the packaged trainer, a GPT whose full checkpoint (weights + AdamW moments) is ~40 MB
and whose step is short, so that a save every few steps weighs: the same steps with no periodic
checkpoint (the baseline), with one every `--every` steps written in the step (`checkpoint.async_save=
false`), and written in a thread after a copy to host memory (the default). Time = the trainer's own
"throughput: N steps in X s wall" (the loop, before the final save, which all three make). The runs
alternate, `--repeats` times; medians. Prints `C12 ckpt_async/no_ckpt wall_s ratio=R sync_ratio=S`
(R near 1: the saves are off the training path; S: what they cost in the step). On a GPU the copy is a
pinned DMA and the write does not compete with the step for the CPU; here the writer thread shares the
machine's 2 cores with the step, so R > 1 is expected on CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import BENCH_ENV, PYTHON, median, ratio_line

MODEL = [
    "model.name=gpt",
    "model.gpt.n_layer=4",
    "model.gpt.n_head=4",
    "model.gpt.n_embd=256",
    "model.gpt.block_size=32",
    "model.gpt.vocab_size=256",
    "data.name=synthetic",
    "train.batch_size=2",
    "eval.interval_steps=0",
    "log.interval_steps=10",
    "log.progress=never",
    "checkpoint.resume=never",
    "checkpoint.keep_latest_k=2",
]
WALL = re.compile(r"throughput: (\d+) steps in ([0-9.]+)s wall")


def run(work: Path, name: str, steps: int, extra: list[str]) -> float:
    sets = [*MODEL, f"train.max_steps={steps}", f"run.name={name}", *extra]
    cmd = [PYTHON, "-m", "ddp_train", *[a for s in sets for a in ("--set", s)]]
    res = subprocess.run(cmd, cwd=work, env=BENCH_ENV, capture_output=True, text=True, timeout=240)
    m = WALL.search(res.stdout + res.stderr)
    if res.returncode != 0 or not m:
        sys.exit(
            f"bench: {' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
    return float(m.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="checkpoint.interval_steps of the two saving runs")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    modes = {
        "none": ["checkpoint.interval_steps=0"],
        "sync": [f"checkpoint.interval_steps={a.every}", "checkpoint.async_save=false"],
        "async": [f"checkpoint.interval_steps={a.every}", "checkpoint.async_save=true"],
    }
    walls: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="c12-") as tmp:
        for i in range(a.repeats):
            for mode, extra in modes.items():
                walls[mode].append(run(Path(tmp), f"c12-{mode}-{i}", a.steps, extra))
                print(f"{mode} run {i}: {walls[mode][-1]:.2f} s for {a.steps} steps", flush=True)
        size = max((f.stat().st_size for f in Path(tmp).glob("runs/*/checkpoints/*.pt")), default=0)
    none, sync, asy = (median(walls[m]) for m in ("none", "sync", "async"))
    print(ratio_line("C12", "ckpt_async/no_ckpt", "wall_s", asy / none, sync_ratio=f"{sync / none:.3f}",
                     none_s=f"{none:.2f}", sync_s=f"{sync:.2f}", async_s=f"{asy:.2f}", every=a.every,
                     ckpt_MiB=f"{size / 2**20:.0f}", cpus=os.cpu_count()))  # fmt: skip


if __name__ == "__main__":
    main()
