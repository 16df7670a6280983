"""Stopping a job: Ctrl-C, SIGTERM or --timeout to `ddp-launch` loses no work; a second Ctrl-C kills.

On local nodes (two nodes x one process, no SSH), through the console script as a user runs it:
- each rank finishes its current step, rank 0 saves a checkpoint of that step, every node exits
  130 (SIGINT) or 143 (SIGTERM, --timeout), the launcher prints one line per node and its table, with
  no traceback from torchrun; the same command then resumes from exactly that step and ends with the
  parameters of an uninterrupted run (conftest's reference_sha).
- a second Ctrl-C while rank 0 is still writing that checkpoint kills every node at once, says so, and
  leaves no process and no published partial checkpoint; a save longer than --grace is killed at
  the end of the grace, and the log says so and why.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from ddp_train import checkpoint
from tests import usershape
from tests.cluster.test_launch_testbed import Launcher, job_pids
from tests.reliability.support import TRAIN_30, finals, job_id, local_inventory, stop

pytestmark = pytest.mark.slow

SLOW = ["--set", "debug.step_delay_s=0.4"]  # changes no number: the kill lands mid-run


@pytest.mark.parametrize(
    ("how", "shape"),
    [("SIGINT", "demo"), ("SIGTERM", "users"), ("timeout", "users")],
)
def test_stop_saves_that_step_and_the_same_command_resumes_bit_exact(
    how: str, shape: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """demo: default.yaml, bit-exact against an uninterrupted run; users: the configuration users train
    with (tests/usershape.py: prepared tokens, a loader worker per rank, ~5 MB checkpoints, replicas),
    where a stop used to kill the loader workers and the ranks failed without saving (#42). SIGTERM and
    --timeout (a SIGTERM to every node) run in the users' configuration only, SIGINT in the demo one only:
    the suite's time (a loader worker ignores both signals alike: tests/unit/test_train_loader_signals.py)."""
    inv = local_inventory(tmp_path)
    train = TRAIN_30 if shape == "demo" else usershape.trainer_args(request.getfixturevalue("users_tokens"))
    base = ["--hosts", str(inv), *train, "--set", f"run.dir={tmp_path / 'runs'}"]
    ckpts = tmp_path / "runs" / ("default" if shape == "demo" else "gpt-tiny") / "checkpoints"
    stopped_id = job_id(f"st-{how.lower()}")
    # --timeout counts from the launch: 1.5 s a step puts it mid-run (30 steps take > 45 s) however long
    # the start takes on a loaded machine (> 10 s in a CI run, when a 10-s timeout hit before step 1)
    extra = ["--timeout", "45", "--set", "debug.step_delay_s=1.5"] if how == "timeout" else SLOW
    run = Launcher([*base, "--job-id", stopped_id, *extra], tmp_path)
    try:
        if how == "timeout":
            code = run.wait(timeout=120)
        else:
            run.wait_for(r"\[local0 r0\] .*INFO step 13/30 ", timeout=120)
            t0 = time.monotonic()
            run.proc.send_signal(getattr(signal, how))
            code = run.wait(timeout=90)
            assert time.monotonic() - t0 < 30, run.text
    finally:
        stop(run, stopped_id)
    text = run.text
    expected = {"SIGINT": 130, "SIGTERM": 143, "timeout": 124}[how]
    node_code = 130 if how == "SIGINT" else 143
    assert code == expected, text
    # one line per node, the same step everywhere, saved by rank 0
    per_node = rf"^ddp-launch: (local\d) r\d: exit {node_code}: rank (\d) stopped after step (\d+)(.*)$"
    lines = re.findall(per_node, text, re.M)
    assert sorted((h, r) for h, r, _, _ in lines) == [("local0", "0"), ("local1", "1")], text
    step = int(lines[0][2])
    assert {int(s) for _, _, s, _ in lines} == {step} and 0 < step < 30, text
    assert [rest for h, _, _, rest in sorted(lines)] == [", checkpoint saved", ""], text
    assert re.search(rf"^local0\s+0\s+exit {node_code}, after SIG\w+ from ddp-launch\s+-$", text, re.M), text
    assert re.search(rf"job {stopped_id} stopped \(.*\) after step {step}, checkpoint saved", text), text
    assert "Traceback" not in text and "SignalException" not in text and "sending KILL" not in text, text
    assert checkpoint.list_checkpoints(ckpts)[-1][0] == step and not list(ckpts.glob("*.tmp"))
    assert job_pids(stopped_id) == []

    resumed_id = job_id("st-resume")
    run = Launcher([*base, "--job-id", resumed_id], tmp_path)
    try:
        code = run.wait(timeout=180)
    finally:
        stop(run, resumed_id)
    assert code == 0, run.text
    resumed = re.findall(r"\[local0 r0\] .*INFO resumed from (\S+) at step (\d+)", run.text)
    assert resumed == [(str(ckpts / f"step-{step:08d}.pt"), str(step))], run.text
    got = finals(run.lines)
    assert [(rank, s) for _, _, rank, _, s, _ in sorted(got)] == [("0", "30"), ("1", "30")], run.text
    if shape == "demo":
        reference = request.getfixturevalue("reference_sha")
        assert {sha for *_, sha in got} == {reference}, "resumed run differs from the uninterrupted one"
    assert job_pids(resumed_id) == []
    print(f"{how}: stopped after step {step}, resumed from it, parameters identical")


def test_a_second_ctrl_c_kills_at_once_and_publishes_no_partial_checkpoint(tmp_path: Path) -> None:
    inv = local_inventory(tmp_path)
    ckpts = tmp_path / "runs" / "default" / "checkpoints"
    job = job_id("st-twice")
    # no periodic saves: the stop's own save is the first, and it pauses 60 s before its rename
    args = ["--hosts", str(inv), "--job-id", job, *TRAIN_30, *SLOW, "--set", "checkpoint.interval_steps=0",
            "--set", "debug.save_delay_s=60", "--set", f"run.dir={tmp_path / 'runs'}"]  # fmt: skip
    run = Launcher(args, tmp_path)
    try:
        run.wait_for(r"\[local0 r0\] .*INFO step 5/30 ", timeout=120)
        run.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not list(ckpts.glob("*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.1)  # rank 0 is inside the save now
        assert list(ckpts.glob("*.tmp")), run.text
        time.sleep(1)
        assert run.proc.poll() is None, run.text  # one Ctrl-C never kills: it waits for the save
        t0 = time.monotonic()
        run.proc.send_signal(signal.SIGINT)
        code = run.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        stop(run, job)
    text = run.text
    assert code == 130 and elapsed < 15, (code, elapsed, text)
    assert "SIGINT again during the grace period: sending KILL to every node now" in text, text
    assert re.search(r"^local0\s+0\s+.*SIGKILL from ddp-launch", text, re.M), text
    assert f"no process of job {job} remains" in text and job_pids(job) == []
    assert checkpoint.list_checkpoints(ckpts) == []  # the interrupted save published nothing


def test_a_save_longer_than_the_grace_is_killed_and_the_log_says_why(tmp_path: Path) -> None:
    inv = local_inventory(tmp_path)
    job = job_id("st-grace")
    args = ["--hosts", str(inv), "--job-id", job, "--grace", "3", *TRAIN_30, *SLOW,
            "--set", "checkpoint.interval_steps=0", "--set", "debug.save_delay_s=60",
            "--set", f"run.dir={tmp_path / 'runs'}"]  # fmt: skip
    run = Launcher(args, tmp_path)
    try:
        run.wait_for(r"\[local0 r0\] .*INFO step 3/30 ", timeout=120)
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(timeout=60)
    finally:
        stop(run, job)
    text = run.text
    assert code == 143, text
    assert "KILL after 3s (--grace)" in text, text
    assert re.search(r"still running 3s after SIGTERM \(--grace\): local0\b.*; sending KILL", text), text
    assert re.search(r"^local0\s+0\s+.*SIGKILL from ddp-launch after SIGTERM", text, re.M), text
    assert f"job {job} FAILED" in text and job_pids(job) == []
