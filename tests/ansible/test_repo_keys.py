"""Issue #45 items 4 and 5: no repository key trusted on first use, and OpenHPC's release for the host's EL
release and architecture. The roles' own tasks run by the real ansible-core on localhost as the EL host
that `facts` describes (tests/ansible/playbooks/repo_keys.yml), in --check where they would change the host:
a key or release package placed beforehand where the role keeps it is what the checks read. The accepted
paths on real EL hosts (rpm --import, rpm -K OK, dnf) run in the EL simulation (test_el9_sim_slurm.py
openhpc, test_el10_sim.py's cuda_repo)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ansible.conftest import REPO_ROOT

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "repo_keys.yml")
FILES = REPO_ROOT / "roles" / "slurm" / "files"
OHPC3 = "6E19BE11D9A082C00A7DB41A7AC05F0940A90CC8"
OHPC4 = "5E333CA3A1BDBBC9DF149D7409ADFAE4D722A692"
# NVIDIA's pin for its rhel10 key (NVIDIA_GPGKEY_SUM of its CUDA container images).
NVIDIA_EL10_SUM = "afbea87d3b979b3788ef34223aeeb323ade481128e2c133723ae99b8a51368bb"


def _facts(major: str, arch: str = "x86_64", distribution: str = "Rocky") -> dict:
    return {
        "distribution": distribution,
        "distribution_major_version": major,
        "distribution_version": f"{major}.1",
        "os_family": "RedHat",
        "architecture": arch,
    }


def _run(playbook, tmp_path: Path, what: str, facts: dict, *args: str, **extra):
    out = tmp_path / "out.json"
    ev = {"what": what, "facts": facts, "out_file": str(out), "ansible_python_interpreter": sys.executable}
    res = playbook("-c", "local", "-i", "localhost,", "-e", json.dumps(ev | extra), *args, PLAY)
    return res, (json.loads(out.read_text()) if res.returncode == 0 else None)


def _fatal(res) -> str:
    """The one failure's message (one line)."""
    msgs = re.findall(r'"msg": "([^"]*)"', res.out)
    assert res.returncode != 0 and len(msgs) == 1 and "\\n" not in msgs[0], res.out[-3000:]
    return msgs[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("major", "arch", "url", "key", "fingerprint"),
    [
        ("9", "x86_64", "OpenHPC/3/EL_9/x86_64/ohpc-release-3-1.el9.x86_64.rpm", "3", OHPC3),
        ("9", "aarch64", "OpenHPC/3/EL_9/aarch64/ohpc-release-3-1.el9.aarch64.rpm", "3", OHPC3),
        ("10", "x86_64", "OpenHPC/4/EL_10/x86_64/ohpc-release-4-1.el10.x86_64.rpm", "4", OHPC4),
        ("10", "aarch64", "OpenHPC/4/EL_10/aarch64/ohpc-release-4-1.el10.aarch64.rpm", "4", OHPC4),
    ],
)
def test_openhpc_release_and_key_follow_the_el_release_and_architecture(
    playbook, tmp_path, major, arch, url, key, fingerprint
):
    res, got = _run(playbook, tmp_path, "openhpc", _facts(major, arch))
    assert res.returncode == 0, res.out[-3000:]
    assert got == {
        "url": f"https://repos.openhpc.community/{url}",
        "key_src": str(REPO_ROOT / "roles" / "slurm" / "files" / f"RPM-GPG-KEY-OpenHPC-{key}"),
        "fingerprint": fingerprint,
    }


@pytest.mark.skipif(shutil.which("gpg") is None, reason="no gpg here")
@pytest.mark.parametrize(("key", "fingerprint"), [("3", OHPC3), ("4", OHPC4)])
def test_the_vendored_openhpc_keys_have_the_pinned_fingerprints(key, fingerprint):
    out = subprocess.run(
        ["gpg", "--batch", "--with-colons", "--show-keys", str(FILES / f"RPM-GPG-KEY-OpenHPC-{key}")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert [line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:")] == [fingerprint]


@pytest.mark.slow
def test_an_explicit_openhpc_url_and_a_mirror_are_kept(playbook, tmp_path):
    own = "http://mirror.example/ohpc-release-3-1.el9.x86_64.rpm"
    res, got = _run(playbook, tmp_path, "openhpc", _facts("9"), slurm_openhpc_release_url=own)
    assert res.returncode == 0 and got["url"] == own and got["fingerprint"] == OHPC3, res.out[-3000:]
    res, got = _run(
        playbook, tmp_path, "openhpc", _facts("10"), slurm_openhpc_mirror="http://m.example/ohpc/"
    )
    assert got["url"] == "http://m.example/ohpc/OpenHPC/4/EL_10/x86_64/ohpc-release-4-1.el10.x86_64.rpm", got


@pytest.mark.parametrize(("major", "arch"), [("8", "x86_64"), ("9", "ppc64le")])
def test_an_el_release_or_architecture_openhpc_does_not_build_for_is_refused_in_one_line(
    playbook, tmp_path, major, arch
):
    res, _ = _run(playbook, tmp_path, "openhpc", _facts(major, arch))
    msg = _fatal(res)
    assert msg.startswith(f"slurm: OpenHPC has no release for EL {major} on {arch} known here"), msg
    assert "slurm_openhpc_release_url" in msg, msg


def _placed_key(tmp_path: Path) -> tuple[Path, str]:
    """A real armored key (OpenHPC 3's, not NVIDIA's) where import-key keeps it, so --check reads it."""
    keys = tmp_path / "rpm-gpg"
    keys.mkdir()
    key = keys / "RPM-GPG-KEY-cuda-rhel10"
    shutil.copy(FILES / "RPM-GPG-KEY-OpenHPC-3", key)
    return keys, key.read_text()


@pytest.mark.slow
def test_el10s_cuda_key_is_refused_unless_it_has_the_checksum_nvidia_pins(playbook, tmp_path):
    """EL10's CDF6BA43.pub has no published fingerprint: a key file of another sha256 (without its Version
    lines) than NVIDIA_GPGKEY_SUM is refused before rpm imports it; the admin's fingerprint replaces the
    pin."""
    keys, text = _placed_key(tmp_path)
    extra = {
        "_cuda_repo_import_dir": str(keys),
        "cuda_repo_gpgkey_url": str(keys / "RPM-GPG-KEY-cuda-rhel10"),
    }
    res, _ = _run(playbook, tmp_path, "cuda", _facts("10"), "--check", **extra)
    msg = _fatal(res)
    have = hashlib.sha256(text.encode()).hexdigest()
    assert f"has the sha256 {have} (without its Version lines), not {NVIDIA_EL10_SUM}: refusing" in msg, msg
    # The admin's fingerprint of this key: checked instead of NVIDIA's checksum, and it passes (the import
    # itself is not run in --check).
    res, _ = _run(
        playbook, tmp_path, "cuda", _facts("10"), "--check", **extra, cuda_repo_gpgkey_fingerprint=OHPC3
    )
    assert "refusing" not in res.out and "TASK [cuda_repo : Import the key]" in res.out, res.out[-3000:]


@pytest.mark.slow
def test_a_key_file_that_holds_another_key_beside_the_pinned_one_is_refused_and_removed(playbook, tmp_path):
    """rpm --import would take every key in the file: the pinned fingerprint must be the only primary key."""
    keys, text = _placed_key(tmp_path)
    key = keys / "RPM-GPG-KEY-cuda-rhel10"
    key.write_text(text + (FILES / "RPM-GPG-KEY-OpenHPC-4").read_text())  # another key, then the pinned one
    extra = {"_cuda_repo_import_dir": str(keys), "cuda_repo_gpgkey_url": str(key)}
    res, _ = _run(playbook, tmp_path, "cuda", _facts("10"), **extra, cuda_repo_gpgkey_fingerprint=OHPC4)
    msg = _fatal(res)
    assert f"has the fingerprint(s) {OHPC3}, " in msg, msg
    assert f"not only {OHPC4}: refusing to trust it" in msg, msg
    assert not key.exists()  # removed: no repository reads it, and the next run fetches it again


@pytest.mark.slow
def test_the_checksum_ignores_the_version_header_as_nvidias_check_does(playbook, tmp_path):
    keys, text = _placed_key(tmp_path)
    key = keys / "RPM-GPG-KEY-cuda-rhel10"
    key.write_text(text.replace("-----\n\n", "-----\nVersion: GnuPG v2\n\n", 1))
    extra = {"_cuda_repo_import_dir": str(keys), "cuda_repo_gpgkey_url": str(key)}
    res, _ = _run(playbook, tmp_path, "cuda", _facts("10"), "--check", **extra)
    assert f"has the sha256 {hashlib.sha256(text.encode()).hexdigest()} " in _fatal(res)


def _unsigned_rpm(tmp_path: Path) -> Path:
    spec = tmp_path / "epel-release.spec"
    spec.write_text(
        "Name: epel-release\nVersion: 9\nRelease: 10.el9\nSummary: not EPEL's\nLicense: GPLv2\n"
        "BuildArch: noarch\n%description\nnot EPEL's\n%files\n"
    )
    top = tmp_path / "rpmbuild"
    subprocess.run(["rpmbuild", "-bb", "--quiet", "--define", f"_topdir {top}", str(spec)], check=True)
    (rpm,) = (top / "RPMS" / "noarch").glob("epel-release-*.rpm")
    return rpm


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("rpmbuild") is None or shutil.which("rpm") is None, reason="no rpm here")
def test_an_epel_release_package_not_signed_by_the_pinned_key_is_refused_on_rhel(playbook, tmp_path):
    """RHEL installs epel-release from a URL, which dnf does not check: rpm -K must find it signed by EPEL's
    pinned key first. Here an unsigned package (rpm -K: digests OK, no signature, exit 0) is refused."""
    keys, _ = _placed_key(tmp_path)
    (keys / "RPM-GPG-KEY-cuda-rhel10").rename(keys / "RPM-GPG-KEY-EPEL-9")
    cache = tmp_path / "cache"
    cache.mkdir()
    rpm = shutil.copy(_unsigned_rpm(tmp_path), cache / "epel-release-latest-9.noarch.rpm")
    extra = {
        "_cuda_repo_import_dir": str(keys),
        "_cuda_repo_rpm_dir": str(cache),
        "epel_gpgkey_url": str(keys / "RPM-GPG-KEY-EPEL-9"),
        "epel_gpgkey_fingerprint": OHPC3,  # the key placed (EPEL's own is not at hand here)
        "epel_release_url": str(rpm),
    }
    res, _ = _run(playbook, tmp_path, "epel", _facts("9", distribution="RedHat"), "--check", **extra)
    msg = _fatal(res)
    assert msg.startswith(
        f"localhost: {rpm} (epel_release_url) is not signed by the key {OHPC3} (rpm -K: "
    ), msg
    assert msg.endswith("refusing to install it."), msg


def test_epel_on_a_rhel_release_without_a_pinned_key_is_refused_in_one_line(playbook, tmp_path):
    res, _ = _run(playbook, tmp_path, "epel", _facts("8", distribution="RedHat"), "--check")
    assert _fatal(res).startswith("epel: no fingerprint of EPEL's key is known here for RHEL 8")
