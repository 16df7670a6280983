"""The training interface per node, from recorded `ip -j addr` / `ip -j route get` output.

data/netif/multi-nic.* was recorded with iproute2 6.x in a network namespace built like a multi-NIC GPU
server: lo, docker0 and virbr0 (bridges), eno1 (management, default route), ens1f0 (training, IPv4 and
IPv6), ens2f0/ens2f1 enslaved to bond0. veths stood in for the NICs (their peers were removed) and this
kernel has no bonding/8021q module, so bond0's MASTER/SLAVE flags and the VLAN bond0.100 (with a
secondary address) were added in the same format.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train.launch.node import script
from ddp_train.launch.plan.plan import Options, build_plan
from ddp_train.launch.preflight import netif
from ddp_train.launch.preflight.netif import Choice, NetifError
from ddp_train.launch.preflight.preflight_model import NodeCheck
from tests.unit.test_launch_plan import node

DATA = Path(__file__).parent / "data" / "netif"
ADDR = json.loads((DATA / "multi-nic.addr.json").read_text())


def route(target: str) -> list:
    return json.loads((DATA / f"multi-nic.route-{target}.json").read_text())


def probe(target: str | None = None, addr: list | None = None) -> dict:
    found: dict = {"addr": ADDR if addr is None else addr}
    if target:
        found.update(route_to=target, route=route(target))
    return found


def test_the_training_nic_is_chosen_among_docker_virbr_bond_vlan_and_ipv6() -> None:
    assert netif.choose("10.0.0.0/24", probe("10.0.0.254")) == Choice("ens1f0", "10.0.0.5", 24)
    # the VLAN on the bond: the primary address (the route's source), not the secondary one
    assert netif.choose("10.10.0.0/16", probe("10.10.0.254")) == Choice("bond0.100", "10.10.0.5", 24)
    assert netif.choose("fd00:10::/64", probe()) == Choice("ens1f0", "fd00:10::5", 64)


def test_no_address_in_the_cidr_names_what_the_node_has() -> None:
    with pytest.raises(NetifError) as e:
        netif.choose("10.99.0.0/24", probe("10.99.0.254"))
    msg = str(e.value)
    assert msg.startswith(
        "no interface has an address in ddp_network_cidr 10.99.0.0/24 (found: docker0 172.17"
    )
    for shown in (
        "virbr0 192.168.122.1/24",
        "eno1 192.168.10.21/24",
        "ens1f0 10.0.0.5/24",
        "bond0.100 10.10.0.99",
    ):
        assert shown in msg
    assert "127.0.0.1" not in msg and "fe80" not in msg and "fd00" not in msg and "\n" not in msg


def test_two_interfaces_in_the_cidr_fail_with_both_named() -> None:
    both = r"ens1f0 10.0.0.5/24, bond0.100 10.10.0.5/24, bond0.100 10.10.0.99/24; gloo/NCCL need one"
    with pytest.raises(
        NetifError, match=r"^2 interfaces have addresses in ddp_network_cidr 10.0.0.0/8: " + both
    ):
        netif.choose("10.0.0.0/8", probe())


def test_a_route_through_another_interface_and_a_down_interface_fail() -> None:
    hijacked = probe("10.0.0.254")
    hijacked["route"] = [dict(hijacked["route"][0], dev="eno1", gateway="192.168.10.1")]
    with pytest.raises(NetifError, match="ens1f0 has 10.0.0.5 .* routes 10.0.0.254 .* through eno1"):
        netif.choose("10.0.0.0/24", hijacked)
    down = copy.deepcopy(ADDR)
    next(i for i in down if i["ifname"] == "ens1f0")["flags"] = ["BROADCAST", "MULTICAST"]
    with pytest.raises(
        NetifError, match=r"^interface ens1f0 10.0.0.5/24 \(in ddp_network_cidr 10.0.0.0/24\) is"
    ):
        netif.choose("10.0.0.0/24", probe(addr=down))


def test_probe_errors_and_bad_cidr_are_one_line() -> None:
    with pytest.raises(
        NetifError, match=r"^cannot list the interfaces: ip \(iproute2\) not found on the node$"
    ):
        netif.choose("10.0.0.0/24", {"error": "ip (iproute2) not found on the node"})
    with pytest.raises(NetifError, match="^ddp_network_cidr '10.0.0.0/33'"):
        netif.choose("10.0.0.0/33", probe())
    assert netif.parse_probe("noise\nDDP-NETIF {not json\n") == {"error": "unreadable interface probe output"}
    assert netif.parse_probe("DDP-PROBE {}\n") is None


def test_the_probe_snippet_runs_after_the_preflight_probe_and_reports_this_machine() -> None:
    argv = netif.probe_argv("127.0.0.0/8")
    assert argv[:2] == ["--netif", "127.0.0.0/8"]
    assert json.loads(argv[2]) == ["127.255.255.254", "127.0.0.1", "127.0.0.2"]
    # other parts of the probe take flags of their own there too (gpuhealth: --gpu-health-off)
    res = subprocess.run([sys.executable, "-c", script("probe"), sys.prefix, "", "--other-flag", *argv],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    found = netif.parse_probe(res.stdout)
    assert found is not None and "DDP-PROBE " in res.stdout, res.stdout + res.stderr
    assert netif.choose("127.0.0.0/8", found) == Choice("lo", "127.0.0.1", 8)
    assert found["route_to"] == "127.255.255.254"  # the first target that is not the node's own
    res = subprocess.run([sys.executable, "-c", script("probe"), sys.prefix, ""], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert "DDP-NETIF" not in res.stdout  # no ddp_network_cidr: nothing asked


def _checks(plan, probes: dict) -> list[NodeCheck]:
    checks = []
    for p in plan.nodes:
        c = NodeCheck(p, facts={"python": "3.11.9", "netif": probes[p.node.name]})
        checks.append(c)
    return checks


def _addr(dev: str, ip: str) -> list:
    def link(name: str, local: str) -> dict:
        return {
            "ifname": name,
            "flags": ["UP"],
            "addr_info": [{"family": "inet", "local": local, "prefixlen": 24}],
        }

    return [link("aaa0", "198.18.0.9"), link(dev, ip)]


def test_each_node_gets_its_own_name_and_a_user_value_wins_and_is_reported() -> None:
    # SSH on the management network (192.0.2.x), training on 10.1.0.0/24: MASTER_ADDR is set in it
    net = {"network_cidr": "10.1.0.0/24", "master_addr": "10.1.0.10"}
    user = {"GLOO_SOCKET_IFNAME": "eth9"}
    nodes = [node("n0", "192.0.2.10", **net), node("n1", "192.0.2.11", **net, env=user)]
    plan = build_plan(nodes, Options(job_id="j"))
    found = {"n0": {"addr": _addr("ens1f0", "10.1.0.10")}, "n1": {"addr": _addr("train0", "10.1.0.11")}}
    checks = _checks(plan, found)
    netif.check(plan, checks)
    assert [c.failures for c in checks] == [[], []]
    assert checks[1].warnings == ["GLOO_SOCKET_IFNAME=eth9 from ddp_env/--env wins over the derived train0"]
    notes: list[str] = []
    out = netif.apply(plan, checks, notes.append)
    n0, n1 = out.nodes
    assert (n0.env["GLOO_SOCKET_IFNAME"], n0.env["NCCL_SOCKET_IFNAME"]) == ("ens1f0", "=ens1f0")
    assert (n1.env["GLOO_SOCKET_IFNAME"], n1.env["NCCL_SOCKET_IFNAME"]) == ("eth9", "=train0")
    assert n0.argv[:7] == ("/opt/ddp-train/venv/bin/torchrun", "--nnodes", "2", "--nproc-per-node", "1",
                           "--local-addr", "10.1.0.10")  # fmt: skip
    assert n1.argv[n1.argv.index("--local-addr") + 1] == "10.1.0.11"
    assert "--master-addr" in n1.argv and out.nodes[1].rank == 1
    assert notes == [
        "n0: trains over ens1f0 10.1.0.10/24: GLOO_SOCKET_IFNAME=ens1f0 NCCL_SOCKET_IFNAME==ens1f0 "
        "--local-addr 10.1.0.10",
        "n1: trains over train0 10.1.0.11/24: NCCL_SOCKET_IFNAME==train0 --local-addr 10.1.0.11; "
        "GLOO_SOCKET_IFNAME=eth9 from ddp_env/--env wins over the derived train0",
    ]
    assert plan.nodes[0].env.get("GLOO_SOCKET_IFNAME") is None  # the input plan is not changed


def test_c10d_ranks_follow_the_training_addresses_as_text() -> None:
    net = {"network_cidr": "10.1.0.0/24", "master_addr": "10.1.0.9"}
    nodes = [node(f"n{i}", f"192.0.2.{10 + i}", **net) for i in range(3)]
    plan = build_plan(nodes, Options(job_id="j", max_restarts=1))
    assert plan.rdzv == "c10d"
    ips = {"n0": "10.1.0.9", "n1": "10.1.0.30", "n2": "10.1.0.100"}  # text order: .100, .30, .9
    checks = _checks(plan, {n: {"addr": _addr("eth1", ip)} for n, ip in ips.items()})
    netif.check(plan, checks)
    out = netif.apply(plan, checks)
    assert [(p.node.name, p.rank) for p in out.nodes] == [("n2", 0), ("n1", 1), ("n0", 2)]
    assert [p.argv.count("--local-addr") for p in out.nodes] == [1, 1, 1]


def test_failures_and_the_cases_where_nothing_is_derived() -> None:
    nodes = [node(f"n{i}", f"10.1.0.1{i}", network_cidr="10.1.0.0/24") for i in range(2)]
    plan = build_plan(nodes, Options(job_id="j"))
    found = {"n0": {"addr": _addr("eth1", "10.1.0.10")}, "n1": {"addr": _addr("eth1", "10.2.0.11")}}
    checks = _checks(plan, found)
    netif.check(plan, checks)
    assert checks[0].failures == []
    assert checks[1].failures == [
        "no interface has an address in ddp_network_cidr 10.1.0.0/24 (found: aaa0 198.18.0.9/24, "
        "eth1 10.2.0.11/24); give the node an address in the training network or fix ddp_network_cidr"
    ]
    bare = build_plan([dataclasses.replace(n, network_cidr=None) for n in nodes], Options(job_id="j"))
    checks = _checks(bare, {"n0": {}, "n1": {}})
    netif.check(bare, checks)
    assert [c.failures for c in checks] == [[], []] and "ddp_network_cidr is not set" in checks[0].warnings[0]
    assert netif.apply(bare, checks) == bare
    assert netif.dry_run_line(bare, bare.nodes[0]) is None
    line = netif.dry_run_line(plan, plan.nodes[0])
    assert line is not None and "ddp_network_cidr 10.1.0.0/24" in line and "NCCL_SOCKET_IFNAME==<dev>" in line


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_without_ddp_master_addr_the_master_trains_at_its_address_in_the_cidr(max_restarts: int) -> None:
    # SSH on 192.0.2.x, training on 10.1.0.0/24, node0 excluded: the first remaining node is the master
    nodes = [node(f"n{i}", f"192.0.2.1{i}", network_cidr="10.1.0.0/24") for i in (1, 2)]
    plan = build_plan(nodes, Options(job_id="j", max_restarts=max_restarts))
    assert plan.master_derived and plan.master_addr == "192.0.2.11"  # a placeholder until preflight
    assert netif.master_unchecked(plan) == (
        "master n1: ansible_host 192.0.2.11 is outside ddp_network_cidr 10.1.0.0/24 and --skip-preflight "
        "leaves the master's training address unknown; run preflight or set ddp_master_addr"
    )
    checks = _checks(plan, {f"n{i}": {"addr": _addr("eth1", f"10.1.0.1{i}")} for i in (1, 2)})
    netif.check(plan, checks)
    notes: list[str] = []
    out = netif.apply(plan, checks, notes.append)
    assert (
        out.master_addr == "10.1.0.11"
        and notes[0] == "MASTER_ADDR 10.1.0.11: n1's address in ddp_network_cidr"
    )
    flag, value = (
        ("--master-addr", "10.1.0.11") if max_restarts == 0 else ("--rdzv-endpoint", "10.1.0.11:29500")
    )
    assert [p.argv[p.argv.index(flag) + 1] for p in out.nodes] == [value, value]
    assert netif.master_unchecked(out) is None
    # ddp_master_addr stays the override: nothing derived
    explicit = build_plan(
        [dataclasses.replace(n, master_addr="10.1.0.99") for n in nodes], Options(job_id="j")
    )
    assert not explicit.master_derived and netif.apply(explicit, checks).master_addr == "10.1.0.99"
