"""Shared fixtures: the repo paths and the multi-host namespace testbed (one per session)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One intra-op thread in every test process and what it starts (ddp-launch already gives its ranks
# OMP_NUM_THREADS=1, launch/plan/plan.py). Set before torch loads: libgomp reads it when it loads. Under
# `-n 4` on 2 cores, torch's second thread spin-waits for a core the other workers hold. Beside two busy
# processes, the torch-heavy unit modules (train_loop, train_gpu_round2, train_eval) took 60 CPU-s with
# two threads and 38 with one; a 40-step gpt-tiny run 9.5-13 and 5.3-5.6 (alone: 5.4-5.8 and 4.7-4.9).
# Numerics tests compare runs of one setting, never across settings.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# ansible-core replaces sys.intern with a callable class when it loads an inventory; torch's dynamo
# registers a polyfill for sys.intern on first use (any optimizer step) and refuses a non-function.
# The launcher's process never runs an optimizer, but this one test process does both: register the
# polyfill while sys.intern is still the builtin.
import torch._dynamo.polyfills.sys  # noqa: F401  (must precede any ansible import)

from tests.testbed import DEFAULT_NET, DEFAULT_PREFIX, Testbed, TestbedError, worker_net, worker_prefix

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def testbed_missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not Path("/usr/sbin/sshd").exists() or shutil.which("ip") is None:
        return "needs openssh-server and iproute2 (bash .ci/setup --with-testbed)"
    return None


def require_testbed(extra_reason: str | None = None) -> None:
    """Skip when the testbed cannot be built here; in CI fail, so a broken setup cannot pass as green."""
    reason = testbed_missing_reason() or extra_reason
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"testbed unavailable in CI: {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def private_testbed(prefix: str, net: str, hosts: int, **up: Any) -> Iterator[Testbed]:
    """A testbed of the caller's own (`up` takes Testbed.up's options; os= picks the OS of the hosts).

    Every module uses a prefix and net of its own: README's `pytest -n 4 --dist loadfile` runs a module
    on one worker, and modules on different workers at the same time."""
    require_testbed()
    tb = Testbed(prefix=prefix, net=net, os=up.pop("os", "debian"), train_net=up.pop("train_net", None))
    try:
        tb.up(hosts, **up)
    except TestbedError as e:
        tb.down()
        pytest.fail(f"testbed {prefix} up failed: {e}")
    try:
        yield tb
    finally:
        tb.down()


# Under pytest-xdist (README: -n 4 --dist loadfile --no-loadscope-reorder) the workers take modules in
# collection order: the longest first, then every other module with a slow test, then the rest, so that
# no worker starts a long module while the others run out of work. The order is the modules' wall time
# in a profiled -n 4 run on the loaded 2-core machine (--durations=0, setup + call + teardown): el9_sim
# 1865 s, el10_sim > 1500 s, el_driver_packages > 975 s, lint 845 s, molecule 795 s, check_mode 452 s,
# el9_sim_check 386 s. Since then el9_sim took in el9_sim_driver's and el9_sim_branch's cases (1196 s and
# 675 s in that run, on hosts of their own) and el10_sim went to one host: alone, beside each other, they
# took 772 s and 536 s (el9_sim's molecule run 505 s, 815 s under -n 4). firewalld_sim (616 s) is out:
# its firewalld converge moved into molecule el9-sim, and the rest takes ~40 s. The Slurm testbed module
# (1251 s in stop 55's profiled -n 4 run, the longest then) goes second.
LONGEST_FIRST = (
    "tests/ansible/test_el9_sim.py",
    "tests/cluster/test_launch_slurm_testbed.py",
    "tests/ansible/test_el10_sim.py",
    "tests/ansible/test_el_driver_packages.py",
    "tests/ansible/test_lint.py",
    "tests/ansible/test_molecule.py",
    "tests/ansible/test_check_mode.py",
    "tests/ansible/test_el9_sim_check.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def order(item: pytest.Item) -> tuple[int, bool]:
        module = item.nodeid.split("::")[0]
        first = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, module not in slow

    items.sort(key=order)  # stable: within a module, and among the rest, the collection order stays


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_bin() -> Path:
    return VENV_BIN


@pytest.fixture(scope="session")
def testbed():
    """Three namespace hosts (node0..node2) with sshd, torn down at the end of the session.

    In CI a missing prerequisite fails instead of skipping, so a broken setup cannot pass as green.
    Each pytest-xdist worker has its own (worker_prefix, worker_net).
    """
    with private_testbed(worker_prefix(DEFAULT_PREFIX), worker_net(DEFAULT_NET), 3) as tb:
        yield tb


@pytest.fixture(scope="session")
def users_tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token files made by `ddp-train prepare`, for runs in the users' configuration (tests/usershape.py)."""
    from tests.usershape import prepared_tokens

    return prepared_tokens(tmp_path_factory.mktemp("users"))
