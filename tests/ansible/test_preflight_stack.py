"""site.yml's preflight refuses a GPU stack that does not exist (the version matrix of role gpu_stack) and
the operating systems the roles cannot provision, in one line naming the variables and the choices,
before any play changes anything. The OS cases give a namespace host another identity (its /etc is an
overlay: /etc/os-release and /etc/redhat-release are replaced there, never on this machine)."""

from __future__ import annotations

import json
import re
import shlex

import pytest

import tests.conftest as root_conftest
from tests import testbed as testbed_mod

pytestmark = pytest.mark.testbed


def _os_release(name: str, version: str, os_id: str, like: str, el: str, pretty: str) -> str:
    fields = {"NAME": name, "VERSION": version, "ID": os_id, "ID_LIKE": like}
    fields.update(VERSION_ID=version.split()[0], PLATFORM_ID=f"platform:el{el}", PRETTY_NAME=pretty)
    return "".join(f'{k}="{v}"\n' for k, v in fields.items())


# The os-release(5) fields Ansible reads, and the release files, as the distributions ship them.
OS_FILES = {
    "rocky10": {
        "os-release": _os_release(
            "Rocky Linux",
            "10.0 (Red Quartz)",
            "rocky",
            "rhel centos fedora",
            "10",
            "Rocky Linux 10.0 (Red Quartz)",
        ),
        "redhat-release": "Rocky Linux release 10.0 (Red Quartz)\n",
    },
    "rocky8": {
        "os-release": _os_release(
            "Rocky Linux", "8.10 (Green Obsidian)", "rocky", "rhel centos fedora", "8", "Rocky Linux 8.10"
        ),
        "redhat-release": "Rocky Linux release 8.10 (Green Obsidian)\n",
    },
    "oracle9": {
        "os-release": _os_release(
            "Oracle Linux Server", "9.5", "ol", "fedora", "9", "Oracle Linux Server 9.5"
        ),
        "redhat-release": "Red Hat Enterprise Linux release 9.5 (Plow)\n",
        "oracle-release": "Oracle Linux Server release 9.5\n",
    },
    "rhel9": {
        "os-release": _os_release(
            "Red Hat Enterprise Linux",
            "9.6 (Plow)",
            "rhel",
            "fedora",
            "9",
            "Red Hat Enterprise Linux 9.6 (Plow)",
        ),
        "redhat-release": "Red Hat Enterprise Linux release 9.6 (Plow)\n",
    },
}

# case: (OS identity or None for the host's own Debian, extra vars, the expected message)
CASES = {
    "cu128_with_torch_2_13": (
        None,
        {"gpu_stack_torch_cuda": "cu128"},
        "gpu_stack_torch_cuda cu128 has no torch 2.13.0 wheels "
        "(choices: cu126, cu130, cu132 (experimental), cpu)",
    ),
    "driver_older_than_cuda_13_needs": (
        None,
        {"gpu_stack_driver_branch": "575"},
        "nvidia_driver_branch 575 is older than CUDA 13.0 (torch 2.13.0+cu130) needs: choose 580 or newer",
    ),
    "toolkit_other_than_the_flavour": (
        None,
        {"cuda_toolkit_version": "12.8"},
        "cuda_toolkit_version 12.8 does not match torch 2.13.0+cu130 (CUDA 13.0): "
        "leave it unset or set it to 13.0",
    ),
    "nccl_other_than_torch_bundles": (
        None,
        {"nccl_version": "2.26.2"},
        "nccl_version 2.26.2 is not the NCCL that torch 2.13.0+cu130 bundles (2.29.7)",
    ),
    "pytorch_version_beside_the_stack": (
        None,
        {"pytorch_version": "2.12.0"},
        "pytorch_version 2.12.0 differs from gpu_stack_torch_version 2.13.0",
    ),
    "unknown_torch_release": (
        None,
        {"gpu_stack_torch_version": "2.11.0"},
        "gpu_stack_torch_version 2.11.0 is not in the version matrix",
    ),
    "cuda_12_on_el10": (
        "rocky10",
        {"gpu_stack_torch_cuda": "cu126"},
        "CUDA 12.6 (torch 2.13.0+cu126) cannot be installed on EL10: "
        "NVIDIA's repository for it starts at CUDA 13.0",
    ),
    "el8": ("rocky8", {}, "Rocky 8.10 (EL8) is not supported: ansible-core >= 2.17 needs Python >= 3.8"),
    "oracle_linux": ("oracle9", {}, "Oracle Linux is not supported"),
    "rhel_without_registration": ("rhel9", {}, "RHEL without a subscription-manager registration"),
}


@pytest.fixture(scope="module")
def os_host():
    """One namespace host whose OS identity a test may swap (restored after each test)."""
    with root_conftest.private_testbed("rxos", "10.213.73", 1) as tb:
        yield tb


def _become(tb: testbed_mod.Testbed, identity: str | None) -> None:
    host = tb.hosts()[0]
    restore = (
        "rm -f /etc/os-release /etc/redhat-release /etc/oracle-release; "
        "ln -s ../usr/lib/os-release /etc/os-release; "
        "if [ -e /etc/debian_version.saved ]; then mv /etc/debian_version.saved /etc/debian_version; fi"
    )
    tb.exec(host, restore)
    if identity is None:
        return
    # rm first: /etc/os-release is a link into /usr, which this host shares with the machine.
    cmds = ["mv /etc/debian_version /etc/debian_version.saved", "rm -f /etc/os-release"]
    for name, text in OS_FILES[identity].items():
        cmds.append(f"printf %s {shlex.quote(text)} > /etc/{name}")
    tb.exec(host, "; ".join(cmds))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_preflight_refuses_before_any_change(case, os_host, playbook):
    identity, extra, message = CASES[case]
    _become(os_host, identity)
    try:
        before = os_host.exec(os_host.hosts()[0], "cat /etc/hosts; nft list ruleset; ls /opt").stdout
        res = playbook("-i", str(os_host.inventory), "-e", json.dumps(extra), "site.yml")
        after = os_host.exec(os_host.hosts()[0], "cat /etc/hosts; nft list ruleset; ls /opt").stdout
    finally:
        _become(os_host, None)

    assert res.returncode == 2, res.out[-3000:]
    assert message in res.out, res.out[-3000:]
    assert "[node0]" in res.out, "the message names the node"
    assert len(re.findall(r"^fatal: ", res.out, re.M)) == 1, "one message"
    assert "PLAY [Map every node's hostname" not in res.out, "no play after preflight ran"
    assert before == after


@pytest.mark.slow
def test_the_default_stack_passes_preflight(os_host, playbook):
    res = playbook("-i", str(os_host.inventory), "playbooks/preflight.yml")
    assert res.returncode == 0, res.out[-3000:]
