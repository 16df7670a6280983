"""Shared by the test_el9_sim*.py and test_el10_sim.py modules: each has EL simulation hosts of its own
(prefix and net), so README's `pytest -n 4 --dist loadfile` runs them on different workers at the same
time."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import tests.conftest as root_conftest
from tests import testbed as testbed_mod
from tests.ansible.conftest import molecule_step, molecule_test, recaps, run, tool_env

SIM = "/var/lib/ddp-sim"


def sh(tb, host: int, cmd: str, check: bool = True) -> str:
    return tb.ssh(tb.hosts()[host].name, cmd, check=check).stdout


@contextlib.contextmanager
def molecule_converged(
    scenario: str,
    prefix: str,
    net: str,
    os_name: str,
    venv_bin: Path,
    hosts: tuple[str, ...] = ("node0", "node1"),
) -> Iterator:
    """The scenario's hosts (`hosts`, as its create.yml brings them up) after `molecule test -s <scenario>
    --destroy never`: converged (changed > 0 on each), idempotent (changed=0) and verified; yields
    (Testbed, molecule's output) and destroys them at the end."""
    root_conftest.require_testbed()
    # --destroy never skips the sequence's first destroy too: an interrupted earlier run's state
    # ("instances already created", without its inventory) would make this converge nothing.
    run([str(venv_bin / "molecule"), "destroy", "-s", scenario], tool_env(venv_bin), 300)
    try:
        out = molecule_test(scenario, venv_bin, "--destroy", "never")
        converge = recaps(molecule_step(out, scenario, "converge"))
        idempotence = recaps(molecule_step(out, scenario, "idempotence"))
        assert sorted(converge) == sorted(hosts) and all(c > 0 for c in converge.values()), converge
        assert idempotence == dict.fromkeys(hosts, 0), idempotence
        assert f"[{scenario} > verify] Executed: Successful" in out
        yield testbed_mod.Testbed(prefix=prefix, net=net, os=os_name), out
    finally:
        run([str(venv_bin / "molecule"), "destroy", "-s", scenario], tool_env(venv_bin), 300)
        netns = os.popen("ip netns list").read()
        assert f"{prefix}-node" not in netns, "molecule destroy left namespaces behind"
