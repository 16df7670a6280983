"""cluster_hosts sizes the kernel neighbour table (IPv4 and IPv6 gc_thresh1/2/3) from the inventory's size,
only ever raising it, and verify's check (tasks_from: neigh_check) refuses live values below it.

The table is the kernel's, shared by every network namespace (a namespace host has no
net.ipv4.neigh.default.*), so this runs the role on this machine itself, writing its sysctl file into
tmp_path. It raises the live thresholds a little and puts back the previous values afterwards unless
someone else changed them meanwhile (another job may raise them too; this never lowers theirs)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

import tests.conftest as root_conftest
from tests.testbed import neigh

pytestmark = pytest.mark.testbed

PROC = Path("/proc/sys/net")
KEYS = [f"net.{v}.neigh.default.gc_thresh{i}" for v in ("ipv4", "ipv6") for i in (1, 2, 3)]


def _path(key: str) -> Path:
    return PROC / Path(*key.split(".")[1:])


def live() -> dict[str, int]:
    return {k: int(_path(k).read_text()) for k in KEYS if _path(k).exists()}


@pytest.fixture
def thresholds():
    """The live values before the test; those the test changed are put back unless changed since."""
    root_conftest.require_testbed()
    with neigh.held():  # no testbed coming up on another pytest-xdist worker changes them meanwhile
        before = live()
        assert before, "this kernel has no net.ipv4.neigh.default.gc_thresh*"
        set_by_test: dict[str, int] = {}
        yield before, set_by_test
        now = live()
        for key, value in set_by_test.items():
            if now.get(key) == value and value > before[key]:
                with contextlib.suppress(OSError):
                    _path(key).write_text(str(before[key]))


def _run(playbook, tmp_path: Path, nodes: int, *extra: str):
    return playbook(
        "-i", "localhost,", "tests/ansible/playbooks/neigh.yml",
        "-e", f"nodes={nodes} neigh_file={tmp_path / '99-zzz-ddp-train-neigh.conf'}", *extra,
    )  # fmt: skip


def _file_values(tmp_path: Path) -> dict[str, int]:
    text = (tmp_path / "99-zzz-ddp-train-neigh.conf").read_text()
    return {k: int(v) for k, v in re.findall(r"^(\S+)=(\d+)$", text, re.M)}


@pytest.mark.slow
def test_a_higher_live_value_is_kept_not_lowered(thresholds, playbook, tmp_path):
    before, _ = thresholds
    res = _run(playbook, tmp_path, 3, "-e", "cluster_hosts_neigh_gc_thresh3_min=16")
    assert res.returncode == 0, res.out[-3000:]
    assert _file_values(tmp_path) == before, "the file holds the live values, so boot does not lower them"
    assert live() == before


@pytest.mark.slow
def test_the_thresholds_follow_the_cluster_size_and_verify_checks_them(thresholds, playbook, tmp_path):
    before, set_by_test = thresholds
    nodes = max(before.values()) // 8 + 16  # 8 entries per node: above every live value
    t3 = 8 * nodes
    want = {k: max({"1": t3 // 8, "2": t3 // 2, "3": t3}[k[-1]], v) for k, v in before.items()}
    set_by_test.update(want)

    res = _run(playbook, tmp_path, nodes, "-e", "cluster_hosts_neigh_gc_thresh3_min=64")
    assert res.returncode == 0, res.out[-3000:]
    assert _file_values(tmp_path) == want
    assert live() == want
    assert live()["net.ipv4.neigh.default.gc_thresh3"] == t3 > before["net.ipv4.neigh.default.gc_thresh3"]

    again = _run(playbook, tmp_path, nodes, "-e", "cluster_hosts_neigh_gc_thresh3_min=64")
    assert again.returncode == 0, again.out[-3000:]
    assert re.search(r"localhost\s+: ok=\d+\s+changed=0 ", again.out), again.out[-2000:]

    # verify's check for a cluster twice the size: the live values are too low, named with the need.
    bigger = _run(
        playbook, tmp_path, 2 * nodes, "-e", "check_only=true cluster_hosts_neigh_gc_thresh3_min=64"
    )
    named = f"net.ipv4.neigh.default.gc_thresh3 is {t3}, below the {2 * t3} that {2 * nodes} nodes need"
    assert bigger.returncode == 2, bigger.out[-3000:]
    assert named in bigger.out, bigger.out[-3000:]


@pytest.mark.slow
def test_a_sysctl_file_that_would_lower_them_at_boot_is_named(thresholds, playbook, tmp_path):
    before, _ = thresholds
    others = tmp_path / "sysctl.d"
    others.mkdir()
    (others / "50-admin.conf").write_text("net.ipv4.neigh.default.gc_thresh3 = 16\n")  # applied before: fine
    (others / "99-zzzz-late.conf").write_text("net/ipv4/neigh/default/gc_thresh3=32\n")
    files = json.dumps({"_cluster_hosts_sysctl_files": [f"{others}/*.conf"]})
    res = _run(playbook, tmp_path, 3, "-e", "cluster_hosts_neigh_gc_thresh3_min=64", "-e", files)
    assert res.returncode == 2, res.out[-3000:]
    named = f"{others}/99-zzzz-late.conf sets net.ipv4.neigh.default.gc_thresh3 = 32, and it applies after"
    assert named in res.out, res.out[-3000:]
    assert "50-admin.conf sets" not in res.out
    assert live() == before
