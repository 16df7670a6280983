"""The monitoring role's checks: bad input stops playbooks/monitoring.yml (and site.yml's preflight)
with one line naming the variable, before anything changes. The role on live hosts with Debian's real
Prometheus and node exporter is tested by molecule/monitoring (test_molecule_monitoring.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO_ROOT

PLAY = str(REPO_ROOT / "playbooks" / "monitoring.yml")


def _inventory(tmp_path: Path, monitoring: list[str]) -> str:
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inv = {
        "all": {
            "vars": {"ddp_network_cidr": "127.0.0.0/8"},
            "children": {
                "gpu_nodes": {"hosts": {"n0": local, "n1": local}},
                "monitoring": {"hosts": {h: None for h in monitoring}},
            },
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


@pytest.mark.parametrize(
    ("monitoring", "extra", "message"),
    [
        (["n0", "n1"], {}, "group monitoring (monitoring_group) must hold one host, it has n0, n1"),
        (
            ["n0"],
            {"monitoring_node_exporter_port": 29500},
            "monitoring_node_exporter_port 29500 is MASTER_PORT",
        ),
        (
            ["n0"],
            {"monitoring_gpu_exporter": "dcgm", "monitoring_dcgm_exporter_port": 50100},
            "monitoring_dcgm_exporter_port 50100 is in the ephemeral port range 50000-51999",
        ),
        (
            ["n0"],
            {"monitoring_node_exporter_port": 70000},
            "monitoring_node_exporter_port must be a TCP port",
        ),
        (["n0"], {"monitoring_prometheus_retention": "two weeks"}, "monitoring_prometheus_retention must be"),
    ],
)
def test_bad_input_is_one_line_naming_the_variable_and_nothing_runs(
    playbook, tmp_path, monitoring, extra, message
):
    res = playbook("-i", _inventory(tmp_path, monitoring), "-e", json.dumps(extra), PLAY)
    assert res.returncode != 0, res.out[-3000:]
    failed = [ln for ln in res.out.splitlines() if '"msg": "monitoring: ' in ln]
    assert len(failed) == 1 and message in failed[0], res.out[-3000:]
    assert "Find each host's address" not in res.out  # the second play never started
    assert not re.search(r"changed=[1-9]", res.out), res.out[-3000:]
