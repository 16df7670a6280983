"""Nobody has to wake up (#43): with `ddp_on_node_loss: restart`, a detached job whose nodes die goes on by
itself on the others, and the job can be followed from another directory and from its monitor host.

Four testbed hosts, the job's monitor on node3 (provisioned by playbooks/cluster_monitor.yml), the job in
the users' configuration (tests/usershape.py: gpt-tiny on prepared tokens, a loader worker per rank,
replicas) with a global batch of 48 (12 x 4 ranks), which 3 and 2 ranks keep too. After `--detach`
nothing is touched but the hosts: node0 (the master) is killed whole, every process of its host; once
the job runs again on three nodes, node2's link goes down (a silent partition). The job must finish
every step on node1 and node3 with the same global batch, each loss costing at most one checkpoint
interval, and `status` must show both losses and the three attempts, from another directory of the
controller and on the monitor host itself. A second test: `--max-node-losses 1` and two losses stop the
job, naming both nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.test_detach_testbed import launch, provision, state, wait_for
from tests.cluster.test_launch_testbed import kill_job
from tests.conftest import private_testbed
from tests.integration.trainrun import describe, parse_finals, run_torchrun
from tests.reliability.test_node_loss import crash
from tests.testbed import Host, Testbed, worker_net, worker_prefix
from tests.usershape import trainer_args

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PREFIX, NET = worker_prefix("nrc"), worker_net("10.213.194")
INTERVAL = 10  # checkpoint.interval_steps of tests/usershape.py


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    with private_testbed(PREFIX, NET, 4) as tb:
        yield tb


@pytest.fixture(scope="module")
def inv(bed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the launch directory, its inventory): the monitor on node3, ddp_on_node_loss: restart."""
    root = tmp_path_factory.mktemp("recovery")
    extra = {"ddp_monitor_host": "node3", "ddp_on_node_loss": "restart"}
    # a disk of its own per host (/tmp is shared): what node0 saved dies with it, but for its replica
    own = {h.name: {"ddp_workdir": str(root / f"work-{h.name}")} for h in bed.hosts()}
    for d in own.values():
        Path(d["ddp_workdir"]).mkdir()
    return root, provision(bed, root, monitor="node3", host_vars=own, all_vars=extra, verify=False)


def console(root: Path, job: str) -> str:
    with contextlib.suppress(OSError):
        return (root / "monitor" / job / "console.log").read_text()
    return ""


def saved(host: str, step: int) -> str:
    """Rank 0's line once the checkpoint of `step` is published and its replica sent."""
    return rf"\[{host} r0\] .*INFO saved replica \S+:step-{step:08d}\.pt in "


def detach(root: Path, inventory: Path, job: str, extra: list[str], env: dict[str, str]) -> None:
    tokens = root / "tokens"
    if not (tokens / "meta.json").exists():
        from tests.usershape import prepared_tokens

        prepared_tokens(root)
    args = ["--hosts", str(inventory), *trainer_args(tokens, steps=60), "--set", "train.batch_size=12",
            "--set", "debug.step_delay_s=0.3", "--set", f"run.dir=runs-{job}", "--job-id", job, "--detach",
            *extra]  # fmt: skip
    started = launch(args, root, env)
    assert started.returncode == 0 and f"job {job} runs detached" in started.stdout, started.stdout


def detach_and_crash(bed: Testbed, root: Path, inventory: Path, job: str, extra: list[str],
                     env: dict[str, str], master: Host) -> None:  # fmt: skip
    """`detach` the job, then kill its master whole once its replica of step 10 is on the next node."""
    detach(root, inventory, job, extra, env)
    wait_for(f"{master.name}'s replica of step 10",
             lambda: re.search(saved(master.name, 10), console(root, job)), 240)  # fmt: skip
    crash(bed, master)


def test_a_lost_master_and_a_partitioned_node_are_left_out_and_the_job_finishes(
    bed: Testbed, inv: tuple[Path, Path]
) -> None:
    root, inventory = inv
    node0, node2 = bed.hosts()[0], bed.hosts()[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_STATE_HOME=str(root / "state"))
    job = "nr-heal"
    link = f"v{bed.prefix}{node2.name[4:]}"  # node2's veth on the bridge side
    try:
        detach_and_crash(bed, root, inventory, job, [], env, node0)
        wait_for(
            "attempt 2's step-20 replica", lambda: re.search(saved("node1", 20), console(root, job)), 240
        )
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        final = wait_for("the job to end", lambda: state(root, job).get("state") == "finished" and
                         state(root, job), timeout=300)  # fmt: skip
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=False)
        kill_job(job)
    text = console(root, job)
    assert final["exit_code"] == 0, text
    assert [x["host"] for x in final["lost"]] == ["node0", "node2"], final["lost"]
    # its own reason, not a line it printed in attempt 1 (the log's tail starts again each attempt)
    heartbeats = r"ssh connection lost: no reply to SSH heartbeats for \d+s"
    assert re.fullmatch(heartbeats, final["lost"][1]["reason"]), final["lost"]
    attempts = final["attempts"]
    assert [a["nodes"] for a in attempts] == [
        ["node0", "node1", "node2", "node3"], ["node1", "node2", "node3"], ["node1", "node3"]
    ], attempts  # fmt: skip
    assert [a["master"] for a in attempts] == ["node0", "node1", "node1"], attempts
    ends = re.findall(r"\[(node\d) r(\d)\] .*ddp-train: final rank=\d world=2 step=(\d+) ", text)
    assert sorted(ends) == [("node1", "0", "60"), ("node3", "1", "60")], text
    # the same global batch on every attempt: 12 x 4 ranks, then 8 x 3 x 2 and 12 x 2 x 2
    kept = re.findall(r"\[node1 r0\] .*INFO global batch 48 kept: .* now (\d+) x (\d) x (\d)", text)
    assert kept == [("8", "3", "2"), ("12", "2", "2")], text
    for before, after, loss in zip(attempts, attempts[1:], final["lost"]):
        lost_steps = before["last_step"] - after["resumed_step"]
        back = after["first_step_at"] - loss["at"]
        print(f"{loss['host']}: {lost_steps} step(s) lost, training went on {back:.1f}s after the loss")
        assert 0 <= lost_steps <= INTERVAL and back <= 60, (before, after, loss)
    # the final loss: within the noise of an uninterrupted run of the same global batch (12 x 2 x 2 here,
    # torchrun on this machine; the summation order is all that differs)
    got = float(re.search(r"\[node1 r0\] .*ddp-train: final rank=0 world=2 step=60 loss=(\S+) ", text)[1])
    same = ["--set", "train.batch_size=12", "--set", "train.global_batch=48"]
    straight = run_torchrun([*trainer_args(root / "tokens", steps=60), *same, "--set",
                             f"run.dir={root / 'runs-straight'}"], root)  # fmt: skip
    assert straight.returncode == 0, describe(straight)
    want = parse_finals(straight.stdout).by_rank[0]["loss"]
    print(f"final loss {got} after two lost nodes, {want} uninterrupted")
    assert abs(got - want) <= 0.01 * want, (got, want)

    elsewhere = root / "elsewhere"  # another directory of the controller: the record finds the monitor
    elsewhere.mkdir()
    here = launch(["status", job], elsewhere, env, timeout=60)
    on_monitor = bed.ssh("node3", f"cd /tmp && {sys.prefix}/bin/ddp-launch status {job}", check=False)
    for out in (here.stdout, on_monitor.stdout + on_monitor.stderr):
        assert re.search(r"^attempt 3: 2 nodes \(node1, node3\), master node1, steps \d+-60, exit 0", out,
                         re.M), out  # fmt: skip
        assert re.search(r"^lost node0 at .* \(attempt 1\): ssh connection lost", out, re.M), out
        assert re.search(r"^lost node2 at .* \(attempt 2\): ssh connection lost: no reply", out, re.M), out


def test_more_losses_than_allowed_stop_the_job_naming_every_lost_node(
    bed: Testbed, inv: tuple[Path, Path]
) -> None:
    root, inventory = inv
    node1, node2 = bed.hosts()[1], bed.hosts()[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_STATE_HOME=str(root / "state"))
    job = "nr-giveup"
    try:
        losses = ["--limit", "node1,node2,node3", "--max-node-losses", "1"]
        detach_and_crash(bed, root, inventory, job, losses, env, node1)
        wait_for("attempt 2's first step", lambda: (state(root, job).get("attempt") == 2 and
                 re.search(r"\[node2 r0\] .*INFO step \d+/60", console(root, job))), 240)  # fmt: skip
        t0 = time.monotonic()
        crash(bed, node2)
        final = wait_for("the job to end", lambda: state(root, job).get("state") == "finished" and
                         state(root, job), timeout=120)  # fmt: skip
        elapsed = time.monotonic() - t0
    finally:
        kill_job(job)
    text = console(root, job)
    assert final["exit_code"] == 1 and elapsed < 60, (elapsed, text)
    assert [x["host"] for x in final["lost"]] == ["node1", "node2"], final
    assert re.search(r"lost node1 at \S+ \(attempt 1\): ssh connection lost", text), text
    assert re.search(r"lost node2 at \S+ \(attempt 2\): ssh connection lost", text), text
    assert "giving up: 2 node(s) lost, more than ddp_max_node_losses 1" in text, text
    print(json.dumps(final["attempts"], indent=1))
