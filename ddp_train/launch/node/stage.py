"""`ddp-launch stage` on a node: which files it lacks, and receiving them, from the controller (`recv`,
over the SSH channel's stdin) or from another node (`serve` / `pull`, plain TCP on the training network).

    stage inspect DEST [CIDR]   stdin: {rel: [size, sha256]}    -> DDP-STAGE {"need": {rel: partial}, ...}
    stage recv DEST             stdin: frames (a JSON header line, then the bytes)
    stage serve DEST ADDRESS    stdin: the token line, then {rel: [size, sha256]} (only those are served);
                                serves until stdin closes -> DDP-STAGE-SERVE {port}
    stage pull DEST HOST PORT   stdin: the token line, then {rel: [size, sha256]}

Every file is written to DEST/.ddp-stage/<sha256>.part, appended to where an earlier try stopped, checked
against its sha256 and renamed into place (os.replace: atomic on one filesystem); a part whose hash does
not come out right is started over once. DEST/.ddp-stage is this user's own (0700, no symlinks followed).
The token keeps other hosts on the network from reading DEST; `serve` hands out only the staged files.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from typing import Any, BinaryIO

MARK, FILE_MARK, SERVE_MARK, BYTES_MARK = (
    "DDP-STAGE ",
    "DDP-STAGE-FILE ",
    "DDP-STAGE-SERVE ",
    "DDP-STAGE-BYTES ",
)
PARTS = ".ddp-stage"
BLOCK = 1 << 20
REPORT_EVERY = 64 << 20  # bytes between progress lines
AUTH_TIMEOUT = 30.0  # seconds a `serve` client has to send the token and its request
LINE_MAX = 64 << 10  # bytes of a `serve` request line (the token, then {"rel", "offset"})


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def safe(dest: str, rel: str) -> str:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or ".." in parts or "" in parts or parts[0] == PARTS:
        raise SystemExit(f"unsafe path {rel!r}")
    return os.path.join(dest, *parts)


def part_path(dest: str, digest: str) -> str:
    return os.path.join(dest, PARTS, f"{digest}.part")


def have(dest: str, rel: str, size: int, digest: str) -> bool:
    path = safe(dest, rel)
    try:
        return os.path.isfile(path) and os.path.getsize(path) == size and sha256(path) == digest
    except OSError:
        return False


def training_address(cidr: str) -> str | None:
    """This node's address inside `cidr` (`ip -j addr`), None when it has none."""
    try:
        net = ipaddress.ip_network(cidr, strict=False)
        out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=20).stdout
        for link in json.loads(out or "[]"):
            for a in link.get("addr_info") or []:
                if "local" in a and ipaddress.ip_address(a["local"].split("%")[0]) in net:
                    return str(a["local"])
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return None


def inspect(dest: str, cidr: str, wanted: dict[str, list[Any]]) -> dict[str, Any]:
    need: dict[str, int] = {}
    for rel, (size, digest) in sorted(wanted.items()):
        if have(dest, rel, size, digest):
            continue
        try:
            partial = os.path.getsize(part_path(dest, digest))
        except OSError:
            partial = 0
        need[rel] = partial if partial <= size else 0
    os.makedirs(dest, exist_ok=True)
    r: dict[str, Any] = {"need": need, "free": shutil.disk_usage(dest).free}
    if cidr:
        r["address"] = training_address(cidr)
    return r


def finish(dest: str, rel: str, size: int, digest: str, got: str) -> bool:
    """Rename the part into place if its hash (`got`, taken as it was written) is right; else remove it."""
    part = part_path(dest, digest)
    if os.path.getsize(part) != size or got != digest:
        os.unlink(part)
        return False
    final = safe(dest, rel)
    os.makedirs(os.path.dirname(final) or ".", exist_ok=True)
    mask = os.umask(0o022)  # the part is 0600 in a 0700 directory; the file gets the mode open() gives
    os.umask(mask)
    os.chmod(part, 0o666 & ~mask)
    os.replace(part, final)
    return True


def _parts_dir(dest: str) -> None:
    """DEST/.ddp-stage, created 0700; refused when it is a symlink or another user's (DEST may be shared)."""
    parts = os.path.join(dest, PARTS)
    os.makedirs(dest, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(parts, 0o700)
    st = os.lstat(parts)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SystemExit(f"stage: {parts} is not a directory (a symbolic link?); remove it")
    if st.st_uid != os.getuid():
        raise SystemExit(f"stage: {parts} belongs to user id {st.st_uid}, not to this user; remove it")


def _open_part(dest: str, digest: str, offset: int) -> tuple[BinaryIO, Any]:
    """The part, cut to `offset` and positioned there, and the sha256 of what it holds up to there."""
    _parts_dir(dest)
    path = part_path(dest, digest)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:  # ELOOP: the part is a symbolic link
        raise SystemExit(f"stage: {path}: {e.strerror}") from None
    f = os.fdopen(fd, "r+b")
    f.truncate(offset)
    h = hashlib.sha256()
    for block in iter(lambda: f.read(BLOCK), b""):
        h.update(block)
    return f, h


def _copy(src: Any, out: BinaryIO, h: Any, n: int, progress: list[int] | None = None) -> int:
    """Copy n bytes from a reader with .read (a file) or .recv (a socket), hashing them; the count copied."""
    read = src.recv if hasattr(src, "recv") else src.read
    done = 0
    while done < n:
        block = read(min(BLOCK, n - done))
        if not block:
            break
        out.write(block)
        h.update(block)
        done += len(block)
        if progress is not None:
            progress[0] += len(block)
            if progress[0] - progress[1] >= REPORT_EVERY:
                progress[1] = progress[0]
                print(BYTES_MARK + str(progress[0]), flush=True)
    return done


def recv(dest: str, stdin: BinaryIO) -> None:
    """Frames from the controller: {"rel", "size", "sha256", "offset"} then size-offset bytes; {} ends."""
    while True:
        line = stdin.readline()
        if not line:
            raise SystemExit("stage: the controller went away (the parts stay for the next run)")
        head = json.loads(line)
        if not head:
            return
        rel, size, digest, offset = head["rel"], head["size"], head["sha256"], head["offset"]
        safe(dest, rel)
        f, h = _open_part(dest, digest, offset)
        with f:
            got = _copy(stdin, f, h, size - offset)
            f.flush()
            os.fsync(f.fileno())
        if got != size - offset:
            raise SystemExit(f"stage: {rel}: the controller went away after {offset + got} of {size} bytes")
        ok = finish(dest, rel, size, digest, h.hexdigest())
        print(FILE_MARK + json.dumps({"rel": rel, "ok": ok}), flush=True)


def _open_served(dest: str, rel: str) -> BinaryIO:
    """A staged file for `serve`: no symbolic link on the way, no path that resolves outside DEST."""
    path = safe(dest, rel)
    if os.path.commonpath([os.path.realpath(path), os.path.realpath(dest)]) != os.path.realpath(dest):
        raise OSError(f"{rel} is outside {dest}")
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise OSError(f"{rel} is not a regular file")
    return f


def serve(dest: str, address: str, stdin: BinaryIO) -> None:
    token = stdin.readline().strip()
    if not token:
        raise SystemExit("stage serve: no token on stdin")
    staged = set(json.loads(stdin.readline() or "{}"))
    for rel in staged:
        safe(dest, rel)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    srv = socket.socket(family, socket.SOCK_STREAM)
    srv.bind((address, 0))
    srv.listen(16)

    def one(conn: socket.socket) -> None:
        conn.settimeout(AUTH_TIMEOUT)
        with conn, conn.makefile("rb") as r:
            try:
                if not hmac.compare_digest(r.readline(LINE_MAX).strip(), token):
                    return
                req = json.loads(r.readline(LINE_MAX))
                if req["rel"] not in staged:
                    return
                conn.settimeout(120)  # authenticated: as pull's connection, a stalled copy ends both sides
                with _open_served(dest, req["rel"]) as f:
                    conn.sendfile(f, offset=int(req["offset"]))
            except (OSError, ValueError, KeyError, TypeError):
                return  # a bad request or a peer gone: nothing for the server to say

    def accept() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(SERVE_MARK + json.dumps({"port": srv.getsockname()[1]}), flush=True)
    stdin.read()  # the controller closes stdin (or goes away) when every node has its copy


def pull(dest: str, host: str, port: int, stdin: BinaryIO) -> None:
    token = stdin.readline().strip()
    wanted: dict[str, list[Any]] = json.loads(stdin.readline())
    progress = [0, 0]
    for rel, (size, digest) in sorted(wanted.items()):
        safe(dest, rel)
        for attempt in range(2):
            try:
                offset = os.path.getsize(part_path(dest, digest)) if attempt == 0 else 0
            except OSError:
                offset = 0
            offset = offset if offset <= size else 0
            conn = socket.create_connection((host, port), timeout=120)
            f, h = _open_part(dest, digest, offset)
            with conn, f:
                conn.sendall(token + b"\n" + json.dumps({"rel": rel, "offset": offset}).encode() + b"\n")
                got = _copy(conn, f, h, size - offset, progress)
                f.flush()
                os.fsync(f.fileno())
            if got != size - offset:
                raise SystemExit(f"stage: {rel}: {host} sent {offset + got} of {size} bytes")
            if finish(dest, rel, size, digest, h.hexdigest()):
                print(FILE_MARK + json.dumps({"rel": rel, "ok": True, "resumed": offset}), flush=True)
                break
        else:
            raise SystemExit(f"stage: {rel}: sha256 differs from the source's after two tries")
    print(BYTES_MARK + str(progress[0]), flush=True)


def main(argv: list[str]) -> int:
    what, args = argv[0], argv[1:]
    if args:  # the controller shell-quotes DEST, so ~ reaches here unexpanded
        args[0] = os.path.expanduser(args[0])
    stdin = sys.stdin.buffer
    if what == "inspect":
        wanted = json.loads(stdin.read())
        print(MARK + json.dumps(inspect(args[0], args[1] if len(args) > 1 else "", wanted)), flush=True)
    elif what == "recv":
        recv(args[0], stdin)
    elif what == "serve":
        serve(args[0], args[1], stdin)
    elif what == "pull":
        pull(args[0], args[1], int(args[2]), stdin)
    else:
        sys.exit(f"unknown stage step {what!r}")
    return 0
