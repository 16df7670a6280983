"""Issue 14's throughput items, checked on CPU: no per-step host sync, honest windows, the MFU peak by
precision, no fp32 logits copy under autocast, scheduled GC, loader worker errors, resume broadcast."""

from __future__ import annotations

import gc
import os
import struct
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_train_loop import metrics, train

from ddp_train import checkpoint, distributed, exitcodes, meter, trainer
from ddp_train.config import ConfigError, load_config
from ddp_train.data import ShardedBatches, TokenFile
from ddp_train.meter import StepMeter
from ddp_train.metrics import JsonlWriter, ProgressBar, peak_flops
from ddp_train.models import build_model
from tests.testbed import free_port


class FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA: records what the meter asks of it."""

    made: list[FakeEvent] = []

    def __init__(self) -> None:
        self.recorded = self.synced = 0
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        self.synced += 1


class FakeWork:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """The meter's CUDA path on CPU: fake events, plain (unpinned) host buffers; logs every tolist()."""
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(meter, "_pinned_like", lambda t: torch.empty(t.shape, dtype=t.dtype))
    copies, reads = [], []
    real_copy, real_tolist = torch.Tensor.copy_, torch.Tensor.tolist

    def copy_(self, src, non_blocking=False):
        copies.append((self, src, non_blocking))
        return real_copy(self, src, non_blocking=non_blocking)

    def tolist(self):
        reads.append(self)
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return copies, reads


def quiet_meter(cuda: bool) -> StepMeter:
    return StepMeter(cuda, ProgressBar(10, False), JsonlWriter(None))


# --- 1: lagged stats without a per-step host sync ----------------------------------------------------


def test_cuda_stats_are_copied_non_blocking_and_read_one_step_later_on_an_event(fake_cuda):
    copies, reads = fake_cuda
    m = quiet_meter(cuda=True)
    device_stats = [torch.tensor([2.0, 1.0, 0.0, 0.0]), torch.tensor([4.0, 3.0, 1.0, 0.0])]
    works = [FakeWork(), FakeWork()]
    m.push(1, 0, 0.1, 64, device_stats[0], works[0])
    # enqueueing a step waits for nothing on the host: the all-reduce is joined to the stream (NCCL's
    # work.wait), the copy is non_blocking, an event is recorded, nothing is read
    assert works[0].waits == 1 and reads == []
    assert [(src is device_stats[0], nb) for _, src, nb in copies] == [(True, True)]
    assert FakeEvent.made[0].recorded == 1 and FakeEvent.made[0].synced == 0
    p, values = m.pop()
    assert (p.step, values) == (1, [2.0, 1.0, 0.0, 0.0])
    assert FakeEvent.made[0].synced == 1  # the host waited on step 1's event only
    assert all(r is not device_stats[0] for r in reads)  # read from the host copy, never the device tensor
    m.push(2, 0, 0.1, 64, device_stats[1], works[1])
    assert FakeEvent.made[1].synced == 0 and m.pop()[1] == [4.0, 3.0, 1.0, 0.0]
    assert m.pop() is None


def test_the_training_loop_reads_no_device_stats_tensor(tmp_path, fake_cuda, monkeypatch, capsys):
    """The whole loop through the CUDA path of the meter: one event per step, each waited on once, the
    numbers read only from host copies; and the run ends exactly like one on the CPU path."""
    _, reads = fake_cuda
    base = (
        "train.max_steps=6",
        "log.interval_steps=2",
        "checkpoint.interval_steps=3",
        "eval.interval_steps=0",
    )
    code, _ = train(tmp_path / "cpu", *base)
    assert code == 0
    plain = capsys.readouterr().out
    monkeypatch.setattr(trainer, "StepMeter", lambda cuda, bar, writer: StepMeter(True, bar, writer))
    FakeEvent.made, reads[:] = [], []
    code, _ = train(tmp_path / "fake-cuda", *base)
    assert code == 0
    assert len(FakeEvent.made) == 6 and all(e.recorded == e.synced == 1 for e in FakeEvent.made)
    assert capsys.readouterr().out.splitlines()[-1] == plain.splitlines()[-1]  # same final loss + params


# --- 3: every step stamped when enqueued -------------------------------------------------------------


def test_last_window_is_as_long_as_the_others_with_interval_1(tmp_path, monkeypatch):
    step = trainer.Trainer.train_step

    def slow_step(self):
        time.sleep(0.05)  # a step that takes a known time: every window should see it
        return step(self)

    monkeypatch.setattr(trainer.Trainer, "train_step", slow_step)
    code, _ = train(
        tmp_path,
        "train.max_steps=8",
        "log.interval_steps=1",
        "checkpoint.interval_steps=4",
        "eval.interval_steps=0",
    )
    assert code == 0
    times = [r["step_time_s"] for r in metrics(tmp_path)]
    assert len(times) == 8
    # the old loop closed the last window right after opening it (and the one after a save short):
    # its tokens/s came out many times too high
    assert min(times) >= 0.045, times


# --- 4: MFU peak by precision ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 80GB HBM3", "fp16", 989.5),
        ("NVIDIA H100 80GB HBM3", "fp32", 494.7),  # fp32 runs as TF32: the trainer enables it on CUDA
        ("NVIDIA H200", "fp32", 494.7),
        ("NVIDIA H100 PCIe", "fp32", 378.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 156.0),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
    ],
)
def test_mfu_peak_follows_the_precision(name, precision, tflops):
    assert peak_flops(name, None, precision) == pytest.approx(tflops * 1e12)
    assert peak_flops(name, 100.0, precision) == pytest.approx(100e12)  # the config override wins


# --- 5: no fp32 logits copy under autocast -----------------------------------------------------------


def test_gpt_loss_under_autocast_makes_no_fp32_copy_of_the_logits(monkeypatch):
    cfg = load_config(None, ["model.name=gpt"])
    model = build_model(cfg)
    x = torch.randint(64, (4, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = torch.nn.functional.cross_entropy(model(x).float().view(-1, 64), x.reshape(-1))
    big = []
    real_float = torch.Tensor.float

    def spy_float(self, *a, **k):
        if self.numel() >= 4 * 32 * 64:
            big.append(self.shape)
        return real_float(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "float", spy_float)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, x)
    assert big == []
    assert loss.dtype == torch.float32 and torch.allclose(loss, reference)  # autocast ran it in fp32
    assert model(x, x).dtype == torch.float32  # without autocast the fp32 model's loss is fp32 too


# --- 6: scheduled garbage collection -----------------------------------------------------------------


def test_gc_is_frozen_disabled_and_run_every_n_steps(tmp_path, monkeypatch):
    calls: list[tuple[str, int | None]] = []
    enabled_during_steps: list[bool] = []
    real_collect, step = gc.collect, trainer.Trainer.train_step

    def collect(generation=2):
        calls.append(("collect", generation))
        return real_collect(generation)

    def train_step(self):
        enabled_during_steps.append(gc.isenabled())
        return step(self)

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append(("freeze", None)))
    monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
    code, _ = train(tmp_path, "train.max_steps=7", "train.gc_interval_steps=3", "eval.interval_steps=0")
    assert code == 0
    assert calls[:2] == [("collect", 2), ("freeze", None)]  # after setup: everything alive frozen
    assert calls.count(("collect", 1)) == 2  # steps 3 and 6, on every rank at the same step
    assert enabled_during_steps == [False] * 7
    assert gc.isenabled()  # given back afterwards


def test_gc_interval_0_leaves_the_collector_alone(tmp_path, monkeypatch):
    seen, step = [], trainer.Trainer.train_step
    monkeypatch.setattr(
        trainer.Trainer, "train_step", lambda self: (seen.append(gc.isenabled()), step(self))[1]
    )
    code, _ = train(tmp_path, "train.max_steps=2", "train.gc_interval_steps=0", "eval.interval_steps=0")
    assert code == 0 and seen == [True, True]


# --- 8: a bad token file read in a DataLoader worker -------------------------------------------------


def bad_token_file(tmp_path):
    ids = [i % 60 for i in range(2000)]
    ids[700] = 9999  # beyond the model's vocab: found only when that block is read
    path = tmp_path / "bad.bin"
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))
    return path


def test_worker_config_error_reaches_the_trainer_as_a_config_error(tmp_path):
    ds = TokenFile(str(bad_token_file(tmp_path)), block_size=50, vocab_size=64)
    batches = ShardedBatches(ds, 4, 0, 1, seed=0, num_workers=1)
    with pytest.raises(
        ConfigError, match=r"bad\.bin: model\.gpt\.vocab_size: token id 9999 >= vocab_size 64"
    ):
        for _ in range(batches.batches_per_epoch):
            batches.next()
    batches.close()


def test_bad_token_file_in_a_worker_is_one_line_and_exit_2(tmp_path, capsys):
    code, _ = train(
        tmp_path,
        "model.name=gpt",
        "data.name=tokens",
        f"data.tokens.path={bad_token_file(tmp_path)}",
        "model.gpt.block_size=50",
        "data.num_workers=1",
        "train.batch_size=4",
        "train.max_steps=20",
        "eval.interval_steps=0",
        "checkpoint.interval_steps=0",
    )
    err = capsys.readouterr().err
    assert code == exitcodes.BAD_INPUT
    lines = [line for line in err.splitlines() if line.startswith("ddp-train: error:")]
    assert len(lines) == 1 and "bad.bin: model.gpt.vocab_size: token id 9999" in lines[0], err
    assert "Traceback" not in err


# --- 7 + refactor: resume broadcast into the ranks' own tensors; object collectives from torch -------


def _two_ranks(rank: int, port: int, out: dict, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = torch.nn.Linear(3, 2)
        state = None
        if rank == 0:
            state = {
                "model": {"weight": torch.full((2, 3), 7.0), "bias": torch.ones(2)},
                "rng": [torch.arange(4)],
            }
        mine = model.state_dict()
        got = distributed.broadcast_state(state, torch.device("cpu"), 0, into={"model": mine})
        gathered = distributed.all_gather_objects({"rank": rank})
        header = distributed.broadcast_object({"path": "x.pt"} if rank == 0 else None, 0)
        if rank == 1:
            out["into_params"] = got["model"]["weight"].data_ptr() == model.weight.data_ptr()
            out["weight"] = model.weight.detach().tolist()
            out["rng"] = got["rng"][0].tolist()
            out["gathered"], out["header"] = gathered, header
        # restore from the node that has the checkpoint (here rank 1, each rank its own directory)
        directory = Path(tmp) / f"node{rank}"
        if rank == 1:
            w = {"weight": torch.full((2, 3), 3.0), "bias": torch.zeros(2)}
            parts = {"optimizer": {}, "scheduler": {}, "data": {}, "rng": [], "config": {}}
            checkpoint.save({"format": checkpoint.FORMAT, "step": 5, "model": w, **parts}, directory, 5)
        fresh = torch.nn.Linear(3, 2)
        ckpt = checkpoint.Checkpointer(directory, rank=rank, local_rank=0)
        state, path, src, _host = ckpt.restore(torch.device("cpu"), into={"model": fresh.state_dict()})
        if rank == 0:
            out["restored"] = (Path(path).name, src, fresh.weight.detach().tolist(), state["step"])
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_resume_broadcast_lands_in_the_model_tensors_and_objects_travel(tmp_path):
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_two_ranks, args=(port, out, str(tmp_path)), nprocs=2, join=True)
        out = dict(out)
    assert out["into_params"] and out["weight"] == [[7.0] * 3] * 2  # no separate copy on rank 1
    assert out["rng"] == [0, 1, 2, 3]
    assert out["gathered"] == [{"rank": 0}, {"rank": 1}] and out["header"] == {"path": "x.pt"}
    # rank 0 had no checkpoint: rank 1 loaded its own and broadcast it into rank 0's model tensors
    assert out["restored"] == ("step-00000005.pt", 1, [[3.0] * 3] * 2, 5)


# --- 2: one long-lived loader with workers, resumable bit-exactly ------------------------------------


def test_persistent_workers_resume_bit_exact_and_the_order_stays_a_tensor(tmp_path, monkeypatch):
    ids = [i % 500 for i in range(4001)]
    path = tmp_path / "t.bin"
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))
    ds = TokenFile(str(path), block_size=50, vocab_size=500)
    inline = ShardedBatches(ds, 4, 1, 2, seed=3)
    straight = [inline.next()[1] for _ in range(14)]  # 10 batches per epoch: crosses into epoch 1
    workers = ShardedBatches(ds, 4, 1, 2, seed=3, num_workers=2, prefetch_factor=3)
    for _ in range(5):
        workers.next()  # the workers are now batches ahead of what was consumed
    state = workers.state_dict()
    workers.load_state_dict({"epoch": 0, "position": 2})  # restart the same (persistent) workers
    assert all(torch.equal(workers.next()[1], b) for b in straight[2:14])
    resumed = ShardedBatches(ds, 4, 1, 2, seed=3, num_workers=1)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next()[1], b) for b in straight[5:14])
    for b in (workers, resumed):
        b.close()

    def no_lists(*_a, **_k):
        raise AssertionError("the epoch order was turned into a Python list")

    monkeypatch.setattr(ShardedBatches, "epoch_indices", no_lists)  # only the debug index log uses it
    order = inline.sampler.epoch_order(0)
    assert isinstance(order, torch.Tensor) and order.dtype == torch.int64 and len(order) == 40
    again = ShardedBatches(ds, 4, 1, 2, seed=3)
    assert torch.equal(again.next()[1], straight[0])
