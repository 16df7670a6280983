"""Helpers shared by the reliability tests: private testbeds, local inventories, job processes, cleanup.

The launcher helpers (Launcher, make_inventory, job_pids, ...) come from the launcher's own testbed
tests and the trainer helpers from tests/integration/trainrun.py; only what they lack lives here.
"""

from __future__ import annotations

import re
import secrets
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.test_launch_testbed import Launcher, job_pids, kill_job
from tests.conftest import private_testbed, testbed_missing_reason  # noqa: F401 (re-exported)
from tests.testbed import free_port

LAUNCH = str(Path(sys.executable).parent / "ddp-launch")
# tests.cluster's FINAL knows only testbed names (nodeN); this one takes any inventory host name.
FINAL = re.compile(
    r"^\[(.+?) r(\d+)\] ddp-train: final rank=(\d+) world=(\d+) step=(\d+) .*params_sha256=(\w+)$"
)


def job_id(tag: str) -> str:
    """A job id unique to this test run (DDP_JOB_ID is how processes are found and cleaned up)."""
    return f"rl-{tag}-{secrets.token_hex(3)}"


def local_inventory(root: Path, nodes: int = 2, port: int | None = None, **variables: object) -> Path:
    """Like inventory/local (local nodes, no SSH) but on a free port, so parallel runs cannot collide."""
    inv = {
        "all": {
            "children": {"gpu_nodes": {"hosts": {f"local{i}": None for i in range(nodes)}}},
            "vars": {
                "ansible_connection": "local",
                "ansible_host": "127.0.0.1",
                "ddp_nproc_per_node": 1,
                "ddp_master_port": port or free_port(),
                **variables,
            },
        }
    }
    path = root / "local-inventory.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def proc_env(pid: int) -> dict[str, str]:
    """The environment of a live process ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def worker_pid(job: str, rank: int) -> int:
    """The trainer worker (not the torchrun agent) with global RANK `rank` of a job."""
    for pid, cmd in job_pids(job):
        if "torchrun" not in cmd and "ddp_train" in cmd and proc_env(pid).get("RANK") == str(rank):
            return pid
    raise AssertionError(f"no worker with RANK={rank} in job {job}: {job_pids(job)}")


def finals(lines: list[str]) -> list[tuple[str, ...]]:
    """(host, node rank, rank, world, step, sha) of every `ddp-train: final` line of a launch."""
    return [m.groups() for m in map(FINAL.match, lines) if m]


def stop(run: Launcher, job: str) -> None:
    """Test cleanup: a launcher still running tears its job down (Launcher.stop); then kill stragglers."""
    run.stop()
    kill_job(job)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):  # noqa: ANN001, ANN201
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}")


# The run every interrupted-and-resumed job is compared with: 30 steps, a checkpoint every 10, decay
# pinned to 30 so it never depends on where a run stopped. Only these flags change the numbers.
TRAIN_30 = [
    "--set", "train.max_steps=30", "--set", "train.decay_steps=30", "--set", "checkpoint.interval_steps=10",
    "--set", "log.interval_steps=1",
]  # fmt: skip
