"""Job control over real SSH on the namespace testbed (three hosts): the stall watchdog names the one
blocked rank of three and its stack, and a SIGKILLed detached monitor makes every host stop and save."""

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


def test_a_killed_detached_monitor_stops_every_host_over_ssh(testbed: Testbed, tmp_path: Path) -> None:
    inv = make_inventory(testbed, tmp_path)
    job = "jt-orphan"
    kill_job(job)  # an earlier run's agent directories (the hosts share this machine's /tmp)
    args = ["--hosts", str(inv), "--set", "train.max_steps=2000", "--set", "debug.step_delay_s=0.2",
            "--set", "log.interval_steps=2", "--detach", "--monitor-here", "--job-id", job]  # fmt: skip
    try:
        out = launch(args, tmp_path)
        assert out.returncode == 0 and f"job {job} runs detached on 3 nodes" in out.stdout, out.stdout
        log = tmp_path / "logs" / job / "node0.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and re.search(r"INFO step [1-9]\d*/2000", log.read_text())):
            assert time.monotonic() < deadline, "no step line"
            time.sleep(0.5)
        pid = json.loads((tmp_path / "logs" / job / "job.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        while job_pids(job) and time.monotonic() - t0 < 60:
            time.sleep(0.5)
        assert job_pids(job) == [], "the hosts kept training without their monitor"
        assert_nothing_left(testbed, job)
        agent_logs = "".join(p.read_text() for p in Path("/tmp").glob(f"ddp-agent-{job}-*/agent.log"))
        assert agent_logs.count("lost the launcher") == 3, agent_logs
        m = re.search(r"ddp-train: stopped rank=0 world=3 step=(\d+) signal=SIGTERM", agent_logs)
        assert m, agent_logs
        ckpts = tmp_path / "work" / "runs" / "default" / "checkpoints"
        assert checkpoint.list_checkpoints(ckpts)[-1][0] == int(m.group(1))
    finally:
        kill_job(job)
