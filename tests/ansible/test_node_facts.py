"""What a node reports about itself (its hostname and FQDN facts, its training address read from `ip`:
whatever root on that node made them) is checked by one rule (cluster_hosts' check_nodes and its filter)
before any role writes it into another node's files: /etc/hosts (cluster_hosts), the nftables sets and
rich rules (firewall), slurm.conf (slurm, in test_slurm_role.py), prometheus.yml (monitoring). Issue #44:
each crafted fact is refused in one line naming the node and the fact. Run on localhost; no node is
contacted (the roles on live hosts: test_cluster_hosts_names.py, test_firewall_testbed.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO_ROOT

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "node_facts.yml")
_spec = importlib.util.spec_from_file_location(
    "node_facts", REPO_ROOT / "roles" / "cluster_hosts" / "filter_plugins" / "node_facts.py"
)
assert _spec and _spec.loader
node_facts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(node_facts)

# What root on node1 can make `hostname`/`hostname -f` and `ip -4 -o addr` report (issue #44, item 3).
INJECTED_FQDN = "LOCALHOST\n6.6.6.6 pypi.org files.pythonhosted.org"
WIDE = "0.0.0.0-255.255.255.255"  # one nftables set element trusting every IPv4 source


def _run(playbook, tmp_path: Path, by: str, hosts: dict, groups: dict | None = None, cidr="10.1.0.0/24"):
    inv = {
        "all": {
            "hosts": {"localhost": {"reported": {"hostname": "ctl", "fqdn": "ctl.example"}}},
            "children": {"gpu_nodes": {"hosts": hosts}, **(groups or {})},
        }
    }
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    extra = {"by": by, "ddp_network_cidr": cidr, "hosts_file": str(tmp_path / "hosts")}
    if by == "firewall":
        extra["check_host"] = "node0"  # a node: the exporter ports make it check the monitoring host too
    extra["ansible_python_interpreter"] = sys.executable
    res = playbook("-i", str(path), "-c", "local", "--check", "--diff", "-e", json.dumps(extra), PLAY)
    msgs = re.findall(rf'"msg": "({by}: [^"]*)"', res.out)
    return res, msgs


def _nodes(cidr_prefix: str = "10.1.0", **crafted: dict) -> dict:
    hosts = {
        f"node{i}": {
            "cluster_hosts_address": f"{cidr_prefix}.1{i}",
            "reported": {"hostname": f"node{i}", "fqdn": f"node{i}.example"},
        }
        for i in range(3)
    }
    for host, values in crafted.items():
        for key, value in values.items():
            if key in ("hostname", "fqdn"):
                hosts[host]["reported"][key] = value
            else:
                hosts[host][key] = value
    return hosts


def _one_line_refusal(res, msgs: list[str], start: str) -> str:
    assert res.returncode != 0, res.out[-3000:]
    assert msgs, res.out[-3000:]
    assert all(m == msgs[0] for m in msgs) and "\\n" not in msgs[0], msgs
    assert msgs[0].startswith(start), msgs[0]
    return msgs[0]


# ---- (a) cluster_hosts: a LOCALHOST hostname no longer exempts the FQDN -----------------------------


def test_cluster_hosts_refuses_an_fqdn_that_would_add_lines_to_every_hosts_file(playbook, tmp_path):
    hosts = _nodes("127.0.1", node1={"hostname": "LOCALHOST", "fqdn": INJECTED_FQDN})
    res, msgs = _run(playbook, tmp_path, "cluster_hosts", hosts, cidr="127.0.0.0/8")
    msg = _one_line_refusal(res, msgs, "cluster_hosts: node1 reports fqdn ")
    assert "'LOCALHOST?6.6.6.6 pypi.org files.pythonhosted.org' (not an RFC 1123 host name)" in msg
    assert "+6.6.6.6" not in res.out and "# BEGIN ddp-train" not in res.out


@pytest.mark.slow
def test_localhost_in_any_case_is_one_loopback_name_never_written(playbook, tmp_path):
    hosts = _nodes("127.0.1", node1={"hostname": "LOCALHOST", "fqdn": "Localhost.LocalDomain"})
    res, _ = _run(playbook, tmp_path, "cluster_hosts", hosts, cidr="127.0.0.0/8")
    assert res.returncode == 0, res.out[-3000:]
    assert re.search(r"\+127\.0\.1\.11\tnode1\n", res.out), res.out[-3000:]
    assert "+127.0.1.10\tnode0.example node0\n" in res.out


# ---- (b) firewall: an address that is not one IPv4 address of the network never becomes a source ------


@pytest.mark.parametrize(
    ("host", "value", "why"),
    [
        ("ctl", WIDE, "not one IPv4 address in 10.1.0.0/24"),  # a Slurm controller outside gpu_nodes
        ("node1", WIDE, "not one IPv4 address in 10.1.0.0/24"),
        ("node1", "10.9.9.9", "outside 10.1.0.0/24"),
        ("node1", "10.1.0.10", "another node reports it too"),
    ],
)
def test_the_firewall_refuses_an_address_before_it_becomes_a_source(playbook, tmp_path, host, value, why):
    hosts = _nodes()
    ctl = {"cluster_hosts_address": "10.1.0.5"}
    hosts.get(host, ctl)["cluster_hosts_address"] = value
    groups = {"slurm_controller": {"hosts": {"ctl": ctl}}}
    res, msgs = _run(playbook, tmp_path, "firewall", hosts, groups)
    msg = _one_line_refusal(res, msgs, "firewall: ")
    assert f"{host} reports cluster_hosts_address '{value}' ({why})" in msg, msg


def test_the_firewall_checks_the_monitoring_hosts_address_too(playbook, tmp_path):
    groups = {"monitoring": {"hosts": {"mon": {"cluster_hosts_address": WIDE}}}}
    res, msgs = _run(playbook, tmp_path, "firewall", _nodes(), groups)
    msg = _one_line_refusal(res, msgs, "firewall: mon reports cluster_hosts_address ")
    assert f"'{WIDE}' (not one IPv4 address in 10.1.0.0/24)" in msg, msg


def test_the_firewall_passes_the_nodes_own_addresses(playbook, tmp_path):
    res, msgs = _run(
        playbook, tmp_path, "firewall", _nodes(), {"slurm_controller": {"hosts": {"node0": None}}}
    )
    assert res.returncode == 0 and not msgs, res.out[-3000:]


# ---- monitoring: Prometheus' targets ---------------------------------------------------------------


def test_monitoring_refuses_a_target_address_outside_the_network(playbook, tmp_path):
    groups = {"monitoring": {"hosts": {"localhost": None}}}
    res, msgs = _run(
        playbook, tmp_path, "monitoring", _nodes(node2={"cluster_hosts_address": "6.6.6.6"}), groups
    )
    msg = _one_line_refusal(res, msgs, "monitoring: node2 reports cluster_hosts_address '6.6.6.6' ")
    assert "(outside 10.1.0.0/24)" in msg


# ---- the rule itself -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("10.1.0.7", True),
        (WIDE, False),
        ("10.1.0.0/24", False),
        ("10.1.0.7,0.0.0.0/0", False),
        ("10.1.0.07", False),  # not canonical: nft and the hosts file read it as they please
        (" 10.1.0.7", False),
        ("10.1.0.7\n", False),
        ("10.2.0.7", False),
        ("fe80::1", False),
    ],
)
def test_an_address_is_exactly_one_ipv4_address_inside_the_network(value, ok):
    hostvars = {"n0": {"a": value}, "n1": {"a": "10.1.0.8"}}
    problems = node_facts.node_fact_problems(["n0", "n1"], hostvars, "10.1.0.0/24", addresses={"a": "a"})
    assert (problems == []) == ok, problems


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("LOCALHOST", None),
        ("localhost.localdomain", None),
        ("localhost\nx", "not an RFC 1123 host name"),
        ("LOCALHOST 6.6.6.6", "not an RFC 1123 host name"),
        ("n1", "a name of another inventory host"),
        ("N1", "a name of another inventory host"),
        ("Shared", "another node reports it too"),
        ("N0", None),  # its own inventory name
        ("-x", "not an RFC 1123 host name"),
    ],
)
def test_names_follow_one_case_insensitive_rule(name, why):
    hostvars = {"n0": {"ansible_facts": {"hostname": name}}, "n1": {"ansible_facts": {"hostname": "shared"}}}
    problems = node_facts.node_fact_problems(
        ["n0", "n1"], hostvars, "10.1.0.0/24", names={"hostname": "ansible_facts.hostname"}
    )
    mine = [p for p in problems if p.startswith("n0 ")]
    assert mine == ([f"n0 reports hostname {node_facts.shown(name)} ({why})"] if why else []), problems
    assert node_facts.without_loopback_names(["LOCALHOST", "localhost.Localdomain", "node0"]) == ["node0"]
