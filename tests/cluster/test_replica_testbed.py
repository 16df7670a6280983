"""A lost node loses no checkpoint (issue 30 item 6): three hosts like a real cluster's (SSH on a
management network, training on another, no shared disk, no ddp_master_addr), checkpoint.replicas 1.
node0 (rank 0) is killed whole mid-run, sshd included, after a replica reached node1; `ddp-launch restart
JOB --exclude node0` takes its MASTER_ADDR from ddp_network_cidr (node1's training address), resumes from
node1's replica and finishes. As users train (tests/usershape.py): gpt-tiny on prepared tokens, a loader
worker per rank, ~5 MB checkpoints, which is what the replica carries over the training network."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.test_launch_testbed import FINAL, Launcher, job_pids, kill_job, make_inventory
from tests.conftest import private_testbed
from tests.testbed import Testbed, worker_net, worker_prefix
from tests.usershape import trainer_args

pytestmark = [pytest.mark.testbed, pytest.mark.slow]
JOBS = ("rep-1", "rep-2")


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with private_testbed(
        worker_prefix("rep"), worker_net("10.213.184"), 3, train_net=worker_net("10.213.185")
    ) as bed:
        yield bed


@pytest.fixture
def started() -> Iterator[list[Launcher]]:
    runs: list[Launcher] = []
    yield runs
    for run in runs:
        run.stop()
    for job in JOBS:  # node1's and node2's agents lost their launcher: each kept its agent.log for us
        kill_job(job)


def test_node0_killed_after_a_save_the_survivors_resume_from_its_replica(
    tb: Testbed, tmp_path: Path, started: list[Launcher], users_tokens: Path
) -> None:
    hosts = tb.hosts()
    work = {h.name: tmp_path / f"work-{h.name}" for h in hosts}
    for d in work.values():
        d.mkdir()
    inv = make_inventory(tb, tmp_path, host_vars={h: {"ddp_workdir": str(d)} for h, d in work.items()})
    spec = yaml.safe_load((inv / "hosts.yml").read_text())
    del spec["all"]["vars"]["ddp_master_addr"]  # derived from ddp_network_cidr (the training network)
    (inv / "hosts.yml").write_text(yaml.safe_dump(spec))
    train = [*trainer_args(users_tokens, steps=30), "--set", "checkpoint.replicas=1"]

    run = Launcher(
        ["--hosts", str(inv), *train, "--job-id", JOBS[0], "--set", "debug.step_delay_s=0.3"], tmp_path
    )
    started.append(run)
    run.wait_for(r"\[node0 r0\] .*INFO saved replica node1:step-00000020\.pt in \d", timeout=180)
    for pid in tb.pids(hosts[0]):  # node0 is gone: trainer, loader worker, torchrun, agent and sshd at once
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert run.wait(timeout=120) == 1, run.text  # README: 1, a node failed or was lost
    assert wait_gone(JOBS[0]) == [], run.text  # the launcher stopped node1 and node2, loader workers too

    kept = work["node1"] / "runs" / "gpt-tiny" / "checkpoints"
    newest = sorted(kept.glob("step-*.pt"))[-1]
    step = int(newest.name[5:13])
    assert step >= 20, run.text
    info = json.loads((kept / f"{newest.name}.replica.json").read_text())
    assert info["from"] == "node0" and len(info["sha256"]) == 64

    again = Launcher(["restart", JOBS[0], "--exclude", "node0", "--job-id", JOBS[1]], tmp_path)
    started.append(again)
    code = again.wait(timeout=240)
    out = again.text
    assert code == 0, out
    assert f"MASTER_ADDR {hosts[1].train_ip}: node1's address in ddp_network_cidr" in out, out
    first = next(ln for ln in again.lines if re.match(r"^\[node1 r0\] .* INFO ", ln))
    resumed = rf"INFO resumed from {re.escape(str(newest))} at step {step} of job {JOBS[0]}, saved .* ago, "
    assert re.search(resumed + "a replica sent by node0$", first), out
    finals = [m.groups() for m in map(FINAL.match, again.lines) if m]
    assert sorted(f[:5] for f in finals) == [
        ("node1", "0", "0", "2", "30"),
        ("node2", "1", "1", "2", "30"),
    ], out
    assert len({f[5] for f in finals}) == 1, out
    assert wait_gone(JOBS[1]) == [], out


def wait_gone(job: str, timeout: float = 5) -> list[tuple[int, str]]:
    """The job's processes once exiting ones had `timeout` s to go."""
    deadline = time.monotonic() + timeout
    while (left := job_pids(job)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
