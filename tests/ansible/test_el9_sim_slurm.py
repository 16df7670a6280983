"""The slurm role's EL path on two EL9 simulation hosts (node0 controller and compute node, node1 compute
node): `slurm_package_source: epel` enables EPEL with epel-release, installs EPEL's slurm packages and
AppStream's munge with dnf (the sim's stub RPMs, tests/testbed/el/manifest.yml), generates the munge key
a fresh EL install lacks and copies it, starts the daemons (Debian 12's real Slurm 22.05 and munge, the
same major release as EPEL 9's 22.05.9), and slurm.yml's own check sees both nodes idle with their GPUs
and runs a step on both. --check before anything is installed, then converge, then a second run that
changes nothing. The `local` and `openhpc` sources on one EL9 host each: the admin's own repository
added with yum_repository, or OpenHPC's release RPM by URL, and Slurm installed from there. And an EL10
host, where EPEL has no Slurm (epel-testing only): one message naming the source. Own testbeds: prefix
elsl, 10.213.171; elsc and elso (local, openhpc), 10.213.173 and .174; elsm, 10.213.172."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.ansible.el_sim import SIM, recaps, sh
from tests.conftest import private_testbed
from tests.testbed import el as testbed_el
from tests.testbed.el import GPU_SLOTS

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1200)]

GPUS = 2
# The namespace hosts cannot have cgroups delegated (as molecule/slurm's group_vars); the GPUs' character
# devices are made in each host's private /run (gres.conf's File= lines need a character device).
GROUP_VARS = {
    "slurm_proctrack_type": "proctrack/linuxproc",
    "slurm_task_plugin": "task/none",
    "slurm_cgroup_constrain": False,
    "slurm_cgroup_plugin": "cgroup/v1",
    "slurm_kill_wait": 10,
    "slurm_gpu_device_prefix": "/run/ddp-sim-gpu/nvidia",
    "slurm_package_source": "epel",
    # The install path is what these tests are about: slurm.yml's allreduce through ddp-launch needs the
    # training venv on the nodes (molecule/slurm runs it).
    "slurm_verify_allreduce": False,
}


@pytest.fixture(scope="module")
def el9():
    for binary in ("slurmctld", "slurmd", "srun", "munged"):
        if shutil.which(binary, path="/usr/sbin:/usr/bin") is None:
            pytest.skip(f"Slurm is not installed here ({binary}): bash .ci/setup --with-testbed")
    with private_testbed("elsl", "10.213.171", 2, os="rocky9", gpus=GPUS) as tb:
        for i in range(2):
            # A fresh EL install has no munge key (EL's munge generates none; the sim's /etc has Debian's).
            devices = " && ".join(f"mknod /run/ddp-sim-gpu/nvidia{g} c 195 {g}" for g in range(GPUS))
            sh(tb, i, f"rm -f /etc/munge/munge.key && mkdir -p /run/ddp-sim-gpu && {devices}")
            # What a real node's sysfs and loaded driver say of each GPU (gres.conf's Cores=, issue #45 7b):
            # GPU 0 local to CPU 0 only, GPU 1 to every CPU; the CPUs' topology is this machine's own.
            for g, slot in enumerate(GPU_SLOTS[:GPUS]):
                d, proc = f"{SIM}/pci/devices/{slot}", f"{SIM}/proc/driver/nvidia/gpus/{slot}"
                cpus = "0" if g == 0 else f"0-{os.cpu_count() - 1}"
                sh(
                    tb,
                    i,
                    f"echo {cpus} > {d}/local_cpulist && mkdir -p {proc} && "
                    f"printf 'Bus Location: \\t {slot}\\nDevice Minor: \\t {g}\\n' > {proc}/information",
                )
        yield tb


def _slurm_inventory(tmp_path, **extra) -> str:
    inv = tmp_path / "slurm-inv"
    (inv / "group_vars").mkdir(parents=True)
    controller = {"all": {"children": {"slurm_controller": {"hosts": {"node0": {}}}}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(controller))
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(GROUP_VARS | extra))
    return str(inv)


@pytest.fixture
def slurm_yml(el9, playbook, tmp_path):
    inv = ["-i", str(el9.inventory), "-i", _slurm_inventory(tmp_path)]

    def _run(*args: str):
        return playbook(*inv, *args, "playbooks/slurm.yml", timeout=900)

    return _run


def test_epel_slurm_installs_starts_and_answers_on_el9(el9, slurm_yml):
    check = slurm_yml("--check")
    assert check.returncode == 0, check.out[-4000:]
    assert "check mode: the epel repository is not there yet" in check.out, check.out[-4000:]
    assert sh(el9, 0, "rpm -q epel-release slurm munge", check=False).count("is not installed") == 3

    res = slurm_yml()
    assert res.returncode == 0, res.out[-6000:]
    assert all(c > 0 for c in recaps(res.out).values()) and len(recaps(res.out)) == 2, res.out[-3000:]
    wanted = {"epel-release": "9-10.el9", "slurm": "22.05.9-1.el9", "slurm-slurmctld": "22.05.9-1.el9"}
    wanted |= {"slurm-slurmd": "22.05.9-1.el9", "munge": "0.5.13-13.el9"}
    ctl = sh(el9, 0, f"rpm -q --queryformat '%{{NAME}} %{{VERSION}}-%{{RELEASE}}\\n' {' '.join(wanted)}")
    assert dict(line.split() for line in ctl.splitlines()) == wanted, ctl
    node1 = sh(el9, 1, "rpm -q slurm-slurmd slurm-slurmctld munge", check=False)
    assert "slurm-slurmd-22.05.9" in node1 and "package slurm-slurmctld is not installed" in node1, node1
    # One key, generated on the controller and copied: munge's alone, the same on both hosts.
    key = "stat -c '%U %a' /etc/munge/munge.key && sha256sum < /etc/munge/munge.key"
    keys = [sh(el9, i, key) for i in (0, 1)]
    assert keys[0] == keys[1] and keys[0].startswith("munge 400\n"), keys
    # Cores= from each GPU's local CPUs, as Slurm's core indexes: CPU 0 is core 0; all CPUs, every core.
    online = [
        c for c in Path("/sys/devices/system/cpu").glob("cpu[0-9]*") if (c / "topology/core_id").exists()
    ]
    cores = {
        ((c / "topology/physical_package_id").read_text(), (c / "topology/core_id").read_text())
        for c in online
    }
    gres = [
        line for line in sh(el9, 0, "cat /etc/slurm/gres.conf").splitlines() if line.startswith("NodeName=")
    ]
    prefix = GROUP_VARS["slurm_gpu_device_prefix"]
    last = f"0-{len(cores) - 1}" if len(cores) > 1 else "0"
    per_node = (
        [f"{prefix}[0-1] Cores=0"] if last == "0" else [f"{prefix}0 Cores=0", f"{prefix}1 Cores={last}"]
    )
    assert gres == [f"NodeName={n} Name=gpu File={f}" for n in ("node0", "node1") for f in per_node], gres
    sinfo = sh(el9, 0, "sinfo --noheader --Node --format='%N %t %G'").split("\n")
    # with the GPUs' cores known, %G adds their sockets: "gpu:2(S:0)" (playbooks/slurm.yml reads it so too)
    seen = sorted(re.sub(r"\(S:[0-9,-]+\)$", "", line) for line in filter(None, sinfo))
    assert seen == [f"node0 idle gpu:{GPUS}", f"node1 idle gpu:{GPUS}"], sinfo
    assert all(re.search(r"gpu:\d+\(S:[0-9,-]+\)$", line) for line in filter(None, sinfo)), sinfo
    assert re.search(r"Run hostname on every node in one step\] \*+\nok: \[node0\]", res.out), res.out[-3000:]

    again = slurm_yml()
    assert again.returncode == 0 and recaps(again.out) == {"node0": 0, "node1": 0}, again.out[-4000:]


SOURCES = {
    # The admin's own repository (here the sim's EPEL directory, served as that): package names as
    # EPEL's (rpmbuild -ta names them alike), EPEL itself left off.
    "local": (
        lambda: {"slurm_local_repo_url": testbed_el.build().repo_url("epel")},
        dict.fromkeys(["slurm", "slurm-slurmctld", "slurm-slurmd"], "@ddp-train-slurm"),
        "is not installed",
    ),
    # OpenHPC 3's release RPM by URL (it requires epel-release, which comes along), then its -ohpc packages.
    # The release RPM is installed only once rpm finds it signed by the pinned key: here the sim's own key,
    # which signed every stub RPM (OpenHPC's key, vendored in roles/slurm/files, signed none of them).
    "openhpc": (
        lambda: {
            "slurm_openhpc_release_url": testbed_el.build().repo_url("ohpc-release-download")
            + "Packages/ohpc-release-3-1.el9.x86_64.rpm",
            "slurm_openhpc_gpgkey_url": testbed_el.build().info["cuda_repo_gpgkey_url"],
            "slurm_openhpc_gpgkey_fingerprint": testbed_el.build().info["cuda_repo_gpgkey_fingerprint"],
        },
        dict.fromkeys(["slurm-ohpc", "slurm-slurmctld-ohpc", "slurm-slurmd-ohpc"], "@OpenHPC"),
        "epel-release-9-10.el9",
    ),
}


@pytest.mark.parametrize("source", ["local", "openhpc"])
def test_the_local_and_openhpc_sources_install_from_their_repositories(source, playbook, tmp_path):
    extra, wanted, epel = SOURCES[source]
    prefix, net = {"local": ("elsc", "10.213.173"), "openhpc": ("elso", "10.213.174")}[source]
    with private_testbed(prefix, net, 1, os="rocky9", gpus=0) as tb:
        sh(tb, 0, "rm -f /etc/munge/munge.key")
        group_vars = {"slurm_package_source": source, **extra()}
        inv = ["-i", str(tb.inventory), "-i", _slurm_inventory(tmp_path, **group_vars)]
        # --check on the fresh host: the source's repository (and OpenHPC's epel-release requirement) is
        # only in the plan, so its packages are said to be unchecked, and nothing is installed.
        check = playbook(*inv, "--check", "playbooks/slurm.yml")
        assert check.returncode == 0, check.out[-4000:]
        assert f"check mode: the {source} repository is not there yet" in check.out, check.out[-4000:]
        assert sh(tb, 0, "rpm -q epel-release munge", check=False).count("is not installed") == 2
        res = playbook(*inv, "playbooks/slurm.yml")
        assert res.returncode == 0, res.out[-6000:]
        installed = sh(tb, 0, f"dnf -q list --installed {' '.join(wanted)} munge | tail -n +2")
        repos = {line.split()[0].removesuffix(".x86_64"): line.split()[2] for line in installed.splitlines()}
        assert repos == wanted | {"munge": "@appstream"}, installed
        assert epel in sh(tb, 0, "rpm -q epel-release", check=False)
        assert sh(tb, 0, "sinfo --noheader --Node --format='%N %t'").split() == ["node0", "idle"]


def test_a_source_without_slurm_for_the_release_is_one_message_naming_it(playbook, tmp_path):
    """EL10: epel-release installs, but EPEL 10 has no Slurm (the sim's epel repo has none for rocky10)."""
    with private_testbed("elsm", "10.213.172", 1, os="rocky10", gpus=0) as el10:
        res = playbook("-i", str(el10.inventory), "-i", _slurm_inventory(tmp_path), "playbooks/slurm.yml")
        assert res.returncode == 2, res.out[-4000:]
        msg = re.search(r"slurm: dnf could not install .*?roles/slurm/README\.md\)", res.out, re.S)
        assert msg, res.out[-4000:]
        text = " ".join(msg.group(0).split())
        assert text.startswith(
            "slurm: dnf could not install slurm, slurm-slurmctld, munge, slurm-slurmd from "
            "slurm_package_source 'epel' on Rocky 10.1: Failed to install some of the specified packages; "
            "No package slurm available; No package slurm-slurmctld available; "
            "No package slurm-slurmd available. Where this source"
        ), text
        assert "Traceback" not in res.out
