"""Node loss: a testbed host dies mid-training; ddp-launch notices, names it, and leaves nothing behind.

On a testbed of this module's own (destroying hosts must not touch the shared one):
- crash: every process of one host (its sshd, the job's torchrun and workers) is SIGKILLed at once.
  The launcher exits non-zero within 30 s naming that host, the other hosts are torn down, and no
  process of the job remains anywhere.
- partition: one host silently drops off the network (its link goes down; no FIN, no RST). Only SSH
  heartbeats can notice; the launcher must still end on its own within 30 s, name the host, say that
  it could not check that host, and leave nothing on the hosts it can reach.
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

from tests.cluster.test_launch_testbed import Launcher, host_job_pids, make_inventory
from tests.reliability.support import job_id, private_testbed, stop
from tests.testbed import Host, Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

SLOW = ["--set", "train.max_steps=2000", "--set", "debug.step_delay_s=0.2", "--set", "log.interval_steps=1"]


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with private_testbed("rlnl", "10.213.90", 3) as bed:
        yield bed


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


def test_host_crash_fails_fast_naming_the_host(tb: Testbed, tmp_path: Path) -> None:
    node0, node1, node2 = tb.hosts()
    job = job_id("nl-crash")
    run = Launcher(["--hosts", str(make_inventory(tb, tmp_path)), "--job-id", job, *SLOW], tmp_path)
    try:
        run.wait_for(r"\[node0 r0\] .*INFO step 5/", timeout=180)
        assert all(host_job_pids(tb, h, job) for h in (node0, node1, node2))
        crash(tb, node1)
        t0 = time.monotonic()
        code = run.wait(timeout=60)
        elapsed = time.monotonic() - t0
        left = leftovers(tb, job, [node0, node1, node2])
    finally:
        stop(run, job)
    text = run.text
    assert code != 0 and elapsed < 30, (code, elapsed, text)
    assert re.search(rf"job {job} FAILED \(first failure: node1 \(rank 1\) ssh connection lost\)", text), text
    assert re.search(r"^node1\s+1\s+ssh lost", text, re.M), text
    # the launcher cannot look into the dead host, and says so instead of claiming it is clean
    assert re.search(rf"node1: processes of job {job} remain: unknown: .*cannot connect to port 22", text), (
        text
    )
    assert left == {"node0": [], "node1": [], "node2": []}, left
    assert tb.pids(node1) == []  # nothing came back on the crashed host either
    print(f"crash: launcher ended {elapsed:.1f}s after node1 was killed")


def test_silent_partition_ends_the_job_and_names_the_host(tb: Testbed, tmp_path: Path) -> None:
    node0, node2 = tb.hosts()[0], tb.hosts()[2]  # node1 may be the crashed one
    job = job_id("nl-part")
    inv = make_inventory(tb, tmp_path)
    run = Launcher(["--hosts", str(inv), "--job-id", job, "--limit", "node0,node2", *SLOW], tmp_path)
    link = f"v{tb.prefix}{node2.name[4:]}"  # node2's veth on the bridge side
    try:
        run.wait_for(r"\[node0 r0\] .*INFO step 5/", timeout=180)
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        t0 = time.monotonic()
        code = run.wait(timeout=150)
        elapsed = time.monotonic() - t0
        left = leftovers(tb, job, [node0])
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        stop(run, job)
    text = run.text
    # an unanswered SSH heartbeat (10 s) marks node2 lost; teardown's grace counts from that heartbeat and
    # nobody waits for node2 again (no TERM/KILL/check connection to it: each would wait for a timeout)
    assert code != 0 and elapsed <= 30, (code, elapsed, text)
    assert re.search(rf"job {job} FAILED \(first failure: node2 \(rank 1\) ssh connection lost: no reply to "
                     r"SSH heartbeats for \d+s", text), text  # fmt: skip
    assert re.search(rf"node2: processes of job {job} remain: unknown: not checked, the node is unreachable",
                     text), text  # fmt: skip
    assert "node2: cannot send" not in text, text
    assert left == {"node0": []}, left
    # what the launcher could not reach keeps running until gloo times out; stop() above cleaned it up
    print(f"partition: launcher ended {elapsed:.1f}s after node2's link went down")
