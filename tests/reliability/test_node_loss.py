"""Node loss: a testbed host dies mid-training; ddp-launch notices, names it, and leaves nothing behind.

On a testbed of this module's own (destroying hosts must not touch the shared one):
- crash: every process of one host (its sshd, the job's torchrun and workers) is SIGKILLed at once.
  The launcher exits non-zero within 30 s naming that host, the other hosts are torn down, and no
  process of the job remains anywhere.
- partition: one host silently drops off the network (its link goes down; no FIN, no RST). Only SSH
  heartbeats can notice; the launcher must still end on its own within 30 s, name the host, say that
  it could not check that host, and leave nothing on the hosts it can reach.

Both run as users train (tests/usershape.py: gpt-tiny on prepared tokens, a loader worker per rank, ~5 MB
checkpoints, replicas on), one chain of restarts on this module's own directory: the crashed job exits 1
with its newest checkpoint saved; `ddp-launch restart JOB --exclude node1` resumes from that step, and is
the job that node2's partition then ends (exit 1, after its own save); `restart` of that one resumes from
its step and finishes. Run alone, the partition test starts from scratch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddp_train.checkpoint import list_checkpoints
from tests.cluster.test_launch_testbed import FINAL, Launcher, host_job_pids, job_pids, make_inventory
from tests.reliability.support import job_id, private_testbed, stop
from tests.testbed import Host, Testbed
from tests.usershape import trainer_args

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

DELAY = ["--set", "debug.step_delay_s=0.1"]  # 10 steps, >= 1 s, from one save to the next: room to strike


def saved(step: int) -> str:
    """Rank 0's line once its checkpoint of `step` is published."""
    return rf"\[node0 r0\] .*INFO saved \S+/step-{step:08d}\.pt in \d"


def resumed(step: int, job: str) -> str:
    return (
        rf"\[node0 r0\] .*INFO resumed from \S+/step-{step:08d}\.pt at step {step} of job {re.escape(job)},"
    )


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with private_testbed("rlnl", "10.213.90", 3) as bed:
        yield bed


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, int]]]:
    """The module's launch directory (every host's ddp_workdir is its work/: /tmp is shared) and the jobs
    a later test restarts: {"crash": (job, its saved step)}."""
    return tmp_path_factory.mktemp("nl-users"), {}


def newest_step(root: Path) -> int:
    return list_checkpoints(root / "work" / "runs" / "gpt-tiny" / "checkpoints")[-1][0]


def crash(tb: Testbed, host: Host) -> None:
    """SIGKILL everything in the host: sshd first (no new sessions), then every process in its netns."""
    os.kill(tb.sshd_pid(host), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (pids := tb.pids(host)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    assert tb.pids(host) == [], f"{host.name} still has processes"


def leftovers(tb: Testbed, job: str, hosts: list[Host]) -> dict[str, list[int]]:
    """The job's processes on each host, once exiting ones had 5 s to go (read before any cleanup)."""
    deadline = time.monotonic() + 5
    while True:
        left = {h.name: host_job_pids(tb, h, job) for h in hosts}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_host_crash_fails_fast_naming_the_host(tb: Testbed, users, users_tokens: Path) -> None:
    node0, node1, node2 = tb.hosts()
    root, chain = users
    job = job_id("nl-crash")
    inv = make_inventory(tb, root)
    run = Launcher(["--hosts", str(inv), "--job-id", job, *trainer_args(users_tokens), *DELAY], root)
    try:
        run.wait_for(saved(10), timeout=180)
        assert all(host_job_pids(tb, h, job) for h in (node0, node1, node2))
        crash(tb, node1)
        t0 = time.monotonic()
        code = run.wait(timeout=60)
        elapsed = time.monotonic() - t0
        left = leftovers(tb, job, [node0, node1, node2])
        rest = job_pids(job)  # loader workers included, wherever they are
    finally:
        stop(run, job)
    text = run.text
    assert code == 1 and elapsed < 30, (code, elapsed, text)  # README: 1, a node failed or was lost
    assert re.search(rf"job {job} FAILED \(first failure: node1 \(rank 1\) ssh connection lost\)", text), text
    assert re.search(r"^node1\s+1\s+ssh lost", text, re.M), text
    # the launcher cannot look into the dead host, and says so instead of claiming it is clean
    assert re.search(rf"node1: processes of job {job} remain: unknown: .*cannot connect to port 22", text), (
        text
    )
    assert left == {"node0": [], "node1": [], "node2": []}, left
    assert rest == [], rest
    assert tb.pids(node1) == []  # nothing came back on the crashed host either
    step = newest_step(root)
    assert step >= 10, text
    chain["crash"] = (job, step)  # the partition test's run is its restart
    print(f"crash: launcher ended {elapsed:.1f}s after node1 was killed; step {step} saved")


def test_silent_partition_ends_the_job_and_names_the_host(tb: Testbed, users, users_tokens: Path) -> None:
    node0, node2 = tb.hosts()[0], tb.hosts()[2]  # node1 may be the crashed one
    root, chain = users
    job = job_id("nl-part")
    crashed = chain.get("crash")
    if crashed:  # the crashed job's restart without node1: resumes from its step on node0 and node2
        args = ["restart", crashed[0], "--exclude", "node1", "--job-id", job]
    else:
        inv = make_inventory(tb, root)
        args = ["--hosts", str(inv), "--job-id", job, "--limit", "node0,node2", *trainer_args(users_tokens),
                *DELAY]  # fmt: skip
    run = Launcher(args, root)
    link = f"v{tb.prefix}{node2.name[4:]}"  # node2's veth on the bridge side
    try:
        run.wait_for(saved(20), timeout=180)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t0 = time.monotonic()
        code = run.wait(timeout=150)
        elapsed = time.monotonic() - t0
        left = leftovers(tb, job, [node0])
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        stop(run, job)
    text = run.text
    if crashed:
        assert re.search(resumed(crashed[1], crashed[0]), text), text
    # an unanswered SSH heartbeat (10 s) marks node2 lost; teardown's grace counts from that heartbeat and
    # nobody waits for node2 again (no TERM/KILL/check connection to it: each would wait for a timeout)
    assert code == 1 and elapsed <= 30, (code, elapsed, text)
    assert re.search(rf"job {job} FAILED \(first failure: node2 \(rank 1\) ssh connection lost: no reply to "
                     r"SSH heartbeats for \d+s", text), text  # fmt: skip
    assert re.search(rf"node2: processes of job {job} remain: unknown: not checked, the node is unreachable",
                     text), text  # fmt: skip
    assert "node2: cannot send" not in text, text
    assert left == {"node0": []}, left
    # what the launcher could not reach keeps running until gloo times out; stop() above cleaned it up
    step = newest_step(root)
    assert step >= 20, text
    print(f"partition: launcher ended {elapsed:.1f}s after node2's link went down; step {step} saved")

    again = Launcher(["restart", job, "--job-id", f"{job}-2"], root)  # the network is back: resume, finish
    try:
        code = again.wait(timeout=240)
        left = leftovers(tb, f"{job}-2", [node0, node2])
        rest = job_pids(f"{job}-2")
    finally:
        stop(again, f"{job}-2")
    assert code == 0, again.text
    assert re.search(resumed(step, job), again.text), again.text
    finals = sorted(m.groups()[:5] for m in map(FINAL.match, again.lines) if m)
    assert finals == [("node0", "0", "0", "2", "30"), ("node2", "1", "1", "2", "30")], again.text
    assert left == {"node0": [], "node2": []} and rest == [], (left, rest)
