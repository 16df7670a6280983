"""The GPU roles on hosts without a GPU: they fail unless told to skip; a (fake) NVIDIA GPU is detected."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.ansible.conftest import REPO_ROOT

pytestmark = pytest.mark.testbed

SKIP_GPU = ["-e", "nvidia_driver_require_gpu=false cuda_toolkit_require_gpu=false nccl_require_gpu=false"]


def _fake_pci(root: Path, devices: dict[str, tuple[str, str]]) -> Path:
    for slot, (vendor, klass) in devices.items():
        d = root / slot
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
    return root


@pytest.mark.slow
def test_gpu_roles_fail_on_a_host_without_gpu_by_default(testbed, playbook):
    res = playbook("-i", str(testbed.inventory), "playbooks/gpu.yml")
    assert res.returncode == 2, res.out[-3000:]
    assert "no NVIDIA GPU found" in res.out
    assert "set nvidia_driver_require_gpu: false" in res.out


@pytest.mark.slow
def test_gpu_roles_skip_with_a_message_when_the_gpu_is_optional(testbed, playbook):
    res = playbook("-i", str(testbed.inventory), *SKIP_GPU, "playbooks/gpu.yml")
    assert res.returncode == 0, res.out[-3000:]
    for what in ("the NVIDIA driver", "the CUDA toolkit 13.0", "the NCCL 2.29.7"):
        assert len(re.findall(f"so {what} is not installed here", res.out)) == 3, what
    assert set(re.findall(r"changed=(\d+)", res.out)) == {"0"}


@pytest.mark.slow
def test_nvidia_gpus_and_nvswitches_are_counted_from_pci_ids(testbed, playbook, tmp_path):
    pci = _fake_pci(
        tmp_path / "pci",  # /tmp is shared with the testbed hosts
        {
            "0000:17:00.0": ("0x10de", "0x030200"),  # H100: 3D controller
            "0000:2a:00.0": ("0x10de", "0x030200"),
            "0000:05:00.0": ("0x10de", "0x068000"),  # NVSwitch: bridge
            "0000:3b:00.0": ("0x15b3", "0x020700"),  # ConnectX NIC: not NVIDIA
            "0000:00:02.0": ("0x8086", "0x030000"),  # Intel VGA: not NVIDIA
        },
    )
    play = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "gpu_facts.yml")
    res = playbook("-i", str(testbed.inventory), "-e", f"gpu_facts_pci_devices_dir={pci}", play)
    assert res.returncode == 0, res.out[-3000:]
    assert res.out.count("gpus=2 nvswitches=1 loaded=False") == 3


@pytest.mark.slow
def test_a_detected_gpu_is_not_skipped_and_unsupported_os_is_refused(testbed, playbook, tmp_path):
    """With a GPU present the driver is installed even when optional, and Debian 12 is refused clearly."""
    pci = _fake_pci(tmp_path / "pci", {"0000:17:00.0": ("0x10de", "0x030200")})
    res = playbook(
        "-i", str(testbed.inventory), *SKIP_GPU, "-e", f"gpu_facts_pci_devices_dir={pci}", "playbooks/gpu.yml"
    )
    assert res.returncode == 2, res.out[-3000:]
    assert "the NVIDIA driver is installed on EL 9/10 and Ubuntu 22.04/24.04 only, not Debian" in res.out
    assert set(re.findall(r"changed=(\d+)", res.out)) == {"0"}
