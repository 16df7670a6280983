"""Multi-host testbed: N fake hosts on this machine, each a network namespace with its own sshd.

Every host gets an IP on a private /24 behind a bridge, its own hostname (UTS namespace), a private
mount namespace with overlayfs over /etc /opt /root /srv /home /var (so roles that edit /etc/hosts or
install into /opt never touch the real machine), a private /run, and an sshd that accepts only the
testbed's key. Host keys are generated per host and written to a known_hosts file: host key checking
stays on. An Ansible inventory of the hosts is written for the roles and the launcher.

    python -m tests.testbed up 3        # prints the hosts, writes inventory/testbed/hosts.yml
    python -m tests.testbed down        # kills its processes by PID, deletes its namespaces

Several testbeds can coexist when they use different --prefix and --net values. Under pytest-xdist
(`pytest -n N`) worker gwK (K > 0) names a testbed worker_prefix(p) and worker_net(n), so the workers'
testbeds of one name never meet.

64 hosts (`up 64`, up to 200 fit the /24) come up in ~16 s and hold ~9 MiB each (sshd only). The
kernel's neighbour table is one per kernel, not per namespace, and n hosts that all talk to each other
need ~n x n entries: `up` raises net.ipv{4,6}.neigh.default.gc_thresh1/2/3 for its n hosts and `down`
restores them, both said on stderr (tests/testbed/neigh.py keeps the count across testbeds in /run).

Each host's root gets a fresh Debian root's ~/.bashrc and ~/.profile (not this machine's, whose
`pyenv init` cost 0.08 CPU-s per SSH command), its system Python the payload cache of
tests/testbed/zipcode.py (Ansible's modules compiled once, not per task), and every SSH session
PIP_COMPILE=false: pip installs torch's wheel without byte-compiling it (docs/testing.md).

`--os rocky9` makes every host an EL9 simulation host (tests/testbed/el): its overlays also cover
/usr and /boot, its /etc says Rocky Linux 9.6, its rpmdb and dnf cache live in its own /var, and
the real dnf 4.14 installs stub packages from local repositories built from el/manifest.yml. Each
gets simulated GPUs (`--gpus`, `--nvswitch`) and the test helper /usr/local/sbin/ddp-sim-reboot.
`--os rocky10` does the same as Rocky Linux 10.1 (no module streams, NVIDIA's rhel10 repository, an
OpenPGP v6 key in the rpmdb as RHEL 10.1 ships one; el/__init__.py IDENTITIES).

    python -m tests.testbed up 2 --os rocky9 --gpus 8 --nvswitch --prefix elsim --net 10.213.75

`--train-net A.B.C` gives every host a second, training network like a real cluster's: SSH stays on
--net (eth0, what the hostnames resolve to), the training interface is on its own bridge with a name
that differs between hosts (`--train-ifnames ens1f0,train0,...`, taken in turn), and a decoy `aaa0`
that sorts first, holds 172.17.0.1/16 on every host as docker0 does and leads nowhere (its peer is
on no bridge). The inventory's ddp_network_cidr is the training network and ddp_master_addr node0's
address in it.

    python -m tests.testbed up 3 --prefix nicc --net 10.213.103 --train-net 10.213.102
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import neigh

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PREFIX = os.environ.get("DDP_TESTBED_PREFIX", "tb")
DEFAULT_NET = os.environ.get("DDP_TESTBED_NET", "10.213.50")
OVERLAY_DIRS = ("/etc", "/opt", "/root", "/srv", "/home", "/var")
# Where the hosts' Python keeps the compiled code of Ansible's module payload (tests/testbed/zipcode.py).
ZIPCODE_CACHE = REPO_ROOT / ".cache" / "testbed-zipcode"
# The preflight probe's torch facts (ddp_train/launch/node/probe.py, ~/.cache/ddp-launch), shared by root
# on every Debian host: they all run this machine's venv, so one import of torch answers for all of them.
PROBE_CACHE = REPO_ROOT / ".cache" / "testbed-probe"
# EL sim hosts: packages install into /usr and /boot too. /usr first, so the uname shim named in the
# overlaid /etc/ld.so.preload exists before any later command of the host's setup runs.
EL_OVERLAY_DIRS = ("/usr", "/boot", *OVERLAY_DIRS)
# The EL simulation identities (tests/testbed/el IDENTITIES).
EL_OSES = ("rocky9", "rocky10")
OS_CHOICES = ("debian", *EL_OSES)
FIRST_HOST_OCTET = 10
DEFAULT_TRAIN_IFNAMES = ("ens1f0", "train0", "enp65s0f1")
DECOY_IFNAME, DECOY_ADDRESS = "aaa0", "172.17.0.1/16"  # sorts before every real name; docker0's address


def _worker() -> int:
    """This pytest-xdist worker's number (gw3: 3); 0 for gw0 and outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def worker_prefix(prefix: str) -> str:
    """`prefix` for this xdist worker: unchanged on gw0, `<prefix>w<K>` on gwK (no digit may follow
    a prefix directly: `down` deletes the links v<prefix><digits>)."""
    return prefix if _worker() == 0 else f"{prefix}w{_worker()}"


def worker_net(net: str) -> str:
    """`net` (A.B.C) for this xdist worker: unchanged on gw0, A.(B+K).C on gwK."""
    a, b, c = net.split(".")
    return net if _worker() == 0 else f"{a}.{int(b) + _worker()}.{c}"


_PORTS = itertools.count()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on, from this worker's own band of 500 below the
    kernel's ephemeral range (32768-60999): no other worker's bind(0) or connect() can draw it between
    this check and the bind of whoever uses it (a local inventory's MASTER_PORT)."""
    base = 20000 + 500 * _worker()
    for _ in range(500):
        port = base + next(_PORTS) % 500
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise TestbedError(f"no free port in {base}-{base + 499}")


def _discard(path: Path) -> None:
    """Remove a directory without waiting for the disk: renamed away at once (its name is free for the
    next `up`), deleted by a detached `rm -rf`. EL hosts' overlays hold a venv with torch each: deleting
    them took 170-212 s of test_el9_sim's teardown under the loaded `pytest -n 4`, a worker waiting."""
    trash = path.with_name(f".{path.name}.deleting-{os.getpid()}-{time.monotonic_ns()}")
    try:
        path.rename(trash)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return
    # setsid --fork: rm is reparented away from us, so it never becomes a zombie child of the caller.
    argv = ["setsid", "--fork", "rm", "-rf", "--one-file-system", str(trash)]
    quiet = subprocess.DEVNULL
    subprocess.run(argv, stdin=quiet, stdout=quiet, stderr=quiet, check=False)


class TestbedError(RuntimeError):
    """The testbed could not be built or torn down."""


def _fresh_root_shell_files(root_upper: Path) -> None:
    """root's ~/.bashrc and ~/.profile of a fresh Debian host on every host, not this machine's.

    bash sources ~/.bashrc for every command sshd runs (Debian builds it with SSH_SOURCE_BASHRC), and
    this machine's root runs `pyenv init` there: 0.08 CPU-s for each SSH command a host ran (30 `ssh
    node0 true` over one master: 2.58 CPU-s against 0.18 without it), the largest part of each Ansible
    task. A host that a user provisions has its own root files, not the controller's."""
    for name in (".bashrc", ".profile"):
        default = Path("/usr/share/base-files") / f"dot{name}"  # what Debian's base-files gives root
        text = default.read_text() if default.is_file() else f"# ~/{name} of a testbed host\n"
        (root_upper / name).write_text(text)


def _cache_ansible_payload_code(etc_upper: Path) -> None:
    """Give the host's system Python the payload code cache of tests/testbed/zipcode.py: Debian links
    /usr/lib/python3.X/sitecustomize.py to /etc/python3.X/sitecustomize.py, and the host's /etc is its
    own overlay, so its copy (the original lines, then the cache's) reaches that host only. Without
    the link (another distribution) nothing changes: the modules compile as they would anyway."""
    here = Path(__file__).resolve().parent
    for link in Path("/usr/lib").glob("python3.*/sitecustomize.py"):
        target = Path(os.path.realpath(link))
        if not link.is_symlink() or target.parent.parent != Path("/etc"):
            continue
        copy = etc_upper / target.relative_to("/etc")
        copy.parent.mkdir(parents=True, exist_ok=True)
        original = target.read_text() if target.is_file() else ""
        copy.write_text(
            f"{original}\n"
            "# ddp-train testbed (tests/testbed/zipcode.py): Ansible's payload compiled once, not per task.\n"
            "try:\n"
            "    import sys as _sys\n"
            f"    _sys.path.insert(0, {str(here)!r})\n"
            "    try:\n"
            "        import zipcode as _zipcode\n"
            "    finally:\n"
            "        del _sys.path[0]\n"
            f"    _zipcode.install({str(ZIPCODE_CACHE)!r})\n"
            "    _zipcode.take_main_from_stdin()\n"
            "except Exception:\n"
            "    pass\n"
        )


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise TestbedError(f"{shlex.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    ip: str
    netns: str
    train_ip: str | None = None  # --train-net: the address on the training interface
    train_dev: str | None = None


@dataclasses.dataclass
class Testbed:
    """One set of namespace hosts, identified by its prefix (namespaces, bridge and state dir)."""

    __test__ = False  # not a pytest test class

    prefix: str = DEFAULT_PREFIX
    net: str = DEFAULT_NET
    state_root: Path = Path("/tmp")
    os: str = "debian"
    train_net: str | None = None  # a second /24 (A.B.C) for training interfaces, named per host
    train_ifnames: tuple[str, ...] = DEFAULT_TRAIN_IFNAMES

    def __post_init__(self) -> None:
        if not self.prefix.isalnum() or len(self.prefix) > 10:  # v<prefix><host 0-199>: ifname <= 15
            raise TestbedError(f"testbed prefix must be 1-10 letters/digits, got {self.prefix!r}")
        for net in [self.net] + ([self.train_net] if self.train_net else []):
            parts = net.split(".")
            if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
                raise TestbedError(f"testbed net must look like 10.213.50 (a /24), got {net!r}")
        if self.train_net == self.net:
            raise TestbedError("--train-net must differ from --net")
        bad = [n for n in self.train_ifnames if not (0 < len(n) <= 15 and n.isascii() and n.isalnum())]
        if bad or not self.train_ifnames or DECOY_IFNAME in self.train_ifnames:
            raise TestbedError(f"training interface names must be 1-15 letters/digits (not aaa0), got {bad}")
        if self.os not in OS_CHOICES:
            raise TestbedError(f"testbed os must be one of {', '.join(OS_CHOICES)}, got {self.os!r}")

    # ---- names and paths -------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.state_root / f"ddp-testbed-{self.prefix}"

    @property
    def bridge(self) -> str:
        return f"br-{self.prefix}"

    @property
    def train_bridge(self) -> str:
        return f"bt-{self.prefix}"

    @property
    def bridge_ip(self) -> str:
        return f"{self.net}.1"

    @property
    def key_file(self) -> Path:
        return self.state_dir / "keys" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "keys" / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.state_dir / "keys" / "ssh_config"

    @property
    def inventory_dir(self) -> Path:
        suffix = "" if self.prefix == "tb" else f"-{self.prefix}"
        return REPO_ROOT / "inventory" / f"testbed{suffix}"

    @property
    def inventory(self) -> Path:
        return self.inventory_dir / "hosts.yml"

    def host(self, i: int) -> Host:
        train = {}
        if self.train_net:
            train = {
                "train_ip": f"{self.train_net}.{FIRST_HOST_OCTET + i}",
                "train_dev": self.train_ifnames[i % len(self.train_ifnames)],
            }
        return Host(
            name=f"node{i}", ip=f"{self.net}.{FIRST_HOST_OCTET + i}", netns=f"{self.prefix}-node{i}", **train
        )

    def hosts(self) -> list[Host]:
        """The hosts that are up now (read from the state dir)."""
        meta = self.state_dir / "hosts.json"
        if not meta.exists():
            return []
        return [Host(**h) for h in json.loads(meta.read_text())]

    def namespaces(self) -> list[str]:
        out = _run("ip", "netns", "list").stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return [n for n in names if n.startswith(f"{self.prefix}-node")]

    # ---- running things inside a host --------------------------------------------------------
    def pids(self, host: Host | str) -> list[int]:
        ns = host.netns if isinstance(host, Host) else host
        res = _run("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in res.stdout.split()]

    def sshd_pid(self, host: Host) -> int:
        return int((self.state_dir / "hosts" / host.name / "sshd.pid").read_text())

    def exec(self, host: Host, command: str, timeout: float = 60, check: bool = True):
        """Run a shell command inside the host's network+mount+UTS namespaces (as sshd sees them)."""
        pid = self.sshd_pid(host)
        return _run(
            "nsenter",
            "-t",
            str(pid),
            "-n",
            "-m",
            "-u",
            "--",
            "sh",
            "-c",
            command,
            check=check,
            timeout=timeout,
        )

    def ssh_argv(self, host: Host | str, command: str) -> list[str]:
        name = host.name if isinstance(host, Host) else host
        return ["ssh", "-F", str(self.ssh_config), name, command]

    def ssh(self, host: Host | str, command: str, timeout: float = 60, check: bool = True):
        return _run(*self.ssh_argv(host, command), check=check, timeout=timeout)

    # ---- up / down --------------------------------------------------------------------------
    def up(
        self,
        n: int,
        loopback_hostname: bool = False,
        gpus: int = 8,
        nvswitch: bool = False,
        gpu_model: str = "h100",
        usr_local: bool = False,
        firewalld: bool = False,
        shared_probe_cache: bool = True,
    ) -> list[Host]:
        """Create n hosts (tearing down a previous testbed of this prefix first).

        gpus, nvswitch and gpu_model describe the simulated hardware of EL sim hosts (os="rocky9"/"rocky10").
        usr_local: Debian hosts also get an overlay over /usr/local, so a test can put fakes (a recorded
        nvidia-smi) in /usr/local/bin, which is first on the hosts' PATH (EL hosts overlay all of /usr).
        firewalld: EL sim hosts run a private D-Bus and firewalld, as a real EL host does (el/firewalld.py).
        shared_probe_cache: root's probe cache on Debian hosts is one directory (PROBE_CACHE) for all of
        them. Its key names the Python, torch's files and the environment that changes what torch sees
        (PYTHONPATH, CUDA_VISIBLE_DEVICES...), so a host made to differ gets its own entry and imports
        torch; False gives each host its own cache, as on real nodes (each imports torch once).
        """
        if not 1 <= n <= 200:
            raise TestbedError(f"host count must be 1..200, got {n}")
        for tool in ("ip", "unshare", "nsenter", "ssh-keygen"):
            if shutil.which(tool) is None:
                raise TestbedError(f"'{tool}' not found: install iproute2, util-linux and openssh-client")
        if not Path("/usr/sbin/sshd").exists():
            raise TestbedError("/usr/sbin/sshd not found: install openssh-server")
        if os.geteuid() != 0:
            raise TestbedError("the testbed needs root (network and mount namespaces)")
        self._el_cache = None
        if self.os in EL_OSES:
            from . import el

            try:
                self._el_cache = el.build(os_name=self.os)
            except el.SimError as e:
                raise TestbedError(f"EL sim: {e}") from e
        self._hw = {"gpus": gpus, "nvswitch": nvswitch, "gpu_model": gpu_model}
        self._usr_local = usr_local
        self._firewalld = firewalld
        self._probe_cache = shared_probe_cache and self.os not in EL_OSES
        if firewalld:
            from .el import firewalld as el_firewalld

            if self.os not in EL_OSES:
                raise TestbedError(f"firewalld runs on --os {'/'.join(EL_OSES)} hosts only")
            if el_firewalld.missing():
                raise TestbedError(
                    f"firewalld needs {', '.join(el_firewalld.missing())}: bash .ci/setup --with-testbed"
                )
        self.down()
        self._say(neigh.acquire(self.prefix, n), f"raised for its {n} hosts")
        keys = self.key_file.parent
        keys.mkdir(parents=True, exist_ok=True)
        comment = f"ddp-testbed-{self.prefix}"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(self.key_file))
        authorized = keys / "authorized_keys"
        shutil.copy(f"{self.key_file}.pub", authorized)
        authorized.chmod(0o600)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)

        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        if self.train_net:
            _run("ip", "link", "add", self.train_bridge, "type", "bridge")
            _run("ip", "link", "set", self.train_bridge, "up")

        hosts = [self.host(i) for i in range(n)]
        known = []
        for h in hosts:
            known.extend(self._start_host(h, hosts, authorized, loopback_hostname))
        self.known_hosts.write_text("".join(known))
        (self.state_dir / "hosts.json").write_text(json.dumps([dataclasses.asdict(h) for h in hosts]))
        self._write_ssh_config(hosts)
        for h in hosts:
            self._wait_sshd(h)
        self._write_inventory(hosts)
        return hosts

    def _start_host(self, h: Host, hosts: list[Host], authorized: Path, loopback_hostname: bool) -> list[str]:
        d = self.state_dir / "hosts" / h.name
        d.mkdir(parents=True)
        veth = f"v{self.prefix}{h.name[4:]}"[:15]
        _run("ip", "netns", "add", h.netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        _run("ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
        _run("ip", "-n", h.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", h.netns, "link", "set", "lo", "up")
        if h.train_dev:
            self._add_training_interfaces(h)

        hostkey = d / "ssh_host_ed25519_key"
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(hostkey))
        pub = " ".join(Path(f"{hostkey}.pub").read_text().split()[:2])
        (d / "sshd_config").write_text(
            f"""Port 22
ListenAddress {h.ip}
HostKey {hostkey}
PidFile {d}/sshd.pid
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AuthorizedKeysFile {authorized}
StrictModes no
UsePAM no
UseDNS no
MaxSessions 100
MaxStartups 100:30:200
Subsystem sftp /usr/lib/openssh/sftp-server
AcceptEnv LANG LC_*
SetEnv PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PIP_COMPILE=false
"""
        )
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if loopback_hostname:  # what Debian's installer writes, and what breaks gloo/NCCL
            lines.append(f"127.0.1.1\t{h.name}")
        lines += [f"{o.ip}\t{o.name}" for o in hosts]
        (d / "hosts").write_text("\n".join(lines) + "\n")
        (d / "hostname").write_text(h.name + "\n")

        setup = []
        overlay_dirs = OVERLAY_DIRS + (("/usr/local",) if self._usr_local else ())
        if self.os in EL_OSES:
            from . import el

            overlay_dirs = EL_OVERLAY_DIRS
            try:
                el.populate_host(self._el_cache, d, h.name, **self._hw)
            except el.SimError as e:
                raise TestbedError(f"EL sim on {h.name}: {e}") from e
        for src in overlay_dirs:
            tag = src.strip("/").replace("/", "_")
            upper, work = d / "ovl" / tag / "upper", d / "ovl" / tag / "work"
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            setup.append(f"mount -t overlay overlay -o lowerdir={src},upperdir={upper},workdir={work} {src}")
            if src == "/etc":
                _cache_ansible_payload_code(upper)
            if src == "/root":
                _fresh_root_shell_files(upper)
        if self._probe_cache:
            PROBE_CACHE.mkdir(parents=True, exist_ok=True)
            cache = "/root/.cache/ddp-launch"
            setup += [f"mkdir -p {cache}", f"mount --bind {PROBE_CACHE} {cache}"]
        setup += [
            f"cp {d}/hosts /etc/hosts",
            f"cp {d}/hostname /etc/hostname",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            "mkdir -p /run/sshd /run/lock",
            f"hostname {h.name}",
        ]
        if self._firewalld:
            from .el import firewalld as el_firewalld

            setup += el_firewalld.start_commands(d)
        setup += [
            f"exec /usr/sbin/sshd -D -e -f {d}/sshd_config",
        ]
        script = "set -e; " + "; ".join(setup)
        with open(d / "sshd.log", "wb") as log:
            # setsid --fork: sshd is reparented away from us, so killing it never leaves a zombie
            # child in the test process.
            subprocess.run(
                [
                    "setsid",
                    "--fork",
                    "ip",
                    "netns",
                    "exec",
                    h.netns,
                    "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "--",
                    "sh",
                    "-c",
                    script,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
        return [f"{h.ip} {pub}\n", f"{h.name} {pub}\n"]

    def _add_training_interfaces(self, h: Host) -> None:
        """The training interface (its own bridge, a per-host name) and the decoy that leads nowhere."""
        num = h.name[4:]
        train, decoy = f"t{self.prefix}{num}"[:15], f"d{self.prefix}{num}"[:15]
        _run("ip", "link", "add", train, "type", "veth", "peer", "name", str(h.train_dev), "netns", h.netns)
        _run("ip", "link", "set", train, "master", self.train_bridge, "up")
        _run("ip", "-n", h.netns, "addr", "add", f"{h.train_ip}/24", "dev", str(h.train_dev))
        _run("ip", "-n", h.netns, "link", "set", str(h.train_dev), "up")
        _run("ip", "link", "add", decoy, "type", "veth", "peer", "name", DECOY_IFNAME, "netns", h.netns)
        _run("ip", "link", "set", decoy, "up")
        _run("ip", "-n", h.netns, "addr", "add", DECOY_ADDRESS, "dev", DECOY_IFNAME)
        _run("ip", "-n", h.netns, "link", "set", DECOY_IFNAME, "up")

    def _wait_sshd(self, h: Host, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        pidfile = self.state_dir / "hosts" / h.name / "sshd.pid"
        while time.monotonic() < deadline:
            if pidfile.exists():
                res = _run("ip", "netns", "exec", h.netns, "ss", "-Hltn", "sport = :22", check=False)
                if f"{h.ip}:22" in res.stdout:
                    return
            time.sleep(0.05)
        log = (self.state_dir / "hosts" / h.name / "sshd.log").read_text(errors="replace")
        raise TestbedError(f"sshd on {h.name} ({h.ip}) did not start: {log.strip()[-500:]}")

    def _write_ssh_config(self, hosts: list[Host]) -> None:
        blocks = [f"Host {h.name}\n  HostName {h.ip}\n  HostKeyAlias {h.name}\n" for h in hosts]
        blocks.append(
            f"Host *\n  User root\n  IdentityFile {self.key_file}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {self.known_hosts}\n  StrictHostKeyChecking yes\n  BatchMode yes\n"
            "  ConnectTimeout 10\n"
        )
        self.ssh_config.write_text("\n".join(blocks))

    def _write_inventory(self, hosts: list[Host]) -> None:
        self.inventory_dir.mkdir(parents=True, exist_ok=True)
        import yaml  # only needed here; keeps `down` usable without the venv

        inv = {
            "all": {
                "children": {
                    "gpu_nodes": {"hosts": {h.name: {"ansible_host": h.ip} for h in hosts}},
                },
                "vars": {
                    "ansible_user": "root",
                    "ansible_python_interpreter": "/usr/bin/python3",
                    "ansible_ssh_private_key_file": str(self.key_file),
                    "ansible_ssh_common_args": (
                        f"-o UserKnownHostsFile={self.known_hosts} -o StrictHostKeyChecking=yes"
                    ),
                    "ddp_network_cidr": f"{self.net}.0/24",
                    "ddp_testbed": True,
                },
            }
        }
        args = f"--prefix {self.prefix}"
        if self.train_net:
            inv["all"]["vars"]["ddp_network_cidr"] = f"{self.train_net}.0/24"
            inv["all"]["vars"]["ddp_master_addr"] = hosts[0].train_ip
            names = ",".join(self.train_ifnames)
            args += f" --net {self.net} --train-net {self.train_net} --train-ifnames {names}"
        if self.os in EL_OSES:
            from . import el

            inv["all"]["vars"].update(el.inventory_vars(self._el_cache))
            nvswitch = " --nvswitch" if self._hw["nvswitch"] else ""
            args += f" --os {self.os} --gpus {self._hw['gpus']}{nvswitch}"
        header = f"# Generated by `python -m tests.testbed up {len(hosts)} {args}`; do not edit.\n"
        self.inventory.write_text(header + yaml.safe_dump(inv, sort_keys=False))

    def down(self) -> None:
        """Kill every process in this testbed's namespaces (by PID), delete them, the veths and bridge.

        Safe to run twice and after a crash: it works from what exists, not from recorded state.
        """
        for ns in self.namespaces():
            for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
                pids = self.pids(ns)
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + wait
                while self.pids(ns) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not self.pids(ns):
                    break
            _run("ip", "netns", "del", ns, check=False)
        links = _run("ip", "-o", "link", "show", check=False).stdout
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if (
                name[:1] in "vtd"
                and name[1:].startswith(self.prefix)
                and name[len(self.prefix) + 1 :].isdigit()
            ):
                _run("ip", "link", "del", name, check=False)
        for bridge in (self.bridge, self.train_bridge):
            if _run("ip", "link", "show", bridge, check=False).returncode == 0:
                _run("ip", "link", "del", bridge, check=False)
        if self.state_dir.exists():
            self._unmount_leftovers()
            _discard(self.state_dir)
        if self.inventory_dir.exists():
            shutil.rmtree(self.inventory_dir, ignore_errors=True)
        self._say(neigh.release(self.prefix), "restored at down")

    def _say(self, changes: list[str], what: str) -> None:
        """The kernel's neighbour thresholds are global: every change is said, on stderr."""
        if changes:
            print(f"testbed {self.prefix}: neighbour table {what}: {', '.join(changes)}", file=sys.stderr)

    def _unmount_leftovers(self) -> None:
        # Overlays live in the hosts' private mount namespaces, which die with their processes;
        # nothing is mounted in ours. Guard anyway so rmtree never walks into a live mount.
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        for m in mounts:
            target = m.split()[1]
            if target.startswith(str(self.state_dir)):
                _run("umount", "-l", target, check=False)
