"""The namespace testbed itself: isolated hosts reachable over SSH with strict host key checking."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.testbed import Testbed

pytestmark = pytest.mark.testbed


def _alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_each_host_has_its_own_hostname_and_hosts_file(testbed):
    for h in testbed.hosts():
        res = testbed.ssh(h, "hostname; getent hosts $(hostname); cat /etc/hosts")
        lines = res.stdout.splitlines()
        assert lines[0] == h.name
        assert lines[1].split() == [h.ip, h.name]
        assert f"{h.ip}\t{h.name}" in res.stdout


def test_ssh_refuses_an_unknown_host_key(testbed, tmp_path):
    h = testbed.hosts()[0]
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    argv = testbed.ssh_argv(h, "true")
    argv[1:1] = ["-o", f"UserKnownHostsFile={empty}"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 255
    assert "Host key verification failed" in res.stderr


def test_writing_etc_hosts_inside_a_host_leaves_the_real_one_alone(testbed):
    real = Path("/etc/hosts").read_text()
    h = testbed.hosts()[1]
    probe = "echo '10.99.99.99 intruder' >> /etc/hosts && mkdir -p /opt/tb-probe && touch /opt/tb-probe/x"
    testbed.ssh(h, probe)
    assert "intruder" in testbed.ssh(h, "cat /etc/hosts").stdout
    assert "intruder" not in testbed.ssh(testbed.hosts()[0], "cat /etc/hosts").stdout
    assert Path("/etc/hosts").read_text() == real
    assert not Path("/opt/tb-probe").exists()


def test_hosts_reach_each_other_only_on_the_private_net(testbed):
    a, b = testbed.hosts()[:2]
    res = testbed.ssh(a, f"getent hosts {b.name} && ip route")
    assert b.ip in res.stdout
    assert "default" not in res.stdout


def test_down_leaves_no_namespace_and_no_process():
    tb = Testbed(prefix="tbdown", net="10.213.59")
    hosts = tb.up(2)
    pids = [p for h in hosts for p in tb.pids(h)]
    assert pids
    tb.ssh(hosts[0], "setsid sleep 300 < /dev/null > /dev/null 2>&1 &")
    tb.down()
    tb.down()  # idempotent
    assert tb.namespaces() == []
    for pid in pids:
        assert not _alive(pid)
    assert subprocess.run(["ip", "link", "show", tb.bridge], capture_output=True).returncode != 0
    assert not tb.state_dir.exists()
