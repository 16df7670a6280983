"""Shared helpers for the bench scripts: run torchrun jobs, take medians, print the ratio line."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BENCH_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout: float = 240) -> tuple[float, str]:
    """Run `torchrun --standalone --nproc-per-node nproc ARGS` in cwd; (wall seconds, output)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, env=BENCH_ENV, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(
            f"bench: {' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
        )
    return wall, res.stdout + res.stderr


def result_lines(output: str, tag: str) -> list[dict]:
    """Parse lines `TAG {json}` printed by a bench worker."""
    return [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith(tag + " ")]


def changed_total(ansible_output: str) -> int:
    """The sum of changed= over the hosts of ansible-playbook's last PLAY RECAP (0: idempotent)."""
    return sum(int(n) for n in re.findall(r"changed=(\d+)", ansible_output.split("PLAY RECAP")[-1]))


def timed_playbook(playbook: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[float, str]:
    """Run ansible-playbook from the repo root: (wall seconds, stdout); exits the bench if it failed."""
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"bench: {playbook} failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-2000:]}")
    return wall, res.stdout


def median(values: list[float]) -> float:
    return statistics.median(values)


def ratio_line(code: str, name: str, metric: str, ratio: float, **extra: object) -> str:
    """The last line every bench prints: `C1 trainer/seed_loop steps_s ratio=1.03 k=v ...`."""
    tail = "".join(f" {k}={v}" for k, v in extra.items())
    return f"{code} {name} {metric} ratio={ratio:.3f}{tail}"
