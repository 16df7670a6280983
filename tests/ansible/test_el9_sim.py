"""The roles' EL code paths on EL9 simulation hosts (tests/testbed --os rocky9: real dnf 4.14 and rpm
against local repositories, simulated GPUs and reboot).

`molecule test -s el9-sim --destroy never` converges site.yml (without its GPU allreduce) on node0
(8 GPUs + NVSwitches) and node1 (8 GPUs), checks idempotence (changed=0) and the scenario's verify; the
tests below then use the converged hosts: verify.yml refusing the gloo fallback and a port range a later
sysctl file undid, then a driver branch change on node1 (last: it leaves node1 on another branch).
Prefix el9s (the scenario's). The post-reboot health checks and a kernel that lost its module
(test_el9_sim_driver.py) and `--check` on a fresh host (test_el9_sim_check.py) run on hosts of their
own, on other pytest-xdist workers."""

from __future__ import annotations

import json
import re

import pytest

from tests.ansible.el_sim import molecule_converged, recaps, sh
from tests.testbed import el as testbed_el

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]

INVENTORY = ["-i", "inventory/testbed-el9s/hosts.yml", "-i", "molecule/el9-sim/inventory/"]


@pytest.fixture(scope="module")
def el9(venv_bin):
    """The converged el9-sim hosts (molecule test without its final destroy), destroyed at the end."""
    with molecule_converged("el9-sim", "el9s", "10.213.54", "rocky9", venv_bin) as (tb, _):
        yield tb


def test_verify_refuses_gloo_on_gpu_nodes(el9, playbook):
    """The venv has torch's CPU build: the allreduce works, with gloo, and that is a failure on GPU nodes."""
    res = playbook(*INVENTORY, "playbooks/verify.yml")
    assert res.returncode == 2, res.out[-3000:]
    for node in ("node0", "node1"):
        assert f"{node} has 8 NVIDIA GPUs but the allreduce ran with gloo, not nccl" in res.out, res.out[
            -3000:
        ]
    assert re.search(r"rank 0/2 gloo", res.out) is None, "the bandwidth report is not reached"


def test_verify_names_a_port_range_another_sysctl_file_undid(el9, playbook):
    sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='32768 60999'")
    try:
        res = playbook(*INVENTORY, "playbooks/verify.yml")
    finally:
        sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='50000 51999'")
    assert res.returncode == 2, res.out[-3000:]
    assert (
        "node1: net.ipv4.ip_local_port_range is 32768-60999, not the 50000-51999 the firewall opens"
        in res.out
    )


def test_changing_the_driver_branch_resets_the_stream_and_relocks(el9, playbook):
    """node1 (8 GPUs, no NVSwitch) moves from 580-open (cu130) to 575-open with torch's cu126 stack: dnf
    alone refuses to switch an enabled stream; the role resets it, syncs the packages down, and locks the
    new versions only."""
    stack = {"gpu_stack_torch_cuda": "cu126", "gpu_stack_driver_branch": "575"}
    args = [*INVENTORY, "--limit", "node1", "-e", json.dumps(stack), "playbooks/gpu.yml"]
    # The NVIDIA Container Toolkit, from its own repo, locked at the older of its two versions: not the
    # driver's, so its locks stay and it is not distro-synced to 1.18.0.
    toolkit = ["libnvidia-container1", "libnvidia-container-tools", "nvidia-container-toolkit-base"]
    toolkit.append("nvidia-container-toolkit")
    repo = testbed_el.build().repo_url("nvidia-container-toolkit")
    sh(
        el9,
        1,
        "printf '[nvidia-container-toolkit]\\nname=nvidia-container-toolkit\\nbaseurl=%s\\nenabled=1\\n"
        f"gpgcheck=0\\n' {repo} > /etc/yum.repos.d/nvidia-container-toolkit.repo && "
        f"dnf -q -y install nvidia-container-toolkit-1.17.8 && dnf -q versionlock add {' '.join(toolkit)}",
    )
    toolkit_locks = sorted(x for x in sh(el9, 1, "dnf -q versionlock list").split() if "container" in x)
    assert len(toolkit_locks) == 4, toolkit_locks

    res = playbook(*args)
    assert res.returncode == 0, res.out[-4000:]

    stream = sh(
        el9, 1, "dnf -q module list --enabled nvidia-driver | awk '$1 == \"nvidia-driver\" {print $2}'"
    )
    assert stream.strip() == "575-open"
    locks = sh(el9, 1, "dnf -q versionlock list").split()
    nvidia = [lock for lock in locks if "nvidia" in lock and "container" not in lock]
    assert nvidia and all(":575.57.08-" in lock for lock in nvidia), locks
    assert sorted(lock for lock in locks if "container" in lock) == toolkit_locks
    versions = sh(el9, 1, f"rpm -q --queryformat '%{{VERSION}}\\n' {' '.join(toolkit)}").split()
    assert versions == ["1.17.8"] * 4, versions
    assert sorted(lock for lock in locks if "nccl" in lock) == [
        "libnccl-0:2.29.3-1+cuda12.9.*",
        "libnccl-devel-0:2.29.3-1+cuda12.9.*",
    ]
    installed = sh(el9, 1, "rpm -qa --queryformat '%{NAME}-%{VERSION}\\n' '*nvidia*' | sort").split()
    assert all("-575.57.08" in p for p in installed if "container" not in p), installed
    assert "release 12.6" in sh(el9, 1, "/usr/local/cuda-12.6/bin/nvcc --version")
    assert "575.57.08" in sh(el9, 1, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    # the second run with the new branch changes nothing
    again = playbook(*args)
    assert again.returncode == 0 and recaps(again.out) == {"node1": 0}, again.out[-3000:]
