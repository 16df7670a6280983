"""The rdma role: skipped with its message on hosts without an HCA (Debian namespace hosts), its Debian
path in check mode over a recorded sysfs tree, and its EL path on an EL9 simulation host pointed at
recorded trees (rdma_sysfs_root): packages, memlock, nvidia-peermem at boot vs DMA-BUF vs none, the verbs
check, idempotence (four runs). Own EL testbed: prefix rdm, 10.213.104."""

from __future__ import annotations

import json
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


@pytest.mark.slow
def test_hosts_without_hca_are_skipped_with_a_message(testbed, playbook):
    res = playbook("-i", str(testbed.inventory), PLAY)
    assert res.returncode == 0, res.out[-3000:]
    assert res.out.count(SKIPPED) == 3, res.out[-3000:]
    assert _changed(res.out) == {"0"}


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_verify_reports_and_checks_the_transport_nccl_chose(playbook, venv_bin, tmp_path):
    """verify.yml's checks over recorded sysfs trees and NCCL logs, one local host per case, in one run."""
    cases = {
        "ib_ok": ("ib_two_active", "nccl_ib_gdr.log", 22.163),
        "ib_but_socket": ("ib_two_active", "nccl_socket.log", 1.1),
        "ib_slow": ("roce", "nccl_ib_no_gdr.log", 3.0),  # 100 Gb/s RoCE: the floor is 6.25 GB/s
        "no_rdma": ("missing", "nccl_socket.log", 1.1),
        "roce_off": ("roce_connectx", "nccl_socket.log", 9.1),  # ddp_rdma off: TCP on the 100 GbE port
        "on_but_down": ("ib_all_down", "nccl_socket.log", 1.1),  # ddp_rdma on
        "roce_rerun": ("roce_connectx", "nccl_ib_no_gdr.log", 11.2),  # auto: RoCE, then the TCP rerun
    }
    rerun = "ddp-allreduce rank=0 world_size=2 backend=nccl algbw_GBps=4.9 busbw_GBps=9.100 ok=1"
    more = {"roce_off": {"ddp_rdma": "off", "rdma_case_iface": "ens1f0np0"},
            "on_but_down": {"ddp_rdma": True},
            "roce_rerun": {"rdma_case_iface": "ens1f0np0", "rdma_case_rerun": rerun}}  # fmt: skip
    hosts = {
        name: {"ansible_connection": "local", "ansible_python_interpreter": str(venv_bin / "python"),
               "rdma_case_tree": str(TREES / tree), "rdma_case_log": str(TREES / log), "rdma_case_busbw": bw,
               **more.get(name, {})}
        for name, (tree, log, bw) in cases.items()
    }  # fmt: skip
    inventory = tmp_path / "hosts.json"
    inventory.write_text(json.dumps({"all": {"hosts": hosts}}))
    play = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "verify_rdma.yml")
    res = playbook("-i", str(inventory), "-e", f"verify_venv={venv_bin.parent}", play)
    assert res.returncode == 2, res.out[-3000:]
    assert re.search(r"ib_ok\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", res.out), res.out[-3000:]
    assert re.search(r"no_rdma\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", res.out), res.out[-3000:]
    assert (
        "ib_ok: NCCL 2.26.2+cuda12.8 network IB (mlx5_0:1, mlx5_1:1), GPUDirect RDMA yes; RDMA ports: "
        "mlx5_0:1, mlx5_1:1 active, 200.0 Gb/s." in res.out
    )
    assert (
        "no_rdma: NCCL 2.27.3+cuda12.9 network Socket, GPUDirect RDMA no; RDMA ports: none active." in res.out
    )
    assert (
        "ib_but_socket has ACTIVE RDMA ports (mlx5_0:1, mlx5_1:1) but NCCL used TCP sockets: "
        "NCCL found no IB device" in res.out
    )
    assert re.search(r"roce_off\s+: ok=\d+\s+changed=0\s+unreachable=0\s+failed=0", res.out), res.out[-3000:]
    assert (
        "roce_off: TCP sockets on ens1f0np0: busbw 9.1 GB/s (the run above); link 100000 Mb/s = 12.5 GB/s, "
        "busbw is 72.8% of it." in res.out
    )
    assert (
        "ib_ok: TCP sockets on eth0: not measured (verify_tcp_compare: false); link speed unknown (cat: "
        in res.out
    )
    assert "; over RDMA: busbw 22.163 GB/s." in res.out
    assert (
        "roce_rerun: TCP sockets on ens1f0np0: busbw 9.1 GB/s (the NCCL_IB_DISABLE=1 run); link 100000 Mb/s "
        "= 12.5 GB/s, busbw is 72.8% of it; over RDMA: busbw 11.2 GB/s." in res.out
    )
    assert (
        "on_but_down: ddp_rdma is on but no RDMA port is ACTIVE: mlx5_0:1 IB INIT 200 Gb/s: bring the "
        "ports up" in res.out
    )
    assert (
        "ib_slow: bus bandwidth 3.0 GB/s is below 0.5 of its 100.0 Gb/s RDMA link (6.25 GB/s), "
        "and NCCL did not use GPUDirect RDMA" in res.out
    )
