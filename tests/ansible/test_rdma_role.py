"""The rdma role: skipped with its message on hosts without an HCA (Debian namespace hosts), its Debian
path in check mode over a recorded sysfs tree, and its EL path on an EL9 simulation host pointed at
recorded trees (rdma_sysfs_root): packages, memlock, nvidia-peermem at boot vs DMA-BUF vs none, the verbs
check, idempotence (four runs). Own EL testbed: prefix rdm, 10.213.104."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.ansible.conftest import REPO_ROOT
from tests.conftest import private_testbed

pytestmark = pytest.mark.testbed

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "rdma.yml")
TREES = REPO_ROOT / "tests" / "unit" / "fixtures" / "rdma"
SKIPPED = "no RDMA device (HCA) found"
PACKAGES = ["rdma-core", "libibverbs-utils", "infiniband-diags", "perftest"]


def _changed(out: str) -> set[str]:
    return set(re.findall(r"changed=(\d+)", out))


def test_hosts_without_hca_are_skipped_with_a_message(testbed, playbook):
    res = playbook("-i", str(testbed.inventory), PLAY)
    assert res.returncode == 0, res.out[-3000:]
    assert res.out.count(SKIPPED) == 3, res.out[-3000:]
    assert _changed(res.out) == {"0"}


def test_debian_path_in_check_mode_with_a_recorded_hca(testbed, playbook):
    """apt would install Debian's package names; nothing is written (check mode)."""
    res = playbook("-i", str(testbed.inventory), "--check", "--diff", "-l", "node0",
                   "-e", f"rdma_sysfs_root={TREES / 'roce'}", PLAY)  # fmt: skip
    assert res.returncode == 0, res.out[-3000:]
    assert SKIPPED not in res.out
    assert "ibverbs-providers" in res.out and "ibverbs-utils" in res.out  # apt's would-install list
    assert "soft memlock unlimited" in res.out  # the limits file's diff
    assert "RDMA ports mlx5_0:1 ACTIVE Ethernet 100 Gb/sec (2X HDR); mlx5_1:1 DOWN Ethernet" in res.out


@pytest.fixture(scope="module")
def el9():
    with private_testbed("rdm", "10.213.104", 1, os="rocky9", gpus=2) as tb:
        yield tb


def test_el_path_on_the_el9_simulation(el9, playbook, tmp_path):
    inv = ["-i", str(el9.inventory)]
    host = el9.hosts()[0].name

    tree = ["-e", f"rdma_sysfs_root={TREES / 'ib_two_active'}"]
    res = playbook(*inv, *tree, "-e", "rdma_gpudirect=peermem", PLAY)
    assert res.returncode == 0, res.out[-3000:]
    assert _changed(res.out) != {"0"}
    assert "RDMA ports mlx5_0:1 ACTIVE InfiniBand 200 Gb/sec (4X HDR); mlx5_1:1 ACTIVE" in res.out
    assert "GPUDirect RDMA: peermem" in res.out
    out = el9.ssh(host, f"rpm -q {' '.join(PACKAGES)} && cat /etc/security/limits.d/90-ddp-train-rdma.conf "
                        "/etc/modules-load.d/nvidia-peermem.conf").stdout  # fmt: skip
    for name in PACKAGES:
        assert f"{name}-" in out
    assert "* soft memlock unlimited" in out and "* hard memlock unlimited" in out
    assert "\nnvidia-peermem\n" in out

    res = playbook(*inv, *tree, "-e", "rdma_gpudirect=peermem", PLAY)
    assert res.returncode == 0 and _changed(res.out) == {"0"}, res.out[-3000:]

    # auto: the sim runs a 5.14 kernel and no driver is loaded (flavour from the default, open): DMA-BUF
    res = playbook(*inv, *tree, PLAY)
    assert res.returncode == 0, res.out[-3000:]
    assert "GPUDirect RDMA: dmabuf" in res.out
    assert el9.ssh(host, "test -e /etc/modules-load.d/nvidia-peermem.conf", check=False).returncode == 1

    # proprietary modules on the inbox stack: no GPUDirect RDMA, said so; and an HCA whose ib_uverbs node is
    # missing: verbs cannot open it and NCCL would use TCP
    broken = tmp_path / "no_uverbs"
    shutil.copytree(TREES / "ib_two_active", broken)
    shutil.rmtree(broken / "sys" / "class" / "infiniband_verbs" / "uverbs1")
    res = playbook(*inv, "-e", f"rdma_sysfs_root={broken}", "-e", "rdma_nvidia_driver_flavor=dkms", PLAY)
    assert res.returncode == 2, res.out[-3000:]
    assert "no GPUDirect RDMA: the dkms driver modules" in res.out
    assert "`ibv_devinfo -l` lists mlx5_0, not every device in sysfs (mlx5_0, mlx5_1)" in res.out
