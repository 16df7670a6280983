"""RDMA facts from recorded sysfs trees, the preflight agreement check, NCCL_IB_HCA, and
the NCCL INFO log parser verify.yml uses (fixtures: tests/unit/fixtures/rdma/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train.launch.node import script
from ddp_train.launch.node.probe import PROBE_MARK, rdma_ports
from ddp_train.launch.plan.inventory import Node, SshTarget
from ddp_train.launch.plan.plan import Options, build_plan, env_line
from ddp_train.launch.preflight import rdma
from ddp_train.launch.preflight.preflight_model import NodeCheck

FIXTURES = Path(__file__).parent / "fixtures" / "rdma"


def tree(name: str) -> str:
    return str(FIXTURES / name)


def test_two_active_ib_ports():
    ports = rdma.read_ports(tree("ib_two_active"))
    assert [p.describe() for p in ports] == ["mlx5_0:1 IB ACTIVE 200 Gb/s", "mlx5_1:1 IB ACTIVE 200 Gb/s"]
    assert rdma.ib_hca_value(ports) == "=mlx5_0:1,mlx5_1:1"
    s = rdma.summary(ports)
    assert (s["active"], s["not_active"], s["link_gbps"]) == (["mlx5_0:1", "mlx5_1:1"], [], 200.0)


def test_roce_port_and_a_down_port():
    ports = rdma.read_ports(tree("roce"))
    assert [(p.name, p.kind, p.state, p.rate_gbps) for p in ports] == [
        ("mlx5_0:1", "RoCE", "ACTIVE", 100.0),
        ("mlx5_1:1", "RoCE", "DOWN", 40.0),
    ]
    assert rdma.ib_hca_value(ports) == "=mlx5_0:1"  # the DOWN port is left out
    assert rdma.summary(ports)["not_active"] == ["mlx5_1:1 RoCE DOWN 40 Gb/s"]


def test_no_infiniband_directory_means_no_ports(tmp_path):
    assert rdma.read_ports(str(tmp_path)) == []
    (tmp_path / "sys" / "class" / "infiniband").mkdir(parents=True)
    assert rdma.read_ports(str(tmp_path)) == []
    assert rdma.summary([]) == {
        "ports": [],
        "active": [],
        "not_active": [],
        "link_gbps": 0.0,
        "nccl_ib_hca": "",
    }


def test_unreadable_values_do_not_crash(tmp_path):
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_3" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (p,) = rdma.read_ports(str(tmp_path))
    assert (p.name, p.active, p.link_layer, p.rate_gbps) == ("mlx5_3:1", True, "InfiniBand", 0.0)


def test_facts_cli_prints_one_json_line():
    res = subprocess.run(
        [sys.executable, "-m", "ddp_train.launch.preflight.rdma", "facts", "--root", tree("ib_one_down")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    facts = json.loads(res.stdout)
    assert facts["active"] == ["mlx5_0:1"] and facts["link_gbps"] == 400.0
    assert facts["not_active"] == ["mlx5_1:1 IB DOWN 10 Gb/s"] and facts["nccl_ib_hca"] == "=mlx5_0:1"


def test_preflight_probe_reports_the_nodes_ports(tmp_path):
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "HOME": str(tmp_path), "DDP_RDMA_ROOT": tree("roce")}
    res = subprocess.run([sys.executable, "-c", script("probe"), venv, ""], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(PROBE_MARK))
    raw = json.loads(line[len(PROBE_MARK) :])["rdma"]
    assert [p.describe() for p in rdma.ports_from_raw(raw)] == [
        "mlx5_0:1 RoCE ACTIVE 100 Gb/s",
        "mlx5_1:1 RoCE DOWN 40 Gb/s",
    ]


# --- the cluster check and NCCL_IB_HCA -------------------------------------------------------------


def node(name: str, address: str, rdma_mode: str = "auto", **env: str) -> Node:
    return Node(name=name, address=address, local=False, ssh=SshTarget(host=address), venv="/v", workdir=None,
                nproc="1", master_port=29500, env=dict(env), rdma=rdma_mode)  # fmt: skip


def checks_for(
    trees: dict[str, str | None],
    gpus: int = 8,
    modes: dict[str, str] | None = None,
    iface: str = "",
    **env: str,
) -> tuple[object, list[NodeCheck]]:
    """A plan over nodes named after `trees` (ddp_rdma from `modes`, else auto), and preflight checks whose
    probe found those sysfs trees (and `iface` as netif's training interface)."""
    nodes = [node(n, f"10.0.0.{i + 1}", (modes or {}).get(n, "auto"), **env) for i, n in enumerate(trees)]
    plan = build_plan(nodes, Options(job_id="j"))
    checks = []
    for p in plan.nodes:
        t = trees[p.node.name]
        raw = rdma_ports(tree(t)) if t else []
        checks.append(NodeCheck(p, facts={"gpus": gpus, "rdma": raw, **({"iface": iface} if iface else {})}))
    return plan, checks


def test_all_nodes_with_active_ports_pass_and_down_ports_are_named():
    _, checks = checks_for({"a": "ib_two_active", "b": "ib_one_down"})
    rdma.check_cluster(checks)
    assert [c.failures for c in checks] == [[], []]
    assert checks[1].warnings == ["RDMA ports not ACTIVE (NCCL skips them): mlx5_1:1 IB DOWN 10 Gb/s"]


def test_nodes_that_disagree_fail_naming_the_nodes():
    _, checks = checks_for({"a": "ib_two_active", "b": "ib_all_down", "c": None, "d": "ib_connectx"})
    rdma.check_cluster(checks)
    fails = {c.name: c.failures for c in checks}
    assert fails["a"] == [] and fails["d"] == []
    assert fails["b"] == [
        "no ACTIVE RDMA port; its ports: mlx5_0:1 IB INIT 200 Gb/s; but a, d have one: NCCL would mix IB and "
        "TCP between nodes. Bring the ports up (ibstat) or set ddp_rdma: off (or --rdma off) for TCP"
    ]
    assert fails["c"][0].startswith(
        "no ACTIVE RDMA port (no HCA in /sys/class/infiniband); but a, d have one"
    )


def test_ib_and_roce_nodes_fail_in_one_line_naming_the_nodes_per_link_layer():
    _, checks = checks_for({"a": "ib_connectx", "b": "roce_connectx", "c": "ib_connectx", "d": None})
    rdma.check_cluster(checks)
    fails = {c.name: c.failures for c in checks}
    assert fails["a"] == [
        "the RDMA nodes differ in link layer (IB on a, c; RoCE on b): an IB port cannot reach a RoCE one; "
        "give every node the same fabric, or set ddp_rdma: off (or --rdma off) for TCP"
    ]
    assert fails["b"] == fails["c"] == []
    assert fails["d"][0].startswith("no ACTIVE RDMA port (no HCA in /sys/class/infiniband); but a, b, c have")


def test_the_same_link_layers_on_every_node_pass():
    _, checks = checks_for({"a": "ib_connectx", "b": "ib_two_active"})
    rdma.check_cluster(checks)
    assert [c.failures for c in checks] == [[], []]


def test_no_node_with_rdma_passes():
    _, checks = checks_for({"a": None, "b": None})
    rdma.check_cluster(checks)
    assert [(c.failures, c.warnings) for c in checks] == [([], []), ([], [])]
    assert rdma.ib_hca_env(checks) == ({}, [])


@pytest.mark.parametrize(("gpus", "env"), [(0, {}), (8, {"NCCL_IB_DISABLE": "1"})])
def test_gloo_nodes_and_tcp_on_purpose_are_not_compared(gpus, env):
    _, checks = checks_for({"a": "ib_two_active", "b": None}, gpus=gpus, **env)
    rdma.check_cluster(checks)
    assert [c.failures for c in checks] == [[], []]
    assert rdma.ib_hca_env(checks) == ({}, [])


def test_launcher_sets_nccl_ib_hca_to_each_nodes_active_ports():
    plan, checks = checks_for({"a": "ib_two_active", "b": "roce"})
    new, notes = rdma.with_ib_hca(plan, checks)
    assert [p.env["NCCL_IB_HCA"] for p in new.nodes] == ["=mlx5_0:1,mlx5_1:1", "=mlx5_0:1"]
    assert notes[:2] == ["a: NCCL_IB_HCA==mlx5_0:1,mlx5_1:1", "b: NCCL_IB_HCA==mlx5_0:1"]
    assert len(notes) == 3 and notes[2].startswith("RoCE chosen on b ")  # b's port is RoCE
    assert json.loads(env_line(new.nodes[1]))["NCCL_IB_HCA"] == "=mlx5_0:1"  # what the agent receives
    assert all("NCCL_IB_GID_INDEX" not in p.env for p in new.nodes)
    assert "NCCL_IB_HCA" not in plan.nodes[0].env  # the original plan is unchanged


def test_a_users_nccl_ib_hca_wins_and_is_reported():
    plan, checks = checks_for({"a": "ib_two_active"}, NCCL_IB_HCA="mlx5_1")
    new, notes = rdma.with_ib_hca(plan, checks)
    assert new.nodes[0].env["NCCL_IB_HCA"] == "mlx5_1"
    assert notes == ["a: NCCL_IB_HCA=mlx5_1 from ddp_env (the active ports are mlx5_0:1,mlx5_1:1)"]


# --- ddp_rdma: auto | on | off, and what doctor says ------------------------------------------------


def test_recorded_connectx_ports_name_their_kind_rate_and_roce_netdev():
    (roce,) = rdma.read_ports(tree("roce_connectx"))
    assert (roce.describe(), roce.netdev) == ("mlx5_0:1 RoCE ACTIVE 100 Gb/s", "ens1f0np0")
    (ib,) = rdma.read_ports(tree("ib_connectx"))
    assert (ib.describe(), ib.netdev) == ("mlx5_0:1 IB ACTIVE 400 Gb/s", "")


def test_auto_keeps_rdma_and_says_once_that_roce_was_chosen_and_how_to_turn_it_off():
    plan, checks = checks_for({"a": "roce_connectx", "b": "roce_connectx"}, iface="ens1f0np0")
    rdma.check_cluster(checks)
    assert [(c.failures, c.warnings) for c in checks] == [([], []), ([], [])]
    new, notes = rdma.with_ib_hca(plan, checks)
    assert [p.env["NCCL_IB_HCA"] for p in new.nodes] == ["=mlx5_0:1", "=mlx5_0:1"]
    assert all("NCCL_IB_DISABLE" not in p.env for p in new.nodes)
    (notice,) = [n for n in notes if "RoCE chosen" in n]
    assert notice.startswith("RoCE chosen on a, b (ddp_rdma auto: an ACTIVE port with link layer Ethernet)")
    assert "PFC or ECN" in notice and "ddp_rdma: off (or --rdma off) trains over TCP sockets" in notice
    assert rdma.doctor_lines(checks)[:2] == [
        "a: RoCE over mlx5_0:1 (ens1f0np0) (ddp_rdma auto: ACTIVE ports, link layer Ethernet)",
        "b: RoCE over mlx5_0:1 (ens1f0np0) (ddp_rdma auto: ACTIVE ports, link layer Ethernet)",
    ]


def test_auto_over_infiniband_gives_no_notice():
    _, checks = checks_for({"a": "ib_connectx", "b": "ib_two_active"})
    assert rdma.doctor_lines(checks) == [
        "a: IB over mlx5_0:1 (ddp_rdma auto: ACTIVE ports)",
        "b: IB over mlx5_0:1, mlx5_1:1 (ddp_rdma auto: ACTIVE ports)",
        "a: NCCL_IB_HCA==mlx5_0:1",
        "b: NCCL_IB_HCA==mlx5_0:1,mlx5_1:1",
    ]


def test_off_disables_ib_and_trains_over_the_training_interface():
    modes = {"a": "off", "b": "off"}
    plan, checks = checks_for({"a": "roce_connectx", "b": None}, modes=modes, iface="ens1f0np0")
    rdma.check_cluster(checks)
    assert [(c.failures, c.warnings) for c in checks] == [([], []), ([], [])]
    new, notes = rdma.with_ib_hca(plan, checks)
    assert [(p.env["NCCL_IB_DISABLE"], "NCCL_IB_HCA" in p.env) for p in new.nodes] == [("1", False)] * 2
    assert json.loads(env_line(new.nodes[0]))["NCCL_IB_DISABLE"] == "1"  # what the agent receives
    assert notes == ["a: NCCL_IB_DISABLE=1 (ddp_rdma off)", "b: NCCL_IB_DISABLE=1 (ddp_rdma off)"]
    assert rdma.doctor_lines(checks)[0] == "a: TCP socket on ens1f0np0 (ddp_rdma off: NCCL_IB_DISABLE=1)"


def test_tcp_without_a_training_network_says_nccl_picks_the_interface():
    _, checks = checks_for({"a": None})
    assert rdma.doctor_lines(checks) == [
        "a: TCP socket on the interface NCCL picks (set ddp_network_cidr) "
        "(ddp_rdma auto: no ACTIVE RDMA port)"
    ]
    _, checks = checks_for({"a": "ib_connectx"}, gpus=0, iface="ens2f0")
    assert rdma.doctor_lines(checks) == ["a: gloo over TCP on ens2f0 (no GPU: gloo, which never uses RDMA)"]


def test_on_refuses_each_node_without_an_active_port_in_one_line():
    modes = {"a": "on", "b": "on", "c": "on"}
    _, checks = checks_for({"a": "ib_connectx", "b": "ib_all_down", "c": None}, modes=modes)
    rdma.check_cluster(checks)
    assert [c.failures for c in checks] == [
        [],
        ["ddp_rdma is on but no RDMA port is ACTIVE; its ports: mlx5_0:1 IB INIT 200 Gb/s: bring the ports "
         "up (ibstat) or set ddp_rdma: off (TCP) or auto"],
        ["ddp_rdma is on but no RDMA port is ACTIVE (no HCA in /sys/class/infiniband): bring the ports up "
         "(ibstat) or set ddp_rdma: off (TCP) or auto"],
    ]  # fmt: skip
    _, checks = checks_for({"a": "roce_connectx"}, modes={"a": "on"})
    rdma.check_cluster(checks)
    assert checks[0].failures == [] and rdma.roce_notice(checks) is None  # RoCE stated: no notice
    _, checks = checks_for({"a": "ib_connectx"}, modes={"a": "on"}, NCCL_IB_DISABLE="1")
    rdma.check_cluster(checks)
    assert checks[0].failures == ["ddp_rdma is on but ddp_env sets NCCL_IB_DISABLE=1: drop one"]


def test_on_refusal_fails_preflight_with_exit_3(tmp_path, capsys, monkeypatch):
    from ddp_train.launch import cli
    from ddp_train.launch.preflight import preflight

    def fake_preflight(plan, **_):
        checks = [
            NodeCheck(p, facts={"gpus": 8, "rdma": rdma_ports(tree("ib_all_down"))}) for p in plan.nodes
        ]
        rdma.check_cluster(checks)
        return preflight.Report(checks=checks)

    monkeypatch.setattr(preflight, "run_preflight", fake_preflight)
    inv = Path(__file__).resolve().parents[2] / "inventory" / "local"
    code = cli.main(["doctor", "--hosts", str(inv), "--rdma", "on"])
    out = capsys.readouterr().out
    assert code == 3, out
    assert out.count("ddp_rdma is on but no RDMA port is ACTIVE") == 2  # one line per node


def test_off_with_the_plans_nccl_ib_disable_says_ddp_rdma_and_a_contradicting_ddp_env_fails():
    _, checks = checks_for({"a": "ib_connectx"}, modes={"a": "off"}, NCCL_IB_DISABLE="1")  # as runargs sets
    rdma.check_cluster(checks)
    assert checks[0].failures == [] and rdma.transport_env(checks) == ({}, [])
    assert rdma.doctor_lines(checks) == [
        "a: TCP socket on the interface NCCL picks (set ddp_network_cidr) (ddp_rdma off: NCCL_IB_DISABLE=1)"
    ]
    _, checks = checks_for({"a": "ib_connectx"}, modes={"a": "off"}, NCCL_IB_DISABLE="0")
    rdma.check_cluster(checks)
    assert checks[0].failures == ["ddp_rdma is off but ddp_env sets NCCL_IB_DISABLE=0: drop one"]


def test_a_node_off_among_rdma_nodes_fails():
    _, checks = checks_for({"a": "ib_connectx", "b": "ib_connectx"}, modes={"b": "off"})
    rdma.check_cluster(checks)
    assert checks[0].failures == []
    assert checks[1].failures == [
        "uses TCP sockets (ddp_rdma off: NCCL_IB_DISABLE=1) but a use RDMA: NCCL would mix IB and TCP "
        "between nodes; set ddp_rdma the same on every node (or --rdma off)"
    ]


def test_ddp_rdma_is_read_from_the_inventory_and_rdma_flag_wins(tmp_path):
    from ddp_train.launch import runargs
    from ddp_train.launch.cliparse import build_parser
    from ddp_train.launch.errors import LaunchError
    from ddp_train.launch.plan.inventory import load_nodes

    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  vars: {ansible_host: 192.0.2.1}\n  hosts:\n    a: {}\n    b: {ddp_rdma: off}\n"
        "    c: {ddp_rdma: 'on'}\n"
    )
    assert [n.rdma for n in load_nodes([str(inv)])] == ["auto", "off", "on"]  # unquoted off: YAML false
    opts = build_parser().parse_args(["doctor", "--hosts", str(inv), "--rdma", "off"])
    runargs.split_rest(opts)
    plan = runargs.build(opts, [], True)
    assert {p.node.rdma for p in plan.nodes} == {"off"}
    # in the plan from the start: --dry-run shows it, --skip-preflight keeps it
    assert {p.env["NCCL_IB_DISABLE"] for p in plan.nodes} == {"1"}
    inv.write_text("all:\n  hosts:\n    a: {ddp_rdma: roce}\n")
    with pytest.raises(LaunchError, match="host a: ddp_rdma: 'roce' is not one of auto, on, off"):
        load_nodes([str(inv)])


# --- NCCL's INFO log ------------------------------------------------------------------------------


def test_nccl_log_ib_with_gpudirect_rdma():
    got = rdma.parse_nccl_log((FIXTURES / "nccl_ib_gdr.log").read_text())
    assert got == {
        "network": "IB", "ib_devices": ["mlx5_0:1", "mlx5_1:1"], "gdr": True, "net_channels": 4,
        "gdr_channels": 4, "version": "2.26.2+cuda12.8", "no_ib_device": False,
    }  # fmt: skip


def test_nccl_log_roce_without_gpudirect_rdma():
    got = rdma.parse_nccl_log((FIXTURES / "nccl_ib_no_gdr.log").read_text())
    assert (got["network"], got["ib_devices"], got["gdr"], got["net_channels"]) == (
        "IB",
        ["mlx5_0:1"],
        False,
        2,
    )


def test_nccl_log_socket_fallback():
    got = rdma.parse_nccl_log((FIXTURES / "nccl_socket.log").read_text())
    assert (got["network"], got["ib_devices"], got["gdr"], got["no_ib_device"]) == ("Socket", [], False, True)


def test_no_nccl_lines_at_all():
    got = rdma.parse_nccl_log("ddp-allreduce rank=0 world_size=2 backend=gloo ok=1\n")
    assert (got["network"], got["gdr"], got["net_channels"]) == (None, None, 0)


def test_nccl_log_cli_reads_stdin():
    res = subprocess.run(
        [sys.executable, "-m", "ddp_train.launch.preflight.rdma", "nccl-log"],
        input=(FIXTURES / "nccl_socket.log").read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(res.stdout)["network"] == "Socket"
