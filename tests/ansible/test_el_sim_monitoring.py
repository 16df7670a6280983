"""The monitoring role's EL path on EL simulation hosts: on two EL9 hosts (node0 the monitoring host and a
node, node1 a node) `--check` on fresh hosts, then the epel role's epel-release, EPEL's node-exporter and
golang-github-prometheus installed with dnf (the sim's stub RPMs; Debian's real node exporter 1.5 and
Prometheus 2.42 run under EL's paths), the daemons started by the role (no systemd), Prometheus
reporting both nodes' exporters up on their training addresses, and a second run that changes nothing.
On an EL10 monitoring host, where EPEL has no Prometheus server: one message naming the packages.
Own testbeds: prefix elmo, 10.213.175; elmt, 10.213.176."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.ansible.el_sim import recaps, sh
from tests.conftest import private_testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1200)]

GROUP_VARS = {"monitoring_prometheus_scrape_interval": "2s"}


def _inventory(tmp_path) -> list[str]:
    inv = tmp_path / "monitoring-inv"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(
        yaml.safe_dump({"all": {"children": {"monitoring": {"hosts": {"node0": {}}}}}})
    )
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(GROUP_VARS))
    return ["-i", str(inv)]


def _targets(tb, url: str) -> list[tuple[str, str]]:
    """(instance, health) of every active target, asked from node0 (Prometheus listens on its address)."""
    code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
    out = json.loads(sh(tb, 0, f"python3 -c {json.dumps(code)}"))
    return sorted((t["labels"]["instance"], t["health"]) for t in out["data"]["activeTargets"])


def test_epel_exporter_and_prometheus_install_start_and_scrape_on_el9(playbook, tmp_path):
    with private_testbed("elmo", "10.213.175", 2, os="rocky9", gpus=0) as tb:
        inv = ["-i", str(tb.inventory), *_inventory(tmp_path)]
        check = playbook(*inv, "--check", "playbooks/monitoring.yml")
        assert check.returncode == 0, check.out[-4000:]
        assert "check mode: EPEL is not there yet" in check.out, check.out[-4000:]
        assert "is not installed" in sh(tb, 0, "rpm -q node-exporter", check=False)

        res = playbook(*inv, "playbooks/monitoring.yml")
        assert res.returncode == 0, res.out[-6000:]
        rpms = sh(
            tb,
            0,
            "rpm -q --queryformat '%{NAME} %{VERSION}\\n' epel-release node-exporter "
            "golang-github-prometheus",
        )
        assert rpms.split() == [
            "epel-release",
            "9",
            "node-exporter",
            "1.11.1",
            "golang-github-prometheus",
            "2.32.1",
        ]
        assert "is not installed" in sh(tb, 1, "rpm -q golang-github-prometheus", check=False)

        ips = [h.ip for h in tb.hosts()]
        want = [(f"{ip}:9100", "up") for ip in ips]
        url = f"http://{ips[0]}:9090/api/v1/targets?state=active"
        deadline = time.monotonic() + 60
        while (got := _targets(tb, url)) != want and time.monotonic() < deadline:
            time.sleep(2)
        assert got == want
        # EL's exporter, under its EL name, run by the role as user prometheus (the hosts share one PID space)
        ps = sh(tb, 1, "ps -o user:20=,args= -C node_exporter").splitlines()
        mine = f"prometheus /usr/bin/node_exporter --web.listen-address={ips[1]}:9100 "
        assert any(" ".join(line.split()).startswith(mine) for line in ps), ps

        again = playbook(*inv, "playbooks/monitoring.yml")
        assert again.returncode == 0 and recaps(again.out) == {"node0": 0, "node1": 0}, again.out[-4000:]


def test_an_el10_monitoring_host_without_a_prometheus_package_is_one_message(playbook, tmp_path):
    with private_testbed("elmt", "10.213.176", 1, os="rocky10", gpus=0) as tb:
        res = playbook("-i", str(tb.inventory), *_inventory(tmp_path), "playbooks/monitoring.yml")
        assert res.returncode == 2, res.out[-4000:]
        text = " ".join(res.out.split())
        assert (
            "monitoring: dnf could not install node-exporter, golang-github-prometheus on Rocky 10.1: "
            "Failed to install some of the specified packages; "
            "No package golang-github-prometheus available. The node exporter can come from its release"
        ) in text, res.out[-4000:]
        assert "Traceback" not in res.out
