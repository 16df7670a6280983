"""The rules the firewall role computes, rendered by the real ansible-core on localhost.

firewalld: rich rules limited to the cluster's sources, so the zone's other traffic (NFS, Slurm,
exporters) keeps the admin's rules; the training network is never bound to a zone of its own.
nftables: a table that decides only the training ports (accept from the cluster, drop from anyone
else) with policy accept, so a drop there never overrides the admin's other tables.
By default the sources are the inventory nodes' own training addresses, not the whole subnet (#24).
The behaviour on live hosts is tested in test_firewall_testbed.py."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO_ROOT

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "firewall_rules.yml")
SRC = 'rule family="ipv4" source address="10.1.0.0/24"'
NODES = {"node0": "10.1.0.10", "node1": "10.1.0.11", "node2": "10.1.0.12"}


def _render(playbook, tmp_path, inventory: str = "localhost,", **extra) -> dict:
    out = tmp_path / "rules.json"
    extra = {"ddp_network_cidr": "10.1.0.0/24", "rules_file": str(out), **extra}
    extra["ansible_python_interpreter"] = sys.executable
    res = playbook("-i", inventory, "-c", "local", "-e", json.dumps(extra), PLAY)
    assert res.returncode == 0, res.out[-2000:]
    return json.loads(out.read_text())


def _rules(playbook, tmp_path, **extra) -> list[str]:
    return _render(playbook, tmp_path, **extra)["rich_rules"]


def _inventory(tmp_path, addresses: dict[str, str]) -> str:
    """An inventory whose gpu_nodes carry the cluster_hosts_address facts cluster_hosts records."""
    hosts = {name: {"cluster_hosts_address": ip} for name, ip in addresses.items()}
    inv = {"all": {"hosts": {"localhost": None}, "children": {"gpu_nodes": {"hosts": hosts}}}}
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


def test_port_range_policy_opens_each_training_port_to_the_cluster_only(playbook, tmp_path):
    rules = _rules(
        playbook, tmp_path, firewall_extra_tcp_ports=[9100], firewall_trusted_sources=["10.1.0.0/24"]
    )
    assert rules == [
        f'{SRC} port port="29500" protocol="tcp" accept',
        f'{SRC} port port="9100" protocol="tcp" accept',
        f'{SRC} port port="50000-51999" protocol="tcp" accept',
    ]


@pytest.mark.slow
@pytest.mark.parametrize("sources", [["10.1.0.0/24"], ["10.1.0.0/24", "10.2.0.5"]])
def test_trusted_sources_policy_accepts_the_sources_and_nothing_else(playbook, tmp_path, sources):
    got = _render(
        playbook,
        tmp_path,
        firewall_ephemeral_policy="trusted_sources",
        firewall_trusted_sources=sources,
        __firewall_live_port_range={"content": base64.b64encode(b"32768\t60999\n").decode()},
    )
    assert got["rich_rules"] == [f'rule family="ipv4" source address="{s}" accept' for s in sources]
    # nftables: the sources reach everything; the live ephemeral range (gloo/NCCL) is closed to others.
    assert "\t\tip saddr @cluster_sources accept\n" in got["nft"]
    assert 'tcp dport 32768-60999 counter drop comment "ddp-train: not a cluster source"' in got["nft"]


def test_by_default_only_the_inventory_nodes_are_trusted_not_the_subnet(playbook, tmp_path):
    """Another host on ddp_network_cidr must not reach the unauthenticated TCPStore and gloo ports."""
    got = _render(playbook, tmp_path, inventory=_inventory(tmp_path, NODES))
    assert got["sources"] == list(NODES.values())
    assert got["rich_rules"] == [
        f'rule family="ipv4" source address="{ip}" port port="{port}" protocol="tcp" accept'
        for ip in NODES.values()
        for port in ("29500", "50000-51999")
    ]
    assert "elements = { 10.1.0.10, 10.1.0.11, 10.1.0.12 }" in got["nft"]
    assert "10.1.0.0/24" not in got["nft"]


@pytest.mark.slow
def test_the_subnet_stays_an_explicit_choice(playbook, tmp_path):
    got = _render(
        playbook, tmp_path, inventory=_inventory(tmp_path, NODES), firewall_trusted_sources=["10.1.0.0/24"]
    )
    assert got["sources"] == ["10.1.0.0/24"]
    assert "elements = { 10.1.0.0/24 }" in got["nft"]


def test_the_nftables_table_decides_only_its_own_ports(playbook, tmp_path):
    """No policy drop: a drop in any table is final and would override the admin's other accept rules."""
    nft = _render(playbook, tmp_path, inventory=_inventory(tmp_path, NODES))["nft"]
    chain = nft.split("chain input {", 1)[1].split("\n\t}", 1)[0]
    rules = [line.strip() for line in chain.splitlines() if line.strip()]
    assert rules == [
        "type filter hook input priority filter; policy accept;",
        "ct state established,related accept",
        'iif "lo" accept',
        "ip saddr @cluster_sources tcp dport { 29500 } accept",
        "ip saddr @cluster_sources tcp dport 50000-51999 accept",
        'tcp dport { 29500 } counter drop comment "ddp-train: not a cluster source"',
        'tcp dport 50000-51999 counter drop comment "ddp-train: not a cluster source"',
    ]


# `ss -Hltnp` on a node whose sshd listens on 2222 (the controller reaches it on 22 through NAT).
SS_NAT = [
    'LISTEN 0      128      10.1.0.10:2222      0.0.0.0:*    users:(("sshd",pid=812,fd=3))',
    'LISTEN 0      128           [::]:2222         [::]:*    users:(("sshd",pid=812,fd=4))',
    'LISTEN 0      4096       0.0.0.0:9100      0.0.0.0:*    users:(("node_exporter",pid=77,fd=3))',
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("registered", "expected"),
    [
        ({"__firewall_ss": {"stdout_lines": SS_NAT}}, [2222]),
        # socket-activated or not found by ss: what `sshd -T` says
        (
            {
                "__firewall_ss": {"stdout_lines": []},
                "__firewall_sshd_t": {"stdout_lines": ["port 2200", "x 1"]},
            },
            [2200],
        ),
        (
            {"__firewall_ss": {"stdout_lines": SS_NAT}, "firewall_ssh_port": 2022},
            [2022],
        ),  # the admin's choice
    ],
)
def test_the_ssh_port_is_the_one_sshd_listens_on_not_ansible_port(playbook, tmp_path, registered, expected):
    got = _render(playbook, tmp_path, firewall_trusted_sources=["10.1.0.0/24"], ansible_port=22, **registered)
    assert got["ssh_ports"] == expected


def _slurm_inventory(tmp_path) -> str:
    """The nodes of _inventory, and node0 the Slurm controller (playbooks/slurm.yml runs)."""
    path = Path(_inventory(tmp_path, NODES))
    inv = yaml.safe_load(path.read_text())
    inv["all"]["children"]["slurm_controller"] = {"hosts": {"node0": None}}
    path.write_text(yaml.safe_dump(inv))
    return str(path)


def test_slurm_ports_and_srun_range_are_opened_to_the_cluster_only(playbook, tmp_path):
    got = _render(playbook, tmp_path, inventory=_slurm_inventory(tmp_path))
    assert got["rich_rules"] == [
        f'rule family="ipv4" source address="{ip}" port port="{port}" protocol="tcp" accept'
        for ip in NODES.values()
        for port in ("29500", "6817", "6818", "50000-51999", "60001-63000")
    ]
    chain = got["nft"].split("chain input {", 1)[1].split("\n\t}", 1)[0]
    rules = [line.strip() for line in chain.splitlines() if line.strip()]
    assert rules[3:] == [
        "ip saddr @cluster_sources tcp dport { 29500 } accept",
        "ip saddr @cluster_sources tcp dport 50000-51999 accept",
        "ip saddr @slurm_sources tcp dport { 6817, 6818 } accept",
        "ip saddr @slurm_sources tcp dport 60001-63000 accept",
        'tcp dport { 29500 } counter drop comment "ddp-train: not a cluster source"',
        'tcp dport 50000-51999 counter drop comment "ddp-train: not a cluster source"',
        'tcp dport { 6817, 6818 } counter drop comment "ddp-train: not a cluster source"',
        'tcp dport 60001-63000 counter drop comment "ddp-train: not a cluster source"',
    ]
    assert got["nft"].count("elements = { 10.1.0.10, 10.1.0.11, 10.1.0.12 }") == 2


@pytest.mark.slow
def test_slurmdbd_and_the_srun_range_follow_the_slurm_variables(playbook, tmp_path):
    got = _render(
        playbook,
        tmp_path,
        inventory=_slurm_inventory(tmp_path),
        slurm_accounting="slurmdbd",
        slurm_srun_port_range="40000-40999",
        firewall_trusted_sources=["10.1.0.0/24"],
    )
    assert got["rich_rules"] == [
        f'{SRC} port port="{port}" protocol="tcp" accept'
        for port in ("29500", "6817", "6818", "6819", "50000-51999", "40000-40999")
    ]


@pytest.mark.slow
def test_no_slurm_ports_without_a_slurm_controller_group(playbook, tmp_path):
    nft = _render(playbook, tmp_path, inventory=_inventory(tmp_path, NODES))["nft"]
    assert "6817" not in nft and "60001" not in nft


# A controller and a login host of their own (inventory/prod's example), on the training network too.
SLURM_HOSTS = {"ctl": "10.1.0.5", "login0": "10.1.0.6"}
SLURM_PORTS = ("6817", "6818", "60001-63000")


def _separate_controller_inventory(tmp_path, **group_names) -> str:
    path = Path(_inventory(tmp_path, NODES))
    inv = yaml.safe_load(path.read_text())
    ctl_group = group_names.get("controller", "slurm_controller")
    login_group = group_names.get("login", "slurm_login")
    for group, host in ((ctl_group, "ctl"), (login_group, "login0")):
        inv["all"]["children"][group] = {"hosts": {host: {"cluster_hosts_address": SLURM_HOSTS[host]}}}
    path.write_text(yaml.safe_dump(inv))
    return str(path)


def test_the_slurm_controller_and_login_hosts_reach_the_nodes_slurm_ports_only(playbook, tmp_path):
    """slurmctld on a host of its own reaches slurmd (6818) and srun's ports on the nodes, not the training
    ports."""
    got = _render(playbook, tmp_path, inventory=_separate_controller_inventory(tmp_path), rules_host="node0")
    assert got["rich_rules"] == [
        f'rule family="ipv4" source address="{ip}" port port="{port}" protocol="tcp" accept'
        for ip in NODES.values()
        for port in ("29500", "6817", "6818", "50000-51999", "60001-63000")
    ] + [
        f'rule family="ipv4" source address="{ip}" port port="{port}" protocol="tcp" accept'
        for ip in SLURM_HOSTS.values()
        for port in SLURM_PORTS
    ]
    nft = got["nft"]
    cluster_set = nft.split("set cluster_sources {", 1)[1].split("}", 1)[0]
    slurm_set = nft.split("set slurm_sources {", 1)[1].split("\n\t}", 1)[0]
    assert "elements = { 10.1.0.10, 10.1.0.11, 10.1.0.12 " in cluster_set
    assert "elements = { 10.1.0.10, 10.1.0.11, 10.1.0.12, 10.1.0.5, 10.1.0.6 }" in slurm_set
    assert "ip saddr @slurm_sources tcp dport { 6817, 6818 } accept" in nft
    assert "ip saddr @cluster_sources tcp dport { 29500 } accept" in nft


def test_on_the_slurm_controller_only_the_slurm_ports_are_opened(playbook, tmp_path):
    """The controller's slurmctld (6817) and srun's ports there admit the nodes and the login host; the
    training ports and the ephemeral range stay the admin's business on a host that does not train."""
    got = _render(playbook, tmp_path, inventory=_separate_controller_inventory(tmp_path), rules_host="ctl")
    assert got["rich_rules"] == [
        f'rule family="ipv4" source address="{ip}" port port="{port}" protocol="tcp" accept'
        for ip in [*NODES.values(), *SLURM_HOSTS.values()]
        for port in SLURM_PORTS
    ]
    chain = got["nft"].split("chain input {", 1)[1].split("\n\t}", 1)[0]
    rules = [line.strip() for line in chain.splitlines() if line.strip()]
    assert rules[3:] == [
        "ip saddr @slurm_sources tcp dport { 6817, 6818 } accept",
        "ip saddr @slurm_sources tcp dport 60001-63000 accept",
        'tcp dport { 6817, 6818 } counter drop comment "ddp-train: not a cluster source"',
        'tcp dport 60001-63000 counter drop comment "ddp-train: not a cluster source"',
    ]
    assert "cluster_sources" not in got["nft"] and "29500" not in got["nft"] and "50000" not in got["nft"]


@pytest.mark.slow
def test_the_slurm_groups_are_the_roles_variables(playbook, tmp_path):
    inventory = _separate_controller_inventory(tmp_path, controller="head", login="submit")
    got = _render(
        playbook,
        tmp_path,
        inventory=inventory,
        rules_host="node0",
        slurm_controller_group="head",
        slurm_login_group="submit",
    )
    for ip in SLURM_HOSTS.values():
        rule = f'rule family="ipv4" source address="{ip}" port port="6818" protocol="tcp" accept'
        assert rule in got["rich_rules"]
    # under the default names the groups do not exist: no Slurm ports at all
    got = _render(playbook, tmp_path, inventory=inventory, rules_host="node0")
    assert "6817" not in got["nft"]


def _monitored_inventory(tmp_path, monitoring_host: str = "node0") -> str:
    hosts = {name: {"cluster_hosts_address": ip, "ansible_connection": "local"} for name, ip in NODES.items()}
    inv = {
        "all": {
            "hosts": {"localhost": None},
            "children": {"gpu_nodes": {"hosts": hosts}, "monitoring": {"hosts": {monitoring_host: None}}},
        }
    }
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


@pytest.mark.slow
def test_the_exporter_port_is_open_to_the_monitoring_host_only(playbook, tmp_path):
    got = _render(playbook, tmp_path, inventory=_monitored_inventory(tmp_path), rules_host="node1")
    exporter = [r for r in got["rich_rules"] if 'port="9100"' in r]
    assert exporter == [
        'rule family="ipv4" source address="10.1.0.10" port port="9100" protocol="tcp" accept'
    ]
    nft = got["nft"]
    assert (
        "set monitoring_sources {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = { 10.1.0.10 }"
        in nft
    )
    accept = nft.index("ip saddr @monitoring_sources tcp dport { 9100 } accept")
    assert accept < nft.index('tcp dport { 9100 } counter drop comment "ddp-train: not the monitoring host"')
    # DCGM's exporter port joins it; without a monitoring group neither is decided by the role
    dcgm = _render(
        playbook, tmp_path, inventory=_monitored_inventory(tmp_path), rules_host="node1",
        monitoring_gpu_exporter="dcgm",
    )  # fmt: skip
    assert "ip saddr @monitoring_sources tcp dport { 9100, 9400 } accept" in dcgm["nft"]
    plain = _render(playbook, tmp_path, inventory=_inventory(tmp_path, NODES))
    assert "monitoring" not in plain["nft"] and not [r for r in plain["rich_rules"] if "9100" in r]


@pytest.mark.slow
def test_prometheus_is_open_to_the_monitoring_sources_only_on_the_monitoring_host(playbook, tmp_path):
    """Prometheus answers queries without authentication (issue #44): on the monitoring host its port is
    decided like the exporters', open to the monitoring sources only (the host itself, by default)."""
    got = _render(playbook, tmp_path, inventory=_monitored_inventory(tmp_path), rules_host="node0")
    assert (
        'rule family="ipv4" source address="10.1.0.10" port port="9090" protocol="tcp" accept'
        in got["rich_rules"]
    )
    assert not [r for r in got["rich_rules"] if 'port="9090"' in r and "10.1.0.10" not in r]
    assert "ip saddr @monitoring_sources tcp dport { 9100, 9090 } accept" in got["nft"]
    assert 'tcp dport { 9100, 9090 } counter drop comment "ddp-train: not the monitoring host"' in got["nft"]
    # the admin's port and sources; the other nodes run no Prometheus; 0 leaves the port to the admin
    mine = _render(
        playbook, tmp_path, inventory=_monitored_inventory(tmp_path), rules_host="node0",
        monitoring_prometheus_port=9091, firewall_monitoring_sources=["10.1.0.10", "10.1.0.200"],
    )  # fmt: skip
    assert "ip saddr @monitoring_sources tcp dport { 9100, 9091 } accept" in mine["nft"]
    assert "elements = { 10.1.0.10, 10.1.0.200 }" in mine["nft"]
    other = _render(playbook, tmp_path, inventory=_monitored_inventory(tmp_path), rules_host="node1")
    assert "9090" not in other["nft"]
    off = _render(
        playbook, tmp_path, inventory=_monitored_inventory(tmp_path), rules_host="node0",
        firewall_monitoring_prometheus_port=0,
    )  # fmt: skip
    assert "9090" not in off["nft"] and "tcp dport { 9100 } counter drop" in off["nft"]
