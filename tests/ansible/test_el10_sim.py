"""The roles' EL10 code paths on Rocky 10.1 simulation hosts (tests/testbed --os rocky10: real dnf and rpm
against local repositories laid out as NVIDIA's rhel10 one, no module streams, an OpenPGP v6 key in the
rpmdb; simulated GPUs and reboot).

`molecule test -s el10-sim --destroy never` converges site.yml (without its GPU allreduce) on node0
(8 GPUs + NVSwitches) and node1 (8 GPUs): the driver branch is locked with versionlock before the install
(branchlock-RedHat.yml), NVIDIA's key is imported beside the v6 key, the venv is made from EL10's
python3; then idempotence (changed=0) and the scenario's verify. A branch change (580 -> 590, the
distro-sync of sync-RedHat.yml) then runs on node1. Prefix el10s, net 10.213.66."""

from __future__ import annotations

import json
import re

import pytest

from tests.ansible.conftest import molecule_step
from tests.ansible.el_sim import molecule_converged, recaps, sh

# The module's converge counts towards its first test's 600 s.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]

INVENTORY = ["-i", "inventory/testbed-el10s/hosts.yml", "-i", "molecule/el10-sim/inventory/"]


@pytest.fixture(scope="module")
def el10(venv_bin):
    """The converged el10-sim hosts (molecule test without its final destroy), destroyed at the end."""
    with molecule_converged("el10-sim", "el10s", "10.213.66", "rocky10", venv_bin) as (tb, out):
        # The EL10 path ran, not EL9's module streams.
        assert "TASK [nvidia_driver : Lock the driver branch]" in molecule_step(out, "el10-sim", "converge")
        assert "Read the enabled nvidia-driver stream" not in out
        yield tb


def test_changing_the_driver_branch_on_el10_relocks_and_syncs(el10, playbook):
    """node1 moves from 580 to 590 (both serve CUDA 13): the 580 locks go, NVIDIA's `*nvidia*590*` lock
    comes, and the installed driver packages are distro-synced to 590; a second run changes nothing."""
    args = [*INVENTORY, "--limit", "node1", "-e", json.dumps({"gpu_stack_driver_branch": "590"})]
    res = playbook(*args, "playbooks/gpu.yml")
    assert res.returncode == 0, res.out[-4000:]
    locks = sh(el10, 1, "dnf -q versionlock list").split()
    driver = [x for x in locks if re.search(r"nvidia|^libnvsdm-|^nvlink5-", x)]
    assert driver and all(":590.44.01-" in x for x in driver), locks
    query = "rpm -qa --queryformat '%{NAME}-%{VERSION}\\n' '*nvidia*' libnvsdm | sort"
    installed = sh(el10, 1, query).split()
    assert installed and all("-590.44.01" in p for p in installed), installed
    assert "590.44.01" in sh(el10, 1, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    again = playbook(*args, "playbooks/gpu.yml")
    assert again.returncode == 0 and recaps(again.out) == {"node1": 0}, again.out[-3000:]
