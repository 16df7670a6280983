"""firewalld executed for real (issue #25): EL sim hosts run a private D-Bus and firewalld, as every real
EL host does, so `firewall_backend: auto` takes the firewalld path and its rules are applied by the real
firewalld 1.3 (nftables backend) in each host's network namespace.

Two Rocky 9 sim hosts and an outsider on their bridge (in ddp_network_cidr, not in the inventory):
base.yml converges and is idempotent; a peer reaches MASTER_PORT and the ephemeral range, the outsider
reaches neither; SSH stays open. Where firewalld is not running and no systemd can start it, auto takes
the nftables path and `firewall_backend: firewalld` stops in one line (the sim's stand-in for a disabled
firewalld; a masked unit needs systemd, which the sim hosts do not run)."""

from __future__ import annotations

import re
import subprocess

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT
from tests.testbed import outsider
from tests.testbed.el import firewalld as sim_firewalld

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PROBE = REPO_ROOT / "molecule" / "default" / "files" / "port_probe.py"
RECAP = r"^(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0"


@pytest.fixture(scope="module")
def el_hosts():
    if sim_firewalld.missing():
        root_conftest.require_testbed(f"needs {', '.join(sim_firewalld.missing())} (firewalld, dbus-daemon)")
    with root_conftest.private_testbed("fwd", "10.213.164", 2, os="rocky9", gpus=0, firewalld=True) as tb:
        yield tb


def _connect_from_outsider(tb, ip: str, port: int) -> bool:
    argv = ["ip", "netns", "exec", outsider.ensure(tb), "python3", str(PROBE), "connect", ip, str(port), "3"]
    return subprocess.run(argv, capture_output=True, text=True).returncode == 0


def test_auto_takes_the_running_firewalld_and_opens_the_training_ports_to_the_nodes_only(el_hosts, playbook):
    tb = el_hosts
    node0, node1 = tb.hosts()
    first = playbook("-i", str(tb.inventory), "playbooks/base.yml")
    assert first.returncode == 0, first.out[-4000:]
    second = playbook("-i", str(tb.inventory), "playbooks/base.yml")
    assert second.returncode == 0, second.out[-4000:]
    assert sorted(re.findall(RECAP, second.out, re.M)) == [("node0", "0"), ("node1", "0")], second.out[-3000:]
    assert "inet ddp_train" not in tb.exec(node0, "nft list tables").stdout  # no table beside firewalld

    rules = tb.exec(node0, "firewall-cmd --list-rich-rules").stdout.splitlines()
    assert sorted(rules) == sorted(
        f'rule family="ipv4" source address="{h.ip}" port port="{port}" protocol="tcp" accept'
        for h in (node0, node1)
        for port in ("29500", "50000-51999")
    )
    assert "22/tcp" in tb.exec(node0, "firewall-cmd --list-ports").stdout.split()

    tb.exec(node0, f"python3 {PROBE} listen 0.0.0.0 30 29500 50999 >/dev/null 2>&1 & sleep 1")
    peer = {
        p: tb.exec(node1, f"python3 {PROBE} connect {node0.ip} {p} 3", check=False).returncode
        for p in (29500, 50999)
    }
    stranger = {p: _connect_from_outsider(tb, node0.ip, p) for p in (29500, 50999)}
    assert peer == {29500: 0, 50999: 0}
    assert stranger == {29500: False, 50999: False}
    assert tb.ssh(node0, "true", check=False).returncode == 0  # a new SSH connection


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
