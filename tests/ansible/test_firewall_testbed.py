"""The firewall role on live namespace hosts (nftables backend), seen from the network (issue #24).

Three nodes with a separate training network (as on a real cluster: SSH on one bridge, training on
another) and an outsider: a fourth namespace on the training bridge that is not in the inventory.
node2 has the admin's own `inet filter` table (policy drop; SSH, a node exporter on 9100 and the
training subnet allowed), as a site firewall would. After base.yml (cluster_hosts + firewall):
  * a peer reaches MASTER_PORT and the ephemeral range of node2; the outsider reaches neither
    (before #24 the whole ddp_network_cidr was trusted: any host on it could reach the unauthenticated
    TCPStore and gloo ports);
  * the outsider still reaches the exporter the admin's table allows (before #24 the role's table had
    `policy drop`, and a drop in any table is final: it silently closed the admin's services);
  * SSH stays open, and a second run changes nothing.
"""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT, run, tool_env
from tests.testbed import outsider

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PROBE = REPO_ROOT / "molecule" / "default" / "files" / "port_probe.py"
MASTER_PORT, RANGE_PORT, EXPORTER_PORT = 29500, 50999, 9100
ADMIN_TABLE = """table inet filter {
  chain input {
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iif "lo" accept
    tcp dport 22 accept
    tcp dport %(exporter)d accept
    ip saddr %(train)s.0/24 accept
  }
}
"""


@pytest.fixture(scope="module")
def provisioned(playbook_module):
    with root_conftest.private_testbed("fwo", "10.213.161", 3, train_net="10.213.162") as tb:
        node2 = tb.hosts()[2]
        table = ADMIN_TABLE % {"exporter": EXPORTER_PORT, "train": tb.train_net}
        tb.exec(node2, f"printf %s {shlex.quote(table)} | nft -f -")
        first = playbook_module("-i", str(tb.inventory), "playbooks/base.yml")
        second = playbook_module("-i", str(tb.inventory), "playbooks/base.yml")
        yield tb, first, second


@pytest.fixture(scope="module")
def playbook_module(venv_bin, tmp_path_factory):
    facts = tmp_path_factory.mktemp("facts")

    def _run(*args: str):
        res = run([str(venv_bin / "ansible-playbook"), *args], tool_env(venv_bin, facts), 600)
        res.out = res.stdout + res.stderr
        return res

    return _run


def _connect(tb, where, ip: str, port: int) -> bool:
    cmd = f"python3 {PROBE} connect {ip} {port} 3"
    if where == "outsider":
        res = subprocess.run(
            ["ip", "netns", "exec", outsider.ensure(tb), *shlex.split(cmd)], capture_output=True, text=True
        )
    else:
        res = tb.exec(where, cmd, check=False)
    return res.returncode == 0


def test_converges_idempotently_with_the_admins_table_in_place(provisioned):
    _, first, second = provisioned
    assert first.returncode == 0, first.out[-4000:]
    assert second.returncode == 0, second.out[-4000:]
    recaps = re.findall(r"^(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0", second.out, re.M)
    assert sorted(recaps) == [("node0", "0"), ("node1", "0"), ("node2", "0")], second.out[-3000:]


def test_only_the_inventory_nodes_reach_the_training_ports(provisioned):
    tb, first, _ = provisioned
    assert first.returncode == 0, first.out[-4000:]
    node0, node1, node2 = tb.hosts()
    ports = f"{MASTER_PORT} {RANGE_PORT} {EXPORTER_PORT}"
    listen = f"python3 {PROBE} listen 0.0.0.0 40 {ports} >/dev/null 2>&1 & sleep 1"
    tb.exec(node2, listen)
    got = {
        (who, port): _connect(tb, host, node2.train_ip, port)
        for who, host in (("peer", node1), ("outsider", "outsider"))
        for port in (MASTER_PORT, RANGE_PORT, EXPORTER_PORT)
    }
    assert got == {
        ("peer", MASTER_PORT): True,
        ("peer", RANGE_PORT): True,
        ("peer", EXPORTER_PORT): True,
        ("outsider", MASTER_PORT): False,
        ("outsider", RANGE_PORT): False,
        ("outsider", EXPORTER_PORT): True,  # the admin's service, allowed by the admin's own table
    }
    # SSH stays open: a new connection from the controller (no ControlMaster socket of ansible's).
    assert tb.ssh(node2, "true", check=False).returncode == 0
    table = " ".join(tb.exec(node2, "nft list table inet ddp_train").stdout.split())
    assert "policy accept;" in table and "policy drop" not in table, table
    assert f"elements = {{ {node0.train_ip}, {node1.train_ip}, {node2.train_ip} }}" in table, table
