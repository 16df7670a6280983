"""Job control over real SSH on the namespace testbed (three hosts): the stall watchdog names the one
blocked rank of three and its stack, and a SIGKILLed detached monitor makes every host stop and save
(as users train: tests/usershape.py), after which `ddp-launch restart` resumes from that step and finishes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddp_train import checkpoint
from tests.cluster.test_launch_testbed import LAUNCH, assert_nothing_left, job_pids, kill_job, make_inventory
from tests.testbed import Testbed
from tests.usershape import trainer_args

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


def launch(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LAUNCH, *args], cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )  # fmt: skip


def test_the_stall_watchdog_names_the_blocked_host_and_rank(testbed: Testbed, tmp_path: Path) -> None:
    inv = make_inventory(testbed, tmp_path)
    job = "jt-stall"
    args = ["--hosts", str(inv), "--set", "train.max_steps=40", "--set", "log.interval_steps=1", "--env",
            "DDP_DEBUG_STALL=1:4", "--stall-timeout", "8", "--grace", "3", "--job-id", job]  # fmt: skip
    try:
        out = launch(args, tmp_path)
        assert out.returncode == 4, out.stdout
        named = r"stack differs from the majority: rank 1 on node1 \(innermost frame debug_stall_block \("
        assert re.search(named, out.stdout), out.stdout
        stacks = tmp_path / "logs" / job / "stacks"
        assert sorted(p.name for p in stacks.iterdir()) == ["node0-r0.txt", "node1-r1.txt", "node2-r2.txt"]
        assert "in debug_stall_block" in (stacks / "node1-r1.txt").read_text()
        assert "in debug_stall_block" not in (stacks / "node2-r2.txt").read_text()
        assert f"no process of job {job} remains" in out.stdout
        assert_nothing_left(testbed, job)
    finally:
        kill_job(job)


def test_a_killed_detached_monitor_stops_every_host_over_ssh(
    testbed: Testbed, tmp_path: Path, users_tokens: Path
) -> None:
    inv = make_inventory(testbed, tmp_path)
    job, again = "jt-orphan", "jt-resumed"
    for j in (job, again):
        kill_job(j)  # an earlier run's agent directories (the hosts share this machine's /tmp)
    args = ["--hosts", str(inv), *trainer_args(users_tokens), "--set", "debug.step_delay_s=0.5",
            "--detach", "--monitor-here", "--job-id", job]  # fmt: skip
    try:
        out = launch(args, tmp_path)
        assert out.returncode == 0 and f"job {job} runs detached on 3 nodes" in out.stdout, out.stdout
        log = tmp_path / "logs" / job / "node0.log"
        deadline = time.monotonic() + 120
        past_20 = r"INFO step 2[1-9]/30"  # past the periodic save at 20: the stop's own save is the newest
        while not (log.exists() and re.search(past_20, log.read_text())):
            assert time.monotonic() < deadline, "no step line past 20"
            time.sleep(0.2)
        pid = json.loads((tmp_path / "logs" / job / "job.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while job_pids(job) and time.monotonic() - t0 < 60:
            time.sleep(0.5)
        assert job_pids(job) == [], "the hosts kept training without their monitor"
        assert_nothing_left(testbed, job)
        agent_logs = "".join(p.read_text() for p in Path("/tmp").glob(f"ddp-agent-{job}-*/agent.log"))
        assert agent_logs.count("lost the launcher") == 3, agent_logs
        # every rank finished its step and stopped there, rank 0 saved it; every node exits 143
        stops = re.findall(r"ddp-train: stopped rank=(\d) world=3 step=(\d+) signal=SIGTERM", agent_logs)
        assert sorted(r for r, _ in stops) == ["0", "1", "2"] and len({n for _, n in stops}) == 1, agent_logs
        step = int(stops[0][1])
        assert agent_logs.count("torchrun stopped its workers (each saves first); exit 143") == 3, agent_logs
        ckpts = tmp_path / "work" / "runs" / "gpt-tiny" / "checkpoints"
        assert 20 < step < 30 and checkpoint.list_checkpoints(ckpts)[-1][0] == step, agent_logs

        # the next run: the recorded command again (detached again), resuming from that step to the end
        out = launch(["restart", job, "--job-id", again], tmp_path)
        assert out.returncode == 0 and f"job {again} runs detached on 3 nodes" in out.stdout, out.stdout
        follow = launch(["attach", again], tmp_path)
        assert follow.returncode == 0, follow.stdout
        text = (tmp_path / "logs" / again / "node0.log").read_text()
        resumed = rf"INFO resumed from \S+/step-{step:08d}\.pt at step {step} of job {job},"
        assert re.search(resumed, text), text
        assert re.search(r"ddp-train: final rank=0 world=3 step=30 ", text), text
        assert_nothing_left(testbed, again)
    finally:
        kill_job(job)
        kill_job(again)
