"""The roles' EL code paths on EL9 simulation hosts (tests/testbed --os rocky9: real dnf 4.14 and rpm
against local repositories, simulated GPUs and reboot).

`molecule test -s el9-sim --destroy never` converges site.yml (without its GPU allreduce) on node0
(8 GPUs + NVSwitches) and node1 (8 GPUs), checks idempotence (changed=0) and the scenario's verify; the
tests below then use the converged hosts, in file order: verify.yml refusing the gloo fallback, a port
range a later sysctl file undid and a node without the Python headers (node1); the nvidia_driver role's
post-reboot health checks failing saying why, and a booted kernel without the module getting it rebuilt
(node0, --limit node0, each case undoing its setup); last, a driver branch change (node1, --limit
node1), which leaves node1 on another branch. Prefix el9s (the scenario's). `--check` on a fresh host
runs on a host of its own (test_el9_sim_check.py).

The health-check, rebuild and branch cases ran on 1-host testbeds of their own (a gpu.yml converge
each), on other pytest-xdist workers, to keep this module's wall short. But the suite is CPU-bound on
its 2 cores (tests/cpuprofile.py) and tests/conftest.py's LONGEST_FIRST balances the modules across the
workers, so they run here, on the same hardware and variables, without converges of their own (~160
CPU-s less): node0 is the driver cases' host (8 GPUs + 4 NVSwitches), node1 the branch change's (8 GPUs,
no NVSwitch). The module's wall is now ~13 min on the loaded 2-core machine (772 s, 505 s of it the
molecule run, beside test_el10_sim.py); under `pytest -n 4` about 1.6 times that."""

from __future__ import annotations

import json
import re

import pytest

from tests.ansible.el_sim import SIM, molecule_converged, recaps, sh
from tests.testbed import el as testbed_el

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]

INVENTORY = ["-i", "inventory/testbed-el9s/hosts.yml", "-i", "molecule/el9-sim/inventory/"]
MOK = "/var/lib/dkms/mok.pub"  # the certificate DKMS signs with (nvidia_driver_mok_certificate)


@pytest.fixture(scope="module")
def el9(venv_bin):
    """The converged el9-sim hosts (molecule test without its final destroy), destroyed at the end."""
    with molecule_converged("el9-sim", "el9s", "10.213.54", "rocky9", venv_bin) as (tb, _):
        yield tb


def test_verify_refuses_gloo_on_gpu_nodes(el9, playbook):
    """The venv has torch's CPU build: the allreduce works, with gloo, and that is a failure on GPU nodes.
    Before it, the compile check passed on both: the role installed python3.11-devel and gcc (the hosts
    have no Python headers without the package), and a torch.compile'd function ran on node0's CPU
    (node1 checks the headers only: molecule/el9-sim/inventory/host_vars/node1.yml)."""
    res = playbook(*INVENTORY, "playbooks/verify.yml")
    assert res.returncode == 2, res.out[-3000:]
    assert "ddp-compilecheck" not in res.out and "cannot build a C extension" not in res.out, res.out[-3000:]
    for node in ("node0", "node1"):
        assert f"{node} has 8 NVIDIA GPUs but the allreduce ran with gloo, not nccl" in res.out, res.out[
            -3000:
        ]
    assert re.search(r"rank 0/2 gloo", res.out) is None, "the bandwidth report is not reached"


def test_verify_names_a_port_range_another_sysctl_file_undid(el9, playbook):
    sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='32768 60999'")
    try:
        res = playbook(*INVENTORY, "playbooks/verify.yml", "-e", "verify_torch_compile=false")
    finally:
        sh(el9, 1, "sysctl -qw net.ipv4.ip_local_port_range='50000 51999'")
    assert res.returncode == 2, res.out[-3000:]
    assert (
        "node1: net.ipv4.ip_local_port_range is 32768-60999, not the 50000-51999 the firewall opens"
        in res.out
    )


def test_verify_catches_a_node_without_the_python_headers(el9, playbook):
    """A node without python3.11-devel fails in site.yml's verify, in one line naming the package, not at
    the first compiled training step (Triton builds its launcher against Python.h there)."""
    sh(el9, 1, "rpm -e --nodeps python3.11-devel && test ! -e /usr/include/python3.11/Python.h")
    try:
        res = playbook(*INVENTORY, "playbooks/verify.yml", "-e", "verify_torch_compile=false")
    finally:
        sh(el9, 1, "dnf -q -y install python3.11-devel")
    assert res.returncode == 2, res.out[-3000:]
    assert re.search(
        r"node1: \S+ cannot build a C extension against Python 3\.11's headers \(/usr/include/python3\.11\): "
        r".*Python\.h: No such file or directory; install the Python 3\.11 headers \(EL: python3\.11-devel",
        res.out,
    ), res.out[-3000:]
    assert "node0: " not in res.out.split("TASK [Check that the node compiles]")[1].split("TASK [")[0]


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
        # DKMS's certificate enrolled (else preflight refuses before anything: test_el9_sim_check.py), and
        # still the module is rejected (signed with another key).
        "secure_boot": (
            f"touch {SIM}/secureboot-rejects {SIM}/mok-enrolled {MOK}; /usr/local/sbin/ddp-sim-reboot",
            f"rm -f {SIM}/secureboot-rejects {SIM}/mok-enrolled {MOK}; /usr/local/sbin/ddp-sim-reboot",
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
    sh(el9, 0, setup)
    try:
        res = playbook(
            *INVENTORY, "--limit", "node0", "-e", "nvidia_driver_fabric_wait_s=10", "playbooks/gpu.yml"
        )
    finally:
        sh(el9, 0, undo)
    assert res.returncode == 2, res.out[-3000:]
    assert message in res.out, res.out[-3000:]
    rebooted = "RUNNING HANDLER [nvidia_driver : Reboot after the NVIDIA driver change]" in res.out
    if case == "secure_boot":  # an installed driver that is not loaded: reboot into it first, then say why
        assert rebooted, res.out[-3000:]
    else:
        assert not rebooted and recaps(res.out) == {"node0": 0}, "nothing was changed on the way"


def test_a_booted_kernel_without_the_module_gets_it_rebuilt_and_rebooted(el9, playbook):
    """As after a kernel installed without its headers: dkms has no module for the booted kernel. The
    nvidia_driver role alone (tests/ansible/playbooks/nvidia_driver.yml) rebuilds it and reboots."""
    kernel = sh(el9, 0, "uname -r").strip()
    version = sh(el9, 0, "rpm -q --queryformat '%{VERSION}' kmod-nvidia-open-dkms").strip()
    sh(el9, 0, f"dkms remove -m nvidia -v {version} -k {kernel}; /usr/local/sbin/ddp-sim-reboot")
    assert not sh(el9, 0, f"ls /lib/modules/{kernel}/extra/").strip()
    assert sh(el9, 0, "nvidia-smi -L", check=False).startswith("NVIDIA-SMI has failed")

    res = playbook(*INVENTORY, "--limit", "node0", "tests/ansible/playbooks/nvidia_driver.yml")

    assert res.returncode == 0, res.out[-3000:]
    assert re.search(
        r"TASK \[nvidia_driver : Build the module for that kernel with dkms\].*?changed: \[node0\]",
        res.out,
        re.S,
    )
    assert "RUNNING HANDLER [nvidia_driver : Gather facts after the reboot]" in res.out
    assert len(sh(el9, 0, "nvidia-smi -L").splitlines()) == 8
    assert f"autoinstall -k {kernel}" in sh(el9, 0, "tail -n 5 /var/log/ddp-sim/dkms.log")


# Last: it leaves node1 on branch 575 (cu126) with the container toolkit's repository and locks.
def test_changing_the_driver_branch_resets_the_stream_and_relocks(el9, playbook):
    """node1 moves from 580-open (cu130) to 575-open with torch's cu126 stack: dnf alone refuses to switch
    an enabled stream; the role resets it, syncs the packages down, and locks the new versions only."""
    stack = {"gpu_stack_torch_cuda": "cu126", "gpu_stack_driver_branch": "575"}
    gpu_yml = [*INVENTORY, "--limit", "node1", "-e", json.dumps(stack), "playbooks/gpu.yml"]
    # The NVIDIA Container Toolkit, from its own repo, locked at the older of its two versions: not the
    # driver's, so its locks stay and it is not distro-synced to 1.18.0.
    toolkit = ["libnvidia-container1", "libnvidia-container-tools", "nvidia-container-toolkit-base"]
    toolkit.append("nvidia-container-toolkit")
    repo = testbed_el.build().repo_url("nvidia-container-toolkit")
    sh(
        el9,
        1,
        "printf '[nvidia-container-toolkit]\\nname=nvidia-container-toolkit\\nbaseurl=%s\\nenabled=1\\n"
        f"gpgcheck=0\\n' {repo} > /etc/yum.repos.d/nvidia-container-toolkit.repo && "
        f"dnf -q -y install nvidia-container-toolkit-1.17.8 && dnf -q versionlock add {' '.join(toolkit)}",
    )
    toolkit_locks = sorted(x for x in sh(el9, 1, "dnf -q versionlock list").split() if "container" in x)
    assert len(toolkit_locks) == 4, toolkit_locks

    res = playbook(*gpu_yml)
    assert res.returncode == 0, res.out[-4000:]

    stream = sh(
        el9, 1, "dnf -q module list --enabled nvidia-driver | awk '$1 == \"nvidia-driver\" {print $2}'"
    )
    assert stream.strip() == "575-open"
    locks = sh(el9, 1, "dnf -q versionlock list").split()
    nvidia = [lock for lock in locks if "nvidia" in lock and "container" not in lock]
    assert nvidia and all(":575.57.08-" in lock for lock in nvidia), locks
    assert sorted(lock for lock in locks if "container" in lock) == toolkit_locks
    versions = sh(el9, 1, f"rpm -q --queryformat '%{{VERSION}}\\n' {' '.join(toolkit)}").split()
    assert versions == ["1.17.8"] * 4, versions
    assert sorted(lock for lock in locks if "nccl" in lock) == [
        "libnccl-0:2.29.3-1+cuda12.9.*",
        "libnccl-devel-0:2.29.3-1+cuda12.9.*",
    ]
    installed = sh(el9, 1, "rpm -qa --queryformat '%{NAME}-%{VERSION}\\n' '*nvidia*' | sort").split()
    assert all("-575.57.08" in p for p in installed if "container" not in p), installed
    assert "release 12.6" in sh(el9, 1, "/usr/local/cuda-12.6/bin/nvcc --version")
    assert "575.57.08" in sh(el9, 1, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    # the second run with the new branch changes nothing
    again = playbook(*gpu_yml)
    assert again.returncode == 0 and recaps(again.out) == {"node1": 0}, again.out[-3000:]
