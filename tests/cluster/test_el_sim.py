"""The EL9 simulation host itself (tests/testbed/el): real dnf 4.14 and rpm against local repos.

Proves what the roles' EL tests will rely on: Ansible sees Rocky/RedHat 9 with dnf, NVIDIA's
modular streams behave as on RHEL (stream switch refused), kernel-devel-matched drags in the newer
kernel and the kmod's %post skips it, the simulated reboot loads the driver only when a module
exists for the booted kernel, and nothing lands on this machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.ansible.conftest import REPO_ROOT, tool_env
from tests.conftest import private_testbed, require_testbed, testbed_missing_reason
from tests.testbed import Testbed, el

# slow as a whole: its tests build on each other's state of one host (the later ones expect node0 to have
# booted the newer kernel), so the module runs complete or not at all
pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PREFIX, NET = "elsim", "10.213.75"
DRIVER = "580.105.08"  # newest 580 in the manifest
OPEN_STREAM_SWITCH = "It is not possible to switch enabled streams of a module"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
# Paths the sim writes inside its hosts; none may appear on this machine.
SIM_ONLY = (
    "/usr/bin/nvidia-smi",
    "/usr/sbin/dkms",
    "/usr/sbin/grubby",
    "/usr/bin/dracut",
    "/usr/src/kernels",
    "/usr/local/sbin/ddp-sim-reboot",
    "/usr/local/lib/ddp-sim",
    "/usr/lib/ddp-sim",
    "/etc/yum.repos.d",
    "/etc/ld.so.preload",
    "/etc/rpm/macros.ddp-sim",
    "/var/lib/ddp-sim",
    "/var/lib/dkms",
    "/var/log/ddp-sim",
)


def _snapshot() -> dict:
    """What the real machine has where the sim installs: the rpmdb and /boot, entry by entry."""
    snap = {}
    for d in ("/var/lib/rpm", "/boot"):
        for p in sorted(Path(d).rglob("*")):
            st = p.lstat()
            snap[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return snap


@pytest.fixture(scope="module")
def sim():
    reason = testbed_missing_reason()
    missing = [
        t
        for t in ("dnf", "rpmbuild", "createrepo_c", "modifyrepo_c", "gpg", "gcc")
        if shutil.which(t) is None
    ]
    if missing and not reason:
        reason = f"needs {', '.join(missing)} (bash .ci/setup --with-testbed)"
    require_testbed(reason)
    before = _snapshot()
    with private_testbed(PREFIX, NET, 2, os="rocky9", gpus=8, nvswitch=True) as tb:
        tb.real_before = before
        tb.cache = el.build()
        yield tb


def sh(tb: Testbed, host: str, cmd: str, ok: bool = True) -> subprocess.CompletedProcess:
    res = tb.ssh(host, cmd, check=False, timeout=120)
    if ok:
        assert res.returncode == 0, (
            f"{cmd!r} on {host} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
        )
    return res


def add_nvidia_repo(tb: Testbed, host: str) -> None:
    """What cuda_repo and the EPEL/CRB tasks do on a real Rocky 9 host."""
    sh(
        tb,
        host,
        f"cat > /etc/yum.repos.d/cuda-rhel9.repo <<'EOF'\n{el.cuda_repo_file(tb.cache)}EOF\n"
        "dnf -q -y install epel-release && dnf -q config-manager --set-enabled crb",
    )


def test_ansible_sees_rocky_9_with_dnf_and_reboots_through_the_sim(sim, tmp_path, venv_bin):
    info = sim.cache.info
    play = tmp_path / "play.yml"
    play.write_text(
        textwrap.dedent(f"""\
        - hosts: node0
          gather_facts: true
          gather_subset: [min]
          tasks:
            - ansible.builtin.assert:
                that:
                  - ansible_distribution == 'Rocky'
                  - ansible_os_family == 'RedHat'
                  - ansible_distribution_major_version == '9'
                  - ansible_pkg_mgr == 'dnf'
                  - ansible_kernel == '{info["installed_kernel"]}'
                  - ddp_testbed_os == 'rocky9'
            # rpm_key refuses file:// URLs (fetch_url's status is not 200); a path on the host works.
            - ansible.builtin.rpm_key:
                key: "{{{{ cuda_repo_gpgkey_url | regex_replace('^file://', '') }}}}"
                fingerprint: "{{{{ cuda_repo_gpgkey_fingerprint }}}}"
            - ansible.builtin.command: "{{{{ nvidia_driver_boot_time_command }}}}"
              register: before
              changed_when: false
            - ansible.builtin.reboot:
                reboot_command: "{{{{ nvidia_driver_reboot_command }}}}"
                boot_time_command: "{{{{ nvidia_driver_boot_time_command }}}}"
                reboot_timeout: 60
            - ansible.builtin.command: "{{{{ nvidia_driver_boot_time_command }}}}"
              register: after
              changed_when: false
            - ansible.builtin.assert:
                that: before.stdout != after.stdout
        """)
    )
    cfg = tmp_path / "ansible.cfg"  # no fact cache: other testbeds also have a node0
    cfg.write_text("[defaults]\nhost_key_checking = True\n[ssh_connection]\npipelining = True\n")
    res = subprocess.run(
        [str(venv_bin / "ansible-playbook"), "-i", str(sim.inventory), str(play)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "ANSIBLE_CONFIG": str(cfg)},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    keys = sh(sim, "node0", "rpm -q gpg-pubkey --qf '%{VERSION}\\n'").stdout.split()
    assert info["cuda_repo_gpgkey_fingerprint"][-8:].lower() in keys


def test_module_install_works_and_a_stream_switch_is_refused(sim):
    add_nvidia_repo(sim, "node1")
    sh(sim, "node1", "dnf -q -y module install nvidia-driver:580-open/default")
    evr = sh(sim, "node1", "rpm -q --qf '%{EPOCH}:%{VERSION}' nvidia-driver kmod-nvidia-open-dkms").stdout
    assert evr == f"3:{DRIVER}3:{DRIVER}"
    res = sh(sim, "node1", "dnf -y module install nvidia-driver:575-open/default", ok=False)
    assert res.returncode == 1
    assert OPEN_STREAM_SWITCH in res.stdout + res.stderr
    assert sh(sim, "node1", "rpm -q --qf '%{VERSION}' nvidia-driver").stdout == DRIVER


def test_versionlock_comes_with_its_package_and_locks_installed_nevras(sim):
    res = sh(sim, "node1", "dnf versionlock list", ok=False)
    assert res.returncode != 0 and "No such command: versionlock" in res.stdout + res.stderr
    sh(sim, "node1", "dnf -q -y install python3-dnf-plugin-versionlock")
    sh(sim, "node1", "dnf -q versionlock add '*nvidia*580*'")
    locks = [
        x
        for x in sh(sim, "node1", "cat /etc/dnf/plugins/versionlock.list").stdout.splitlines()
        if x and not x.startswith("#")
    ]
    installed = sh(sim, "node1", "rpm -qa --qf '%{NAME}\\n' '*nvidia*'").stdout.split()
    assert sorted(x.split(f"-3:{DRIVER}")[0] for x in locks) == sorted(installed)
    sh(sim, "node1", "dnf -q versionlock clear")


def test_kernel_devel_matched_pulls_the_newer_kernel_and_the_kmod_post_skips_it(sim):
    info = sim.cache.info
    running, newer = info["installed_kernel"], info["newer_kernels"][-1]
    sh(sim, "node0", "dnf -q -y install kernel-devel-matched")
    cores = sh(sim, "node0", "rpm -q --qf '%{VERSION}-%{RELEASE}.%{ARCH}\\n' kernel-core").stdout.split()
    assert sorted(cores) == sorted([running, newer])
    assert sh(sim, "node0", "grubby --default-kernel").stdout.strip() == f"/boot/vmlinuz-{newer}"
    assert sh(sim, "node0", "uname -r").stdout.strip() == running  # not rebooted yet
    add_nvidia_repo(sim, "node0")
    sh(sim, "node0", "dnf -q -y module install nvidia-driver:580-open/default")
    log = sh(sim, "node0", "cat /var/log/ddp-sim/dkms.log").stdout
    assert f"dkms install -m nvidia -v {DRIVER} -q --force" in log  # NVIDIA's %post, uname -r only
    assert "autoinstall" not in log
    sh(sim, "node0", f"test ! -e /lib/modules/{newer}/extra/nvidia.ko.xz")
    # the running kernel has no headers either: the %post's build failed and was ignored
    assert sh(sim, "node0", "dkms status").stdout.strip() == f"nvidia/{DRIVER}: added"


def test_the_driver_loads_only_with_a_module_for_the_booted_kernel(sim):
    newer = sim.cache.info["newer_kernels"][-1]
    sh(sim, "node0", "ddp-sim-reboot")
    assert sh(sim, "node0", "uname -r").stdout.strip() == newer
    res = sh(sim, "node0", "nvidia-smi", ok=False)
    assert res.returncode == 9 and NO_DRIVER in res.stdout
    res = sh(sim, "node0", "dkms build -m nvidia -v 1.0 -k 9.9.9", ok=False)
    assert res.returncode != 0  # unknown module source
    # The open modules compile C++ and nothing installed g++ (EPEL's dkms requires gcc only): the build
    # fails as the real one does (NVIDIA/open-gpu-kernel-modules#805), until gcc-c++ is installed.
    res = sh(sim, "node0", f"dkms autoinstall -k {newer}", ok=False)
    assert res.returncode == 11 and "Bad return status for module build on kernel" in res.stderr, res.stderr
    make_log = sh(sim, "node0", f"cat /var/lib/dkms/nvidia/{DRIVER}/build/make.log").stdout
    assert "g++: command not found" in make_log
    sh(sim, "node0", "dnf -q -y install gcc-c++")
    sh(sim, "node0", f"dkms autoinstall -k {newer}")
    assert sh(sim, "node0", "dkms status").stdout.strip() == f"nvidia/{DRIVER}, {newer}, x86_64: installed"
    sh(sim, "node0", "ddp-sim-reboot")
    assert (
        f"NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER}"
        in sh(sim, "node0", "cat /var/lib/ddp-sim/proc/driver/nvidia/version").stdout
    )
    sh(sim, "node0", "echo 3 > /var/lib/ddp-sim/mig-enabled")
    rows = sh(
        sim,
        "node0",
        "nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version,mig.mode.current --format=csv,noheader",
    ).stdout.splitlines()
    assert len(rows) == 8
    assert rows[0] == f"0, NVIDIA H100 80GB HBM3, 00000000:1B:00.0, {DRIVER}, Disabled"
    assert rows[3].endswith("Enabled")
    # NVSwitch host without Fabric Manager: the fabric never completes
    assert "State                             : In Progress" in sh(sim, "node0", "nvidia-smi -q").stdout
    sh(sim, "node0", f"dnf -q -y install nvidia-fabricmanager-{DRIVER}")
    q = sh(sim, "node0", "nvidia-smi -q").stdout
    assert (
        "State                             : Completed" in q
        and "Status                            : Success" in q
    )
    sh(sim, "node0", "touch /var/lib/ddp-sim/secureboot-rejects && ddp-sim-reboot")
    assert sh(sim, "node0", "nvidia-smi", ok=False).returncode == 9
    sh(sim, "node0", "rm /var/lib/ddp-sim/secureboot-rejects && ddp-sim-reboot && nvidia-smi -L >/dev/null")


def test_dracut_force_rebuilds_only_the_running_kernel(sim):
    info = sim.cache.info
    running, other = info["newer_kernels"][-1], info["installed_kernel"]  # node0 booted the newer one
    sh(sim, "node0", "rm -f /boot/initramfs-*.img && dracut --force")
    assert sh(sim, "node0", "ls /boot/").stdout.split().count(f"initramfs-{running}.img") == 1
    sh(sim, "node0", f"test ! -e /boot/initramfs-{other}.img")
    sh(sim, "node0", "dracut --regenerate-all --force")
    sh(sim, "node0", f"test -e /boot/initramfs-{other}.img")
    log = sh(sim, "node0", "cat /var/log/ddp-sim/dracut.log").stdout
    assert "dracut --force" in log and "dracut --regenerate-all --force" in log


def test_cuda_repo_imports_its_key_where_the_rpmdb_holds_an_openpgp_v6_key(sim, tmp_path, venv_bin):
    """rpm_key lists the rpmdb's keys through gpg, which cannot read a v6 key (ansible/ansible#86246): on
    RHEL 10.1 every rpm_key task fails. The role's own import reads only the key it imports."""
    # The rpmdb entry `rpm --import` makes of a key: package gpg-pubkey, the armored key its description.
    spec = tmp_path / "gpg-pubkey.spec"
    spec.write_text(el.v6_key_spec())
    subprocess.run(
        ["rpmbuild", "-bb", "--quiet", "--define", f"_topdir {tmp_path / 'top'}", str(spec)], check=True
    )
    (rpm,) = (tmp_path / "top" / "RPMS" / "noarch").glob("gpg-pubkey-*.rpm")
    # --oldpackage: rpm compares gpg-pubkey versions (key ids), and the repository's key, generated per
    # cache and already imported by the module install above, has a random one that may sort higher.
    sh(sim, "node1", f"rpm -i --nodeps --oldpackage {rpm} && rpm -q gpg-pubkey-5a6340b3")
    # rpm_key's listing (ansible.builtin.rpm_key is_key_imported), in a throwaway gpg home.
    listing = (
        "rpm -q gpg-pubkey --qf '%{description}' | gpg --homedir \"$(mktemp -d)\" --batch --with-colons -"
    )
    probe = sh(sim, "node1", listing, ok=False)
    assert probe.returncode == 2 and "unknown version 6" in probe.stderr, probe.stderr

    play = tmp_path / "play.yml"
    play.write_text("- hosts: node1\n  roles: [cuda_repo]\n")
    env = tool_env(venv_bin, tmp_path / "facts")
    argv = [str(venv_bin / "ansible-playbook"), "-i", str(sim.inventory), str(play)]
    runs = [subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)]
    runs.append(subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT))
    for res in runs:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-1000:]
    assert "changed=0" in runs[1].stdout.splitlines()[-2], runs[1].stdout[-1500:]
    fingerprint = sim.cache.info["cuda_repo_gpgkey_fingerprint"]
    keys = sh(sim, "node1", "rpm -q gpg-pubkey --qf '%{VERSION}\\n'").stdout.split()
    assert sorted(keys) == sorted(["5a6340b3", fingerprint[-8:].lower()]), keys


def test_nvidia_module_streams_and_profiles_as_published(sim):
    """Every branch has its open, dkms and precompiled streams, besides the floating open-dkms, latest-dkms
    and latest; the precompiled ones have no src profile, and their kmod is built per kernel."""
    add_nvidia_repo(sim, "node1")
    out = sh(sim, "node1", "dnf -q module list nvidia-driver").stdout
    rows = re.findall(r"^nvidia-driver\s+(\S+)(?: \[\w\])*\s+(.+?)\s+Nvidia driver for", out, re.M)
    profiles = {stream: {p.split()[0] for p in profs.split(", ")} for stream, profs in rows}
    precompiled = {"580", "575", "latest"}
    dkms = {"580-open", "580-dkms", "575-open", "575-dkms", "open-dkms", "latest-dkms"}
    assert set(profiles) == precompiled | dkms, out
    assert all(profiles[s] == {"default", "fm", "ks"} for s in precompiled), profiles
    assert all(profiles[s] == {"default", "fm", "ks", "src"} for s in dkms), profiles
    info = sim.cache.info
    kmods = [p for p in info["packages"] if re.search(rf"/kmod-nvidia-{DRIVER}-5\.14\.0-", p)]
    assert len(kmods) == 1 + len(info["newer_kernels"]), kmods


def test_rocky10_identity_from_the_same_manifest():
    """--os rocky10: Rocky 10.1's release, python3 3.12 and kernel, NVIDIA's rhel10 repository without module
    streams and with a second CUDA 13 branch (590); EL9's own packages and the 575 branch stay EL9's."""
    el9, el10 = el.Manifest.load(os_name="rocky9"), el.Manifest.load(os_name="rocky10")
    base = {p.name: f"{p.version}-{p.release}" for p in el10.packages if p.base}
    assert base["rocky-release"] == "10.1-1.4.el10" and base["python3"].startswith("3.12.")
    assert re.fullmatch(r"6\.12\.0-124\.[\d.]+\.el10_1\.x86_64", el10.installed_kernel)
    assert el10.modules == [] and len(el9.modules) > 0
    assert {p.repo for p in el10.packages if p.name == "nvidia-driver-cuda"} == {"cuda-rhel10-x86_64"}

    def branches(man: el.Manifest) -> set:
        return {p.version.split(".")[0] for p in man.packages if p.name == "kmod-nvidia-open-dkms"}

    assert branches(el10) == {"580", "590"} and branches(el9) == {"580", "575"}
    assert not any(p.name.startswith("python3.11") for p in el10.packages)
    assert all(p.release.endswith(".el10") for p in el10.packages if p.name == "nvidia-kmod-common")
    assert "Rocky Linux 10.1" in el.IDENTITIES["rocky10"].os_release
    assert "Debian" not in el.openpgp_v6_key() and el.v6_key_spec().startswith("Name: gpg-pubkey\n")


def test_nothing_lands_on_the_real_machine(sim):
    assert _snapshot() == sim.real_before  # rpmdb and /boot untouched
    leaked = [p for p in SIM_ONLY if os.path.lexists(p)]
    for k in [sim.cache.info["installed_kernel"], *sim.cache.info["newer_kernels"]]:
        leaked += [p for p in (f"/lib/modules/{k}", f"/boot/vmlinuz-{k}") if os.path.lexists(p)]
    assert leaked == []
    assert os.path.islink("/etc/os-release")  # still Debian's
    assert Path(
        "/usr/lib/python3/dist-packages/dnf-plugins/versionlock.py"
    ).is_file()  # hidden only in the hosts


def test_down_leaves_no_namespace(sim):
    sim.down()
    assert sim.namespaces() == []
    assert subprocess.run(["ip", "link", "show", sim.bridge], capture_output=True).returncode != 0
    assert not sim.state_dir.exists() and not sim.inventory_dir.exists()
    sim.down()  # idempotent
