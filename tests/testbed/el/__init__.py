"""EL9 (Rocky 9) and EL10 (Rocky 10) simulation for the namespace testbed: real dnf 4.14 and rpm against
local repositories.

`build()` turns manifest.yml into stub RPMs (rpmbuild), signs them with a key generated per cache,
writes createrepo_c repositories (NVIDIA's with modular metadata, modules.yaml via modifyrepo_c)
and a *base image*: the overlay upper dirs of a freshly installed Rocky 9.6 host (its /etc, its
rpmdb under /var/lib/rpm, the base packages' files under /usr and /boot). Everything is cached
under /tmp/ddp-el-sim-<hash of manifest, stubs and this file>; `up` only copies the base image into
each host's overlays, so it stays fast.

What the base image changes relative to this Debian machine, all inside the host's overlays:
  /etc   Rocky 9.6 os-release (a file, not Debian's symlink), redhat/rocky/system-release,
         dnf.conf as Rocky ships it, yum.repos.d with ONLY the local file:// repos, rpm macros
         (%_dbpath /var/lib/rpm, as on EL; Debian's rpm defaults to ~/.rpmdb), sysconfig/kernel
         (UPDATEDEFAULT=yes), ld.so.preload (the uname shim); Debian's debian_version and the
         Debian-only dnf plugin confs are hidden (overlay whiteouts).
  /usr   the shim, ddp-sim-reboot, and Debian's dnf plugins that EL's base install lacks are hidden
         (versionlock arrives with python3-dnf-plugin-versionlock, as on EL; local and
         post-transaction-actions are not installed on EL by default).

One manifest serves both identities (IDENTITIES): its packages, kernels, drivers and toolkits carry an
`os` list where they exist for one only, @EL@ and @DIST@ stand for 9/10 and el9/el10. Rocky 10.1 has no
module streams (NVIDIA's rhel10 repository has no modules.yaml: the roles lock the branch with
versionlock, branchlock-RedHat.yml), and its rpmdb holds an OpenPGP v6 key, as RHEL 10.1's does.
"""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import stat
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.yml"
STUBS = HERE / "stubs"
CACHE_ROOT = Path(os.environ.get("DDP_EL_SIM_CACHE", "/tmp"))
SIM_DIR = "/var/lib/ddp-sim"
OVERLAY_DIRS = ("/etc", "/usr", "/var", "/boot")
CUDA_REPO = "cuda-rhel9-x86_64"  # the rocky9 identity's; Identity.cuda_repo

# Rocky Linux 9.6's /usr/lib/os-release and release files, as shipped by rocky-release-9.6-1.2.el9
# (https://git.resf.org/sig_core/rocky-release, branch r9; the same text `cat /etc/os-release`
# prints on a Rocky 9.6 host).
OS_RELEASE = """NAME="Rocky Linux"
VERSION="9.6 (Blue Onyx)"
ID="rocky"
ID_LIKE="rhel centos fedora"
VERSION_ID="9.6"
PLATFORM_ID="platform:el9"
PRETTY_NAME="Rocky Linux 9.6 (Blue Onyx)"
ANSI_COLOR="0;32"
LOGO="fedora-logo-icon"
CPE_NAME="cpe:/o:rocky:rocky:9::baseos"
HOME_URL="https://rockylinux.org/"
VENDOR_NAME="RESF"
VENDOR_URL="https://resf.org/"
BUG_REPORT_URL="https://bugs.rockylinux.org/"
SUPPORT_END="2032-05-31"
ROCKY_SUPPORT_PRODUCT="Rocky-Linux-9"
ROCKY_SUPPORT_PRODUCT_VERSION="9.6"
REDHAT_SUPPORT_PRODUCT="Rocky Linux"
REDHAT_SUPPORT_PRODUCT_VERSION="9.6"
"""
RELEASE_LINE = "Rocky Linux release 9.6 (Blue Onyx)\n"
# Rocky Linux 10.1's (released 2025-11; 10.x is "Red Quartz", end of life 2035-05-31): Rocky 9.6's fields
# with 10.1's values, not compared line by line against a 10.1 host's file.
OS_RELEASE_10 = """NAME="Rocky Linux"
VERSION="10.1 (Red Quartz)"
ID="rocky"
ID_LIKE="rhel centos fedora"
VERSION_ID="10.1"
PLATFORM_ID="platform:el10"
PRETTY_NAME="Rocky Linux 10.1 (Red Quartz)"
ANSI_COLOR="0;32"
LOGO="fedora-logo-icon"
CPE_NAME="cpe:/o:rocky:rocky:10::baseos"
HOME_URL="https://rockylinux.org/"
VENDOR_NAME="RESF"
VENDOR_URL="https://resf.org/"
BUG_REPORT_URL="https://bugs.rockylinux.org/"
SUPPORT_END="2035-05-31"
ROCKY_SUPPORT_PRODUCT="Rocky-Linux-10"
ROCKY_SUPPORT_PRODUCT_VERSION="10.1"
REDHAT_SUPPORT_PRODUCT="Rocky Linux"
REDHAT_SUPPORT_PRODUCT_VERSION="10.1"
"""
RELEASE_LINE_10 = "Rocky Linux release 10.1 (Red Quartz)\n"
# Rocky 9's /etc/dnf/dnf.conf (dnf-4.14.0-*.el9 as built for EL9).
DNF_CONF = """[main]
gpgcheck=1
installonly_limit=3
clean_requirements_on_remove=True
best=True
skip_if_unavailable=False
"""
# EL9's /etc/sysconfig/kernel (written by anaconda): new kernels become the default.
SYSCONFIG_KERNEL = """# UPDATEDEFAULT specifies if kernel-install should make
# new kernels the default
UPDATEDEFAULT=yes

# DEFAULTKERNEL specifies the default kernel package type
DEFAULTKERNEL=kernel-core
"""
HIDE_ETC = (
    "debian_version",
    "lsb-release",
    "dnf/plugins/local.conf",
    "dnf/plugins/post-transaction-actions.conf",
    "dnf/plugins/versionlock.conf",
    "dnf/plugins/versionlock.list",
    "dnf/dnf-strict.conf",
    "dnf/automatic.conf",
)
DNF_PLUGINS = "lib/python3/dist-packages/dnf-plugins"
# Plugins Debian ships in dnf-plugins-core that EL9 packages separately (python3-dnf-plugin-*), not
# installed on a Rocky minimal host: versionlock comes with its package; the others stay hidden.
HIDE_USR = tuple(
    f"{DNF_PLUGINS}/{p}.py"
    for p in ("versionlock", "local", "post-transaction-actions", "leaves", "show_leaves", "modulesync")
) + ("include/python3.11",)  # the Python headers come with python3.11-devel / python3-devel (manifest)
UNAME_SHIM = "/usr/local/lib/ddp-sim/uname-booted-kernel.so"
REBOOT = "/usr/local/sbin/ddp-sim-reboot"


class SimError(RuntimeError):
    """The EL simulation could not be built."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """One simulated EL release: what /etc says, the dist tag, NVIDIA's repository layout for it."""

    os: str  # the testbed's --os
    major: str
    os_release: str
    release_line: str
    modular: bool  # NVIDIA's repository has the nvidia-driver module streams (EL9; EL10 has no modularity)
    v6_key: bool  # an OpenPGP v6 key in the rpmdb (RHEL 10.1's release key; ansible/ansible#86246)

    @property
    def dist(self) -> str:
        return f"el{self.major}"

    @property
    def cuda_repo(self) -> str:
        return f"cuda-rhel{self.major}-x86_64"


IDENTITIES = {
    "rocky9": Identity("rocky9", "9", OS_RELEASE, RELEASE_LINE, modular=True, v6_key=False),
    "rocky10": Identity("rocky10", "10", OS_RELEASE_10, RELEASE_LINE_10, modular=False, v6_key=True),
}


def identity(os_name: str) -> Identity:
    if os_name not in IDENTITIES:
        raise SimError(f"EL sim os must be one of {', '.join(IDENTITIES)}, got {os_name!r}")
    return IDENTITIES[os_name]


def openpgp_v6_key() -> str:
    """An armored OpenPGP v6 public key (RFC 9580: a version-6 Ed25519 key packet and a user ID), the
    version RHEL 10.1's release key has. gpg before 2.5 stops at it: "packet(6) with unknown version 6"."""

    def packet(tag: int, body: bytes) -> bytes:
        return bytes([0xC0 | tag, len(body)]) + body

    key = packet(6, bytes([6]) + struct.pack(">IBI", 1735689600, 27, 32) + bytes(range(32)))
    data = key + packet(13, b"ddp-sim stand-in for RHEL 10.1's v6 release key")
    crc = 0xB704CE
    for byte in data:
        crc ^= byte << 16
        for _ in range(8):
            crc = (crc << 1) ^ (0x1864CFB if crc & 0x800000 else 0)
    b64 = base64.b64encode(data).decode()
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    tail = base64.b64encode((crc & 0xFFFFFF).to_bytes(3, "big")).decode()
    return "\n".join(
        ["-----BEGIN PGP PUBLIC KEY BLOCK-----", "", *lines, f"={tail}", "-----END PGP PUBLIC KEY BLOCK-----"]
    )


def v6_key_spec() -> str:
    """The rpmdb entry `rpm --import` makes of a key, as a spec: package gpg-pubkey, version the key id,
    the armored key its description (a stand-in key id and release: the v6 key above is not RHEL's)."""
    return (
        "Name: gpg-pubkey\nVersion: 5a6340b3\nRelease: 6771b1f6\nSummary: v6 key\nLicense: pubkey\n"
        f"BuildArch: noarch\n%description\n{openpgp_v6_key()}\n%files\n"
    )


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        out = (res.stderr or res.stdout).strip()[-2000:]
        raise SimError(f"{shlex.join(map(str, cmd))} failed ({res.returncode}): {out}")
    return res


@dataclasses.dataclass(frozen=True)
class Pkg:
    name: str
    version: str
    release: str
    repo: str
    epoch: int = 0
    arch: str = "x86_64"
    base: bool = False
    requires: tuple = ()
    provides: tuple = ()
    conflicts: tuple = ()
    obsoletes: tuple = ()
    files: tuple = ()  # ((path, spec-dict), ...)
    dirs: tuple = ()
    config: tuple = ()
    scripts: tuple = ()  # ((name, body), ...)

    @property
    def nevra(self) -> str:
        return f"{self.name}-{self.epoch}:{self.version}-{self.release}.{self.arch}"

    @property
    def filename(self) -> str:
        return f"{self.name}-{self.version}-{self.release}.{self.arch}.rpm"


def _subst(obj, table: dict):
    if isinstance(obj, str):
        for k, v in table.items():
            obj = obj.replace(k, str(v))
        return obj
    if isinstance(obj, list):
        return [_subst(o, table) for o in obj]
    if isinstance(obj, dict):
        return {_subst(k, table): _subst(v, table) for k, v in obj.items()}
    return obj


def _pkg(d: dict, **defaults) -> Pkg:
    d = {**defaults, **d}
    return Pkg(
        name=d["name"],
        version=str(d["version"]),
        release=str(d["release"]),
        repo=d["repo"],
        epoch=int(d.get("epoch", 0)),
        arch=d.get("arch", "x86_64"),
        base=bool(d.get("base", False)),
        requires=tuple(d.get("requires", ())),
        provides=tuple(d.get("provides", ())),
        conflicts=tuple(d.get("conflicts", ())),
        obsoletes=tuple(d.get("obsoletes", ())),
        files=tuple((p, tuple(sorted(s.items()))) for p, s in (d.get("files") or {}).items()),
        dirs=tuple(d.get("dirs", ())),
        config=tuple(d.get("config", ())),
        scripts=tuple(sorted((d.get("scripts") or {}).items())),
    )


@dataclasses.dataclass
class Manifest:
    raw: dict
    ident: Identity
    packages: list[Pkg]
    modules: list[dict]  # modulemd documents
    installed_kernel: str
    newer_kernels: list[str]

    @classmethod
    def load(cls, path: Path = MANIFEST, os_name: str = "rocky9") -> Manifest:
        import yaml

        ident = identity(os_name)

        def mine(entries: list) -> list:
            return [e for e in entries if os_name in e.get("os", [os_name])]

        raw = _subst(yaml.safe_load(path.read_text()), {"@EL@": ident.major, "@DIST@": ident.dist})
        raw["repos"] = {rid: r for rid, r in raw["repos"].items() if os_name in r.get("os", [os_name])}
        pkgs = [_pkg(p) for p in mine(raw["packages"])]
        installed = ""
        newer = []
        precompiled_for = []  # (kernel uname -r, its kmod package suffix, dist tag)
        for k in mine(raw["kernels"]):
            krel = f"{k['version']}-{k['release']}.x86_64"
            table = {"@KREL@": krel, "@V@": k["version"], "@R@": k["release"]}
            for t in raw["kernel_packages"]:
                t = _subst(t, table)
                base = bool(k.get("installed")) and t["name"] in (
                    "kernel",
                    "kernel-core",
                    "kernel-modules-core",
                    "kernel-modules",
                )
                pkgs.append(_pkg(t, version=k["version"], release=k["release"], base=base))
            rel_base, _, dist = k["release"].rpartition(".")
            precompiled_for.append((krel, f"{k['version']}-{rel_base}", dist))
            if k.get("installed"):
                installed = krel
            else:
                newer.append(krel)
        modules = []
        mod = raw["nvidia_module"]
        drel = f"1.{ident.dist}"
        for drv in mine(raw["nvidia_drivers"]):
            v, b = drv["version"], drv["branch"]
            table = {"@V@": v, "@E@": 3, "@R@": drel, "@FABRIC@": drv["fabric"], "@B@": b}
            built = {}
            for t in raw["nvidia_packages"]:
                t = _subst(t, table)
                rel, epoch = t.get("release", drel), t.get("epoch", 3)
                p = _pkg(t, version=v, release=rel, epoch=epoch, repo=ident.cuda_repo)
                built[p.name] = p
                pkgs.append(p)
            if not ident.modular:  # no modules.yaml: no streams, and no precompiled kmods modelled
                continue
            # Precompiled streams (<branch>, latest): one kmod-nvidia-<driver>-<kernel> per kernel, built
            # against it (NVIDIA/yum-packaging-precompiled-kmod: kmod-nvidia-535.54.03-5.14.0-284.18.1,
            # version 535.54.03, release 3.el9_2).
            pre = []
            for krel, ksuffix, dist in precompiled_for:
                pk = _pkg(
                    {
                        "name": f"kmod-nvidia-{v}-{ksuffix}",
                        "requires": [f"kernel-core-uname-r = {krel}", f"nvidia-kmod-common = 3:{v}"],
                        "provides": [f"nvidia-kmod = 3:{v}"],
                    },
                    version=v,
                    release=f"3.{dist}",
                    epoch=3,
                    repo=ident.cuda_repo,
                )
                built[pk.name] = pk
                pkgs.append(pk)
                pre.append((krel, pk.name))
            for stream, sdef in mod["streams"].items():
                stream = stream.replace("@B@", b)
                kmods, kmod = [sdef["kmod"]], sdef["kmod"]
                if kmod == "precompiled":  # profiles: the running kernel's (NVIDIA's dnf plugin picks it)
                    kmods, kmod = [n for _, n in pre], next(n for k, n in pre if k == installed)
                names = [
                    "nvidia-kmod-common",
                    *kmods,
                    "nvidia-driver-libs",
                    "nvidia-driver",
                    "nvidia-driver-cuda-libs",
                    "nvidia-driver-cuda",
                    "nvidia-persistenced",
                    "nvidia-modprobe",
                    "nvidia-settings",
                    "libnvidia-nscq",
                    drv["fabric"],
                    *("libnvidia-ml", "libnvidia-cfg", "libnvidia-gpucomp", "libnvidia-fbc"),
                    *("libnvsdm", "nvidia-imex", "nvlink5"),
                ]
                if kmod == "kmod-nvidia-open-dkms":
                    names.append("nvidia-open")
                profiles = {
                    pname: {"rpms": [_subst(x, {"@KMOD@": kmod, "@FABRIC@": drv["fabric"]}) for x in prpms]}
                    for pname, prpms in mod["profiles"].items()
                    if pname in sdef.get("profiles", mod["profiles"])
                }
                modules.append(
                    {
                        "document": "modulemd",
                        "version": 2,
                        "data": {
                            "name": "nvidia-driver",
                            "stream": stream,
                            "version": int(drv["module_version"]),
                            "context": "00000000",
                            "arch": "x86_64",
                            "summary": f"Nvidia driver for {stream} branch",
                            "description": f"This module provides the NVIDIA driver {v} ({stream}).",
                            "license": {"module": ["MIT"]},
                            "dependencies": [{"requires": {"platform": [ident.dist]}}],
                            "profiles": profiles,
                            "artifacts": {
                                "rpms": sorted(
                                    f"{built[n].name}-{built[n].epoch}:{built[n].version}-{built[n].release}.{built[n].arch}"
                                    for n in names
                                )
                            },
                        },
                    }
                )
        if modules and mod.get("default_stream"):
            streams = sorted({m["data"]["stream"] for m in modules})
            modules.append(
                {
                    "document": "modulemd-defaults",
                    "version": 1,
                    "data": {
                        "module": "nvidia-driver",
                        "stream": mod["default_stream"],
                        "profiles": {st: ["default"] for st in streams},
                    },
                }
            )
        for tk in mine(raw["cuda_toolkits"]):
            xy = tk["xy"].replace(".", "-")
            pkgs.append(
                _pkg(
                    {
                        "name": f"cuda-nvcc-{xy}",
                        "files": {f"/usr/local/cuda-{tk['xy']}/bin/nvcc": {"nvcc": tk["nvcc"]}},
                    },
                    version=tk["version"],
                    release="1",
                    repo=ident.cuda_repo,
                )
            )
            pkgs.append(
                _pkg(
                    {"name": f"cuda-toolkit-{xy}", "requires": [f"cuda-nvcc-{xy} >= {tk['version']}"]},
                    version=tk["version"],
                    release="1",
                    repo=ident.cuda_repo,
                )
            )
        for n in mine(raw["nccl"]):
            rel = f"1+cuda{n['cuda']}"
            pkgs.append(
                _pkg(
                    {
                        "name": "libnccl",
                        "files": {
                            f"/usr/lib64/libnccl.so.{n['version']}": {
                                "text": f"ddp-sim stub NCCL {n['version']}+cuda{n['cuda']}\n"
                            },
                            "/usr/lib64/libnccl.so.2": {"symlink": f"libnccl.so.{n['version']}"},
                        },
                    },
                    version=n["version"],
                    release=rel,
                    repo=ident.cuda_repo,
                )
            )
            pkgs.append(
                _pkg(
                    {
                        "name": "libnccl-devel",
                        "requires": [f"libnccl = {n['version']}-{rel}"],
                        "files": {
                            "/usr/include/nccl.h": {"text": f"/* ddp-sim stub nccl.h {n['version']} */\n"},
                            "/usr/lib64/libnccl.so": {"symlink": "libnccl.so.2"},
                        },
                    },
                    version=n["version"],
                    release=rel,
                    repo=ident.cuda_repo,
                )
            )
        return cls(
            raw=raw,
            ident=ident,
            packages=pkgs,
            modules=modules,
            installed_kernel=installed,
            newer_kernels=newer,
        )


def cache_key() -> str:
    h = hashlib.sha256()
    for p in [MANIFEST, Path(__file__), *sorted(STUBS.iterdir())]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Cache:
    """A built simulation: repositories, the signing key and the base image."""

    root: Path
    os_name: str = "rocky9"

    @property
    def ident(self) -> Identity:
        return identity(self.os_name)

    @property
    def repos(self) -> Path:
        return self.root / "repos"

    def repo_url(self, repo: str) -> str:
        return f"file://{self.repos / repo}/"

    @property
    def info(self) -> dict:
        return json.loads((self.root / "info.json").read_text())

    @property
    def base(self) -> Path:
        return self.root / "base"


def build(force: bool = False, os_name: str = "rocky9") -> Cache:
    """Build (or reuse) one identity's cache for the current manifest; safe against concurrent callers."""
    identity(os_name)
    name = f"ddp-el-sim-{cache_key()}" if os_name == "rocky9" else f"ddp-el-sim-{os_name}-{cache_key()}"
    root = CACHE_ROOT / name
    cache = Cache(root, os_name)
    if (root / "info.json").exists() and not force:
        return cache
    with open(CACHE_ROOT / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (root / "info.json").exists() and not force:
            return cache
        if not Path("/boot").is_dir():
            raise SimError("/boot is missing: the EL sim overlays it (and never writes to it)")
        for tool in ("rpmbuild", "rpmsign", "createrepo_c", "modifyrepo_c", "dnf", "gpg", "gcc"):
            if shutil.which(tool) is None:
                raise SimError(
                    f"'{tool}' not found: bash .ci/setup --with-testbed installs the EL sim's tools"
                )
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        try:
            _build_into(root, os_name)  # info.json, written last, marks the cache complete
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return cache


# ---- RPMs -------------------------------------------------------------------------------------
def _spec(p: Pkg, stage: Path) -> str:
    lines = [
        "%global __os_install_post %{nil}",
        "%global debug_package %{nil}",
        "%define _build_id_links none",
        f"Name: {p.name}",
        f"Version: {p.version}",
        f"Release: {p.release}",
        *([f"Epoch: {p.epoch}"] if p.epoch else []),
        f"Summary: ddp-sim stub of {p.name}",
        "License: stub",
        "AutoReqProv: no",
        *(["BuildArch: noarch"] if p.arch == "noarch" else []),
        *(f"Requires: {r}" for r in p.requires),
        *(f"Provides: {r}" for r in p.provides),
        *(f"Conflicts: {r}" for r in p.conflicts),
        *(f"Obsoletes: {r}" for r in p.obsoletes),
        "%description",
        f"ddp-sim stub of {p.name} for the EL simulation host (tests/testbed/el).",
        "%install",
        "mkdir -p %{buildroot}",
        f"cp -a {stage}/. %{{buildroot}}/",
        "%files",
    ]
    for path, _ in p.files:
        lines.append(f"%config(noreplace) {path}" if path in p.config else path)
    lines += [f"%dir {d}" for d in p.dirs]
    for name, body in p.scripts:
        lines += [f"%{name}", body.rstrip("\n")]
    return "\n".join(lines) + "\n"


def _stage(p: Pkg, stage: Path, repo_urls: dict) -> None:
    stage.mkdir(parents=True)
    for path, spec in p.files:
        s = dict(spec)
        dst = stage / path.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if "symlink" in s:
            dst.symlink_to(s["symlink"])
            continue
        if "host_tree" in s:  # a directory of this machine's, whole (%files lists it: recursive)
            shutil.copytree(s["host_tree"], dst, symlinks=True)
            continue
        if "stub" in s:
            content = (STUBS / s["stub"]).read_text().replace("@V@", p.version)
            mode = 0o755
        elif "nvcc" in s:
            content = (
                "#!/bin/sh\n# ddp-sim stub of nvcc: only --version/-V\ncat <<'EOF'\n" + s["nvcc"] + "EOF\n"
            )
            mode = 0o755
        elif "host" in s:
            content = Path(s["host"]).read_text()
            mode = 0o644
        elif "repo_file" in s:
            content = _repo_file({s["repo_file"]: repo_urls[s["repo_file"]]})
            mode = 0o644
        else:
            content = s.get("text", "")
            mode = 0o644
        dst.write_text(content)
        dst.chmod(int(s["mode"], 8) if "mode" in s else mode)
    for d in p.dirs:
        (stage / d.lstrip("/")).mkdir(parents=True, exist_ok=True)


def _rpmbuild(p: Pkg, work: Path, out: Path, repo_urls: dict) -> Path:
    d = work / f"{p.name}-{p.version}-{p.release}"
    stage = d / "stage"
    _stage(p, stage, repo_urls)
    spec = d / f"{p.name}.spec"
    spec.write_text(_spec(p, stage))
    _run(
        "rpmbuild",
        "-bb",
        "--quiet",
        "--define",
        f"_topdir {d / 'top'}",
        "--define",
        f"_rpmdir {d / 'rpms'}",
        "--target",
        p.arch,
        spec,
    )
    built = d / "rpms" / p.arch / p.filename
    if not built.exists():
        raise SimError(f"rpmbuild did not produce {built}")
    dest = out / p.repo / "Packages" / p.filename
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(built, dest)
    return dest


def _repo_file(repos: dict, file_name: str | None = None) -> str:
    """The .repo text for {repo_id: (definition, url)}."""
    out = []
    for rid, (rdef, url) in repos.items():
        gpg = int(rdef.get("gpgcheck", 0))
        out.append(
            f"[{rid}]\nname={rdef['name']}\nbaseurl={url}\nenabled={rdef['enabled']}\ngpgcheck={gpg}\n"
            + (f"gpgkey={rdef['gpgkey']}\n" if gpg and rdef.get("gpgkey") else "")
            + "metadata_expire=-1\n"
        )
    return "\n".join(out)


def _gpg_key(home: Path) -> str:
    home.mkdir(mode=0o700)
    env = {**os.environ, "GNUPGHOME": str(home)}
    _run(
        "gpg",
        "--batch",
        "--passphrase",
        "",
        "--quick-gen-key",
        "ddp-sim cuda-rhel9 repository <ddp-sim@localhost>",
        "rsa3072",
        "sign",
        "never",
        env=env,
    )
    out = _run("gpg", "--batch", "--with-colons", "--list-keys", env=env).stdout
    return next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))


def _build_into(root: Path, os_name: str) -> None:
    import yaml

    man = Manifest.load(os_name=os_name)
    cuda_repo = man.ident.cuda_repo
    repos_dir = root / "repos"
    repo_urls = {rid: (rdef, f"file://{root / 'repos' / rid}/") for rid, rdef in man.raw["repos"].items()}

    fpr = _gpg_key(root / "gnupg")
    keyname = f"{fpr[-8:]}.pub"
    work = root / "work"
    with ThreadPoolExecutor(max_workers=2) as ex:
        rpms = list(ex.map(lambda p: _rpmbuild(p, work, repos_dir, repo_urls), man.packages))
    env = {**os.environ, "GNUPGHOME": str(root / "gnupg")}
    _run(
        "rpmsign",
        "--addsign",
        "--define",
        f"_gpg_name {fpr}",
        "--define",
        f"_gpg_path {root / 'gnupg'}",
        "--define",
        "__gpg /usr/bin/gpg",
        *rpms,
        env=env,
    )
    for rid in man.raw["repos"]:
        rdir = repos_dir / rid
        (rdir / "Packages").mkdir(parents=True, exist_ok=True)
        _run("createrepo_c", "--quiet", "--no-database", rdir)
    cuda = repos_dir / cuda_repo
    if man.modules:
        mods = cuda / "modules.yaml"
        mods.write_text(
            yaml.safe_dump_all(man.modules, sort_keys=False, explicit_start=True, explicit_end=True)
        )
        _run("modifyrepo_c", "--mdtype=modules", mods, cuda / "repodata")
    _run("gpg", "--batch", "--yes", "--armor", "--export", "--output", cuda / keyname, fpr, env=env)
    _run(
        "gpg",
        "--batch",
        "--yes",
        "--armor",
        "--detach-sign",
        "--output",
        cuda / "repodata" / "repomd.xml.asc",
        cuda / "repodata" / "repomd.xml",
        env=env,
    )
    shutil.rmtree(work)

    lib = root / "lib"
    lib.mkdir()
    _run(
        "gcc",
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-o",
        lib / "uname-booted-kernel.so",
        STUBS / "uname-booted-kernel.c",
    )

    info = {
        "installed_kernel": man.installed_kernel,
        "newer_kernels": man.newer_kernels,
        "os": os_name,
        "cuda_repo": cuda_repo,
        "cuda_repo_baseurl": f"file://{root / 'repos' / cuda_repo}/",
        "cuda_repo_gpgkey_url": f"file://{root / 'repos' / cuda_repo / keyname}",
        "cuda_repo_gpgkey_fingerprint": fpr,
        "base_packages": sorted(f"{p.name}-{p.version}-{p.release}" for p in man.packages if p.base),
        "packages": sorted(f"{p.repo}/{p.nevra}" for p in man.packages),
    }
    if man.ident.v6_key:
        top = root / "v6key"
        (top / "SPECS").mkdir(parents=True)
        (top / "SPECS" / "gpg-pubkey.spec").write_text(v6_key_spec())
        _run("rpmbuild", "-bb", "--quiet", "--define", f"_topdir {top}", top / "SPECS" / "gpg-pubkey.spec")
        (rpm,) = (top / "RPMS" / "noarch").glob("gpg-pubkey-*.rpm")
        info["v6_key_rpm"] = str(rpm)
    _build_base_image(root, man, repo_urls, lib / "uname-booted-kernel.so", info)
    (root / "info.json").write_text(json.dumps(info, indent=1))


# ---- the base image ---------------------------------------------------------------------------
def _whiteout(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    path.write_text(text)
    path.chmod(mode)


def _rocky_repos(repo_urls: dict) -> dict[str, str]:
    files: dict[str, dict] = {}
    for rid, (rdef, url) in repo_urls.items():
        if rdef.get("by_package") or rdef.get("by_role"):
            continue
        files.setdefault(rdef["file"], {})[rid] = (rdef, url)
    return {name: _repo_file(repos) for name, repos in files.items()}


def _build_base_image(root: Path, man: Manifest, repo_urls: dict, shim: Path, info: dict) -> None:
    base = root / "base"
    up = {d: base / d.strip("/") / "upper" for d in OVERLAY_DIRS}
    for d in OVERLAY_DIRS:
        up[d].mkdir(parents=True)
        (base / d.strip("/") / "work").mkdir()
    etc, usr = up["/etc"], up["/usr"]
    ident = man.ident
    _write(etc / "os-release", ident.os_release)
    _write(usr / "lib/os-release", ident.os_release)
    for f in ("redhat-release", "rocky-release", "system-release"):
        _write(etc / f, ident.release_line)
    _write(etc / "dnf/dnf.conf", DNF_CONF)
    for name, text in _rocky_repos(repo_urls).items():
        _write(etc / "yum.repos.d" / name, text)
    _write(
        etc / "rpm/macros.ddp-sim",
        "# ddp-sim: EL's rpmdb location (Debian's rpm defaults to ~/.rpmdb)\n%_dbpath /var/lib/rpm\n",
    )
    _write(etc / "sysconfig/kernel", SYSCONFIG_KERNEL)
    _write(etc / "machine-id", "ddpsim0000000000000000000000000\n")
    for h in HIDE_ETC:
        if Path("/etc", h).exists() or Path("/etc", h).is_symlink():
            _whiteout(etc / h)
    for h in HIDE_USR:
        if Path("/usr", h).exists():
            _whiteout(usr / h)
    # Debian's python3-apt: an EL host has none, and with it package_facts' `auto` picks apt (listed
    # before rpm) and reports the Debian packages instead of the rpmdb.
    for h in Path("/usr/lib/python3/dist-packages").glob("apt*"):
        _whiteout(usr / h.relative_to("/usr"))
    (usr / "local/lib/ddp-sim").mkdir(parents=True)
    shutil.copy(shim, usr / UNAME_SHIM.removeprefix("/usr/"))
    _write(usr / REBOOT.removeprefix("/usr/"), (STUBS / "ddp-sim-reboot").read_text(), 0o755)
    (up["/var"] / "lib/rpm").mkdir(parents=True)
    (up["/var"] / "lib/ddp-sim").mkdir(parents=True)

    work = {d: base / d.strip("/") / "work" for d in OVERLAY_DIRS}
    mounts = [
        f"mount -t overlay overlay -o lowerdir={d},upperdir={up[d]},workdir={work[d]} {d}"
        for d in OVERLAY_DIRS
    ]
    script = "\n".join(
        [
            "set -e",
            *mounts,
            "mount -t tmpfs -o mode=755 tmpfs /run",
            "rpm --initdb",
            f"dnf -q -y --releasever={ident.major} --setopt=install_weak_deps=False install "
            + " ".join(info["base_packages"]),
            # RHEL 10.1's release key is OpenPGP v6, in the rpmdb from the install on (as `rpm --import`
            # would put it): what ansible's rpm_key cannot list (ansible/ansible#86246).
            *([f"rpm -i --nodeps {shlex.quote(info['v6_key_rpm'])}"] if ident.v6_key else []),
            "dnf -q -y makecache",
            f"echo {man.installed_kernel} > {SIM_DIR}/booted-kernel",
            f"echo {UNAME_SHIM} > /etc/ld.so.preload",
            "rm -rf /var/log/ddp-sim /var/log/dnf*.log /var/log/hawkey.log",
            'test "$(grubby --default-kernel)" = /boot/vmlinuz-' + man.installed_kernel,
        ]
    )
    _run("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script)
    for d in OVERLAY_DIRS:
        shutil.rmtree(base / d.strip("/") / "work")


# ---- per host ---------------------------------------------------------------------------------
GPU_MODELS = {  # PCI device id, nvidia-smi name
    "h100": ("0x2330", "NVIDIA H100 80GB HBM3"),
    "h200": ("0x2335", "NVIDIA H200"),
}
# Bus addresses of the eight SXM GPUs and four NVSwitches of a DGX/HGX H100 (DGX H100 user guide).
GPU_SLOTS = (
    "0000:1b:00.0",
    "0000:43:00.0",
    "0000:52:00.0",
    "0000:61:00.0",
    "0000:9d:00.0",
    "0000:c3:00.0",
    "0000:d1:00.0",
    "0000:df:00.0",
)
NVSWITCH_SLOTS = ("0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0")


def populate_host(
    cache: Cache,
    host_dir: Path,
    hostname: str,
    gpus: int = 8,
    nvswitch: bool = False,
    gpu_model: str = "h100",
) -> None:
    """Copy the base image into one host's overlay upper dirs and add its simulated hardware."""
    if not 0 <= gpus <= len(GPU_SLOTS):
        raise SimError(f"gpus must be 0..{len(GPU_SLOTS)}, got {gpus}")
    if gpu_model not in GPU_MODELS:
        raise SimError(f"gpu_model must be one of {', '.join(GPU_MODELS)}, got {gpu_model!r}")
    for d in OVERLAY_DIRS:
        tag = d.strip("/")
        upper = host_dir / "ovl" / tag / "upper"
        upper.mkdir(parents=True, exist_ok=True)
        _run("cp", "-a", f"{cache.base / tag / 'upper'}/.", f"{upper}/")
    sim = host_dir / "ovl" / "var" / "upper" / SIM_DIR.removeprefix("/var/")
    (sim / "boot_id").write_text(hashlib.md5(f"{hostname}-boot0".encode()).hexdigest() + "\n")
    devid, name = GPU_MODELS[gpu_model]
    devs = [(s, "0x10de", "0x030200", devid) for s in GPU_SLOTS[:gpus]]
    if nvswitch:
        devs += [(s, "0x10de", "0x068000", "0x22a3") for s in NVSWITCH_SLOTS]
    devs.append(("0000:29:00.0", "0x8086", "0x020000", "0x159b"))  # Intel E810 NIC: not NVIDIA
    for slot, vendor, cls, dev in devs:
        d = sim / "pci" / "devices" / slot
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        (d / "device").write_text(dev + "\n")
    (sim / "hw").mkdir()
    for slot in GPU_SLOTS[:gpus]:
        u = hashlib.sha1(f"{hostname}/{slot}".encode()).hexdigest()
        (sim / "hw" / slot).write_text(f"{name}\nGPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:32]}\n")


def inventory_vars(cache: Cache) -> dict:
    info = cache.info
    return {
        "ddp_testbed_os": cache.os_name,
        "gpu_facts_pci_devices_dir": f"{SIM_DIR}/pci/devices",
        "gpu_facts_proc_driver_dir": f"{SIM_DIR}/proc/driver/nvidia",
        "nvidia_driver_reboot_command": REBOOT,
        "nvidia_driver_boot_time_command": f"cat {SIM_DIR}/boot_id",
        "cuda_repo_baseurl": info["cuda_repo_baseurl"],
        "cuda_repo_gpgkey_url": info["cuda_repo_gpgkey_url"],
        "cuda_repo_gpgkey_fingerprint": info["cuda_repo_gpgkey_fingerprint"],
    }


def cuda_repo_file(cache: Cache) -> str:
    """NVIDIA's cuda-rhel<N>.repo, pointing at the local copy (what the cuda_repo role writes)."""
    info = cache.info
    repo = cache.ident.cuda_repo
    return (
        f"[{repo}]\nname={repo}\nbaseurl={info['cuda_repo_baseurl']}\nenabled=1\ngpgcheck=1\n"
        f"gpgkey={info['cuda_repo_gpgkey_url']}\n"
    )
