"""The roles' EL code paths on EL9 simulation hosts (tests/testbed --os rocky9: real dnf 4.14 and rpm
against local repositories, simulated GPUs and reboot).

`molecule test -s el9-sim --destroy never` converges site.yml (without its GPU allreduce) on node0
(8 GPUs + NVSwitches) and node1 (8 GPUs), checks idempotence (changed=0) and the scenario's verify; the
tests below then use the converged hosts: verify.yml refusing the gloo fallback and a port range a later
sysctl file undid. Prefix el9s (the scenario's). The post-reboot health checks and a kernel that lost its
module (test_el9_sim_driver.py), a driver branch change (test_el9_sim_branch.py) and `--check` on a fresh
host (test_el9_sim_check.py) run on hosts of their own, on other pytest-xdist workers: this module, the
longest, must not grow (a branch change on its node1 would save a 1-host converge of ~2 min but add ~9 min
to it under the loaded -n 4 run)."""

from __future__ import annotations

import re

import pytest

from tests.ansible.el_sim import molecule_converged, sh

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]

INVENTORY = ["-i", "inventory/testbed-el9s/hosts.yml", "-i", "molecule/el9-sim/inventory/"]


@pytest.fixture(scope="module")
def el9(venv_bin):
    """The converged el9-sim hosts (molecule test without its final destroy), destroyed at the end."""
    with molecule_converged("el9-sim", "el9s", "10.213.54", "rocky9", venv_bin) as (tb, _):
        yield tb


def test_verify_refuses_gloo_on_gpu_nodes(el9, playbook):
    """The venv has torch's CPU build: the allreduce works, with gloo, and that is a failure on GPU nodes.
    Before it, the compile check passed on both: the role installed python3.11-devel and gcc (the hosts
    have no Python headers without the package), and a torch.compile'd function ran on node0's CPU
    (node1 checks the headers only: molecule/el9-sim/inventory/host_vars/node1.yml)."""
    res = playbook(*INVENTORY, "playbooks/verify.yml")
    assert res.returncode == 2, res.out[-3000:]
    assert "ddp-compilecheck" not in res.out and "cannot build a C extension" not in res.out, res.out[-3000:]
    for node in ("node0", "node1"):
        assert f"{node} has 8 NVIDIA GPUs but the allreduce ran with gloo, not nccl" in res.out, res.out[
            -3000:
        ]
    assert re.search(r"rank 0/2 gloo", res.out) is None, "the bandwidth report is not reached"


def test_verify_names_a_port_range_another_sysctl_file_undid(el9, playbook):
    sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='32768 60999'")
    try:
        res = playbook(*INVENTORY, "playbooks/verify.yml", "-e", "verify_torch_compile=false")
    finally:
        sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='50000 51999'")
    assert res.returncode == 2, res.out[-3000:]
    assert (
        "node1: net.ipv4.ip_local_port_range is 32768-60999, not the 50000-51999 the firewall opens"
        in res.out
    )


def test_verify_catches_a_node_without_the_python_headers(el9, playbook):
    """A node without python3.11-devel fails in site.yml's verify, in one line naming the package, not at
    the first compiled training step (Triton builds its launcher against Python.h there)."""
    sh(el9, 1, "rpm -e --nodeps python3.11-devel && test ! -e /usr/include/python3.11/Python.h")
    try:
        res = playbook(*INVENTORY, "playbooks/verify.yml", "-e", "verify_torch_compile=false")
    finally:
        sh(el9, 1, "dnf -q -y install python3.11-devel")
    assert res.returncode == 2, res.out[-3000:]
    assert re.search(
        r"node1: \S+ cannot build a C extension against Python 3\.11's headers \(/usr/include/python3\.11\): "
        r".*Python\.h: No such file or directory; install the Python 3\.11 headers \(EL: python3\.11-devel",
        res.out,
    ), res.out[-3000:]
    assert "node0: " not in res.out.split("TASK [Check that the node compiles]")[1].split("TASK [")[0]
