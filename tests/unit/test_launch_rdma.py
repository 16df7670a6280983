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


def node(name: str, address: str, **env: str) -> Node:
    return Node(name=name, address=address, local=False, ssh=SshTarget(host=address), venv="/v", workdir=None,
                nproc="1", master_port=29500, env=dict(env))  # fmt: skip


def checks_for(trees: dict[str, str | None], gpus: int = 8, **env: str) -> tuple[object, list[NodeCheck]]:
    """A plan over nodes named after `trees`, and preflight checks whose probe found those sysfs trees."""
    plan = build_plan([node(n, f"10.0.0.{i + 1}", **env) for i, n in enumerate(trees)], Options(job_id="j"))
    checks = []
    for p in plan.nodes:
        t = trees[p.node.name]
        raw = rdma_ports(tree(t)) if t else []
        checks.append(NodeCheck(p, facts={"gpus": gpus, "rdma": raw}))
    return plan, checks


def test_all_nodes_with_active_ports_pass_and_down_ports_are_named():
    _, checks = checks_for({"a": "ib_two_active", "b": "ib_one_down"})
    rdma.check_cluster(checks)
    assert [c.failures for c in checks] == [[], []]
    assert checks[1].warnings == ["RDMA ports not ACTIVE (NCCL skips them): mlx5_1:1 IB DOWN 10 Gb/s"]


def test_nodes_that_disagree_fail_naming_the_nodes():
    _, checks = checks_for({"a": "ib_two_active", "b": "ib_all_down", "c": None, "d": "roce"})
    rdma.check_cluster(checks)
    fails = {c.name: c.failures for c in checks}
    assert fails["a"] == [] and fails["d"] == []
    assert fails["b"] == [
        "no ACTIVE RDMA port; its ports: mlx5_0:1 IB INIT 200 Gb/s; but a, d have one: NCCL would mix IB and "
        "TCP between nodes. Bring the ports up (ibstat) or set NCCL_IB_DISABLE: '1' in ddp_env for TCP"
    ]
    assert fails["c"][0].startswith(
        "no ACTIVE RDMA port (no HCA in /sys/class/infiniband); but a, d have one"
    )


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
    assert notes == ["a: NCCL_IB_HCA==mlx5_0:1,mlx5_1:1", "b: NCCL_IB_HCA==mlx5_0:1"]
    assert json.loads(env_line(new.nodes[1]))["NCCL_IB_HCA"] == "=mlx5_0:1"  # what the agent receives
    assert all("NCCL_IB_GID_INDEX" not in p.env for p in new.nodes)
    assert "NCCL_IB_HCA" not in plan.nodes[0].env  # the original plan is unchanged


def test_a_users_nccl_ib_hca_wins_and_is_reported():
    plan, checks = checks_for({"a": "ib_two_active"}, NCCL_IB_HCA="mlx5_1")
    new, notes = rdma.with_ib_hca(plan, checks)
    assert new.nodes[0].env["NCCL_IB_HCA"] == "mlx5_1"
    assert notes == ["a: NCCL_IB_HCA=mlx5_1 from ddp_env (the active ports are mlx5_0:1,mlx5_1:1)"]


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
