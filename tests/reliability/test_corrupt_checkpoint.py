"""Corrupt checkpoints on disk: the trainer falls back to the previous good one, or stops with one clear line.

Every kind of damage (truncated at several points, a flipped bit inside tensor data, garbage, a
foreign zip, another program's torch file, a pickle that would run code) is detected before use; the
bad file is moved aside as *.corrupt and named in a warning. End to end: a run whose newest checkpoint
is truncated resumes from the one before and finishes with exactly the parameters of an uninterrupted
run; when no checkpoint is usable the trainer exits 2 with one line naming the file (never a
traceback, never a hang on the other ranks) and deletes nothing.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ddp_train import checkpoint
from tests.integration.trainrun import describe, parse_finals, run_torchrun, sets, trainer_env
from tests.reliability.support import TRAIN_30

pytestmark = pytest.mark.slow

KEEP_ALL = [*TRAIN_30, *sets(checkpoint__keep_latest_k=0)]


def train(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """The trainer as one process (no torchrun): the cheapest real run."""
    return subprocess.run(
        [sys.executable, "-m", "ddp_train", *args],
        cwd=cwd, env=trainer_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Checkpoints 10, 20 and 30 of one uninterrupted single-process run, and its final params sha."""
    work = tmp_path_factory.mktemp("corrupt-good")
    proc = train([*KEEP_ALL, *sets(run__dir=str(work))], work)
    assert proc.returncode == 0, describe(proc)
    ckpts = work / "default" / "checkpoints"
    assert [s for s, _ in checkpoint.list_checkpoints(ckpts)] == [10, 20, 30]
    return ckpts, parse_finals(proc.stdout).sha


def copy_up_to(good_dir: Path, dest: Path, last: int) -> Path:
    dest.mkdir(parents=True)
    for step, path in checkpoint.list_checkpoints(good_dir):
        if step <= last:
            shutil.copy(path, dest / path.name)
    return dest


def _largest_entry_data(path: Path) -> tuple[int, int]:
    """(offset, size) of the data of the biggest member of a torch zip: where the tensors are."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


class _Evil:
    """Unpickling this would create a file: a weights_only loader must refuse it."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.canary), "w"))


def damage(path: Path, how: str, canary: Path) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated-half":
        path.write_bytes(data[: len(data) // 2])
    elif how == "truncated-tail":
        path.write_bytes(data[:-7])  # the end-of-central-directory record is cut
    elif how == "bit-flip-in-tensor-data":
        offset, size = _largest_entry_data(path)
        pos = offset + size // 2
        path.write_bytes(data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :])
    elif how == "garbage":
        path.write_bytes(random.Random(7).randbytes(len(data)))
    elif how == "foreign-zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("readme.txt", "not a checkpoint")
    elif how == "other-torch-file":
        torch.save({"weights": torch.zeros(3)}, path)
    elif how == "pickle-that-runs-code":
        torch.save({"format": checkpoint.FORMAT, "evil": _Evil(canary)}, path)
    else:
        raise AssertionError(how)


KINDS = [
    "empty", "truncated-half", "truncated-tail", "bit-flip-in-tensor-data", "garbage", "foreign-zip",
    "other-torch-file", "pickle-that-runs-code",
]  # fmt: skip


@pytest.mark.parametrize("how", KINDS)
def test_newest_damaged_falls_back_to_previous(
    how: str, good: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = copy_up_to(good[0], tmp_path / "ckpts", 20)
    bad = ckpts / "step-00000020.pt"
    canary = tmp_path / "canary"
    damage(bad, how, canary)
    with pytest.raises(checkpoint.CorruptCheckpoint) as err:
        checkpoint.load(bad)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    with caplog.at_level(logging.WARNING, logger="ddp_train.checkpoint"):
        state, path = checkpoint.load_latest(ckpts)
    assert (state["step"], path) == (10, ckpts / "step-00000010.pt")
    torch.testing.assert_close(state["model"], torch.load(good[0] / "step-00000010.pt")["model"])
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000010.pt", "step-00000020.pt.corrupt"]
    assert [s for s, _ in checkpoint.list_checkpoints(ckpts)] == [10]
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert str(bad) in warning and "falling back to step-00000010.pt" in warning, warning
    assert not canary.exists()


def test_truncated_newest_resumes_from_previous_and_matches_uninterrupted(
    good: tuple[Path, str], tmp_path: Path
) -> None:
    ckpts = copy_up_to(good[0], tmp_path / "default" / "checkpoints", 20)
    damage(ckpts / "step-00000020.pt", "truncated-half", tmp_path / "canary")
    proc = train([*KEEP_ALL, *sets(run__dir=str(tmp_path))], tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert "step-00000020.pt" in proc.stderr and "unreadable checkpoint" in proc.stderr, proc.stderr
    assert "moved it to step-00000020.pt.corrupt, falling back to step-00000010.pt" in proc.stderr
    assert f"resumed from {ckpts / 'step-00000010.pt'} at step 10" in proc.stderr
    assert parse_finals(proc.stdout).sha == good[1]
    assert "Traceback" not in proc.stderr
    assert [s for s, _ in checkpoint.list_checkpoints(ckpts)] == [10, 20, 30]
    assert (ckpts / "step-00000020.pt.corrupt").exists()  # kept for inspection, never loaded


def test_no_usable_checkpoint_is_one_line_exit_2_and_nothing_moved(
    good: tuple[Path, str], tmp_path: Path
) -> None:
    ckpts = copy_up_to(good[0], tmp_path / "default" / "checkpoints", 20)
    for path in ckpts.iterdir():
        damage(path, "truncated-half", tmp_path / "canary")
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    proc = train([*KEEP_ALL, *sets(run__dir=str(tmp_path))], tmp_path)
    assert proc.returncode == 2, describe(proc)
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [
        f"ddp-train: error: {ckpts}: no usable checkpoint (2 corrupt; newest: {ckpts / 'step-00000020.pt'}: "
        "unreadable checkpoint (BadZipFile: File is not a zip file))"
    ], proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before  # nothing renamed or deleted


def test_no_usable_checkpoint_under_torchrun_stops_every_rank_promptly(
    good: tuple[Path, str], tmp_path: Path
) -> None:
    ckpts = copy_up_to(good[0], tmp_path / "default" / "checkpoints", 10)
    damage(ckpts / "step-00000010.pt", "bit-flip-in-tensor-data", tmp_path / "canary")
    proc = run_torchrun([*KEEP_ALL, *sets(run__dir=str(tmp_path))], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0, describe(proc)
    # rank 0 found the problem; rank 1 got it through the broadcast: both print the same one line
    line = (
        f"ddp-train: error: {ckpts}: no usable checkpoint (1 corrupt; newest: {ckpts / 'step-00000010.pt'}: "
        "corrupt checkpoint (CRC mismatch in "
    )
    errors = [ln for ln in proc.stderr.splitlines() if "ddp-train: error" in ln]
    assert len(errors) == 2 and all(ln.startswith(line) for ln in errors), describe(proc)
    assert "exitcode  : 2" in proc.stderr
    assert os.listdir(ckpts) == ["step-00000010.pt"]


def test_checkpoint_of_another_model_is_refused_naming_the_file(
    good: tuple[Path, str], tmp_path: Path
) -> None:
    ckpts = copy_up_to(good[0], tmp_path / "default" / "checkpoints", 10)
    proc = train([*KEEP_ALL, *sets(run__dir=str(tmp_path), model__mlp__hidden_dim=64)], tmp_path)
    assert proc.returncode == 2, describe(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"ddp-train: error: {ckpts / 'step-00000010.pt'}: does not fit this model/optimizer: "
    ), proc.stderr
