"""Helpers to run the trainer as users do: `python -m ddp_train` alone or under real torchrun."""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FINAL_LINE = re.compile(
    r"^ddp-train: final rank=(?P<rank>\d+) world=(?P<world>\d+) step=(?P<step>\d+) "
    r"loss=(?P<loss>\S+) params_sha256=(?P<sha>[0-9a-f]{16})$",
    re.M,
)
STOP_LINE = re.compile(r"^ddp-train: stopped rank=(\d+) world=(\d+) step=(\d+) signal=SIGTERM$", re.M)


def trainer_env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@functools.cache
def torchrun_logs() -> str:
    """One directory per test process for torchrun's --log-dir, removed when the process ends: without
    it torchrun makes a /tmp/torchelastic_* per run and never removes it."""
    path = tempfile.mkdtemp(prefix="ddp-tests-torchrun-")
    atexit.register(shutil.rmtree, path, True)
    return path


def torchrun_cmd(args: list[str], nproc: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        "--log-dir", torchrun_logs(), "-m", "ddp_train", *args,
    ]  # fmt: skip


@dataclass
class Finals:
    """The parsed `ddp-train: final ...` lines of one run, by rank."""

    by_rank: dict[int, dict]

    @property
    def shas(self) -> set[str]:
        return {f["sha"] for f in self.by_rank.values()}

    @property
    def sha(self) -> str:
        assert len(self.shas) == 1, f"ranks differ: {self.by_rank}"
        return next(iter(self.shas))


def parse_finals(stdout: str) -> Finals:
    out = {}
    for m in FINAL_LINE.finditer(stdout):
        d = m.groupdict()
        out[int(d["rank"])] = {
            "world": int(d["world"]),
            "step": int(d["step"]),
            "loss": float(d["loss"]),
            "sha": d["sha"],
        }
    return Finals(out)


def run_torchrun(
    args: list[str], cwd: Path, nproc: int = 2, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_cmd(args, nproc), cwd=cwd, env=trainer_env(), capture_output=True, text=True, timeout=timeout
    )


def sets(**kv: object) -> list[str]:
    """--set arguments from keyword pairs: sets(train__lr=0.1) -> ['--set', 'train.lr=0.1']."""
    out: list[str] = []
    for k, v in kv.items():
        value = json.dumps(v) if isinstance(v, (bool, type(None), list)) else str(v)
        out += ["--set", f"{k.replace('__', '.')}={value}"]
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
