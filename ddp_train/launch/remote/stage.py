"""`ddp-launch stage SRC --to DEST --hosts INVENTORY`: put a data set on every node, each byte sent once.

SRC is hashed here (sha256 per file); every node says which files it lacks or holds with another hash
(node/stage.py `inspect`). A node that lacks nothing gets nothing. Otherwise the controller streams the
missing files to one node over its SSH channel, and the copy then doubles node to node: each node that
has it serves it on its training address (ddp_network_cidr; without one, ansible_host) to one node that
lacks it, per round, so 8 nodes take 1 + 3 rounds and the controller's link carries the data once. Every
file lands as a part file that a later run continues, is checked against its sha256 and renamed into
place. A relative DEST is taken against ddp_workdir (the directory the trainer starts in, which is what
a relative data.tokens.path is read against); without ddp_workdir against the login directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_train.launch.errors import LaunchError, one_line
from ddp_train.launch.node import command, marked_json, tree
from ddp_train.launch.node.stage import BYTES_MARK, FILE_MARK, MARK, SERVE_MARK
from ddp_train.launch.plan.inventory import Node
from ddp_train.launch.remote.fanout import parallel, set_forks
from ddp_train.storage import size_text

if TYPE_CHECKING:
    from ddp_train.launch.remote.remote import Session, Stream

CHUNK = 1 << 20
Wanted = dict[str, list[Any]]  # rel -> [size, sha256]


class StageError(Exception):
    """One node could not get the data; one line naming it."""


@dataclasses.dataclass
class Source:
    root: str
    files: Wanted

    @property
    def total(self) -> int:
        return sum(size for size, _ in self.files.values())


def scan(src: str) -> Source:
    """SRC's regular files with size and sha256 (a single file stages as DEST/<its name>)."""
    path = Path(src).expanduser()
    if path.is_file():
        return Source(
            str(path.parent.resolve()),
            {path.name: [path.stat().st_size, tree.content_digest(str(path), "f")]},
        )
    if not path.is_dir():
        raise LaunchError(f"stage SRC {src}: no such file or directory")
    root = str(path.resolve())
    try:
        items = tree.walk(root)
        links = [rel for rel, _, kind, _, _ in items if kind == "l"]
        if links:
            raise LaunchError(
                f"stage SRC {src}: {links[0]} is a symbolic link; stage copies regular files only"
            )
        files = {rel: [size, tree.content_digest(full, "f")] for rel, full, _, _, size in items}
    except OSError as e:
        raise LaunchError(f"stage SRC {src}: cannot read {e.filename}: {e.strerror}") from None
    bad = [rel for rel in files if rel.split("/")[0] == ".ddp-stage"]
    if bad or not files:
        raise LaunchError(
            f"stage SRC {src}: " + (f"{bad[0]}: .ddp-stage is stage's own" if bad else "no files")
        )
    return Source(root, files)


def dest_dir(node: Node, dest: str) -> str:
    """DEST on the node: absolute or ~ as given, else under ddp_workdir (else the login directory)."""
    if dest.startswith(("/", "~")) or not node.workdir:
        return dest
    return f"{node.workdir.rstrip('/')}/{dest}"


class Progress:
    """Bytes delivered to nodes out of the total: a redrawn bar on a TTY, a line per 10% otherwise."""

    def __init__(self, total: int, out: Any = None) -> None:
        self.total, self.done, self.out = max(total, 1), 0, out or sys.stderr
        self.tty = bool(getattr(self.out, "isatty", lambda: False)())
        self.lock, self.t0, self.shown, self.drawn = threading.Lock(), time.monotonic(), -1, False

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            pct = min(100, self.done * 100 // self.total)
            rate = self.done / max(time.monotonic() - self.t0, 1e-3)
            text = f"{size_text(self.done)}/{size_text(self.total)} {pct}% {size_text(int(rate))}/s"
            if self.tty:
                bar = "#" * (pct * 30 // 100)
                self.out.write(f"\rstage: [{bar:<30}] {text}")
                self.out.flush()
                self.drawn = True
            elif pct // 10 > self.shown:
                self.shown = pct // 10
                print(f"stage: {text}", file=self.out, flush=True)

    def wrap(self, say: Callable[[str], None]) -> Callable[[str], None]:
        """`say` that first clears the bar (the next `add` draws it again below the line)."""

        def said(text: str) -> None:
            with self.lock:
                if self.drawn:
                    self.out.write("\r\033[K")
                    self.out.flush()
                    self.drawn = False
                say(text)

        return said

    def end(self) -> None:
        if self.drawn:
            self.out.write("\n")
            self.drawn = False


def _inspect(session: Session, node: Node, where: str, source: Source) -> dict[str, Any]:
    code, out = session.exec(
        command(node.venv, "stage", "inspect", where, node.network_cidr or ""),
        timeout=3600,
        stdin=json.dumps(source.files).encode(),
    )
    try:
        found = marked_json(out, MARK)
    except ValueError:
        found = None
    if code != 0 or not isinstance(found, dict):
        raise StageError(
            f"{node.name}: {one_line(out.strip().splitlines()[-1] if out.strip() else f'exit {code}')}"
        )
    return found


def _recv_stream(session: Session, node: Node, where: str, connect_timeout: float) -> Stream:
    """`stage recv` on the node, fed through OpenSSH where it can be (with the launcher's SSH settings,
    as --sync's rsync): paramiko's Python ciphers cap a stream at a few tens of MB/s on a busy machine."""
    import subprocess

    from ddp_train.launch.remote.remote import _LocalStream
    from ddp_train.launch.remote.sync import ssh_command

    cmd = command(node.venv, "stage", "recv", where)
    if node.local or node.ssh is None or node.ssh.password or not shutil.which("ssh"):
        return session.start(cmd, stdin=True)
    argv = [*ssh_command(node.ssh, connect_timeout), "--", node.ssh.host, cmd]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return _LocalStream(proc)


def _changed(path: str) -> LaunchError:
    return LaunchError(f"stage SRC {path}: changed since the scan; run stage again")


def push(
    session: Session,
    node: Node,
    where: str,
    source: Source,
    need: dict[str, int],
    progress: Progress,
    connect_timeout: float = 10,
) -> int:
    """Stream the needed files over the SSH channel (from each part's end); the bytes sent."""
    from ddp_train.launch.remote.remote import RemoteError

    sent, todo = 0, dict(need)
    for _ in range(2):  # a resumed part whose hash comes out wrong is sent again from its start
        stream = _recv_stream(session, node, where, connect_timeout)
        lines: list[str] = []  # read while sending: a node blocked on its output would stop reading
        reader = threading.Thread(target=lambda: lines.extend(stream.lines()), daemon=True)  # noqa: B023
        reader.start()
        try:
            try:
                for rel, offset in sorted(todo.items()):
                    size, digest = source.files[rel]
                    head = {"rel": rel, "size": size, "sha256": digest, "offset": offset}
                    path = os.path.join(source.root, rel)
                    try:
                        f = open(path, "rb")  # noqa: SIM115 (closed below)
                    except OSError:
                        raise _changed(path) from None
                    with f:
                        if os.fstat(f.fileno()).st_size != size:
                            raise _changed(path)
                        stream.send(json.dumps(head).encode() + b"\n")
                        f.seek(offset)
                        left = size - offset  # exactly what the header says, or the stream is out of step
                        while left:
                            block = f.read(min(CHUNK, left))
                            if not block:
                                raise _changed(path)
                            stream.send(block)
                            sent, left = sent + len(block), left - len(block)
                            progress.add(len(block))
                        if f.read(1):
                            raise _changed(path)
                stream.send(b"{}\n")
            except RemoteError as e:  # the node stopped reading: what it said is the reason
                lines.append(str(e))
            stream.close_stdin()
            reader.join(3600)
            code, why = stream.wait(timeout=60)
        finally:
            stream.close()
        done = [marked_json(ln, FILE_MARK) for ln in lines if ln.startswith(FILE_MARK)]
        bad = {d["rel"] for d in done if not d["ok"]}
        if code != 0 or len(done) != len(todo):
            raise StageError(f"{node.name}: receiving failed: {one_line(lines[-1] if lines else why or '')}")
        if not bad:
            return sent
        todo = {rel: 0 for rel in bad}
    raise StageError(f"{node.name}: {sorted(bad)[0]}: sha256 differs from the source's after two tries")


class Server:
    """`stage serve` on a node that holds the data: its port; the token and the files it may hand out on
    stdin; stopped by EOF."""

    def __init__(
        self, session: Session, node: Node, where: str, address: str, token: str, files: Wanted
    ) -> None:
        self.node, self.address = node, address
        self.stream = session.start(command(node.venv, "stage", "serve", where, address), stdin=True)
        self.stream.send(token.encode() + b"\n" + json.dumps(files).encode() + b"\n")
        lines = self.stream.lines()
        for ln in lines:
            if ln.startswith(SERVE_MARK):
                self.port = int(marked_json(ln, SERVE_MARK)["port"])
                return
        self.stream.close()
        raise StageError(f"{node.name}: cannot serve the data on {address}")

    def stop(self) -> None:
        self.stream.close_stdin()
        self.stream.wait(timeout=10)
        self.stream.close()


def pull(
    session: Session,
    node: Node,
    where: str,
    source: Source,
    need: dict[str, int],
    server: Server,
    token: str,
    progress: Progress,
) -> list[str]:
    """`stage pull` on the node from `server`; the per-file lines it printed."""
    wanted = {rel: source.files[rel] for rel in need}
    stream = session.start(
        command(node.venv, "stage", "pull", where, server.address, str(server.port)), stdin=True
    )
    try:
        stream.send(token.encode() + b"\n" + json.dumps(wanted).encode() + b"\n")
        stream.close_stdin()
        counted, lines = 0, []
        for ln in stream.lines():
            lines.append(ln)
            if ln.startswith(BYTES_MARK):
                now = int(ln[len(BYTES_MARK) :])
                progress.add(now - counted)
                counted = now
        code, why = stream.wait(timeout=60)
    finally:
        stream.close()
    if code != 0:
        raise StageError(
            f"{node.name}: pulling from {server.node.name} failed: "
            + one_line(lines[-1] if lines else why or "")
        )
    return lines


def stage(
    nodes: Sequence[Node],
    source: Source,
    dest: str,
    connect_timeout: float = 10,
    say: Callable[[str], None] = print,
    out: Any = None,
) -> int:
    """Bring `source` to DEST on every node; 0, or LaunchError/StageError naming the first failure."""
    from ddp_train.launch.remote.remote import RemoteError
    from ddp_train.launch.remote.sessionpool import SessionPool

    wheres = {n.name: dest_dir(n, dest) for n in nodes}
    say(
        f"stage: {len(source.files)} file(s), {size_text(source.total)} from {source.root} "
        f"to {len(nodes)} node(s)"
    )
    with SessionPool(connect_timeout) as pool:
        try:
            states = dict(
                zip(wheres, parallel(lambda n: _inspect(pool.get(n), n, wheres[n.name], source), nodes))
            )
        except RemoteError as e:
            raise StageError(str(e)) from None
        for n in nodes:
            need_bytes = sum(source.files[r][0] for r in states[n.name]["need"])
            if need_bytes > states[n.name]["free"]:
                raise StageError(
                    f"{n.name}: {wheres[n.name]}: {size_text(states[n.name]['free'])} free, "
                    f"{size_text(need_bytes)} needed"
                )
        need = {n.name: states[n.name]["need"] for n in nodes}
        total = sum(source.files[r][0] - off for name in need for r, off in need[name].items())
        holders = [n for n in nodes if not need[n.name]]
        for n in holders:
            say(f"stage: {n.name}: up to date ({wheres[n.name]}), 0 files, 0 bytes sent")
        pending = [n for n in nodes if need[n.name]]
        if not pending:
            return 0
        progress = Progress(total, out)
        say = progress.wrap(say)
        try:
            if not holders:  # the controller sends to the node that lacks least
                seed = min(
                    pending, key=lambda n: sum(source.files[r][0] - o for r, o in need[n.name].items())
                )
                pending.remove(seed)
                sent = push(
                    pool.get(seed),
                    seed,
                    wheres[seed.name],
                    source,
                    need[seed.name],
                    progress,
                    connect_timeout,
                )
                progress.end()
                resumed = sum(1 for o in need[seed.name].values() if o)
                say(
                    f"stage: {seed.name}: {len(need[seed.name])} file(s), {sent} bytes sent from this machine"
                    + (f" ({resumed} resumed)" if resumed else "")
                    + f" -> {wheres[seed.name]}"
                )
                holders.append(seed)
            token, servers = secrets.token_hex(16), {}
            try:
                while pending:
                    pairs = list(zip(holders, pending))
                    for h, _ in pairs:
                        if h.name not in servers:
                            addr = states[h.name].get("address") or ("127.0.0.1" if h.local else h.address)
                            servers[h.name] = Server(
                                pool.get(h), h, wheres[h.name], addr, token, source.files
                            )

                    def one(pair: tuple[Node, Node]) -> tuple[Node, Node, list[str]]:
                        h, n = pair
                        srv = servers[h.name]
                        return (
                            h,
                            n,
                            pull(pool.get(n), n, wheres[n.name], source, need[n.name], srv, token, progress),
                        )

                    for h, n, lines in parallel(one, pairs, forks=len(pairs)):
                        files = [marked_json(ln, FILE_MARK) for ln in lines if ln.startswith(FILE_MARK)]
                        resumed = sum(1 for f in files if f.get("resumed"))
                        say(
                            f"stage: {n.name}: {len(files)} file(s) from {h.name} ({servers[h.name].address})"
                            + (f" ({resumed} resumed)" if resumed else "")
                            + f" -> {wheres[n.name]}"
                        )
                        pending.remove(n)
                        holders.append(n)
            finally:
                for s in servers.values():
                    s.stop()
            progress.end()
        except RemoteError as e:
            raise StageError(str(e)) from None
    return 0


# ---- command line ---------------------------------------------------------------------------------


def main(opts: argparse.Namespace) -> int:
    from ddp_train import exitcodes
    from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY, load_nodes
    from ddp_train.launch.remote.fanout import ansible_forks

    try:
        if not opts.dest.strip() or "\0" in opts.dest:
            raise LaunchError(f"stage --to {opts.dest!r}: expected a directory path")
        nodes = load_nodes(
            opts.hosts or [DEFAULT_INVENTORY],
            group=opts.group,
            limit=opts.limit,
            exclude=opts.exclude,
            extra_vars=opts.extra_vars,
        )
        if opts.forks is not None and opts.forks < 1:
            raise LaunchError(f"--forks {opts.forks}: expected a number of nodes, 1 or more")
        set_forks(opts.forks or next((n.forks for n in nodes if n.forks), None) or ansible_forks())
        source = scan(opts.src)
        return stage(nodes, source, opts.dest, opts.connect_timeout)
    except (LaunchError, StageError) as e:
        print(f"ddp-launch stage: error: {one_line(str(e), 1000)}", file=sys.stderr)
        return exitcodes.BAD_INPUT if isinstance(e, LaunchError) else exitcodes.NODE_FAILED
