"""The roles' EL code paths on EL9 simulation hosts (tests/testbed --os rocky9: real dnf 4.14 and rpm
against local repositories, simulated GPUs and reboot).

`molecule test -s el9-sim --destroy never` converges site.yml (without its GPU allreduce) on node0
(8 GPUs + NVSwitches) and node1 (8 GPUs), checks idempotence (changed=0) and the scenario's verify; the
tests below then use the converged hosts: verify.yml refusing the gloo fallback and a port range a later
sysctl file undid, the post-reboot health checks, a kernel that lost its module, and a driver branch
change. `--check` on a fresh host runs on a host of its own. Prefixes el9s (molecule) and el9k."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

import tests.conftest as root_conftest
from tests import testbed as testbed_mod
from tests.ansible.conftest import REPO_ROOT, run, tool_env
from tests.testbed import el as testbed_el

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SIM = "/var/lib/ddp-sim"
INVENTORY = ["-i", "inventory/testbed-el9s/hosts.yml", "-i", "molecule/el9-sim/inventory/"]


def _recaps(out: str) -> dict[str, int]:
    return {h: int(c) for h, c in re.findall(r"(node\d)\s+: ok=\d+\s+changed=(\d+)", out)}


def _step(out: str, step: str) -> str:
    m = re.search(rf"\[el9-sim > {step}\] Executing(.*?)\[el9-sim > {step}\] Executed", out, re.S)
    assert m, f"molecule did not run {step}"
    return m.group(1)


@pytest.fixture(scope="module")
def el9(venv_bin):
    """The converged el9-sim hosts (molecule test without its final destroy), destroyed at the end."""
    root_conftest.require_testbed()
    env = tool_env(venv_bin)
    start = time.monotonic()
    res = run(
        [str(venv_bin / "molecule"), "test", "-s", "el9-sim", "--destroy", "never"], env, 1500, merge=True
    )
    out = ANSI.sub("", res.stdout)
    print(f"molecule test -s el9-sim: rc={res.returncode} in {(time.monotonic() - start) / 60:.1f} min")
    try:
        assert res.returncode == 0, out[-6000:]
        converge, idempotence = _recaps(_step(out, "converge")), _recaps(_step(out, "idempotence"))
        assert sorted(converge) == ["node0", "node1"] and all(c > 0 for c in converge.values()), converge
        assert idempotence == {"node0": 0, "node1": 0}, idempotence
        assert "[el9-sim > verify] Executed: Successful" in out
        yield testbed_mod.Testbed(prefix="el9s", net="10.213.54", os="rocky9")
    finally:
        run([str(venv_bin / "molecule"), "destroy", "-s", "el9-sim"], env, 300)
        netns = os.popen("ip netns list").read()
        assert "el9s-node" not in netns, "molecule destroy left namespaces behind"


def _sh(tb, host: int, cmd: str, check: bool = True) -> str:
    return tb.ssh(tb.hosts()[host].name, cmd, check=check).stdout


def test_verify_refuses_gloo_on_gpu_nodes(el9, playbook):
    """The venv has torch's CPU build: the allreduce works, with gloo, and that is a failure on GPU nodes."""
    res = playbook(*INVENTORY, "playbooks/verify.yml")
    assert res.returncode == 2, res.out[-3000:]
    for node in ("node0", "node1"):
        assert f"{node} has 8 NVIDIA GPUs but the allreduce ran with gloo, not nccl" in res.out, res.out[
            -3000:
        ]
    assert re.search(r"rank 0/2 gloo", res.out) is None, "the bandwidth report is not reached"


def test_verify_names_a_port_range_another_sysctl_file_undid(el9, playbook):
    _sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='32768 60999'")
    try:
        res = playbook(*INVENTORY, "playbooks/verify.yml")
    finally:
        _sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='50000 51999'")
    assert res.returncode == 2, res.out[-3000:]
    assert (
        "node1: net.ipv4.ip_local_port_range is 32768-60999, not the 50000-51999 the firewall opens"
        in res.out
    )


@pytest.mark.parametrize(
    "case",
    ["mig", "secure_boot", "fabric_manager_stopped", "fabric_completed_with_error"],
)
def test_a_gpu_host_with_a_broken_driver_fails_with_the_reason(case, el9, playbook):
    """After the (simulated) reboot nothing changes but the driver is unusable: the run fails, saying why."""
    setup, undo, message = {
        "mig": (
            "nvidia-smi -i 3 -mig 1 >/dev/null",
            "nvidia-smi -i 3 -mig 0 >/dev/null",
            "node0: MIG mode is on for GPU 3: DDP expects whole GPUs",
        ),
        "secure_boot": (
            f"touch {SIM}/secureboot-rejects; /usr/local/sbin/ddp-sim-reboot",
            f"rm -f {SIM}/secureboot-rejects; /usr/local/sbin/ddp-sim-reboot",
            "node0: 8 NVIDIA GPUs but the driver is not loaded "
            "(/var/lib/ddp-sim/proc/driver/nvidia is missing): "
            "Secure Boot is enabled and rejects the DKMS-built module",
        ),
        "fabric_manager_stopped": (
            f"touch {SIM}/fabricmanager-stopped",
            f"rm -f {SIM}/fabricmanager-stopped",
            "node0: 4 NVSwitches but the fabric of GPU 00000000:1B:00.0 is In Progress (status N/A), GPU "
            "00000000:43:00.0 is In Progress (status N/A)",
        ),
        # NVML: the status is read once the state is Completed; Completed is not enough.
        "fabric_completed_with_error": (
            f"echo 'Insufficient Resources' > {SIM}/fabric-error",
            f"rm -f {SIM}/fabric-error",
            "node0: 4 NVSwitches but the fabric of GPU 00000000:1B:00.0 is Completed (status Insufficient "
            "Resources)",
        ),
    }[case]
    _sh(el9, 0, setup)
    try:
        res = playbook(
            *INVENTORY, "--limit", "node0", "-e", "nvidia_driver_fabric_wait_s=10", "playbooks/gpu.yml"
        )
    finally:
        _sh(el9, 0, undo)
    assert res.returncode == 2, res.out[-3000:]
    assert message in res.out, res.out[-3000:]
    rebooted = "RUNNING HANDLER [nvidia_driver : Reboot after the NVIDIA driver change]" in res.out
    if case == "secure_boot":  # an installed driver that is not loaded: reboot into it first, then say why
        assert rebooted, res.out[-3000:]
    else:
        assert not rebooted and _recaps(res.out) == {"node0": 0}, "nothing was changed on the way"


def test_a_booted_kernel_without_the_module_gets_it_rebuilt_and_rebooted(el9, playbook):
    """As after a kernel installed without its headers: dkms has no module for the booted kernel."""
    kernel = _sh(el9, 0, "uname -r").strip()
    version = _sh(el9, 0, "rpm -q --queryformat '%{VERSION}' kmod-nvidia-open-dkms").strip()
    _sh(el9, 0, f"dkms remove -m nvidia -v {version} -k {kernel}; /usr/local/sbin/ddp-sim-reboot")
    assert not _sh(el9, 0, f"ls /lib/modules/{kernel}/extra/").strip()
    assert _sh(el9, 0, "nvidia-smi -L", check=False).startswith("NVIDIA-SMI has failed")

    res = playbook(*INVENTORY, "--limit", "node0", "playbooks/gpu.yml")

    assert res.returncode == 0, res.out[-3000:]
    assert re.search(
        r"TASK \[nvidia_driver : Build the module for that kernel with dkms\].*?changed: \[node0\]",
        res.out,
        re.S,
    )
    assert "RUNNING HANDLER [nvidia_driver : Gather facts after the reboot]" in res.out
    assert len(_sh(el9, 0, "nvidia-smi -L").splitlines()) == 8
    assert f"autoinstall -k {kernel}" in _sh(el9, 0, "tail -n 5 /var/log/ddp-sim/dkms.log")


def test_changing_the_driver_branch_resets_the_stream_and_relocks(el9, playbook):
    """node1 moves from 580-open (cu130) to 575-open with torch's cu126 stack: dnf alone refuses to switch
    an enabled stream; the role resets it, syncs the packages down, and locks the new versions only."""
    stack = {"gpu_stack_torch_cuda": "cu126", "gpu_stack_driver_branch": "575"}
    # The NVIDIA Container Toolkit, from its own repo, locked at the older of its two versions: not the
    # driver's, so its locks stay and it is not distro-synced to 1.18.0.
    toolkit = ["libnvidia-container1", "libnvidia-container-tools", "nvidia-container-toolkit-base"]
    toolkit.append("nvidia-container-toolkit")
    repo = testbed_el.build().repo_url("nvidia-container-toolkit")
    _sh(
        el9,
        1,
        "printf '[nvidia-container-toolkit]\\nname=nvidia-container-toolkit\\nbaseurl=%s\\nenabled=1\\n"
        f"gpgcheck=0\\n' {repo} > /etc/yum.repos.d/nvidia-container-toolkit.repo && "
        f"dnf -q -y install nvidia-container-toolkit-1.17.8 && dnf -q versionlock add {' '.join(toolkit)}",
    )
    toolkit_locks = sorted(x for x in _sh(el9, 1, "dnf -q versionlock list").split() if "container" in x)
    assert len(toolkit_locks) == 4, toolkit_locks

    res = playbook(*INVENTORY, "--limit", "node1", "-e", json.dumps(stack), "playbooks/gpu.yml")
    assert res.returncode == 0, res.out[-4000:]

    stream = _sh(
        el9, 1, "dnf -q module list --enabled nvidia-driver | awk '$1 == \"nvidia-driver\" {print $2}'"
    )
    assert stream.strip() == "575-open"
    locks = _sh(el9, 1, "dnf -q versionlock list").split()
    nvidia = [lock for lock in locks if "nvidia" in lock and "container" not in lock]
    assert nvidia and all(":575.57.08-" in lock for lock in nvidia), locks
    assert sorted(lock for lock in locks if "container" in lock) == toolkit_locks
    versions = _sh(el9, 1, f"rpm -q --queryformat '%{{VERSION}}\\n' {' '.join(toolkit)}").split()
    assert versions == ["1.17.8"] * 4, versions
    assert sorted(lock for lock in locks if "nccl" in lock) == [
        "libnccl-0:2.29.3-1+cuda12.9.*",
        "libnccl-devel-0:2.29.3-1+cuda12.9.*",
    ]
    installed = _sh(el9, 1, "rpm -qa --queryformat '%{NAME}-%{VERSION}\\n' '*nvidia*' | sort").split()
    assert all("-575.57.08" in p for p in installed if "container" not in p), installed
    assert "release 12.6" in _sh(el9, 1, "/usr/local/cuda-12.6/bin/nvcc --version")
    assert "575.57.08" in _sh(el9, 1, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    # the second run with the new branch changes nothing
    again = playbook(*INVENTORY, "--limit", "node1", "-e", json.dumps(stack), "playbooks/gpu.yml")
    assert again.returncode == 0 and _recaps(again.out) == {"node1": 0}, again.out[-3000:]


def test_check_mode_on_a_fresh_host_passes_and_changes_nothing(venv_bin, tmp_path):
    with root_conftest.private_testbed("el9k", "10.213.55", 1, os="rocky9", gpus=8, nvswitch=True) as tb:
        state = (
            "rpm -qa | sort; dnf -q module list --enabled 2>&1; "
            "ls -la /etc/yum.repos.d /etc/sysctl.d /boot /opt; cat /etc/hosts; nft list ruleset; "
            "ls -R /var/lib/ddp-sim; cat /proc/sys/net/ipv4/ip_local_port_range; "
            "test -e /etc/modprobe.d && ls /etc/modprobe.d; true"
        )
        before = tb.ssh("node0", state).stdout
        env = tool_env(venv_bin, tmp_path / "facts")
        # The converge of the el9-sim scenario (site.yml without the allreduce), with its variables.
        argv = [str(venv_bin / "ansible-playbook"), "--check", "-i", str(tb.inventory)]
        argv += ["-i", "molecule/el9-sim/inventory/", "molecule/el9-sim/converge.yml"]
        env["MOLECULE_PROJECT_DIRECTORY"] = str(REPO_ROOT)
        res = run(argv, env, 900, merge=True)
        after = tb.ssh("node0", state).stdout
    assert res.returncode == 0, res.stdout[-4000:]
    assert _recaps(res.stdout)["node0"] > 0, "check mode reports what would change"
    assert before == after
