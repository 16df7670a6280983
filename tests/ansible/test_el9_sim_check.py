"""`--check` of the el9-sim scenario's converge on a fresh EL9 simulation host passes and changes
nothing; and in check mode, before anything is installed, preflight refuses in one line what the driver's
install would meet: Secure Boot without an enrolled DKMS key, and a kernel that installing dkms would
bring. Own host: prefix el9k, 10.213.55."""

from __future__ import annotations

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT, run, tool_env
from tests.ansible.el_sim import SIM, recaps

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]

STATE = (
    "rpm -qa | sort; dnf -q module list --enabled 2>&1; "
    "ls -la /etc/yum.repos.d /etc/sysctl.d /boot /opt; cat /etc/hosts; nft list ruleset; "
    "ls -R /var/lib/ddp-sim; cat /proc/sys/net/ipv4/ip_local_port_range; "
    "test -e /etc/modprobe.d && ls /etc/modprobe.d; true"
)
BOOTS = "5.14.0-570.17.1.el9_6.x86_64"  # installed and running at `up` (manifest.yml)
NEWEST = "5.14.0-570.26.1.el9_6.x86_64"  # only in the repositories


@pytest.fixture(scope="module")
def fresh():
    with root_conftest.private_testbed("el9k", "10.213.55", 1, os="rocky9", gpus=8, nvswitch=True) as tb:
        yield tb


def _check(tb, venv_bin, tmp_path, play: str, *extra: str):
    env = tool_env(venv_bin, tmp_path / "facts")
    argv = [str(venv_bin / "ansible-playbook"), "--check", "-i", str(tb.inventory)]
    argv += ["-i", "molecule/el9-sim/inventory/", *extra, play]
    env["MOLECULE_PROJECT_DIRECTORY"] = str(REPO_ROOT)
    return run(argv, env, 900, merge=True)


def test_check_mode_on_a_fresh_host_passes_and_changes_nothing(fresh, venv_bin, tmp_path):
    before = fresh.ssh("node0", STATE).stdout
    # The converge of the el9-sim scenario (site.yml without the allreduce), with its variables.
    res = _check(fresh, venv_bin, tmp_path, "molecule/el9-sim/converge.yml")
    after = fresh.ssh("node0", STATE).stdout
    assert res.returncode == 0, res.stdout[-4000:]
    assert recaps(res.stdout)["node0"] > 0, "check mode reports what would change"
    assert before == after
    # dkms would come with kernel-devel-matched of the kernel that boots, not the newest (no kernel change)
    assert "installing dkms will install kernel" not in res.stdout


@pytest.mark.parametrize(
    "case",
    ["secure_boot", "secure_boot_key_enrolled", "kernel_change", "kernel_change_allowed"],
)
def test_preflight_says_in_check_mode_what_the_driver_install_would_meet(case, fresh, venv_bin, tmp_path):
    """Recorded states of the host: mokutil's answers (the sim's flags), and repositories that no longer
    carry kernel-devel-matched of the running kernel (an exclude, as a repository moved on to the next
    minor release looks to dnf)."""
    setup, undo, extra, rc, line = {
        "secure_boot": (
            f"touch {SIM}/secureboot-rejects",
            f"rm -f {SIM}/secureboot-rejects",
            [],
            2,
            "node0: Secure Boot is enabled and the certificate DKMS signs the NVIDIA module with "
            "(/var/lib/dkms/mok.pub) is not enrolled, so the driver would not load after the reboot. Either "
            "disable Secure Boot in the firmware, or enroll that certificate once",
        ),
        "secure_boot_key_enrolled": (
            f"touch {SIM}/secureboot-rejects {SIM}/mok-enrolled /root/site-mok.der",
            f"rm -f {SIM}/secureboot-rejects {SIM}/mok-enrolled /root/site-mok.der",
            ["-e", "nvidia_driver_mok_certificate=/root/site-mok.der"],
            0,
            "",
        ),
        "kernel_change": (
            f"echo 'excludepkgs=kernel-devel-matched-{BOOTS.rsplit('.', 1)[0]}*' >> /etc/dnf/dnf.conf",
            "sed -i '/^excludepkgs=kernel-devel-matched/d' /etc/dnf/dnf.conf",
            [],
            2,
            f"node0: installing dkms would install kernel {NEWEST} and the driver's reboot would boot it: "
            f"the enabled repositories no longer carry kernel-devel-matched of {BOOTS}, the kernel that "
            "boots now",
        ),
        "kernel_change_allowed": (
            f"echo 'excludepkgs=kernel-devel-matched-{BOOTS.rsplit('.', 1)[0]}*' >> /etc/dnf/dnf.conf",
            "sed -i '/^excludepkgs=kernel-devel-matched/d' /etc/dnf/dnf.conf",
            ["-e", "nvidia_driver_allow_kernel_change=true"],
            0,
            f"node0: installing dkms will install kernel {NEWEST} (nvidia_driver_allow_kernel_change), "
            f"and the driver's reboot will boot it instead of {BOOTS}",
        ),
    }[case]
    fresh.ssh("node0", setup)
    try:
        before = fresh.ssh("node0", STATE).stdout
        res = _check(fresh, venv_bin, tmp_path, "playbooks/preflight.yml", *extra)
        after = fresh.ssh("node0", STATE).stdout
    finally:
        fresh.ssh("node0", undo)
    assert res.returncode == rc, res.stdout[-4000:]
    out = " ".join(res.stdout.split())  # the message, unfolded
    assert line in out, res.stdout[-4000:]
    assert before == after
    if case == "secure_boot_key_enrolled":
        assert "Secure Boot is enabled" not in out
