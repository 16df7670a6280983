"""The trainer under real torchrun (2 processes, 3 for one resume, gloo, CPU): learning, sharding, resume,
SIGTERM."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.trainrun import (
    STOP_LINE,
    describe,
    parse_finals,
    read_jsonl,
    run_torchrun,
    sets,
    torchrun_cmd,
    trainer_env,
)

# 20 steps of 2 micro-batches x 16 samples per rank: 16 steps per epoch, so the run crosses an epoch.
# decay_steps is pinned so a run stopped early (max_steps=10) follows the same LR schedule.
COMMON = sets(
    train__max_steps=20,
    train__decay_steps=20,
    train__batch_size=16,
    train__grad_accum_steps=2,
    checkpoint__interval_steps=10,
    log__interval_steps=1,
)
CHANCE_LOSS = math.log(8)  # 8 classes


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchrun")


@pytest.fixture(scope="module")
def straight(work: Path) -> tuple[subprocess.CompletedProcess, Path]:
    proc = run_torchrun([*COMMON, *sets(run__dir="straight", debug__dump_indices=True)], cwd=work)
    assert proc.returncode == 0, describe(proc)
    return proc, work / "straight" / "default"


@pytest.mark.slow
def test_loss_falls_and_ranks_end_identical(straight):
    proc, run_dir = straight
    finals = parse_finals(proc.stdout)
    assert sorted(finals.by_rank) == [0, 1], describe(proc)
    assert all(f["world"] == 2 and f["step"] == 20 for f in finals.by_rank.values())
    assert len(finals.shas) == 1, f"parameters differ between ranks: {finals.by_rank}"
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[0]["loss"] > CHANCE_LOSS - 0.1  # starts near chance ...
    assert records[-1]["loss"] < 1.75  # ... and has clearly learned
    assert finals.by_rank[0]["loss"] == pytest.approx(records[-1]["loss"], abs=1e-6)
    for key in ("lr", "samples_per_s", "tokens_per_s", "step_time_s", "grad_norm", "epoch"):
        assert key in records[-1]
    assert "mfu" not in records[-1]  # MFU is reported on CUDA only
    assert records[4]["lr"] == pytest.approx(3e-3)  # end of warmup
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000010.pt",
        "step-00000020.pt",
    ]


@pytest.mark.slow
def test_sampler_gives_disjoint_shards_and_new_order_each_epoch(straight):
    _, run_dir = straight
    per_rank = {r: read_jsonl(run_dir / f"indices-rank{r}.jsonl") for r in (0, 1)}
    for r, recs in per_rank.items():
        assert [x["epoch"] for x in recs] == [0, 1], f"rank {r} did not start two epochs"
    for epoch in (0, 1):
        a, b = (set(per_rank[r][epoch]["indices"]) for r in (0, 1))
        assert len(a) == len(b) == 512
        assert not a & b, f"epoch {epoch}: ranks share samples"
        assert len(a | b) == 1024  # together they cover the dataset
    for r in (0, 1):
        e0, e1 = per_rank[r][0]["indices"], per_rank[r][1]["indices"]
        assert e0 != e1 and set(e0) != set(e1), f"rank {r}: same data order in epochs 0 and 1"


@pytest.mark.slow
def test_stop_at_10_then_resume_to_20_is_bit_exact(work, straight):
    first = run_torchrun([*COMMON, *sets(run__dir="split", train__max_steps=10)], cwd=work)
    assert first.returncode == 0, describe(first)
    assert parse_finals(first.stdout).by_rank[0]["step"] == 10
    second = run_torchrun([*COMMON, *sets(run__dir="split")], cwd=work)
    assert second.returncode == 0, describe(second)
    assert "resumed from" in second.stderr and "step-00000010.pt" in second.stderr
    assert parse_finals(second.stdout).sha == parse_finals(straight[0].stdout).sha


@pytest.mark.slow
def test_three_ranks_resume_bit_exact_too(work):
    """3 ranks: DDP's first step in a process reduces in one bucket and scales g * (1/3), later steps in
    the rebuilt buckets and g / 3; a resumed process settles its buckets first (settle_buckets), so its
    first step reduces as step 11 did in the straight run (without it: equal at step 10, not at 11)."""
    straight3 = run_torchrun([*COMMON, *sets(run__dir="straight3")], cwd=work, nproc=3)
    assert straight3.returncode == 0, describe(straight3)
    first = run_torchrun([*COMMON, *sets(run__dir="split3", train__max_steps=10)], cwd=work, nproc=3)
    assert first.returncode == 0, describe(first)
    second = run_torchrun([*COMMON, *sets(run__dir="split3")], cwd=work, nproc=3)
    assert second.returncode == 0, describe(second)
    assert "resumed from" in second.stderr and "step-00000010.pt" in second.stderr
    finals = parse_finals(second.stdout)
    assert sorted(finals.by_rank) == [0, 1, 2] and finals.sha == parse_finals(straight3.stdout).sha


@pytest.mark.slow
def test_gradient_accumulation_equals_the_large_batch(work, straight):
    """2 x 16 with no_sync on the first micro-step == 1 x 32 up to float summation order."""
    import torch

    big = run_torchrun(
        [*COMMON, *sets(run__dir="big", train__batch_size=32, train__grad_accum_steps=1)], cwd=work
    )
    assert big.returncode == 0, describe(big)
    assert parse_finals(big.stdout).by_rank[0]["loss"] == pytest.approx(
        parse_finals(straight[0].stdout).by_rank[0]["loss"], abs=1e-4
    )
    ck = "default/checkpoints/step-00000020.pt"
    a = torch.load(work / "big" / ck, weights_only=True)["model"]
    b = torch.load(straight[1] / "checkpoints" / "step-00000020.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_resume_on_fewer_ranks_keeps_the_global_batch_and_ends_where_the_straight_run_does(work, straight):
    """A restart on fewer ranks (`ddp-launch restart --exclude` adds train.global_batch=auto): 2 ranks x
    16 x 2 to step 10, then 1 rank from its checkpoint keeps its 64 sequences a step (16 x 4;
    ddp_train/batchplan.py) from where the epoch stopped, so the parameters at step 20 are the straight
    2-rank run's up to float summation order (as 2 x 16 equals 1 x 32 above)."""
    import torch

    first = run_torchrun([*COMMON, *sets(run__dir="fewer", train__max_steps=10)], cwd=work)
    assert first.returncode == 0, describe(first)
    second = run_torchrun([*COMMON, *sets(run__dir="fewer", train__global_batch="auto")], cwd=work, nproc=1)
    assert second.returncode == 0, describe(second)
    said = "global batch 64 kept on 1 rank(s): batch_size 16 x grad_accum_steps 4 (configured 16 x 2)"
    assert said in second.stderr, second.stderr[-3000:]
    moved = "global batch 64 kept: 16 x 2 rank(s) x 2 now 16 x 1 x 4; the epoch goes on 640 sequences in"
    assert moved in second.stderr, second.stderr[-3000:]
    ck = "default/checkpoints/step-00000020.pt"
    a = torch.load(work / "fewer" / ck, weights_only=True)["model"]
    b = torch.load(straight[1] / "checkpoints" / "step-00000020.pt", weights_only=True)["model"]
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_world_size_that_cannot_split_the_global_batch_is_one_line_exit_2(work):
    bad = run_torchrun([*COMMON, *sets(train__global_batch=63, run__dir="odd")], cwd=work)
    assert bad.returncode != 0
    line = "train.global_batch: global batch 63 cannot be split evenly over 2 ranks (63/2 is not whole)"
    # one line from the trainer (torchrun's own report of the failed ranks follows it)
    assert line in bad.stderr and 'ddp_train/trainer.py", line' not in bad.stderr, bad.stderr[-3000:]


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"run ended early (exit {proc.returncode})\n{out}\n{err[-4000:]}")
        if metrics.exists() and any(r["step"] >= step for r in read_jsonl(metrics)):
            return
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no step {step} in {metrics} after {timeout}s")


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen):
    """Kill and reap proc on the way out when a step inside the block failed before it ended."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _start_slow(work: Path, name: str) -> subprocess.Popen:
    args = [*COMMON, *sets(run__dir=name, debug__step_delay_s=0.25)]
    return subprocess.Popen(
        torchrun_cmd(args),
        cwd=work,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _worker_with_rank(torchrun_pid: int, rank: int) -> int:
    for pid in _children(torchrun_pid):
        try:
            environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {torchrun_pid}")


def _stopped_steps(stdout: str) -> dict[int, int]:
    return {int(m.group(1)): int(m.group(3)) for m in STOP_LINE.finditer(stdout)}


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_then_resume_is_bit_exact(work, straight):
    proc = _start_slow(work, "sigterm")
    with _reaped(proc):
        _wait_for_step(work / "sigterm" / "default" / "metrics.jsonl", 3, proc)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
        out, err = proc.communicate(timeout=90)
    stopped = _stopped_steps(out)
    assert sorted(stopped) == [0, 1], f"{out}\n{err[-4000:]}"
    step = stopped[0]
    assert stopped[1] == step and 3 <= step < 20
    assert proc.returncode != 0  # an interrupted job is not a success
    ckpts = work / "sigterm" / "default" / "checkpoints"
    assert (ckpts / f"step-{step:08d}.pt").is_file(), sorted(os.listdir(ckpts))
    assert not list(ckpts.glob("*.tmp"))
    resumed = run_torchrun([*COMMON, *sets(run__dir="sigterm")], cwd=work)
    assert resumed.returncode == 0, describe(resumed)
    assert f"step-{step:08d}.pt" in resumed.stderr
    assert parse_finals(resumed.stdout).sha == parse_finals(straight[0].stdout).sha


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_every_rank_after_the_same_step(work):
    proc = _start_slow(work, "sigterm-one")
    with _reaped(proc):
        _wait_for_step(work / "sigterm-one" / "default" / "metrics.jsonl", 3, proc)
        os.kill(_worker_with_rank(proc.pid, 1), signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    stopped = _stopped_steps(out)
    assert sorted(stopped) == [0, 1] and stopped[0] == stopped[1], f"{out}\n{err[-4000:]}"
    assert stopped[0] < 20
    assert "exitcode  : 143" in err  # torchrun reports the workers' documented SIGTERM exit code
    assert (work / "sigterm-one" / "default" / "checkpoints" / f"step-{stopped[0]:08d}.pt").is_file()


@pytest.mark.slow
def test_single_process_without_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "ddp_train", *sets(train__max_steps=3, checkpoint__resume="never")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=trainer_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, describe(proc)
    finals = parse_finals(proc.stdout)
    assert finals.by_rank[0]["world"] == 1 and finals.by_rank[0]["step"] == 3
    assert (tmp_path / "runs" / "default" / "checkpoints" / "step-00000003.pt").is_file()


@pytest.mark.slow
def test_max_restarts_resumes_automatically_after_a_killed_worker(work, straight):
    """torchrun --max-restarts 1: SIGKILL one worker after the step-10 checkpoint; the new group resumes."""
    args = [*COMMON, *sets(run__dir="elastic", debug__step_delay_s=0.25)]
    cmd = torchrun_cmd(args)
    cmd.insert(cmd.index("--standalone") + 1, "--max-restarts=1")
    proc = subprocess.Popen(
        cmd, cwd=work, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    with _reaped(proc):
        _wait_for_step(work / "elastic" / "default" / "metrics.jsonl", 12, proc)
        os.kill(_worker_with_rank(proc.pid, 1), signal.SIGKILL)
        out, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, f"{out}\n{err[-6000:]}"
    assert "resumed from" in err and "step-00000010.pt" in err
    assert parse_finals(out).sha == parse_finals(straight[0].stdout).sha


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_every_rank_once_after_saving(work):
    """A terminal's Ctrl-C goes to the foreground process group. torchrun 2.13 starts each worker in a
    session of its own (elastic/multiprocessing/subprocess_handler/subprocess_handler.py:
    start_new_session=True), so only torchrun gets it and forwards it once: every rank saves, none dies
    of a second copy (trainer.StopRequest: a second signal kills)."""
    args = [*COMMON, *sets(run__dir="ctrl-c", debug__step_delay_s=0.25)]
    proc = subprocess.Popen(
        torchrun_cmd(args), cwd=work, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for_step(work / "ctrl-c" / "default" / "metrics.jsonl", 3, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    stopped = re.findall(r"^ddp-train: stopped rank=(\d) world=2 step=(\d+) signal=SIGINT$", out, re.M)
    assert sorted(r for r, _ in stopped) == ["0", "1"], f"{out}\n{err[-4000:]}"
    assert stopped[0][1] == stopped[1][1]
    step = int(stopped[0][1])
    assert (work / "ctrl-c" / "default" / "checkpoints" / f"step-{step:08d}.pt").is_file()
    assert "exitcode  : -2" not in err  # no worker died by the forwarded SIGINT
