"""`--detach` with the monitor on the cluster (issue 30, launch/jobs/clustermon.py), over real SSH on a
three-host namespace testbed provisioned by roles/cluster_monitor: the launching process and its SSH
sessions killed (the laptop gone), the job runs to its end under the monitor on node0, which reaches
the nodes with the role's key and known hosts; `status` and `stop` from another directory reach it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ansible.conftest import run, tool_env
from tests.cluster.test_launch_testbed import LAUNCH, job_pids, kill_job, make_inventory
from tests.conftest import private_testbed
from tests.testbed import Testbed, worker_net, worker_prefix

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PREFIX, NET = worker_prefix("dtc"), worker_net("10.213.180")
HOSTKEY = "ssh_host_ed25519_key.pub"  # where the testbed keeps each host's (tests/testbed)


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    with private_testbed(PREFIX, NET, 3) as tb:
        yield tb


def provision(tb: Testbed, root: Path, monitor: str = "node0", host_vars: dict | None = None,
              all_vars: dict | None = None, verify: bool = True) -> Path:  # fmt: skip
    """An inventory of the testbed, provisioned by playbooks/cluster_monitor.yml (roles/cluster_monitor)
    with its defaults: the key in the monitor host's ~/.ssh, every host key in its /etc/ssh/ssh_known_hosts
    (each host's own /root and /etc are overlays). Applied twice (the second changes nothing), then in check
    mode; with verify=False once (the tests that only need a provisioned cluster: test_detach proves the
    rest). host_vars and all_vars add to the inventory's (make_inventory).

    The testbed's sshd reads one shared authorized_keys file, so the line the role wrote on each host
    goes there, as it is (with its from=node0)."""
    hostkeys = {h.name: {"cluster_monitor_host_key": str(tb.state_dir / "hosts" / h.name / HOSTKEY),
                         **(host_vars or {}).get(h.name, {})} for h in tb.hosts()}  # fmt: skip
    inv = make_inventory(tb, root, host_vars=hostkeys,
                         all_vars={"ddp_monitor_dir": str(root / "monitor"), **(all_vars or {})})  # fmt: skip
    env = tool_env(Path(LAUNCH).parent, root / "facts")
    playbook = [str(Path(LAUNCH).parent / "ansible-playbook"), "-i", str(inv)]
    playbook.append("playbooks/cluster_monitor.yml")
    runs = (([], r"changed=[1-9]"), ([], r"changed=0 "), (["--check"], r"changed=0 "))
    for extra, changed in runs if verify else runs[:1]:
        res = run([*playbook, *extra], env)
        assert res.returncode == 0, res.stdout + res.stderr
        recap = res.stdout[res.stdout.index("PLAY RECAP") :]
        assert re.search(rf"{monitor}\s+: ok=\d+\s+{changed}", recap), recap
    lines = []
    address = next(h.ip for h in tb.hosts() if h.name == monitor)
    for h in tb.hosts():
        written = tb.state_dir / "hosts" / h.name / "ovl" / "root" / "upper" / ".ssh" / "authorized_keys"
        ours = [line for line in written.read_text().splitlines() if "ddp-cluster-monitor" in line]
        allowed = re.match(r'^from="([0-9.,]+)" ssh-ed25519 ', ours[0]) if len(ours) == 1 else None
        assert allowed and address in allowed.group(1).split(","), ours  # its SSH (and training) address
        lines += ours
    known = (
        tb.state_dir / "hosts" / monitor / "ovl" / "etc" / "upper" / "ssh" / "ssh_known_hosts"
    ).read_text()
    assert all(f"{h.name} ssh-ed25519 " in known and f"{h.ip} ssh-ed25519 " in known for h in tb.hosts()), (
        known
    )
    with open(tb.key_file.parent / "authorized_keys", "a") as f:  # every testbed sshd's AuthorizedKeysFile
        f.write(lines[0] + "\n")
    return inv


def launch(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)  # fmt: skip


def wait_for(what: str, check, timeout: float = 120):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return found


def state(root: Path, job: str) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((root / "monitor" / job / "job.json").read_text())
    return {}


def controller_sessions(tb: Testbed) -> list[int]:
    """The sshd processes on the hosts that serve a connection from the controller (the bridge)."""
    pids = []
    for h in tb.hosts():
        out = subprocess.run(["ip", "netns", "exec", h.netns, "ss", "-Htnp", "state", "established",
                              "( sport = :22 )"], capture_output=True, text=True).stdout  # fmt: skip
        for line in out.splitlines():
            if line.split()[3].rsplit(":", 1)[0] == tb.bridge_ip:
                pids += [int(p) for p in re.findall(r"pid=(\d+)", line)]
    return pids


def test_the_job_outlives_the_laptop_and_is_found_from_anywhere(bed: Testbed, tmp_path: Path) -> None:
    inv = provision(bed, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_STATE_HOME=str(tmp_path / "state"))
    other = tmp_path / "other-checkout"  # a second controller directory: no logs/ of the job there
    other.mkdir()
    job, long_job = "dt-laptop", "dt-stop"
    base = ["--hosts", str(inv), "--set", "log.interval_steps=2", "--detach"]
    try:
        laptop = subprocess.Popen(
            [LAUNCH, *base, "--set", "train.max_steps=60", "--set", "debug.step_delay_s=0.2", "--job-id",
             job],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        data = wait_for("the job to run", lambda: state(tmp_path, job).get("state") == "running" and
                        state(tmp_path, job))  # fmt: skip
        os.killpg(laptop.pid, signal.SIGKILL)  # the laptop gone: the launcher and its SSH connections
        for pid in controller_sessions(bed):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        out = laptop.communicate(timeout=10)[0]
        node0 = bed.hosts()[0]
        assert data["detached"] and data["pid"] in bed.pids(node0), (data, out)  # the monitor: on node0
        assert not [p for p, _ in job_pids(job) if not any(p in bed.pids(h) for h in bed.hosts())]
        final = wait_for("the job to finish", lambda: state(tmp_path, job).get("state") == "finished" and
                         state(tmp_path, job), timeout=180)  # fmt: skip
        assert final["exit_code"] == 0, final
        console = (tmp_path / "monitor" / job / "console.log").read_text()
        assert len(re.findall(r"ddp-train: final rank=\d world=3 step=60 ", console)) == 3, console

        status = launch(["status", job], other, env, timeout=60)
        assert status.returncode == 0, status.stdout
        assert f"job {job}: finished (exit 0)" in status.stdout and "(detached)" in status.stdout, (
            status.stdout
        )
        assert re.search(r"^node0\s+0\s+60/60\s", status.stdout, re.M), status.stdout
        logs = launch(["logs", job, "--node", "node1"], other, env, timeout=60)  # node1's own log, over SSH
        assert logs.returncode == 0 and re.search(r"ddp-train: final rank=1 world=3 step=60 ", logs.stdout), (
            logs.stdout
        )
        attach = launch(["attach", job], other, env, timeout=60)  # an ended job: its last lines, its code
        assert attach.returncode == 0 and f"attached to job {job} (finished (exit 0))" in attach.stdout, (
            attach.stdout
        )
        listed = launch(["jobs"], other, env, timeout=60)
        assert re.search(rf"^{job}\s+finished \(exit 0\)\s+3\s", listed.stdout, re.M), listed.stdout

        # a second laptop: the inventory, no record of the job; the monitor host is asked through --hosts
        laptop2 = dict(env, XDG_STATE_HOME=str(tmp_path / "laptop2-state"))
        unknown = launch(["status", job], other, laptop2, timeout=60)
        assert unknown.returncode == 2 and "add --hosts INVENTORY" in unknown.stdout, unknown.stdout
        status2 = launch(["status", job, "--hosts", str(inv)], other, laptop2, timeout=60)
        assert status2.returncode == 0 and status2.stdout.splitlines()[0] == status.stdout.splitlines()[0], (
            status2.stdout
        )
        assert re.search(r"^node0\s+0\s+60/60\s", status2.stdout, re.M), status2.stdout
        listed2 = launch(["jobs", "--hosts", str(inv)], other, laptop2, timeout=60)
        assert re.search(rf"^{job}\s+finished \(exit 0\)\s+3\s", listed2.stdout, re.M), listed2.stdout
        fetched = launch(["fetch", job, "metrics", "--hosts", str(inv), "--to", str(other / "got")], other,
                         laptop2, timeout=60)  # fmt: skip
        assert fetched.returncode == 0, fetched.stdout
        there = Path(json.loads((tmp_path / "monitor" / job / "job.json").read_text())["metrics"]["path"])
        there = there if there.is_absolute() else tmp_path / "work" / there  # the nodes share /tmp with us
        assert (other / "got" / "metrics.jsonl").read_bytes() == there.read_bytes()
        again = launch(["restart", "--hosts", str(inv), job, "--job-id", "dt-again"], other, laptop2)
        assert again.returncode == 0 and f"restart of job {job} in {other}: " in again.stdout, again.stdout
        assert "job dt-again runs detached on 3 nodes" in again.stdout, again.stdout
        resumed = wait_for("the restart to finish", lambda: state(tmp_path, "dt-again").get("state") ==
                           "finished" and state(tmp_path, "dt-again"), timeout=120)  # fmt: skip
        assert resumed["exit_code"] == 0, resumed
        log = (tmp_path / "monitor" / "dt-again" / "node0.log").read_text()
        assert re.search(r"resumed from \S+step-00000060\.pt at step 60 of job dt-laptop", log), log

        started = launch([*base, "--set", "train.max_steps=2000", "--set", "debug.step_delay_s=0.2",
                          "--job-id", long_job], tmp_path, env)  # fmt: skip
        assert started.returncode == 0 and f"job {long_job} runs detached on 3 nodes" in started.stdout, (
            started.stdout
        )
        assert "under setsid" in started.stdout, started.stdout  # no systemd as PID 1 in a testbed host
        log = tmp_path / "monitor" / long_job / "node0.log"
        wait_for(
            "a step line", lambda: log.exists() and re.search(r"INFO step [1-9]\d*/2000", log.read_text())
        )
        stop = launch(["stop", long_job], other, env, timeout=120)
        assert stop.returncode == 0, stop.stdout
        ranks = re.findall(r"ddp-train: stopped rank=(\d) world=3 step=\d+ signal=SIGTERM", stop.stdout)
        assert sorted(ranks) == ["0", "1", "2"], stop.stdout  # every rank saved
        assert state(tmp_path, long_job)["exit_code"] == 143
    finally:
        kill_job(job)
        kill_job(long_job)
        kill_job("dt-again")
