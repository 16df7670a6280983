"""Shared by the test_el9_sim*.py modules: each has EL9 simulation hosts of its own (prefix and net),
so README's `pytest -n 4 --dist loadfile` runs them on different workers at the same time."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT, run, tool_env

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SIM = "/var/lib/ddp-sim"
# The el9-sim scenario's variables (its inventory source holds group_vars only).
SCENARIO_VARS = ["-i", "molecule/el9-sim/inventory/"]


def recaps(out: str) -> dict[str, int]:
    return {h: int(c) for h, c in re.findall(r"(node\d)\s+: ok=\d+\s+changed=(\d+)", out)}


def sh(tb, host: int, cmd: str, check: bool = True) -> str:
    return tb.ssh(tb.hosts()[host].name, cmd, check=check).stdout


@contextlib.contextmanager
def gpu_converged(prefix: str, net: str, venv_bin: Path, facts: Path, **up) -> Iterator:
    """One EL9 sim host (node0, 8 GPUs; `up` as private_testbed's) after playbooks/gpu.yml converged it,
    with the el9-sim scenario's variables: the GPU stack the scenario's converge installs."""
    with root_conftest.private_testbed(prefix, net, 1, os="rocky9", gpus=8, **up) as tb:
        argv = [str(venv_bin / "ansible-playbook"), "-i", str(tb.inventory), *SCENARIO_VARS]
        env = tool_env(venv_bin, facts, MOLECULE_PROJECT_DIRECTORY=str(REPO_ROOT))
        res = run([*argv, "playbooks/gpu.yml"], env, 900, merge=True)
        assert res.returncode == 0 and recaps(res.stdout)["node0"] > 0, ANSI.sub("", res.stdout)[-4000:]
        yield tb
