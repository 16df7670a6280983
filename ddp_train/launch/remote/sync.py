"""`--sync DIR`: ship a project directory to every node, into a per-content directory under ddp_workdir.

The directory is scanned here (`.gitignore`-style excludes, a size limit) and named by the hash of its
content: `<ddp_workdir>/.ddp-launch/sync/<digest>`. A node that already has that directory gets
nothing; otherwise only the files that differ from the node's newest earlier copy are sent, with rsync
over the launcher's own SSH settings (same known_hosts, host keys checked) when both ends have it, else
as a tar archive over the existing Fabric connection. Each copy is built in a temporary directory,
checked against the digest on the node and renamed into place, so a half-sent copy is never used.
Local nodes run from DIR itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_train.launch.errors import LaunchError, one_line
from ddp_train.launch.node import command, marked_json, tree
from ddp_train.launch.node.sync import DONE_MARK, INSPECT_MARK
from ddp_train.launch.plan.inventory import Node, SshTarget
from ddp_train.storage import size_text

if TYPE_CHECKING:
    from ddp_train.launch.remote.remote import Session

SYNC_DIR = ".ddp-launch/sync"  # under the node's ddp_workdir
DEFAULT_MAX_BYTES = 1 << 30
MANIFEST_NAME = tree.MANIFEST  # in each copy: its files, for the next sync and for preflight
ALWAYS_EXCLUDED = (".git/", "__pycache__/", "*.pyc", "/.ddp-launch/", f"/{MANIFEST_NAME}")
IGNORE_FILE, ROOT_IGNORE_FILE = ".gitignore", ".ddpignore"
SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The scanned content of a --sync directory."""

    root: str  # absolute local path
    entries: dict  # path -> [kind, exec, size, sha256]
    digest: str

    @property
    def name(self) -> str:
        """The per-content directory name on the nodes."""
        return self.digest[:20]

    @property
    def total_bytes(self) -> int:
        return sum(e[2] for e in self.entries.values())


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """What one node got: files and bytes sent (0, 0 when it was up to date) and how."""

    node: str
    via: str  # up-to-date | rsync | archive
    files: int
    bytes: int
    note: str = ""  # why auto fell back to the archive

    def line(self, where: str) -> str:
        if self.via == "up-to-date":
            return f"sync: {self.node}: up to date ({where}), 0 files, 0 bytes sent"
        extra = f" ({self.note})" if self.note else ""
        sent = f"{self.files} file(s), {self.bytes} bytes sent via {self.via}"
        return f"sync: {self.node}: {sent}{extra} -> {where}"


class SyncError(Exception):
    """A node could not receive the directory; one line naming the node."""


# ---- scanning -----------------------------------------------------------------------------------


def parse_size(text: str, where: str) -> int:
    """'500M', '2G', '1.5GiB', '1000' (bytes) -> bytes; LaunchError naming `where` otherwise."""
    m = SIZE.match(str(text).strip())
    if not m:
        raise LaunchError(f"{where} {text!r}: expected a size like 500M or 2G")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _glob_regex(pattern: str) -> str:
    """One gitignore glob (without its leading '/' or trailing '/') as a regex over '/'-separated paths."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in pattern[i + 2 :]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append(f"[^{body[1:]}]" if body.startswith("!") else f"[{body}]")
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


class Excludes:
    """gitignore semantics: every `.gitignore` applies below its directory, `.ddpignore` and the
    extra patterns at the root; the last matching rule wins, `!` re-includes, `dir/` matches dirs only."""

    def __init__(self, root: str, extra: Sequence[str] = ()) -> None:
        self.root = root
        self.rules: list[tuple[str, re.Pattern, bool, bool]] = []
        self.loaded: set[str] = set()
        for p in (*ALWAYS_EXCLUDED, *self._read(ROOT_IGNORE_FILE), *extra):
            self._add("", p)

    def _read(self, rel: str) -> list[str]:
        try:
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="surrogateescape") as f:
                return f.read().splitlines()
        except OSError:
            return []

    def _add(self, base: str, line: str) -> None:
        line = line.rstrip("\r")
        if not line.strip() or line.startswith("#"):
            return
        if not line.endswith("\\ "):
            line = line.rstrip(" ")
        negate = line.startswith("!")
        line = line[1:] if negate else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            return
        anchored = "/" in line
        body = _glob_regex(line.lstrip("/"))
        regex = re.compile(("" if anchored else "(?:.*/)?") + body)
        self.rules.append((base, regex, negate, dir_only))

    def _load(self, rel_dir: str) -> None:
        if rel_dir in self.loaded:
            return
        self.loaded.add(rel_dir)
        if rel_dir:
            self._load(rel_dir.rsplit("/", 1)[0] if "/" in rel_dir else "")
        for line in self._read(f"{rel_dir}/{IGNORE_FILE}" if rel_dir else IGNORE_FILE):
            self._add(f"{rel_dir}/" if rel_dir else "", line)

    def excluded(self, rel: str, is_dir: bool) -> bool:
        """The walk asks top-down and never enters an excluded directory, as git does."""
        self._load(rel.rsplit("/", 1)[0] if "/" in rel else "")
        hit = False
        for base, regex, negate, dir_only in self.rules:
            if rel.startswith(base) and (is_dir or not dir_only) and regex.fullmatch(rel[len(base) :]):
                hit = not negate
        return hit


def scan(directory: str, exclude: Sequence[str] = (), max_bytes: int = DEFAULT_MAX_BYTES) -> Manifest:
    """List, size-check and hash the directory to sync; LaunchError (one line) if it is bad or too big."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise LaunchError(f"--sync {directory}: not a directory")
    root_s = str(root.resolve())
    rules = Excludes(root_s, exclude)
    try:
        items = tree.walk(root_s, rules.excluded)
    except OSError as e:
        raise LaunchError(f"--sync {directory}: cannot read {e.filename}: {e.strerror}") from None
    if not items:
        raise LaunchError(f"--sync {directory}: no files to sync (all excluded?)")
    total = sum(size for *_, size in items)
    if total > max_bytes:
        per_top: dict[str, int] = {}
        for rel, _, _, _, size in items:
            top, sep, _ = rel.partition("/")
            per_top[top + ("/" if sep else "")] = per_top.get(top + ("/" if sep else ""), 0) + size
        biggest = sorted(per_top.items(), key=lambda kv: -kv[1])[:3]
        raise LaunchError(
            f"--sync {directory}: {size_text(total)} is over the {size_text(max_bytes)} limit; biggest: "
            + ", ".join(f"{k} {size_text(v)}" for k, v in biggest)
            + f" (exclude them in {IGNORE_FILE}/{ROOT_IGNORE_FILE} or --sync-exclude,"
            " or raise --sync-max-size)"
        )
    try:
        entries, digest = tree.tree(items)
    except OSError as e:
        raise LaunchError(f"--sync {directory}: cannot read {e.filename}: {e.strerror}") from None
    return Manifest(root=root_s, entries=entries, digest=digest)


def remote_dir(node: Node, manifest: Manifest) -> str:
    """The node's copy: <ddp_workdir>/.ddp-launch/sync/<digest> (local nodes use the directory itself)."""
    if node.local or node.ssh is None:
        return manifest.root
    base = f"{node.workdir.rstrip('/')}/{SYNC_DIR}" if node.workdir else SYNC_DIR
    return f"{base}/{manifest.name}"


# ---- shipping -----------------------------------------------------------------------------------


def ssh_command(target: SshTarget, connect_timeout: float) -> list[str]:
    """The OpenSSH command line with the launcher's settings: same user, port, keys, known_hosts."""
    from ddp_train.launch.remote.remote import known_hosts_files

    known = " ".join(f'"{f}"' if " " in f else f for f in known_hosts_files(target))
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known}", "-o", f"ConnectTimeout={max(1, round(connect_timeout))}",
            "-p", str(target.port)]  # fmt: skip
    if target.user:
        argv += ["-l", target.user]
    for key in target.key_files:
        argv += ["-i", key]
    if target.key_files:
        argv += ["-o", "IdentitiesOnly=yes"]
    for opt, value in (("HostKeyAlias", target.host_key_alias), ("ProxyCommand", target.proxy_command),
                       ("ProxyJump", target.proxy_jump)):  # fmt: skip
        if value:
            argv += ["-o", f"{opt}={value}"]
    return argv


def sync_node(
    session: Session, node: Node, manifest: Manifest, via: str = "auto", connect_timeout: float = 10
) -> SyncResult:
    """Bring `manifest` to one remote node; SyncError with one line if it cannot."""
    from ddp_train.launch.remote.remote import RemoteError

    where = remote_dir(node, manifest)
    base = where.rsplit("/", 1)[0]
    try:
        state = _json_line(
            session, command(node.venv, "sync", "inspect", base, manifest.name, manifest.digest), INSPECT_MARK
        )
        if state["present"]:
            return SyncResult(node.name, "up-to-date", 0, 0)
        tmp = f"{manifest.name}.tmp-{os.getpid()}-{os.urandom(3).hex()}"
        note = ""
        if via != "archive":
            why = _rsync_unusable(node, state)
            if why and via == "rsync":
                raise SyncError(f"{node.name}: --sync-via rsync: {why}")
            if not why:
                try:
                    files, sent = _rsync(node, manifest, base, tmp, state.get("prev"), connect_timeout)
                    _finish(session, node, manifest, base, tmp)
                    return SyncResult(node.name, "rsync", files, sent)
                except SyncError as e:
                    if via == "rsync":
                        raise
                    session.exec(shlex.join(["rm", "-rf", "--", f"{base}/{tmp}"]))
                    why = str(e).split(": ", 1)[-1]
            note = f"rsync: {why}" if via == "auto" else ""
        files, sent = _archive(session, node, manifest, base, tmp, state)
        return SyncResult(node.name, "archive", files, sent, note)
    except RemoteError as e:
        raise SyncError(str(e)) from None


def _json_line(session: Session, cmd: str, mark: str) -> dict:
    code, out = session.exec(cmd, timeout=300)
    try:
        found = marked_json(out, mark)
    except ValueError:
        found = None
    if code != 0 or not isinstance(found, dict):
        last = out.strip().splitlines()[-1] if out.strip() else f"exit {code}"
        raise SyncError(f"{session.node.name}: {one_line(last)}")
    return found


def _rsync_unusable(node: Node, state: dict) -> str | None:
    if shutil.which("rsync") is None:
        return "not installed on this machine"
    if not state.get("rsync"):
        return "not installed on the node"
    assert node.ssh is not None
    if node.ssh.password:
        return "password authentication (rsync runs ssh in batch mode)"
    return None


def _rsync(
    node: Node, manifest: Manifest, base: str, tmp: str, prev: str | None, timeout: float
) -> tuple[int, int]:
    """rsync the listed files into base/tmp; hard links to the earlier copy for unchanged files."""
    assert node.ssh is not None
    host = f"[{node.ssh.host}]" if ":" in node.ssh.host else node.ssh.host
    argv = ["rsync", "-a", "--protect-args", "--from0", "--files-from=-", "--stats", "--timeout=120",
            "-e", shlex.join(ssh_command(node.ssh, timeout))]  # fmt: skip
    if prev:
        argv.append(f"--link-dest=../{prev}")
    argv += [f"{manifest.root}/", f"{host}:{base}/{tmp}/"]
    listing = "\0".join(manifest.entries).encode("utf-8", "surrogateescape") + b"\0"
    try:
        res = subprocess.run(argv, input=listing, capture_output=True, timeout=3600)
    except subprocess.TimeoutExpired:
        raise SyncError(f"{node.name}: rsync timed out") from None
    out = res.stdout.decode("utf-8", "replace")
    if res.returncode != 0:
        err = res.stderr.decode("utf-8", "replace").strip().splitlines()
        raise SyncError(f"{node.name}: rsync exited {res.returncode}: {one_line(err[0] if err else '')}")
    return _stat(out, "Number of regular files transferred"), _stat(out, "Total bytes sent")


def _stat(stats: str, label: str) -> int:
    m = re.search(rf"^{label}: ([\d,.]+)", stats, re.M)
    return int(re.sub(r"\D", "", m.group(1))) if m else 0


def _archive(
    session: Session, node: Node, manifest: Manifest, base: str, tmp: str, state: dict
) -> tuple[int, int]:
    """tar the files that differ from the node's earlier copy, send it over the session, unpack there."""
    prev, old = state.get("prev") or "", state.get("prev_entries") or {}
    keep = [rel for rel, e in manifest.entries.items() if prev and old.get(rel) == e]
    changed = [rel for rel in manifest.entries if rel not in set(keep)]
    remote_tar, sent = "", 0
    if changed:
        with tempfile.TemporaryDirectory(prefix="ddp-sync-") as td:
            local_tar = os.path.join(td, "sync.tar.gz")
            with tarfile.open(local_tar, "w:gz", compresslevel=1) as t:
                for rel in changed:
                    t.add(os.path.join(manifest.root, rel), arcname=rel, recursive=False)
            sent = os.path.getsize(local_tar)
            remote_tar = f"{base}/{tmp}.tar.gz"
            session.put(local_tar, remote_tar)
    cmd = command(node.venv, "sync", "unpack", base, f"{base}/{tmp}", remote_tar, prev, json.dumps(keep))
    code, out = session.exec(cmd, timeout=600)
    if code != 0:
        session.exec(shlex.join(["rm", "-rf", "--", f"{base}/{tmp}", *([remote_tar] if remote_tar else [])]))
        last = out.strip().splitlines()[-1] if out.strip() else f"exit {code}"
        raise SyncError(f"{node.name}: unpacking failed: {one_line(last)}")
    _finish(session, node, manifest, base, tmp)
    return len(changed), sent


def _finish(session: Session, node: Node, manifest: Manifest, base: str, tmp: str) -> None:
    code, out = session.exec(
        command(node.venv, "sync", "finish", base, manifest.name, f"{base}/{tmp}", manifest.digest),
        timeout=600,
    )
    if code != 0 or DONE_MARK not in out:
        last = out.strip().splitlines()[-1] if out.strip() else f"exit {code}"
        raise SyncError(f"{node.name}: {one_line(last)}")
