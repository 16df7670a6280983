"""Checkpoint atomicity: rank 0 SIGKILLed while it writes a checkpoint loses nothing that was published.

Two kill points, both under real torchrun (2 ranks, gloo): in the middle of writing the bytes (a test
shim makes torch.save dribble the file out) and after the temp file is complete but before its rename
(the trainer's own debug.save_delay_s window). Each time the previous checkpoint stays byte-identical
and loadable, no published name ever held a partial file (a watcher verifies every file the moment it
appears), resume ignores and removes the temp file, and the finished run equals an uninterrupted one
(conftest's reference_sha).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ddp_train import checkpoint
from tests.integration.test_trainer_torchrun import _worker_with_rank
from tests.integration.trainrun import describe, parse_finals, run_torchrun, sets, torchrun_cmd, trainer_env
from tests.reliability.support import TRAIN_30, wait_until

pytestmark = pytest.mark.slow

SHIM = Path(__file__).resolve().parent / "slow_save"
TRAIN = [*TRAIN_30, *sets(checkpoint__keep_latest_k=0)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Watcher(threading.Thread):
    """Verifies (zip CRCs) every published checkpoint as soon as it is listed; records what it saw."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.seen: dict[str, str] = {}  # name -> "ok" or the error
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for _, path in checkpoint.list_checkpoints(self.directory):
                if path.name in self.seen:
                    continue
                try:
                    checkpoint.verify(path)
                    self.seen[path.name] = "ok"
                except checkpoint.CorruptCheckpoint as e:
                    self.seen[path.name] = str(e)
                except FileNotFoundError:
                    continue  # pruned between listing and reading
            time.sleep(0.01)


def start(work: Path, extra: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_cmd([*TRAIN, *sets(run__dir=str(work / "runs")), *extra]),
        cwd=work, env={**trainer_env(), **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("when", ["mid-write", "before-rename"])
def test_rank0_killed_while_saving_keeps_previous_checkpoint(
    when: str, tmp_path: Path, reference_sha: str
) -> None:
    ckpts = tmp_path / "runs" / "default" / "checkpoints"
    tmp_file = ckpts / "step-00000020.pt.tmp"
    report = tmp_path / "slow-save.report"
    if when == "mid-write":
        extra: list[str] = []
        env = {"PYTHONPATH": str(SHIM), "RL_SLOW_SAVE_STEP": "20", "RL_SLOW_SAVE_REPORT": str(report)}
    else:
        extra, env = sets(debug__save_delay_s=4), {}  # every save pauses 4 s before its rename
    watcher = Watcher(ckpts)
    watcher.start()
    proc = start(tmp_path, extra, env)
    try:
        if when == "mid-write":

            def half_written() -> tuple[int, int, int] | None:
                if not report.exists():
                    return None
                pid, written, total, _ = report.read_text().split()
                return (int(pid), int(written), int(total)) if int(written) >= 3 * int(total) // 20 else None

            writer, _, total = wait_until(half_written, 120, "rank 0 to be mid-way through step 20")
        else:
            # save_delay_s sleeps after the temp file is complete and fsynced, before os.replace
            wait_until(lambda: tmp_file.exists() and tmp_file.stat().st_size, 120, "the step-20 temp file")
            time.sleep(1)
            writer = _worker_with_rank(proc.pid, 0)
            total = -1
        previous = ckpts / "step-00000010.pt"
        before = sha256(previous)
        os.kill(writer, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        watcher.done.set()
        watcher.join(5)
    assert proc.returncode != 0, f"torchrun ended {proc.returncode} after rank 0 was killed"
    assert "exitcode  : -9" in err, err[-3000:]
    # what was published before the kill is untouched and loads; the interrupted save never appeared
    assert sha256(previous) == before
    assert checkpoint.load(previous)["step"] == 10
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000010.pt", "step-00000020.pt.tmp"]
    if when == "mid-write":
        assert tmp_file.stat().st_size < total
        with pytest.raises(checkpoint.CorruptCheckpoint):
            checkpoint.verify(tmp_file)
    else:
        checkpoint.verify(tmp_file)  # complete and fsynced, yet never published: the rename is the commit
    assert [s for s, _ in checkpoint.list_checkpoints(ckpts)] == [10]
    state, path = checkpoint.load_latest(ckpts)
    assert (state["step"], path) == (10, previous)
    assert watcher.seen == {"step-00000010.pt": "ok"}, watcher.seen  # never a partial published file

    resumed = run_torchrun([*TRAIN, *sets(run__dir=str(tmp_path / "runs"))], cwd=tmp_path)
    assert resumed.returncode == 0, describe(resumed)
    assert "removed step-00000020.pt.tmp left by an interrupted save" in resumed.stderr
    assert f"resumed from {previous} at step 10" in resumed.stderr
    assert parse_finals(resumed.stdout).sha == reference_sha
    assert not list(ckpts.glob("*.tmp"))
    assert [s for s, _ in checkpoint.list_checkpoints(ckpts)] == [10, 20, 30]


def test_a_save_slower_than_the_collective_timeout_does_not_fail_the_other_ranks(
    tmp_path: Path, reference_sha: str
) -> None:
    """Rank 1 waits for rank 0's save on the store (checkpoint.io_timeout_s), not in a collective.

    The shim makes the step-10 save take ~8 s (16 chunks, 0.5 s apart, each fsynced); the process
    group's collective timeout is 3 s. A barrier after the save would time out on rank 1.
    """
    report = tmp_path / "slow-save.report"
    env = {"PYTHONPATH": str(SHIM), "RL_SLOW_SAVE_STEP": "10", "RL_SLOW_SAVE_REPORT": str(report),
           "RL_SLOW_SAVE_CHUNKS": "16", "RL_SLOW_SAVE_PAUSE_S": "0.5"}  # fmt: skip
    proc = start(tmp_path, sets(dist__collective_timeout_s=3), env)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{out}\n{err[-4000:]}"
    _, written, total, name = report.read_text().split()
    assert written == total and name.endswith("step-00000010.pt.tmp")  # the slow save really ran
    seconds = float(re.search(r"saved \S+step-00000010\.pt in (\d+\.\d+)s", err).group(1))
    assert seconds > 3 * 2, err[-3000:]  # well past the collective timeout
    assert parse_finals(out).sha == reference_sha
