"""`molecule test -s default` on the namespace testbed: create, converge, idempotence (changed=0),
verify (real state and an allreduce across three hosts), destroy. Takes a few minutes (it installs
torch into three venvs); it uses the testbed prefix mol and net 10.213.53."""

from __future__ import annotations

import re
import subprocess

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import molecule_step, molecule_test, recaps

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


@pytest.mark.timeout(1800)
def test_molecule_default_scenario(venv_bin):
    root_conftest.require_testbed()
    out = molecule_test("default", venv_bin)
    converge = recaps(molecule_step(out, "default", "converge"))
    assert sorted(converge) == ["node0", "node1", "node2"] and all(c > 0 for c in converge.values()), converge
    idempotence = recaps(molecule_step(out, "default", "idempotence"))
    assert idempotence == {"node0": 0, "node1": 0, "node2": 0}, idempotence
    verify = molecule_step(out, "default", "verify")
    assert len(re.findall(r"rank \d/3 gloo 16\.0 MiB: busbw [0-9.]+ GB/s", verify)) == 3
    outsider = r"TASK \[Connect from the outsider to MASTER_PORT and to the ephemeral range \(refused\)\]"
    assert re.search(outsider + r".*?ok: \[node0 -> localhost\] => \(item=29500\)", verify, re.S)
    exporter = r"TASK \[Connect from the outsider to the admin's exporter"
    assert re.search(exporter + r".*?ok: \[node0 -> localhost", verify, re.S)
    assert "default > destroy: Executed: Successful" in out
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mol-node" not in netns, "molecule destroy left namespaces behind"
