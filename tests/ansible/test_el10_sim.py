"""The roles' EL10 code paths on Rocky 10.1 simulation hosts (tests/testbed --os rocky10: real dnf and rpm
against local repositories laid out as NVIDIA's rhel10 one, no module streams, an OpenPGP v6 key in the
rpmdb; simulated GPUs and reboot).

`molecule test -s el10-sim --destroy never` converges site.yml (without its GPU allreduce) on node0
(8 GPUs + NVSwitches): the driver branch is locked with versionlock before the install
(branchlock-RedHat.yml), NVIDIA's key is imported beside the v6 key, the venv is made from EL10's
python3; then idempotence (changed=0) and the scenario's verify. A branch change (580 -> 590, the
distro-sync of sync-RedHat.yml) then runs on node0, and Fabric Manager follows the driver. One host:
what a second one proves (a peer through the firewall, a host without NVSwitch) molecule el9-sim proves
with the same roles' code. Prefix el10s, net 10.213.66."""

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
    """The converged el10-sim host (molecule test without its final destroy), destroyed at the end."""
    with molecule_converged("el10-sim", "el10s", "10.213.66", "rocky10", venv_bin, ("node0",)) as (tb, out):
        # The EL10 path ran, not EL9's module streams.
        assert "TASK [nvidia_driver : Lock the driver branch]" in molecule_step(out, "el10-sim", "converge")
        assert "Read the enabled nvidia-driver stream" not in out
        yield tb


def test_changing_the_driver_branch_on_el10_relocks_and_syncs(el10, playbook):
    """node0 moves from 580 to 590 (both serve CUDA 13): the 580 locks go, NVIDIA's `*nvidia*590*` lock
    comes, and the installed driver packages are distro-synced to 590, Fabric Manager (an NVSwitch host)
    and libnvsdm with them, so the fabric still comes up; a second run changes nothing."""
    args = [*INVENTORY, "-e", json.dumps({"gpu_stack_driver_branch": "590"})]
    res = playbook(*args, "playbooks/gpu.yml")
    assert res.returncode == 0, res.out[-4000:]
    locks = sh(el10, 0, "dnf -q versionlock list").split()
    driver = [x for x in locks if re.search(r"nvidia|^libnvsdm-|^nvlink5-", x)]
    assert driver and all(":590.44.01-" in x for x in driver), locks
    query = "rpm -qa --queryformat '%{NAME}-%{VERSION}\\n' '*nvidia*' libnvsdm | sort"
    installed = sh(el10, 0, query).split()
    assert installed and all("-590.44.01" in p for p in installed), installed
    assert {"nvidia-fabricmanager-590.44.01", "libnvsdm-590.44.01"} <= set(installed), installed
    assert "590.44.01" in sh(el10, 0, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    fabric = sh(el10, 0, "nvidia-smi -q | grep -A2 '^ *Fabric$'")
    assert re.findall(r"State\s+: (.+)", fabric) == ["Completed"] * 8, fabric
    assert re.findall(r"Status\s+: (.+)", fabric) == ["Success"] * 8, fabric
    again = playbook(*args, "playbooks/gpu.yml")
    assert again.returncode == 0 and recaps(again.out) == {"node0": 0}, again.out[-3000:]
