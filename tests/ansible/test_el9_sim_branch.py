"""Changing the driver branch on an EL9 simulation host gpu.yml converged with the el9-sim scenario's
variables (8 GPUs, no NVSwitch). Own host: prefix el9b, 10.213.57."""

from __future__ import annotations

import json

import pytest

from tests.ansible.el_sim import gpu_converged, recaps, sh
from tests.testbed import el as testbed_el

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def el9(venv_bin, tmp_path_factory):
    with gpu_converged("el9b", "10.213.57", venv_bin, tmp_path_factory.mktemp("facts")) as tb:
        yield tb


@pytest.fixture
def gpu_yml(el9, playbook):
    def _run(*args: str):
        return playbook(
            "-i", str(el9.inventory), "-i", "molecule/el9-sim/inventory/", *args, "playbooks/gpu.yml"
        )

    return _run


def test_changing_the_driver_branch_resets_the_stream_and_relocks(el9, gpu_yml):
    """node0 moves from 580-open (cu130) to 575-open with torch's cu126 stack: dnf alone refuses to switch
    an enabled stream; the role resets it, syncs the packages down, and locks the new versions only."""
    stack = {"gpu_stack_torch_cuda": "cu126", "gpu_stack_driver_branch": "575"}
    # The NVIDIA Container Toolkit, from its own repo, locked at the older of its two versions: not the
    # driver's, so its locks stay and it is not distro-synced to 1.18.0.
    toolkit = ["libnvidia-container1", "libnvidia-container-tools", "nvidia-container-toolkit-base"]
    toolkit.append("nvidia-container-toolkit")
    repo = testbed_el.build().repo_url("nvidia-container-toolkit")
    sh(
        el9,
        0,
        "printf '[nvidia-container-toolkit]\\nname=nvidia-container-toolkit\\nbaseurl=%s\\nenabled=1\\n"
        f"gpgcheck=0\\n' {repo} > /etc/yum.repos.d/nvidia-container-toolkit.repo && "
        f"dnf -q -y install nvidia-container-toolkit-1.17.8 && dnf -q versionlock add {' '.join(toolkit)}",
    )
    toolkit_locks = sorted(x for x in sh(el9, 0, "dnf -q versionlock list").split() if "container" in x)
    assert len(toolkit_locks) == 4, toolkit_locks

    res = gpu_yml("-e", json.dumps(stack))
    assert res.returncode == 0, res.out[-4000:]

    stream = sh(
        el9, 0, "dnf -q module list --enabled nvidia-driver | awk '$1 == \"nvidia-driver\" {print $2}'"
    )
    assert stream.strip() == "575-open"
    locks = sh(el9, 0, "dnf -q versionlock list").split()
    nvidia = [lock for lock in locks if "nvidia" in lock and "container" not in lock]
    assert nvidia and all(":575.57.08-" in lock for lock in nvidia), locks
    assert sorted(lock for lock in locks if "container" in lock) == toolkit_locks
    versions = sh(el9, 0, f"rpm -q --queryformat '%{{VERSION}}\\n' {' '.join(toolkit)}").split()
    assert versions == ["1.17.8"] * 4, versions
    assert sorted(lock for lock in locks if "nccl" in lock) == [
        "libnccl-0:2.29.3-1+cuda12.9.*",
        "libnccl-devel-0:2.29.3-1+cuda12.9.*",
    ]
    installed = sh(el9, 0, "rpm -qa --queryformat '%{NAME}-%{VERSION}\\n' '*nvidia*' | sort").split()
    assert all("-575.57.08" in p for p in installed if "container" not in p), installed
    assert "release 12.6" in sh(el9, 0, "/usr/local/cuda-12.6/bin/nvcc --version")
    assert "575.57.08" in sh(el9, 0, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    # the second run with the new branch changes nothing
    again = gpu_yml("-e", json.dumps(stack))
    assert again.returncode == 0 and recaps(again.out) == {"node0": 0}, again.out[-3000:]
