"""A disk that refuses the run's writes (#32): one line naming the operation, path, free space and the
intact checkpoint, exit 2, no traceback; the other rank stops with one line naming rank 0's failure."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_train import checkpoint
from tests.integration.trainrun import describe, run_torchrun, sets, trainer_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def train_alone(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddp_train", *args],
        cwd=cwd, env=trainer_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip


ONE_LINE = re.compile(
    r"^ddp-train: error: (?P<path>\S+): (?P<op>saving [^:]+) failed: No space left on device \(ENOSPC\); "
    r"[\d.]+ (?:B|KiB) free of 1\.0 MiB on (?P<mount>\S+); checkpoint step (?P<step>\d+) is intact "
    r"\((?P<kept>\S+)\)$"
)


@pytest.mark.slow
def test_disk_full_is_one_line_exit_2_and_a_relaunch_resumes(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "full", "size=1m") as full:
        proc = train_alone(sets(run__dir=full, train__max_steps=200), tmp_path)
        assert proc.returncode == 2, describe(proc)
        assert "Traceback" not in proc.stderr, describe(proc)
        lines = proc.stderr.strip().splitlines()
        m = ONE_LINE.match(lines[-1])
        assert m, describe(proc)
        assert [ln for ln in lines if ln.startswith("ddp-train: error:")] == [lines[-1]]
        assert Path(m["path"]).parent.is_relative_to(full) and m["mount"] == str(full)
        kept = Path(m["kept"])
        assert checkpoint.load(kept)["step"] == int(m["step"])  # the previous checkpoint is intact
        assert not list(kept.parent.glob("*.tmp"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(full)], check=True)
        again = train_alone(sets(run__dir=full, train__max_steps=200), tmp_path)
        assert again.returncode == 0, describe(again)
        assert f"resumed from {kept} at step {m['step']}" in again.stderr, describe(again)


@pytest.mark.slow
def test_disk_full_under_torchrun_the_other_rank_names_rank_0(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "full", "size=1m") as full:
        proc = run_torchrun(sets(run__dir=full, train__max_steps=200), tmp_path)
        assert proc.returncode != 0, describe(proc)
        out = proc.stdout + proc.stderr
        errors = [ln for ln in out.splitlines() if ln.startswith("ddp-train: error:")]
        assert len(errors) == 1 and ONE_LINE.match(errors[0]), describe(proc)
        stopped = [ln for ln in out.splitlines() if ln.startswith("ddp-train: stopped: rank 0 failed: ")]
        assert len(stopped) == 1 and errors[0].removeprefix("ddp-train: error: ") in stopped[0], describe(
            proc
        )
        assert "ddp_train/trainer.py" not in out, describe(proc)  # no worker traceback at all


@pytest.mark.slow
def test_read_only_checkpoint_dir_names_it(tmp_path: Path) -> None:
    # mode=0755: a tmpfs root is 1777 by default, and a checkpoint.dir others can write is refused at
    # the start (storage.own_dir), before the read-only file system this test is about is ever met
    with tmpfs(tmp_path / "ro", "size=1m,ro,mode=0755") as ro:
        args = sets(run__dir=tmp_path / "runs", checkpoint__dir=ro, train__max_steps=20)
        proc = train_alone(args, tmp_path)
        assert proc.returncode == 2, describe(proc)
        assert "Traceback" not in proc.stderr, describe(proc)
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(
            f"ddp-train: error: {ro}/step-00000010.pt: saving checkpoint step 10 failed: "
        ), line
        assert "Read-only file system (EROFS)" in line and f" on {ro}; no checkpoint in {ro} yet" in line, (
            line
        )
