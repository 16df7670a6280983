"""A second copy of each checkpoint on other nodes (checkpoint.replicas), so a lost node loses no work.

After rank 0's atomic save, a thread of rank 0 streams the file to the first rank (LOCAL_RANK 0) of the
next `replicas` nodes over a plain TCP connection on the training network; the receiver writes it as
`<name>.tmp`, fsyncs, checks the sha256 that follows the bytes, writes `<name>.replica.json` (the hash
and where it came from) and renames, as rank 0's own save does. A restart then finds it like any other
checkpoint (Checkpointer.restore: the newest step on any node wins), and load() checks its hash.

Why a socket and a thread on rank 0, not a gloo group or a pull: gloo's new_group is a collective of
every rank, and a transfer failing inside it (the receiver's node gone) is a process-group error that
stops the job; a socket fails alone, into one warning. Rank 0 knows the moment the file is complete,
streams it from disk in chunks (never the whole checkpoint in memory) and logs the result where the
saves are logged. The listener binds port 0 on the address that routes to MASTER_ADDR, i.e. the
training network, where the firewall role opens the ephemeral range to the cluster's addresses
(roles/firewall: firewall_ephemeral_port_range, net.ipv4.ip_local_port_range). A random token,
exchanged in the same all_gather, keeps a stray connection from writing into the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from ddp_train import checkpoint, storage
from ddp_train.config import Config
from ddp_train.distributed import DistEnv

CHUNK = 4 << 20
TOKEN_TIMEOUT_S = 10.0  # a connection that has not shown the token by then is dropped
CLOSE_WAIT_S = 2.0  # Receiver.close(): how long the connections in hand may take to end
log = logging.getLogger("ddp_train")


def training_address(master_addr: str | None) -> str:
    """This node's address on the network that leads to MASTER_ADDR (a UDP connect sends nothing; the
    kernel only picks the route and its source address)."""
    if not master_addr:
        raise OSError("MASTER_ADDR is not set")
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 9))
        return str(s.getsockname()[0])


def receivers(rank: int, world_size: int, local_world_size: int, replicas: int) -> list[int]:
    """The ranks that keep a replica: the first rank of nodes 1..replicas (torchrun numbers the ranks
    of a node contiguously, node by node). None on one node."""
    nodes = world_size // max(1, local_world_size)
    return [n * local_world_size for n in range(1, min(replicas, nodes - 1) + 1)]


def _shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def _readline(f: BinaryIO, limit: int = 4096) -> str:
    line = f.readline(limit)
    if not line.endswith(b"\n"):
        raise ConnectionError("connection closed")
    return line.decode("utf-8", "replace").strip()


class Receiver:
    """A listening socket and a thread that stores each replica sent to it in `directory`, and best.pt
    at `best_path` (a hard link to the received copy of its step when the sender's is one)."""

    def __init__(
        self,
        directory: Path,
        keep_latest_k: int,
        master_addr: str | None,
        timeout_s: float,
        best_path: Path | None = None,
    ) -> None:
        self.directory, self.keep_latest_k, self.timeout_s = directory, keep_latest_k, timeout_s
        self.best_path = best_path
        self.token = secrets.token_hex(16)
        host = training_address(master_addr)
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(4)
        self.address = f"{host}|{self.sock.getsockname()[1]}|{self.token}"
        self.lock = threading.Lock()  # one transfer writes at a time (the same <name>.tmp, prune)
        self.handlers: set[threading.Thread] = set()  # a thread per connection still being handled
        self.handlers_lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="ddp-replica-recv", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop listening (shutdown() wakes the accept() that close() alone leaves blocked, Linux), then
        give the connections in hand CLOSE_WAIT_S to end, so none logs after its owner is gone."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        deadline = time.monotonic() + CLOSE_WAIT_S
        with self.handlers_lock:
            handlers = list(self.handlers)
        for t in handlers:
            t.join(max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            # a thread per connection: a peer that stalls holds its own thread, never the next transfer
            t = threading.Thread(target=self._handle, args=(conn,), name="ddp-replica-conn", daemon=True)
            with self.handlers_lock:
                self.handlers.add(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._handle_one(conn)
        finally:
            with self.handlers_lock:
                self.handlers.discard(threading.current_thread())

    def _handle_one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TOKEN_TIMEOUT_S)  # until the token is checked: a short wait per read ...
            # ... and a deadline for the whole header, which a peer trickling bytes cannot extend
            deadline = threading.Timer(TOKEN_TIMEOUT_S, _shutdown, (conn,))
            deadline.start()
            try:
                self.receive(conn, deadline)
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, the receiver serves on
                log.warning("replica not received: %s: %s", type(exc).__name__, exc)
            finally:
                deadline.cancel()

    def receive(self, conn: socket.socket, deadline: threading.Timer) -> None:
        """One transfer: header, "send", the bytes and their sha256, then "ok" or "bad <why>"."""
        f = conn.makefile("rb")
        header = json.loads(_readline(f))
        name, size = str(header["name"]), int(header["size"])
        token = header.get("token")
        if not (isinstance(token, str) and hmac.compare_digest(token.encode(), self.token.encode())):
            conn.sendall(b"bad refused\n")
            return
        deadline.cancel()
        conn.settimeout(self.timeout_s)  # the token's holder: a sender that went silent frees the thread
        best = self.best_path is not None and name == self.best_path.name
        if checkpoint.step_of(name) is None and not best:
            conn.sendall(b"bad refused\n")
            return
        with self.lock:
            if not best:
                self._store(conn, f, header, self.directory / name, size)
            elif not self._link_best(header, size):
                assert self.best_path is not None
                self._store(conn, f, header, self.best_path, size)
                return
            else:
                conn.sendall(b"have\n")

    def _link_best(self, header: dict[str, Any], size: int) -> bool:
        """best.pt as a hard link to this node's verified copy of the checkpoint the sender's best.pt is a
        link of (header "link", with the sha256 the sender just sent that copy with), instead of its bytes
        again; False when there is no such copy with that very hash (an older run's file of the same name
        and size is not it)."""
        link, sha = header.get("link"), header.get("link_sha256")
        if not isinstance(link, str) or checkpoint.step_of(link) is None or self.best_path is None:
            return False
        copy = self.directory / link
        try:
            info = json.loads(checkpoint.replica_info(copy).read_text())
            if copy.stat().st_size != size or not isinstance(sha, str) or info.get("sha256") != sha:
                return False
            # the record first: best.pt is never there without the hash its bytes are checked against
            checkpoint.write_replica_info(self.best_path, info)
            storage.link(copy, self.best_path)
        except (OSError, ValueError):
            return False  # not here, unreadable, or another filesystem: the bytes are sent
        log.info("best.pt is the replica %s (a hard link)", link)
        return True

    def _store(
        self, conn: socket.socket, f: BinaryIO, header: dict[str, Any], final: Path, size: int
    ) -> None:
        name = final.name
        try:
            st = final.stat()
            if (st.st_size, st.st_mtime_ns) == (size, int(header["mtime_ns"])):
                conn.sendall(b"have\n")  # a shared checkpoint.dir: the same file, nothing to copy
                return
        except FileNotFoundError:
            pass
        conn.sendall(b"send\n")
        digest = hashlib.sha256()

        def write(out: BinaryIO) -> None:
            left = size
            while left:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    raise ConnectionError(f"connection closed with {left} of {size} bytes to come")
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
            sent = _readline(f)
            if sent != digest.hexdigest():
                conn.sendall(b"bad sha256 mismatch\n")
                got, origin = digest.hexdigest()[:12], header.get("host")
                raise ValueError(
                    f"{name} from {origin}: sha256 {got} of the received bytes differs from the sender's "
                    f"{sent[:12]}; discarded"
                )
            checkpoint.write_replica_info(final, {"sha256": sent, "from": header.get("host"), "size": size})

        storage.publish(final, write)
        if final.parent == self.directory:  # a checkpoint, not best.pt: keep_latest_k, before the "ok"
            checkpoint.prune(self.directory, self.keep_latest_k)
        conn.sendall(f"ok {digest.hexdigest()}\n".encode())


class Sender:
    """Rank 0's thread: sends the newest saved checkpoint, then best.pt when it changed, to every
    receiver, one at a time; a save made while a transfer runs replaces the one waiting (only the newest
    copy matters), as a new best.pt replaces the best.pt waiting."""

    def __init__(self, targets: list[tuple[int, str, str]], timeout_s: float) -> None:
        self.targets, self.timeout_s = targets, timeout_s  # (rank, host, "ip|port|token")
        self.cond = threading.Condition()
        self.pending: Path | None = None
        self.pending_best: tuple[Path, Path | None] | None = None  # best.pt, the checkpoint it links
        self.busy = False
        self.results: dict[Path, list[str]] = {}  # failures per file, for finish()
        self.thread: threading.Thread | None = None

    def send(self, path: Path | None, best: tuple[Path, Path | None] | None = None) -> None:
        """Queue the checkpoint `path` and/or `best`: (best.pt, the checkpoint it is a hard link of, or
        None: best.pt written on its own)."""
        with self.cond:
            self.pending = path or self.pending
            self.pending_best = best or self.pending_best
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="ddp-replica-send", daemon=True)
                self.thread.start()
            self.cond.notify()

    def wait(self, timeout_s: float) -> bool:
        """Whether everything sent so far was dealt with (copied or failed) within `timeout_s`."""
        with self.cond:
            return self.cond.wait_for(
                lambda: self.pending is None and self.pending_best is None and not self.busy, timeout_s
            )

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending is not None or self.pending_best is not None)
                path, best, self.busy = self.pending, self.pending_best, True
                self.pending = self.pending_best = None
            # the checkpoint first: a best.pt that links it then arrives as a link to the copy each
            # receiver has just been sent (its sha256), not its bytes again
            sent: dict[str, str] = {}  # receiver host -> sha256 of `path` it holds now
            for what, links in ([(path, None)] if path else []) + ([best] if best else []):
                failed = []
                for rank, host, address in self.targets:
                    try:
                        digest = self._send_one(what, rank, host, address, links, sent.get(host))
                        if what == path and digest:
                            sent[host] = digest
                    except Exception as exc:  # noqa: BLE001 - a failed copy is a warning, never the run's end
                        failed.append(host)
                        log.warning(
                            "replica of %s to %s (rank %d) failed: %s; this copy is on this node only",
                            what.name, host, rank, exc,
                        )  # fmt: skip
                with self.cond:
                    self.results[what] = failed
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def _send_one(
        self,
        path: Path,
        rank: int,
        host: str,
        address: str,
        links: Path | None = None,
        sha: str | None = None,
    ) -> str | None:
        """Send `path` to one receiver; the sha256 it now holds it with (None: it had the file already,
        a shared directory). `links`/`sha`: best.pt is a hard link to that checkpoint, sent with `sha`."""
        ip, port, token = address.split("|")
        t0 = time.perf_counter()
        with open(path, "rb") as src:  # an open file survives its pruning by the next save
            st = os.fstat(src.fileno())
            with socket.create_connection((ip, int(port)), timeout=self.timeout_s) as conn:
                f = conn.makefile("rb")
                header = {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                          "token": token, "host": socket.gethostname()}  # fmt: skip
                with contextlib.suppress(OSError):  # still the same file (a later best.pt is not)?
                    if links is not None and sha is not None and os.stat(links).st_ino == st.st_ino:
                        header.update(link=links.name, link_sha256=sha)
                conn.sendall(json.dumps(header).encode() + b"\n")
                answer = _readline(f)
                if answer == "have":
                    return None
                if answer != "send":
                    raise ValueError(f"receiver answered {answer!r}")
                digest = hashlib.sha256()
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    conn.sendall(chunk)
                conn.sendall(digest.hexdigest().encode() + b"\n")
                answer = _readline(f)
        if answer != f"ok {digest.hexdigest()}":
            raise ValueError(f"receiver answered {answer!r}")
        # "saved ... .pt in N.NNs": ddp-launch sizes a stop's grace by the longest (launch/run/trainerlog.py)
        seconds = time.perf_counter() - t0
        log.info(
            "saved replica %s:%s in %.2fs (sha256 %s)", host, path.name, seconds, digest.hexdigest()[:12]
        )
        return digest.hexdigest()


class Replicas:
    """Both ends for one rank: offer() a receiver's address for the startup all_gather, connect() rank
    0 to the gathered ones, send() after each save, finish() after the last one."""

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        local_world_size: int,
        replicas: int,
        keep_latest_k: int,
        master_addr: str | None,
        timeout_s: float,
        best_path: Path | None = None,
    ) -> None:
        self.directory, self.rank, self.keep_latest_k = directory, rank, keep_latest_k
        self.best_path = best_path
        self.master_addr, self.timeout_s = master_addr, timeout_s
        self.receivers = receivers(rank, world_size, local_world_size, replicas)
        self.receiver: Receiver | None = None
        self.sender: Sender | None = None
        self.last: Path | None = None  # the newest checkpoint queued
        self.last_best: Path | None = None  # best.pt, when it was queued

    @classmethod
    def from_config(cls, cfg: Config, env: DistEnv) -> Replicas:
        """The run's replicas (checkpoint.replicas), for Checkpointer.from_config."""
        c = cfg.checkpoint
        return cls(cfg.checkpoint_dir, rank=env.rank, local_rank=env.local_rank, world_size=env.world_size,
                   local_world_size=env.local_world_size, replicas=c.replicas, keep_latest_k=c.keep_latest_k,
                   master_addr=env.master_addr, timeout_s=c.io_timeout_s,
                   best_path=cfg.run_dir / "best.pt" if cfg.eval.keep_best else None)  # fmt: skip

    def offer(self) -> dict[str, Any]:
        """What this rank adds to the startup report: its listening address if it keeps a replica."""
        if self.rank not in self.receivers or self.receiver is not None:
            return {}
        try:
            self.receiver = Receiver(
                self.directory, self.keep_latest_k, self.master_addr, self.timeout_s, self.best_path
            )
        except OSError as exc:
            return {"replica_error": f"cannot listen on the training network: {exc}"}
        return {"replica_addr": self.receiver.address}

    def connect(self, reports: list[dict[str, Any]]) -> None:
        """Rank 0: the receivers' addresses from the gathered reports (a receiver that could not listen
        is a warning: its node keeps no replica)."""
        if self.rank != 0 or not self.receivers:
            return
        targets = []
        for r in self.receivers:
            report, host = reports[r], reports[r].get("host", f"rank {r}")
            if "replica_addr" in report:
                targets.append((r, host, report["replica_addr"]))
            else:
                log.warning("no checkpoint replica on %s (rank %d): %s", host, r, report.get("replica_error"))
        self.sender = Sender(targets, self.timeout_s) if targets else None

    def send(self, path: Path, best: Path | None = None) -> None:
        """After a save: its checkpoint, and best.pt when it became a hard link to it."""
        if self.sender is not None:
            self.last = path
            self.last_best = best or self.last_best
            self.sender.send(path, (best, path) if best is not None else None)

    def send_best(self, best: Path) -> None:
        """After best.pt was written on its own (the weights alone, at a step that is no checkpoint)."""
        if self.sender is not None:
            self.last_best = best
            self.sender.send(None, (best, None))

    def finish(self, timeout_s: float) -> None:
        """Rank 0, after the last save: wait up to `timeout_s` for its replica, or say that it did not
        complete."""
        queued = [p for p in (self.last, self.last_best) if p is not None]
        if self.sender is None or not queued:
            return
        names = " and ".join(p.name for p in queued)
        hosts = ", ".join(h for _, h, _ in self.sender.targets)
        if not self.sender.wait(0):  # a line in the log if the process is killed while it waits
            log.info("waiting up to %gs for the replica of %s on %s", timeout_s, names, hosts)
        if not self.sender.wait(timeout_s):
            log.warning("the replica of %s on %s did not complete within %gs: it is on this node only",
                        names, hosts, timeout_s)  # fmt: skip
            return
        for p in queued:
            if self.sender.results.get(p):
                log.warning("the replica of %s did not complete: it is on this node only", p.name)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
