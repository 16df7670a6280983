"""Bad input stops site.yml in its preflight play: one message naming the variable (or OS) and the
nodes, exit status 2, and nothing changed on any node."""

from __future__ import annotations

import json
import re

import pytest

from tests.ansible.conftest import write_inventory

pytestmark = pytest.mark.testbed

NODES = "[node0, node1, node2]"


def _set(**values):
    return lambda inv: inv["all"]["vars"].update(values)


def _drop(name):
    return lambda inv: inv["all"]["vars"].pop(name)


def _no_nodes(inv):
    inv["all"]["children"]["gpu_nodes"]["hosts"] = {}


# case: (inventory edit, extra ansible-playbook args, expected message)
CASES = {
    "missing_network_cidr": (_drop("ddp_network_cidr"), [], "ddp_network_cidr is not set"),
    "port_not_an_integer": (
        _set(ddp_master_port="29500x"),
        [],
        "ddp_master_port must be an integer from 1 to 65535, got '29500x'",
    ),
    "port_out_of_range": (
        _set(ddp_master_port=70000),
        [],
        "ddp_master_port must be an integer from 1 to 65535, got '70000'",
    ),
    "unsupported_os": (
        lambda inv: None,
        ["-e", json.dumps({"preflight_supported_os": ["RedHat-9", "RedHat-10"]})],
        "is not a supported OS (supported: RedHat-9, RedHat-10)",
    ),
    "no_gpu_nodes": (_no_nodes, [], "the inventory has no hosts in group gpu_nodes"),
}


def _node_state(testbed) -> dict[str, str]:
    cmd = "cat /etc/hosts; ls /opt; nft list ruleset; cat /proc/sys/net/ipv4/ip_local_port_range"
    return {h.name: testbed.ssh(h, cmd).stdout for h in testbed.hosts()}


@pytest.mark.slow
def test_a_valid_inventory_passes_preflight(testbed, playbook):
    res = playbook("-i", str(testbed.inventory), "playbooks/preflight.yml")
    assert res.returncode == 0, res.out[-3000:]
    assert re.findall(r"node\d\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", res.out)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_input_stops_site_yml_before_anything_changes(case, testbed, playbook, tmp_path):
    edit, extra, message = CASES[case]
    before = _node_state(testbed)
    inventory = write_inventory(testbed.inventory, tmp_path / "inventory", edit)

    res = playbook("-i", str(inventory), *extra, "site.yml")

    assert res.returncode == 2, res.out[-3000:]
    assert message in res.out, res.out[-3000:]
    if case != "no_gpu_nodes":
        assert f"{message}" in res.out and NODES in res.out, "the message names the nodes concerned"
    assert len(re.findall(r"^fatal: ", res.out, re.M)) == 1, "one message, not one per node"
    assert "PLAY [Map every node's hostname" not in res.out, "no play after preflight ran"
    assert set(re.findall(r"changed=(\d+)", res.out)) <= {"0"}
    assert _node_state(testbed) == before
