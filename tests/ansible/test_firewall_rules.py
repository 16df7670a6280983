"""The firewalld backend adds rich rules limited to the cluster's sources, so the zone's other traffic
(NFS, Slurm, exporters) keeps the admin's rules; it never binds the training network to a zone of its own.
(firewalld itself needs systemd, which no test host here runs: this checks the rules the role computes.)"""

from __future__ import annotations

import json
import sys

import pytest

from tests.ansible.conftest import REPO_ROOT

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "firewall_rules.yml")
SRC = 'rule family="ipv4" source address="10.1.0.0/24"'


def _rules(playbook, tmp_path, **extra) -> list[str]:
    out = tmp_path / "rules.json"
    extra = {"ddp_network_cidr": "10.1.0.0/24", "rules_file": str(out), **extra}
    extra["ansible_python_interpreter"] = sys.executable
    res = playbook("-i", "localhost,", "-c", "local", "-e", json.dumps(extra), PLAY)
    assert res.returncode == 0, res.out[-2000:]
    return json.loads(out.read_text())


def test_port_range_policy_opens_each_training_port_to_the_cluster_only(playbook, tmp_path):
    rules = _rules(playbook, tmp_path, firewall_extra_tcp_ports=[9100])
    assert rules == [
        f'{SRC} port port="29500" protocol="tcp" accept',
        f'{SRC} port port="9100" protocol="tcp" accept',
        f'{SRC} port port="50000-51999" protocol="tcp" accept',
    ]


@pytest.mark.parametrize("sources", [["10.1.0.0/24"], ["10.1.0.0/24", "10.2.0.5"]])
def test_trusted_sources_policy_accepts_the_sources_and_nothing_else(playbook, tmp_path, sources):
    rules = _rules(
        playbook, tmp_path, firewall_ephemeral_policy="trusted_sources", firewall_trusted_sources=sources
    )
    assert rules == [f'rule family="ipv4" source address="{s}" accept' for s in sources]
