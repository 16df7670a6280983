"""cluster_hosts writes each node's self-reported hostname and FQDN (gathered facts) into every node's
/etc/hosts. Root on one node must not be able to inject names or lines into all nodes (issue #24):
the names must be RFC 1123 host names, and no node may claim a name that belongs to another inventory
host. A bad name stops the role in one line naming the node, before any hosts file is written."""

from __future__ import annotations

import re

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "cluster_hosts.yml")


@pytest.fixture(scope="module")
def hosts():
    with root_conftest.private_testbed("chn", "10.213.163", 2) as tb:
        yield tb


def _set_hostname(tb, host, name: str) -> None:
    """What root on the node can do: the kernel takes any bytes (up to 64) as the UTS hostname."""
    tb.exec(host, f"printf %s '{name}' > /proc/sys/kernel/hostname")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("node0", "a name of another inventory host"),  # would map node0 to node1's address on every node
        ("NODE0", "a name of another inventory host"),  # names are case-insensitive
        ("x 10.213.163.1", "not an RFC 1123 host name"),  # a second name (and an address) on the line
        ("-lead", "not an RFC 1123 host name"),
    ],
)
def test_a_bad_or_colliding_hostname_stops_the_role_naming_the_node(hosts, playbook, name, why):
    node0, node1 = hosts.hosts()
    _set_hostname(hosts, node1, name)
    try:
        res = playbook("-i", str(hosts.inventory), PLAY)
    finally:
        _set_hostname(hosts, node1, node1.name)
    assert res.returncode != 0, res.out[-3000:]
    msgs = re.findall(r'"msg": "(cluster_hosts: [^"]*)"', res.out)
    assert msgs, res.out[-3000:]
    assert all("\\n" not in m for m in msgs)
    assert msgs[0].startswith("cluster_hosts: node1 reports ") and f"'{name}' ({why}" in msgs[0], msgs[0]
    for h in (node0, node1):
        assert "ddp-train cluster nodes" not in hosts.exec(h, "cat /etc/hosts").stdout


def test_valid_names_are_written(hosts, playbook):
    res = playbook("-i", str(hosts.inventory), PLAY)
    assert res.returncode == 0, res.out[-3000:]
    node0, node1 = hosts.hosts()
    block = hosts.exec(node0, "cat /etc/hosts").stdout
    assert re.search(rf"(?m)^{re.escape(node1.ip)}\s+node1$", block), block
