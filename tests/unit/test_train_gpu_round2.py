"""Issue 31 on CPU: a cheap best.pt, wall-clock throughput, eval timed after the step, flight-recorder
dump directories on every rank, DDP's gradient bucket views, forkserver workers, read-only token maps,
no DDP at world 1."""

from __future__ import annotations

import os
import re
import struct
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from test_train_loop import metrics, train
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_train import checkpoint, data, distributed, exitcodes, meter, trainer
from ddp_train.config import ConfigError, load_config
from ddp_train.data import ShardedBatches, TokenFile
from ddp_train.evaluate import Evaluator
from ddp_train.meter import StepMeter
from ddp_train.models import build_model
from tests.testbed import free_port

CONFIGS = Path(trainer.__file__).parent / "configs"

# --- 1: best.pt is the weights only; GPU configs evaluate rarely; wall-clock tokens/s -----------------


@pytest.mark.slow
def test_best_pt_holds_the_weights_only_and_loads_into_the_model(tmp_path):
    """A best of a step without a checkpoint: best.pt is written, the weights alone. A learning rate too
    small to change the val loss keeps every val loss equal, so the best stays at step 2, which saves no
    checkpoint (#46: at a checkpoint step best.pt is a hard link to it instead: test_async_save.py,
    test_train_eval.py)."""
    code, cfg = train(
        tmp_path,
        "model.name=gpt",
        "train.max_steps=4",
        "train.lr=1e-12",  # moves no weight enough to change the val loss
        "train.min_lr=1e-13",
        "eval.interval_steps=2",
        "checkpoint.interval_steps=3",
    )
    assert code == 0
    best = torch.load(cfg.run_dir / "best.pt", weights_only=True)
    full = checkpoint.load(cfg.run_dir / "checkpoints" / "step-00000004.pt")
    # the old best.pt was a second full checkpoint: optimizer (2 AdamW moments per weight), data, RNG
    assert best["format"] == checkpoint.BEST_FORMAT and best["step"] == best["best"]["step"] == 2
    assert not {"optimizer", "scheduler", "data", "rng"} & set(best)
    assert (cfg.run_dir / "best.pt").stat().st_size < 0.5 * (
        cfg.run_dir / "checkpoints" / "step-00000004.pt"
    ).stat().st_size
    model = build_model(load_config(None, ["model.name=gpt"]))
    model.load_state_dict(best["model"])  # usable as is
    assert best["model"].keys() == full["model"].keys()


def test_gpu_configs_evaluate_every_hundreds_of_steps():
    gpu = [p for p in CONFIGS.glob("*.yaml") if load_config(str(p), []).train.precision != "fp32"]
    assert gpu, "no GPU config found"
    for path in gpu:
        cfg = load_config(str(path), [])
        assert cfg.eval.interval_steps >= 100, path.name


def test_wall_clock_tokens_per_s_keeps_the_time_eval_takes(tmp_path, monkeypatch):
    real = Evaluator.evaluate
    took: list[float] = []  # each eval's own wall time (0.3 s and more on a loaded machine)

    def slow_evaluate(self, *a, **k):
        t0 = time.perf_counter()
        time.sleep(0.3)
        try:
            return real(self, *a, **k)
        finally:
            took.append(time.perf_counter() - t0)

    monkeypatch.setattr(Evaluator, "evaluate", slow_evaluate)
    code, _ = train(tmp_path, "train.max_steps=6", "eval.interval_steps=2", "log.interval_steps=2")
    assert code == 0
    recs = metrics(tmp_path)
    assert [r["step"] for r in recs] == [2, 4, 6]
    for r, eval_s in zip(recs[1:], took):  # windows 3-4 and 5-6 hold the evals of steps 2 and 4
        tokens = r["tokens_per_s"] * r["step_time_s"] * 2
        hidden = tokens / r["wall_tokens_per_s"] - tokens / r["tokens_per_s"]
        # the eval paused out of tokens_per_s is in the wall figure, once (with best.pt's save beside
        # it); CI (stop 38) saw 1.47 s under load against a fixed bound of 1.0
        assert 0.95 * eval_s <= hidden < 2 * eval_s + 0.5, (r, took)


def test_run_throughput_line_names_both_figures(tmp_path, capsys):
    code, _ = train(tmp_path, "train.max_steps=4", "eval.interval_steps=2", "debug.step_delay_s=0.1")
    captured = capsys.readouterr()
    assert code == 0
    lines = [ln for ln in (captured.out + captured.err).splitlines() if " INFO throughput: " in ln]
    assert len(lines) == 1, captured.err[-2000:]
    m = re.search(
        r"throughput: 4 steps in \S+s wall: (\d+) tok/s wall-clock, (\d+) tok/s compute-only", lines[0]
    )
    assert m, lines[0]
    assert int(m.group(1)) < int(m.group(2))  # 4 x 0.1 s of debug delay is paused out of compute only


def test_run_throughput_counts_the_evaluation_after_the_last_step(tmp_path, monkeypatch, capsys):
    real = Evaluator.evaluate
    monkeypatch.setattr(
        Evaluator, "evaluate", lambda self, *a, **k: (time.sleep(0.3), real(self, *a, **k))[1]
    )
    code, _ = train(tmp_path, "train.max_steps=2", "eval.interval_steps=2")
    err = capsys.readouterr().err
    assert code == 0
    m = re.search(r"throughput: 2 steps in \S+s wall: .* \((\S+)s of eval, checkpoints and delays", err)
    assert m and float(m.group(1)) >= 0.3, err[-1500:]


# --- 2: validation starts its clock after the device finished the step ---------------------------------


class FakeDevice:
    """A device that runs behind the host: each recorded step leaves `step_s` of work queued; waiting on
    an event, or any host read of device data (what evaluate's .tolist() does), advances a fake clock
    by the work still queued."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.queued, self.offset = step_s, 0.0, 0.0

    def finish(self) -> None:
        self.offset, self.queued = self.offset + self.queued, 0.0


@pytest.fixture
def fake_device(monkeypatch):
    dev = FakeDevice(step_s=1.0)
    real_clock = time.perf_counter

    class Event:
        def record(self) -> None:
            dev.queued += dev.step_s

        def synchronize(self) -> None:
            dev.finish()

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + dev.offset)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(meter, "_pinned_like", lambda t: torch.empty(t.shape, dtype=t.dtype))
    monkeypatch.setattr(trainer, "StepMeter", lambda cuda, bar, writer: StepMeter(True, bar, writer))
    return dev


def test_eval_is_timed_after_the_device_finished_the_step(tmp_path, monkeypatch, fake_device):
    def evaluate(self, *a, **k):
        fake_device.finish()  # the val loss read on the host waits for every queued kernel
        fake_device.offset += 0.25  # eval's own time
        return 1.0

    pauses: list[float] = []
    real_pause = StepMeter.pause
    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    monkeypatch.setattr(StepMeter, "pause", lambda self, s: (pauses.append(s), real_pause(self, s))[1])
    monkeypatch.setattr(trainer.Trainer, "save", lambda self: None)  # only eval pauses the meter
    code, _ = train(tmp_path, "train.max_steps=4", "eval.interval_steps=2", "checkpoint.interval_steps=0")
    assert code == 0
    # the old loop started eval's clock with step 2's 1.0 s still on the device: 1.25 s paused each time
    assert len(pauses) == 2 and all(0.25 <= s < 0.5 for s in pauses), pauses


# --- 3: every rank creates its flight-recorder dump directory -----------------------------------------


def test_flight_recorder_dump_dir_is_made_on_a_rank_other_than_0(tmp_path, monkeypatch):
    seen = {}

    def init(cfg, env, device, *_):
        prefix = Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"])
        seen["rank"], seen["dir"] = env.rank, prefix.parent.is_dir()
        raise ConfigError("config", "dist", "stop here")  # no process group needed for this test

    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed, "init", init)
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}"])
    assert trainer.run(cfg) == exitcodes.BAD_INPUT
    # the old code left the directory to rank 0: torch's writer then failed to open rank 1's dump
    assert seen == {"rank": 1, "dir": True}
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == f"{cfg.run_dir}/nccl_trace_rank_"


def test_a_user_set_dump_path_gets_its_directory_too(tmp_path):
    environ = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "a" / "b" / "trace_")}
    distributed.make_dump_dirs(environ)
    assert (tmp_path / "a" / "b").is_dir()


# --- 4 + 9: DDP's gradients stay bucket views; no DDP at world size 1 ---------------------------------


def _ddp_ranks(rank: int, port: int, out: dict, run_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    env = distributed.read_env()
    cfg = load_config(None, [f"run.dir={run_dir}", "eval.interval_steps=0", "checkpoint.resume=never"])
    distributed.init(cfg.dist, env, torch.device("cpu"))
    try:
        t = trainer.Trainer(cfg, env, torch.device("cpu"))
        ptrs = []
        for _ in range(4):
            t.train_step()
            grads = [p.grad for p in t.model.parameters()]
            ptrs.append([g.data_ptr() if g is not None else None for g in grads])
        t.batches.close()
        if rank == 0:
            out["ddp"] = isinstance(t.train_model, DDP)
            out["ptrs"] = ptrs
    finally:
        distributed.shutdown()


@pytest.mark.slow
def test_ddp_gradients_stay_views_of_the_buckets(tmp_path):
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ddp_ranks, args=(port, out, str(tmp_path / "runs")), nprocs=2, join=True)
        out = dict(out)
    assert out["ddp"]
    # zero_grad(set_to_none=True) dropped them after every step: a new allocation and a copy into the
    # bucket in every backward. In place, they are the same memory (DDP's buckets) step after step,
    # from the second step on (DDP rebuilds its buckets once, in the order the first backward used).
    assert None not in out["ptrs"][0], out["ptrs"][0]
    assert out["ptrs"][1] == out["ptrs"][2] == out["ptrs"][3]


def test_world_size_1_trains_without_ddp(tmp_path, monkeypatch, capsys):
    port = free_port()
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    wrapped = []

    class SpyDDP(DDP):
        def __init__(self, *a, **k):
            wrapped.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(distributed, "DDP", SpyDDP)
    code, _ = train(tmp_path, "train.max_steps=3", "eval.interval_steps=0")
    assert code == 0, capsys.readouterr().err
    assert "world=1" in capsys.readouterr().out
    assert wrapped == []  # a process group of one, but nothing to average: no DDP wrapper


# --- 8: token files mapped read-only ------------------------------------------------------------------


def _maps_of(path: Path) -> list[str]:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return [line.split()[1] for line in f if line.rstrip().endswith(str(path))]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_token_file_is_mapped_read_only(tmp_path, recwarn):
    path = tmp_path / "train.bin"
    path.write_bytes(struct.pack("<4001H", *[i % 50 for i in range(4001)]))
    ds = TokenFile(str(path), block_size=40, vocab_size=64)
    x, y = ds[3]
    assert x.tolist() == [(120 + i) % 50 for i in range(40)] and torch.equal(x[1:], y[:-1])
    perms = _maps_of(path)
    # ACCESS_COPY was 'rw-p': private writable, charged to every rank and worker under strict overcommit
    assert perms and all("w" not in p for p in perms), perms
    assert not [w for w in recwarn if "not writable" in str(w.message)]


# --- 6: DataLoader workers are not fork()ed from a process that runs NCCL ------------------------------


@pytest.mark.slow
def test_workers_start_from_a_forkserver_on_cuda_and_read_the_same_batches(tmp_path):
    assert data.worker_start_method(torch.device("cuda", 0)) == "forkserver"
    assert data.worker_start_method(torch.device("cpu")) is None  # no NCCL, no CUDA: fork is safe and cheap
    path = tmp_path / "train.bin"
    path.write_bytes(struct.pack("<2001H", *[i % 50 for i in range(2001)]))
    ds = TokenFile(str(path), block_size=40, vocab_size=64)
    ds[0]  # mapped in this process: the map must not travel to the workers (an mmap cannot be pickled)
    inline = ShardedBatches(ds, 4, 0, 1, seed=3)
    served = ShardedBatches(ds, 4, 0, 1, seed=3, num_workers=2, worker_start="forkserver")
    assert served.loader.multiprocessing_context.get_start_method() == "forkserver"
    try:
        assert all(torch.equal(served.next()[0], inline.next()[0]) for _ in range(15))  # crosses an epoch
    finally:
        served.close()


def test_a_plugin_dataset_that_cannot_be_pickled_keeps_fork_workers(caplog):
    # review #1: forkserver pickles the dataset into each worker; a plug-in's local class cannot be
    class Local(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor([i])

    cuda = torch.device("cuda", 0)
    assert data.worker_start_method(cuda, Local()) is None
    assert "data.plugin" in caplog.text and "fork" in caplog.text
    rows = data.TokenSequences(torch.zeros(4, 3, dtype=torch.long))
    assert data.worker_start_method(cuda, rows) == "forkserver"
    assert data.worker_start_method(cuda, torch.utils.data.TensorDataset(torch.zeros(4))) == "forkserver"
    assert data.worker_start_method(torch.device("cpu"), Local()) is None


# --- 7: compiled, the first step and the first validation get dist.compile_timeout_s ------------------


def test_compile_timeout_covers_the_first_step_and_the_first_validation(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    port = free_port()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(torch, "compile", lambda model, **_: model)  # the timeouts, not inductor, on trial
    seen: list[tuple[str, int, float]] = []

    def timeout() -> float:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    step, evaluate = trainer.Trainer.train_step, Evaluator.evaluate

    def spy_step(self):
        seen.append(("train", self.step + 1, timeout()))
        return step(self)

    def spy_eval(self, *a, **k):
        seen.append(("eval", -1, timeout()))
        return evaluate(self, *a, **k)

    monkeypatch.setattr(trainer.Trainer, "train_step", spy_step)
    monkeypatch.setattr(Evaluator, "evaluate", spy_eval)
    sets = ("train.compile=true", "train.max_steps=5", "eval.interval_steps=3", "dist.compile_timeout_s=1000")
    code, _ = train(tmp_path, *sets, "dist.collective_timeout_s=200")
    assert code == 0, capsys.readouterr().err
    # step 1's all-reduce is read back while step 2 runs: from step 3 on the normal timeout, raised again
    # for the first (compiling) validation only
    assert seen == [
        ("train", 1, 1000),
        ("train", 2, 1000),
        ("train", 3, 200),
        ("eval", -1, 1000),
        ("train", 4, 200),
        ("train", 5, 200),
        ("eval", -1, 200),
    ]


def test_compile_threads_are_the_node_cores_shared_by_its_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    four = distributed.DistEnv(local_world_size=4)
    assert distributed.compile_threads_env(four, {}) == {"TORCHINDUCTOR_COMPILE_THREADS": "4"}
    assert distributed.compile_threads_env(distributed.DistEnv(local_world_size=32), {}) == {
        "TORCHINDUCTOR_COMPILE_THREADS": "1"
    }
    user = {"TORCHINDUCTOR_COMPILE_THREADS": "2"}
    assert distributed.compile_threads_env(four, user) == {}  # the user's wins


# --- 1: the job summary reads the run's throughput line ------------------------------------------------


def test_the_launchers_job_summary_parses_the_trainers_throughput_line(tmp_path, capsys):
    from ddp_train.launch.run.trainerlog import parse_throughput

    code, _ = train(tmp_path, "train.max_steps=4", "eval.interval_steps=2", "debug.step_delay_s=0.1")
    captured = capsys.readouterr()
    assert code == 0
    lines = (captured.out + captured.err).splitlines()  # the lines ddp-launch reads from a node
    speed = parse_throughput(lines)
    assert speed is not None and speed["steps"] == 4, lines[-3:]
    assert 0 < speed["wall_tokens_per_s"] < speed["tokens_per_s"]
