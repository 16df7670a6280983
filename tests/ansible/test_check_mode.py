"""Check mode is safe: site.yml's provisioning plays in --check on fresh hosts fail nowhere and change
nothing (hosts file, firewall, sysctl, venv all as before)."""

from __future__ import annotations

import re

import pytest

import tests.conftest as root_conftest

pytestmark = pytest.mark.testbed

NO_GPU = ["-e", "nvidia_driver_require_gpu=false cuda_toolkit_require_gpu=false nccl_require_gpu=false"]
STATE = "cat /etc/hosts; ls -a /opt; nft list ruleset; cat /proc/sys/net/ipv4/ip_local_port_range"


@pytest.fixture(scope="module")
def fresh_hosts():
    """Three hosts of this module's own, each hostname on 127.0.1.1 as Debian's installer writes it."""
    with root_conftest.private_testbed("rxchk", "10.213.72", 3, loopback_hostname=True) as tb:
        yield tb


@pytest.mark.slow
def test_check_mode_on_fresh_hosts_changes_nothing(fresh_hosts, playbook):
    before = {h.name: fresh_hosts.ssh(h, STATE).stdout for h in fresh_hosts.hosts()}
    assert all("127.0.1.1" in s and "ddp-train" not in s for s in before.values())

    res = playbook("--check", "-i", str(fresh_hosts.inventory), *NO_GPU, "molecule/default/converge.yml")

    assert res.returncode == 0, res.out[-4000:]
    recaps = re.findall(r"^(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0", res.out, re.M)
    assert sorted(n for n, _ in recaps) == ["node0", "node1", "node2"]
    assert all(int(c) > 0 for _, c in recaps), "check mode should predict the changes a real run makes"
    after = {h.name: fresh_hosts.ssh(h, STATE).stdout for h in fresh_hosts.hosts()}
    assert after == before
