"""Elastic restart: `ddp-launch --max-restarts 1`, a worker SIGKILLed once mid-run; the job still ends right.

Run as a user would, on local nodes: two nodes x 1 process (each node its own torchrun agent; with
restarts on several nodes ddp-launch uses c10d rendezvous with a fresh store per round, since a static
rendezvous cannot re-form the group across nodes) and one node x 2 processes (static rendezvous).
torchrun restarts the worker group, the trainer resumes from the newest checkpoint by itself, and the
final parameters are bit-for-bit those of an uninterrupted run with the same seed (conftest's
reference_sha; CPU, gloo).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.cluster.test_launch_testbed import Launcher, job_pids
from tests.reliability.support import TRAIN_30, finals, job_id, local_inventory, stop, worker_pid

pytestmark = pytest.mark.slow

# A restart that cannot re-form the process group fails after 60 s instead of hanging for 300 s.
TRAIN = [*TRAIN_30, "--set", "dist.init_timeout_s=60"]


@pytest.mark.parametrize(
    ("nodes", "nproc", "hosts"),
    [(2, 1, ["local0", "local1"]), (1, 2, ["local0", "local0"])],
    ids=["2-nodes-x-1", "1-node-x-2"],
)
def test_killed_worker_restarts_resumes_and_matches_an_uninterrupted_run(
    nodes: int, nproc: int, hosts: list[str], tmp_path: Path, reference_sha: str
) -> None:
    inv = local_inventory(tmp_path, nodes=nodes)
    killed_id = job_id("el-kill")
    ckpts = tmp_path / "killed" / "default" / "checkpoints"
    # The same job, slowed down (the delay changes no number) so the kill lands between two saves.
    run = Launcher(
        ["--hosts", str(inv), "--job-id", killed_id, "--max-restarts", "1", "--nproc-per-node", str(nproc),
         *TRAIN, "--set", "debug.step_delay_s=0.4", "--set", f"run.dir={tmp_path / 'killed'}"],
        tmp_path,
    )  # fmt: skip
    try:
        run.wait_for(r"\[local0 r0\] .*INFO step 12/30 ", timeout=180)
        assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000010.pt"]
        victim = worker_pid(killed_id, rank=1)
        os.kill(victim, signal.SIGKILL)
        code = run.wait(timeout=240)
    finally:
        stop(run, killed_id)
    text = run.text
    assert code == 0, text
    # torchrun saw the SIGKILL, restarted; the new workers resumed from the step-10 checkpoint
    label = f"{hosts[1]} r{nodes - 1}"
    assert re.search(
        rf"\[{label}\] .*failed \(exitcode: -9\) local_rank: {nproc - 1} \(pid: {victim}\)", text
    ), text
    resumed = re.findall(r"\[local0 r0\] .*INFO resumed from (\S+) at step (\d+)", text)
    assert resumed == [(str(ckpts / "step-00000010.pt"), "10")], text
    got = finals(run.lines)
    assert sorted((host, rank, world, step) for host, _, rank, world, step, _ in got) == [
        (hosts[0], "0", "2", "30"), (hosts[1], "1", "2", "30"),
    ], text  # fmt: skip
    assert {sha for *_, sha in got} == {reference_sha}, "resumed run differs from the uninterrupted one"
    assert "job " + killed_id + " succeeded" in text
    assert job_pids(killed_id) == []
