"""The nvidia_driver role against the EL9 simulation's NVIDIA repository as published for 580: dkms below
the 3.1.8 NVIDIA's kmods require is upgraded, or refused in one line naming the installed version when the
repositories offer none newer; the version locks cover every installed driver package, including libnvsdm
and nvlink5, which have no "nvidia" in their names. One EL9 host with NVSwitches (Fabric Manager pulls
libnvsdm). Own testbed: prefix eldk, 10.213.65."""

from __future__ import annotations

import re

import pytest

from tests.ansible.conftest import REPO_ROOT
from tests.conftest import private_testbed

# Each test converges the driver (two to four playbook runs): under the loaded `pytest -n 4` (2 cores) the
# first took more than pytest's default 600 s.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1200)]

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "nvidia_driver.yml")
DRIVER = "580.105.08"  # the newest 580 in the manifest
# What an old EPEL snapshot looks like: only dkms 3.0.x available.
HOLD_BACK = "sed -i '/^\\[epel\\]/a excludepkgs=dkms-3.[1-9]*' /etc/yum.repos.d/epel.repo"
RELEASE = "sed -i '/^excludepkgs=dkms/d' /etc/yum.repos.d/epel.repo"


@pytest.fixture(scope="module")
def el9():
    with private_testbed("eldk", "10.213.65", 1, os="rocky9", gpus=8, nvswitch=True) as tb:
        yield tb


def _sh(tb, cmd: str) -> str:
    return tb.ssh(tb.hosts()[0].name, cmd).stdout


def _changed(out: str) -> int:
    (n,) = re.findall(r"node0\s+: ok=\d+\s+changed=(\d+)", out)
    return int(n)


def test_a_dkms_older_than_the_kmod_requires_is_upgraded_or_named(el9, playbook):
    inv = ["-i", str(el9.inventory)]
    _sh(el9, f"dnf -q -y install epel-release && dnf -q -y install dkms-3.0.10 && {HOLD_BACK}")
    res = playbook(*inv, PLAY)
    assert res.returncode == 2, res.out[-3000:]
    assert (
        "node0: dkms 3.0.10 is installed and the enabled repositories offer none newer; NVIDIA's "
        "kmod-nvidia-open-dkms requires dkms >= 3.1.8 (EPEL 9 has it; a version lock, an exclude or an "
        "old EPEL snapshot holds it back)" in res.out
    ), res.out[-3000:]
    assert "nothing provides dkms" not in res.out  # stopped before dnf's solver error
    assert _sh(el9, "rpm -q kmod-nvidia-open-dkms || true").startswith("package kmod-nvidia-open-dkms is not")
    # --check says the same before anything changes (the queries run, the upgrade is only reported)
    res = playbook(*inv, "--check", PLAY)
    assert res.returncode == 2, res.out[-3000:]
    assert "node0: dkms 3.0.10 is installed and the enabled repositories offer none newer" in res.out

    _sh(el9, RELEASE)
    res = playbook(*inv, "--check", PLAY)
    upgrade = r"TASK \[nvidia_driver : Upgrade an older dkms\][^\n]*\nchanged: \[node0\]"
    assert re.search(upgrade, res.out), res.out[-3000:]
    assert "dkms 3.0.10 is installed" not in res.out
    assert _sh(el9, "rpm -q --qf '%{VERSION}' dkms") == "3.0.10"  # check mode changed nothing
    res = playbook(*inv, PLAY)
    assert res.returncode == 0, res.out[-3000:]
    assert _sh(el9, "rpm -q --qf '%{VERSION}' dkms") == "3.4.1"


def test_every_installed_driver_package_is_locked_libnvsdm_and_nvlink5_too(el9, playbook):
    """Runs after the converge above: Fabric Manager pulled libnvsdm; nvlink5 is added by hand."""
    inv = ["-i", str(el9.inventory)]
    query = "rpm -qa --qf '%{NAME}-%{EPOCHNUM}:%{VERSION}-%{RELEASE}.*\\n' '*nvidia*' libnvsdm nvlink5 | sort"
    installed = _sh(el9, query).split()
    assert f"libnvsdm-0:{DRIVER}-1.*" in installed and f"libnvidia-ml-3:{DRIVER}-1.el9.*" in installed
    assert sorted(_sh(el9, "dnf -q versionlock list").split()) == installed

    _sh(el9, "dnf -q -y install nvlink5")
    res = playbook(*inv, PLAY)
    assert res.returncode == 0 and _changed(res.out) > 0, res.out[-3000:]
    installed = _sh(el9, query).split()
    assert f"nvlink5-0:{DRIVER}-1.*" in installed and f"nvidia-imex-0:{DRIVER}-1.*" in installed
    assert sorted(_sh(el9, "dnf -q versionlock list").split()) == installed
    again = playbook(*inv, PLAY)
    assert again.returncode == 0 and _changed(again.out) == 0, again.out[-3000:]
