"""Job control on local nodes (the embedded inventory, on a free port), through the console script:
--detach, jobs, status, attach (Ctrl-C only detaches), a second job on the same nodes and port refused,
stop (every rank saves), the resume (detached) whose monitor is SIGKILLed (every node stops by itself
and saves). The stall watchdog's test runs on the testbed (test_jobs_testbed.py: three ranks, a
majority to differ from)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddp_train import checkpoint
from tests import usershape
from tests.cluster.test_launch_testbed import job_pids
from tests.reliability.support import LAUNCH, job_id, local_inventory

pytestmark = pytest.mark.slow

SLOW = ["--set", "train.max_steps=80", "--set", "debug.step_delay_s=0.3", "--set", "log.interval_steps=2"]


def launch(args: list[str], cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LAUNCH, *args], cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )  # fmt: skip


def state(cwd: Path, job: str) -> dict:
    return json.loads((cwd / "logs" / job / "job.json").read_text())


def wait_until(check, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def stepped(cwd: Path, job: str, at_least: int = 2) -> bool:
    log = cwd / "logs" / job / "local0.log"
    steps = re.findall(r"INFO step (\d+)/", log.read_text()) if log.exists() else []
    return bool(steps) and int(steps[-1]) >= at_least


def cleanup(cwd: Path, job: str) -> None:
    try:
        pid = state(cwd, job).get("pid")
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, TypeError):
        pass
    for pid, _ in job_pids(job):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_detach_status_attach_stop_resume_and_a_killed_monitor(tmp_path: Path) -> None:
    inv = local_inventory(tmp_path)
    base = ["--hosts", str(inv), "--set", f"run.dir={tmp_path / 'runs'}"]
    job = job_id("det")
    try:
        t0 = time.monotonic()
        out = launch([*base, *SLOW, "--detach", "--job-id", job], tmp_path)
        assert out.returncode == 0, out.stdout
        assert time.monotonic() - t0 < 60 and f"job {job} runs detached on 2 nodes" in out.stdout, out.stdout
        assert f"ddp-launch attach {job}" in out.stdout
        wait_until(lambda: stepped(tmp_path, job), 90, "a step line")
        os.kill(state(tmp_path, job)["pid"], signal.SIGHUP)  # the terminal closed: the monitor goes on

        listed = launch(["jobs"], tmp_path)
        assert re.search(rf"^{job}\s+running\s+2\s+\d+/80 ", listed.stdout, re.M), listed.stdout
        status = launch(["status", job], tmp_path)
        assert status.returncode == 0 and f"job {job}: running" in status.stdout, status.stdout
        eta = r"\d+(s|m\d\ds|h\d\dm|d\d\dh)"  # progress.duration(); never "-" once a step is known
        assert re.search(
            rf"^local0\s+0\s+\d+/80\s+\d+\.\d{{4}}\s+\d+\s+{eta}\s+\S+ ago$", status.stdout, re.M
        )

        every = launch(["logs", job], tmp_path)  # the detached monitor's console: every node, prefixed
        assert every.returncode == 0 and re.search(r"^\[local0 r0\] .*INFO step \d+/80", every.stdout, re.M)
        one = launch(["logs", job, "--node", "local0"], tmp_path)  # one node's own log, as written
        assert one.returncode == 0 and re.search(r"INFO step \d+/80", one.stdout), one.stdout
        assert (tmp_path / "logs" / job / "local0.log").read_text().startswith(one.stdout)
        assert one.stdout != every.stdout[: len(one.stdout)]  # not the console's prefixed lines

        other = launch([*base, "--set", "train.max_steps=2", "--job-id", job_id("two")], tmp_path, timeout=60)
        assert other.returncode == 3, other.stdout
        assert re.search(rf"preflight failed: job {job} \(pid \d+, running\) already runs on local0, local1",
                         other.stdout), other.stdout  # fmt: skip

        attach = subprocess.Popen([LAUNCH, "attach", job], cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)  # fmt: skip
        assert attach.stdout is not None
        seen = []
        for line in attach.stdout:
            seen.append(line)
            if re.search(r"\[local0 r0\] .*INFO step \d+/80", line):
                break
        attach.send_signal(signal.SIGINT)
        rest = attach.communicate(timeout=20)[0]
        assert attach.returncode == 0 and f"detached from job {job}; it keeps running" in rest, seen + [rest]
        assert state(tmp_path, job)["state"] == "running"

        stop = launch(["stop", job], tmp_path)
        assert stop.returncode == 0, stop.stdout
        m = re.search(
            rf"job {job} stopped \(received SIGTERM\) after step (\d+), checkpoint saved", stop.stdout
        )
        assert m, stop.stdout
        step = int(m.group(1))
        assert state(tmp_path, job)["exit_code"] == 143 and job_pids(job) == []
        ckpts = tmp_path / "runs" / "default" / "checkpoints"
        assert checkpoint.list_checkpoints(ckpts)[-1][0] == step
        assert "finished (exit 143)" in launch(["jobs"], tmp_path).stdout
        followed = launch(["logs", job, "-f"], tmp_path, timeout=30)  # ended: prints, exits with its code
        assert followed.returncode == 143 and f"job {job} stopped (received SIGTERM)" in followed.stdout
        metrics = (tmp_path / "logs" / job / "metrics.jsonl").read_text().splitlines()  # rank 0's, at the end
        assert metrics and all(json.loads(line).get("step") for line in metrics), metrics[:3]
        assert (tmp_path / "logs" / job / "metrics.png").read_bytes().startswith(b"\x89PNG")
    finally:
        cleanup(tmp_path, job)

    # The resume, detached too; then its monitor is SIGKILLed: every node stops by itself and saves.
    resumed = job_id("res")
    try:
        out = launch([*base, *SLOW, "--detach", "--job-id", resumed], tmp_path, TMPDIR=str(tmp_path))
        assert out.returncode == 0, out.stdout
        wait_until(lambda: stepped(tmp_path, resumed, step + 2), 90, "a step line after the resume")
        resumed_at = rf"INFO resumed from \S+step-{step:08d}\.pt at step {step}"
        assert re.search(resumed_at, log_of(tmp_path, resumed)), log_of(tmp_path, resumed)
        os.kill(state(tmp_path, resumed)["pid"], signal.SIGKILL)
        wait_until(lambda: job_pids(resumed) == [], 45, "every process of the job to end")
        assert re.search(rf"^{resumed}\s+lost\s", launch(["jobs"], tmp_path).stdout, re.M)
        agent_logs = "".join(p.read_text() for p in tmp_path.glob(f"ddp-agent-{resumed}-*/agent.log"))
        assert agent_logs.count("lost the launcher (stdin closed") == 2, agent_logs
        m = re.search(r"ddp-train: stopped rank=0 world=2 step=(\d+) signal=SIGTERM", agent_logs)
        assert m and int(m.group(1)) > step, agent_logs
        assert checkpoint.list_checkpoints(ckpts)[-1][0] == int(m.group(1))
    finally:
        cleanup(tmp_path, resumed)


def log_of(cwd: Path, job: str) -> str:
    path = cwd / "logs" / job / "console.log"
    return path.read_text() if path.exists() else ""


def test_the_users_walk_through_stop_saves_that_step_exits_143_and_resumes_from_it(
    tmp_path: Path, users_tokens: Path
) -> None:
    """#42's walk-through, as a new user runs it: gpt-tiny on token files made by `prepare`, a loader
    worker per rank, ~5 MB checkpoints with replicas; `--detach`, then `ddp-launch stop`. Was: both ranks
    died of "DataLoader worker (pid N) is killed by signal: Terminated", nothing saved, FAILED."""
    inv = local_inventory(tmp_path)
    train = [*usershape.trainer_args(users_tokens, steps=40), "--set", "debug.step_delay_s=0.5"]
    base = ["--hosts", str(inv), *train, "--set", f"run.dir={tmp_path / 'runs'}"]
    ckpts = tmp_path / "runs" / "gpt-tiny" / "checkpoints"
    job = job_id("walk")
    try:
        out = launch([*base, "--detach", "--job-id", job], tmp_path)
        assert out.returncode == 0, out.stdout
        wait_until(lambda: stepped(tmp_path, job, 12), 90, "step 12")  # past the first periodic save
        stopped = launch(["stop", job], tmp_path)
        text = log_of(tmp_path, job)
        assert stopped.returncode == 0, stopped.stdout + text
        m = re.search(
            rf"job {job} stopped \(received SIGTERM\) after step (\d+), checkpoint saved", stopped.stdout
        )
        assert m, stopped.stdout + text
        step = int(m.group(1))
        assert 12 <= step < 40, stopped.stdout
        assert "DataLoader worker" not in text and "Traceback" not in text, text
        assert state(tmp_path, job)["exit_code"] == 143 and job_pids(job) == []
        assert checkpoint.list_checkpoints(ckpts)[-1][0] == step and not list(ckpts.glob("*.tmp"))
    finally:
        cleanup(tmp_path, job)

    resumed = job_id("walk-res")
    try:
        out = launch([*base, "--job-id", resumed], tmp_path, timeout=240)
        assert out.returncode == 0, out.stdout
        resumed_at = rf"\[local0 r0\] .*INFO resumed from \S+step-{step:08d}\.pt at step {step}"
        assert re.search(resumed_at, out.stdout), out.stdout
        assert re.search(r"ddp-train: final rank=0 world=2 step=40 ", out.stdout), out.stdout
        assert job_pids(resumed) == []
    finally:
        cleanup(tmp_path, resumed)
