"""The nvidia_driver role on an EL9 simulation host it converged (gpu.yml, the el9-sim scenario's
variables): the post-reboot health checks fail saying why, and a booted kernel without the module gets
it rebuilt. Own host: prefix el9d, 10.213.56 (node0: 8 GPUs + 4 NVSwitches)."""

from __future__ import annotations

import re

import pytest

from tests.ansible.el_sim import SIM, gpu_converged, recaps, sh

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]
MOK = "/var/lib/dkms/mok.pub"  # the certificate DKMS signs with (nvidia_driver_mok_certificate)


@pytest.fixture(scope="module")
def el9(venv_bin, tmp_path_factory):
    with gpu_converged("el9d", "10.213.56", venv_bin, tmp_path_factory.mktemp("facts"), nvswitch=True) as tb:
        yield tb


@pytest.fixture
def inventory(el9):
    return ["-i", str(el9.inventory), "-i", "molecule/el9-sim/inventory/"]


@pytest.mark.parametrize(
    "case",
    ["mig", "secure_boot", "fabric_manager_stopped", "fabric_completed_with_error"],
)
def test_a_gpu_host_with_a_broken_driver_fails_with_the_reason(case, el9, inventory, playbook):
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
            *inventory, "--limit", "node0", "-e", "nvidia_driver_fabric_wait_s=10", "playbooks/gpu.yml"
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


def test_a_booted_kernel_without_the_module_gets_it_rebuilt_and_rebooted(el9, inventory, playbook):
    """As after a kernel installed without its headers: dkms has no module for the booted kernel."""
    kernel = sh(el9, 0, "uname -r").strip()
    version = sh(el9, 0, "rpm -q --queryformat '%{VERSION}' kmod-nvidia-open-dkms").strip()
    sh(el9, 0, f"dkms remove -m nvidia -v {version} -k {kernel}; /usr/local/sbin/ddp-sim-reboot")
    assert not sh(el9, 0, f"ls /lib/modules/{kernel}/extra/").strip()
    assert sh(el9, 0, "nvidia-smi -L", check=False).startswith("NVIDIA-SMI has failed")

    res = playbook(*inventory, "--limit", "node0", "playbooks/gpu.yml")

    assert res.returncode == 0, res.out[-3000:]
    assert re.search(
        r"TASK \[nvidia_driver : Build the module for that kernel with dkms\].*?changed: \[node0\]",
        res.out,
        re.S,
    )
    assert "RUNNING HANDLER [nvidia_driver : Gather facts after the reboot]" in res.out
    assert len(sh(el9, 0, "nvidia-smi -L").splitlines()) == 8
    assert f"autoinstall -k {kernel}" in sh(el9, 0, "tail -n 5 /var/log/ddp-sim/dkms.log")
