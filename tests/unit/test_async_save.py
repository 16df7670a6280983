"""Checkpoints written off the training path (issue #46, ddp_train/asyncsave.py): the step waits only for a
copy to host memory, a thread writes; at most one save in flight; a failure is raised, never silent; a
stop during a background save loses nothing; best.pt is a hard link to its step's checkpoint."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time

import pytest
import torch
from test_train_loop import train

from ddp_train import checkpoint, exitcodes, storage
from ddp_train.asyncsave import HostSnapshot
from ddp_train.checkpoint import Checkpointer
from ddp_train.storage import StorageError


def test_the_host_copy_keeps_tied_tensors_one_and_reuses_its_buffers():
    shared = torch.arange(6.0)
    state = {"model": {"wte": shared, "head": shared, "b": torch.zeros(2)}, "step": 3, "rng": [(1, (2,))]}
    snap = HostSnapshot()
    copy = snap.copy(state)
    assert copy["model"]["wte"] is copy["model"]["head"] and copy["model"]["wte"] is not shared
    assert torch.equal(copy["model"]["wte"], shared) and copy["step"] == 3 and copy["rng"] == [(1, (2,))]
    shared.add_(1)  # training goes on: the copy does not move
    assert copy["model"]["wte"][0] == 0
    buffers = [b.data_ptr() for b in snap.buffers]
    again = snap.copy(state)
    assert [b.data_ptr() for b in snap.buffers] == buffers and again["model"]["wte"][0] == 1  # reused
    assert len(snap.buffers) == 2  # one per distinct tensor


def test_the_host_copy_of_a_gpt_state_dict_keeps_its_tied_weights_one_and_its_metadata():
    from ddp_train.config import load_config
    from ddp_train.models import build_model

    model = build_model(load_config(None, ["model.name=gpt"]))
    sd = model.state_dict()
    tied = [k for k in sd if sd[k].data_ptr() == sd["wte.weight"].data_ptr()]
    assert len(tied) == 2 and sd[tied[0]] is not sd[tied[1]]  # two objects over one storage
    copy = HostSnapshot().copy(sd)
    assert copy[tied[0]] is copy[tied[1]] and copy._metadata == sd._metadata


def _ckpt(tmp_path, **kw) -> Checkpointer:
    return Checkpointer(tmp_path / "ck", rank=0, local_rank=0, best_path=tmp_path / "best.pt", **kw)


def _state(step: int) -> dict:
    return {"format": checkpoint.FORMAT, "step": step, "model": {"w": torch.full((4,), float(step))},
            "optimizer": {}, "scheduler": {}, "data": {}, "rng": [], "config": {}}  # fmt: skip


def test_a_save_returns_before_its_write_and_the_next_one_waits_for_it(tmp_path):
    ck = _ckpt(tmp_path, async_save=True, save_delay_s=1.0)
    t0 = time.monotonic()
    ck.save(None, lambda _: _state(1), 1)
    assert time.monotonic() - t0 < 0.5 and not (tmp_path / "ck" / "step-00000001.pt").exists()
    ck.save(None, lambda _: _state(2), 2)  # waits for step 1's write first: one in flight
    assert time.monotonic() - t0 >= 1.0 and (tmp_path / "ck" / "step-00000001.pt").exists()
    ck.finish()  # the run's end waits for the last one
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "ck")] == [1, 2]
    assert torch.equal(
        checkpoint.load(tmp_path / "ck" / "step-00000002.pt")["model"]["w"], torch.full((4,), 2.0)
    )


def test_a_failed_background_save_stops_the_run_at_the_next_wait(tmp_path, monkeypatch):
    ck = _ckpt(tmp_path, async_save=True)

    def full(state, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    ck.save(None, lambda _: _state(1), 1)  # returns: the write fails in the thread
    with pytest.raises(StorageError, match=r"saving checkpoint step 1 failed: No space left on device"):
        ck.finish()
    ck.save(None, lambda _: _state(2), 2)
    with pytest.raises(StorageError, match="saving checkpoint step 2 failed"):
        ck.save(None, lambda _: _state(3), 3)


def test_a_rank_that_fails_lets_its_save_in_flight_end_first(tmp_path, monkeypatch, caplog):
    """The loop's `finally` drains: the ranks of a multi-rank run end with os._exit, which would cut the
    writer off; a failure of that save is logged, not raised over the run's own error."""
    ck = _ckpt(tmp_path, async_save=True, save_delay_s=1.0)
    ck.save(None, lambda _: _state(1), 1)
    ck.drain()
    assert checkpoint.load(tmp_path / "ck" / "step-00000001.pt")["step"] == 1

    def full(state, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    ck.save(None, lambda _: _state(2), 2)
    ck.drain()
    assert "a background checkpoint save failed: " in caplog.text and "step 2 failed" in caplog.text


def test_best_pt_is_a_hard_link_to_its_steps_checkpoint_or_the_weights_alone(tmp_path, monkeypatch):
    best = {"val_loss": 1.5, "step": 4}
    ck = _ckpt(tmp_path)
    ck.save(None, lambda _: _state(4), 4, best=best)
    assert os.path.samefile(tmp_path / "best.pt", tmp_path / "ck" / "step-00000004.pt")

    def cross_device(target, final):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(storage, "link", cross_device)  # checkpoint.dir on another filesystem
    ck.save(None, lambda _: _state(6), 6, best={"val_loss": 1.2, "step": 6})
    alone = torch.load(tmp_path / "best.pt", weights_only=True)
    assert alone["format"] == checkpoint.BEST_FORMAT and alone["step"] == 6 and "optimizer" not in alone
    assert torch.equal(alone["model"]["w"], torch.full((4,), 6.0))


@pytest.mark.slow
def test_a_stop_during_a_background_save_loses_nothing(tmp_path):
    """SIGTERM while step 5's save is in its write (debug.save_delay_s holds it before the rename) and
    training has gone on past it: the stop waits for that write, then saves its own step; both load."""
    ckpts = tmp_path / "runs" / "default" / "checkpoints"
    tmp5, records = ckpts / "step-00000005.pt.tmp", tmp_path / "runs" / "default" / "metrics.jsonl"
    went_on: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if tmp5.exists() and records.exists():
                steps = [json.loads(line).get("step", 0) for line in records.read_text().splitlines()]
                if max(steps, default=0) >= 8 and tmp5.exists():
                    went_on.append(max(steps))
                    break
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code, cfg = train(
        tmp_path, "train.max_steps=400", "debug.step_delay_s=0.03", "checkpoint.interval_steps=5",
        "debug.save_delay_s=3", "log.interval_steps=1",
    )  # fmt: skip
    watcher.join(10)
    assert went_on, "training did not go on while step 5 was written"
    assert code == exitcodes.SIGTERM
    steps = [s for s, _ in checkpoint.list_checkpoints(ckpts)]
    assert 5 in steps and steps[-1] > went_on[0] and not list(ckpts.glob("*.tmp")), steps
    for step in (5, steps[-1]):
        assert checkpoint.load(ckpts / checkpoint.checkpoint_name(step))["step"] == step


def test_at_end_false_keeps_the_periodic_saves_and_writes_none_after_the_last_step(tmp_path):
    """checkpoint.at_end=false (bench/gpu.sh's throughput runs): no save of the last step; periodic ones
    stay."""
    code, _ = train(tmp_path, "train.max_steps=5", "checkpoint.interval_steps=2", "checkpoint.at_end=false")
    ckpts = tmp_path / "runs" / "default" / "checkpoints"
    assert code == 0
    assert [s for s, _ in checkpoint.list_checkpoints(ckpts)] == [2, 4]
