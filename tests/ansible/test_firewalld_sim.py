"""firewalld executed for real (issue #25): EL sim hosts run a private D-Bus and firewalld, as every real
EL host does. Where firewalld is running, `firewall_backend: auto` takes the firewalld path and the real
firewalld 1.3 applies its rules: that converge, its idempotence, the rules, a peer reaching MASTER_PORT
and the ephemeral range, an outsider reaching neither, and a new SSH connection run in molecule el9-sim
(its create.yml starts firewalld, verify.yml checks them). Here, on two Rocky 9 sim hosts: where
firewalld is not running and no systemd can start it, auto takes the nftables path and
`firewall_backend: firewalld` stops in one line (the sim's stand-in for a disabled firewalld; a masked
unit needs systemd, which the sim hosts do not run)."""

from __future__ import annotations

import pytest

import tests.conftest as root_conftest
from tests.testbed.el import firewalld as sim_firewalld

pytestmark = [pytest.mark.testbed, pytest.mark.slow]


@pytest.fixture(scope="module")
def el_hosts():
    if sim_firewalld.missing():
        root_conftest.require_testbed(f"needs {', '.join(sim_firewalld.missing())} (firewalld, dbus-daemon)")
    with root_conftest.private_testbed("fwd", "10.213.164", 2, os="rocky9", gpus=0, firewalld=True) as tb:
        yield tb


def test_without_a_running_firewalld_auto_takes_nftables_and_firewalld_is_refused(el_hosts, playbook):
    tb = el_hosts
    node1 = tb.hosts()[1]
    pid = (tb.state_dir / "hosts" / node1.name / "firewalld.pid").read_text().strip()
    tb.exec(node1, f"kill {pid}; while firewall-cmd --state >/dev/null 2>&1; do sleep 0.2; done")
    refused = playbook("-i", str(tb.inventory), "-e", "firewall_backend=firewalld", "playbooks/base.yml")
    assert refused.returncode != 0
    assert "firewall_backend is firewalld but firewalld is not running on node1" in refused.out, refused.out[
        -3000:
    ]
    auto = playbook("-i", str(tb.inventory), "playbooks/base.yml")
    assert auto.returncode == 0, auto.out[-4000:]
    assert "policy accept;" in tb.exec(node1, "nft list table inet ddp_train").stdout
