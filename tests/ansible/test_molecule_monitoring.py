"""`molecule test -s monitoring` on the namespace testbed: the monitoring role with Debian 12's real
Prometheus and node exporter on three hosts with a training network (node0 also the monitoring host; node0
and node1 with the fake nvidia-smi, GPU 2 idle): --check, converge, idempotence (changed=0), verify
(Prometheus, listening on node0's training address only, reports every node's exporter up at its training
address, the GPU nodes' series exist with the idle GPU at 0, the exporter answers neither on the SSH
address nor to another node; the trainer run for 4 steps on node0 with log.prometheus, and Prometheus'
ddp_train_step and ddp_train_loss for node0 equal its last logged record), destroy. Uses the testbed
prefix mon and nets 10.213.189 (SSH) and 10.213.190 (training)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import run, tool_env

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RECAP = re.compile(r"(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0")


def _step(out: str, step: str) -> str:
    m = re.search(rf"\[monitoring > {step}\] Executing(.*?)\[monitoring > {step}\] Executed", out, re.S)
    assert m, f"molecule did not run {step}"
    return m.group(1)


@pytest.mark.timeout(1500)
def test_molecule_monitoring_scenario(venv_bin):
    root_conftest.require_testbed()
    missing = [
        b
        for b in ("prometheus", "prometheus-node-exporter", "promtool")
        if shutil.which(b, path="/usr/sbin:/usr/bin") is None
    ]
    if missing:
        pytest.skip(f"Prometheus is not installed here ({', '.join(missing)}): bash .ci/setup --with-testbed")
    start = time.monotonic()
    res = run([str(venv_bin / "molecule"), "test", "-s", "monitoring"], tool_env(venv_bin), 1400, merge=True)
    out = ANSI.sub("", res.stdout)
    print(f"molecule test -s monitoring: rc={res.returncode} in {(time.monotonic() - start) / 60:.1f} min")

    assert res.returncode == 0, out[-6000:]
    check = _step(out, "check")
    assert sorted(n for n, _ in RECAP.findall(check)) == ["node0", "node1", "node2"], check[-3000:]
    converge = RECAP.findall(_step(out, "converge"))
    assert sorted(n for n, _ in converge) == ["node0", "node1", "node2"]
    assert all(int(c) > 0 for _, c in converge)
    assert sorted(RECAP.findall(_step(out, "idempotence"))) == [
        ("node0", "0"),
        ("node1", "0"),
        ("node2", "0"),
    ]
    verify = _step(out, "verify")
    for task in (
        "Ask Prometheus at the monitoring host's SSH address (it listens on the training one only)",
        "Check that the targets are the nodes' training addresses",
        "Check the GPU series (4 GPUs on node0 and node1, none on node2, GPU 2 idle)",
        "Check that each exists on every GPU (node_load1 on every node)",
        "Ask node1's exporter at its training address from node2 (not the monitoring host)",
        "Run the trainer for a few steps on the monitoring host with log.prometheus",
        "Check ddp_train_step and ddp_train_loss against the trainer's last record",
    ):
        assert re.search(rf"TASK \[{re.escape(task)}\].*?ok: \[node\d\]", verify, re.S), task
    assert "failed=0" in verify and not re.search(r"failed=[1-9]", verify)
    assert "monitoring > destroy: Executed: Successful" in out
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mon-node" not in netns, "molecule destroy left namespaces behind"
