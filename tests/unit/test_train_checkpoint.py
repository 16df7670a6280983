"""Checkpoint files: atomic publication, keep_latest_k, never a temp file as latest, corrupt-file fallback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddp_train import checkpoint
from ddp_train.checkpoint import CheckpointError, CorruptCheckpoint


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "format": checkpoint.FORMAT,
        "step": step,
        "model": {"w": torch.randn(256, 64, generator=g)},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step},
        "data": {"epoch": 0, "position": step},
        "rng": [{"torch": torch.get_rng_state(), "cuda": None, "python": (3, tuple(range(625)), None)}],
        "config": {"seed": 1},
    }


def test_save_publishes_a_complete_file_and_load_reads_it_back(tmp_path):
    path = checkpoint.save(state(10), tmp_path / "ck", 10)
    assert path == tmp_path / "ck" / "step-00000010.pt"
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-00000010.pt"]
    loaded = checkpoint.load(path)
    assert loaded["step"] == 10 and torch.equal(loaded["model"]["w"], state(10)["model"]["w"])
    assert loaded["rng"][0]["python"] == (3, tuple(range(625)), None)


def test_write_fsync_rename_fsync_dir_order(tmp_path, monkeypatch):
    calls: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.save(state(3), tmp_path, 3)
    assert calls == [
        ("fsync", "step-00000003.pt.tmp"),  # data on disk before it gets its name
        ("replace", "step-00000003.pt.tmp", "step-00000003.pt"),
        ("fsync", tmp_path.name),  # and the rename itself made durable
    ]


def test_temp_files_are_never_listed_and_are_cleaned(tmp_path):
    checkpoint.save(state(10), tmp_path, 10)
    (tmp_path / "step-00000020.pt.tmp").write_bytes(b"half a checkpoint")  # a writer killed mid-save
    (tmp_path / "step-00000030.pt.corrupt").write_bytes(b"moved aside")
    (tmp_path / "notes.txt").write_text("x")
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [10]
    loaded, path = checkpoint.load_latest(tmp_path)
    assert path.name == "step-00000010.pt"
    assert [p.name for p in checkpoint.remove_stale_temps(tmp_path)] == ["step-00000020.pt.tmp"]
    assert not (tmp_path / "step-00000020.pt.tmp").exists()


def test_a_failed_write_leaves_no_temp_and_keeps_the_previous(tmp_path):
    checkpoint.save(state(1), tmp_path, 1)
    bad = state(2)
    bad["model"]["w"] = lambda: None  # not picklable: torch.save fails half-way
    with pytest.raises(Exception):  # noqa: B017
        checkpoint.save(bad, tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001.pt"]


def test_keep_latest_k(tmp_path):
    for step in (5, 10, 15, 20, 25):
        checkpoint.save(state(step), tmp_path, step)
    deleted = checkpoint.prune(tmp_path, 2)
    assert [p.name for p in deleted] == ["step-00000005.pt", "step-00000010.pt", "step-00000015.pt"]
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [20, 25]
    assert checkpoint.prune(tmp_path, 0) == []  # 0 keeps everything


def test_steps_sort_numerically_past_eight_digits(tmp_path):
    checkpoint.save(state(99_999_999), tmp_path, 99_999_999)
    checkpoint.save(state(100_000_000), tmp_path, 100_000_000)
    assert checkpoint.load_latest(tmp_path)[0]["step"] == 100_000_000


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: torch.load alone would not notice
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte, lambda p: p.write_bytes(b"")])
def test_corrupt_newest_falls_back_to_the_previous_and_is_moved_aside(tmp_path, damage, caplog):
    for step in (10, 20):
        checkpoint.save(state(step), tmp_path, step)
    damage(tmp_path / "step-00000020.pt")
    with pytest.raises(CorruptCheckpoint, match="step-00000020.pt"):
        checkpoint.load(tmp_path / "step-00000020.pt")
    loaded, path = checkpoint.load_latest(tmp_path)
    assert path.name == "step-00000010.pt" and loaded["step"] == 10
    assert (tmp_path / "step-00000020.pt.corrupt").exists()
    assert "step-00000020.pt" in caplog.text and "falling back to step-00000010.pt" in caplog.text
    checkpoint.save(state(15), tmp_path, 15)  # the corrupt file no longer counts for keep_latest_k
    checkpoint.prune(tmp_path, 1)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [15]


def test_only_corrupt_checkpoints_is_a_clear_error_and_nothing_is_moved(tmp_path):
    checkpoint.save(state(10), tmp_path, 10)
    _truncate(tmp_path / "step-00000010.pt")
    with pytest.raises(CheckpointError) as err:
        checkpoint.load_latest(tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message and "step-00000010.pt" in message
    assert (tmp_path / "step-00000010.pt").exists()  # a restart must not silently start from scratch


def test_foreign_files_are_refused(tmp_path):
    torch.save({"model": {}}, tmp_path / "step-00000001.pt")  # a torch file, but not ours
    with pytest.raises(CorruptCheckpoint, match="not a ddp-train checkpoint"):
        checkpoint.load(tmp_path / "step-00000001.pt")
    torch.save({**state(2), "evil": torch.nn.Linear(1, 1)}, tmp_path / "step-00000002.pt")
    with pytest.raises(CorruptCheckpoint, match="cannot load"):  # weights_only: no arbitrary objects
        checkpoint.load(tmp_path / "step-00000002.pt")


def test_no_directory_means_no_checkpoint(tmp_path):
    assert checkpoint.load_latest(tmp_path / "absent") is None
    assert checkpoint.list_checkpoints(tmp_path / "absent") == []
