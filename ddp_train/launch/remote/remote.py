"""Run commands on a node: over SSH (Fabric/paramiko, host keys always verified) or locally.

A `Session` runs short commands (`exec`), copies files (`put`) and starts long-running ones
(`start` -> `Stream`, whose output is read line by line). Local nodes (`ansible_connection: local`)
run the very same command strings through `/bin/sh -c` in a new session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import os
import queue
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_train.launch.errors import one_line
from ddp_train.launch.plan.inventory import Node, SshTarget

if TYPE_CHECKING:  # paramiko/fabric load on first connection, not for --dry-run
    import paramiko
    from fabric import Connection

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
LOST = "ssh connection lost"
POLL_S = 2.0  # idle wake-up of the transport thread and of a stream's reader (issue #19)


class RemoteError(Exception):
    """A node could not be reached or a command on it failed; the message is one line naming the node."""


class Stream:
    """Output and exit status of a command started with `Session.start`."""

    def lines(self) -> Iterator[str]:
        """Yield output lines (stdout and stderr merged) until the command's output ends."""
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> tuple[int | None, str | None]:
        """(exit code, None) once the command ended, else (None, why): connection lost, or timed out."""
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        """Write to the command's stdin (started with stdin=True); RemoteError if it cannot."""
        raise NotImplementedError

    def close_stdin(self) -> None:
        """Send EOF to the command's stdin."""

    def close(self) -> None:
        """Drop the command's output channel (the command itself is not signalled)."""


class Session:
    """One connection to a node."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def exec(self, command: str, timeout: float = 30, stdin: bytes | None = None) -> tuple[int, str]:
        """Run a short command; (exit code, merged output). RemoteError if it cannot finish in time.
        `stdin`: written to the command's stdin, then EOF (how values stay out of command lines)."""
        stream = self.start(command, stdin=stdin is not None)
        if stdin is not None:
            try:
                stream.send(stdin)
            finally:
                stream.close_stdin()
        result: queue.Queue[list[str]] = queue.Queue()
        reader = threading.Thread(target=lambda: result.put(list(stream.lines())), daemon=True)
        reader.start()
        try:
            lines = result.get(timeout=timeout)
        except queue.Empty:
            stream.close()
            raise RemoteError(f"{self.node.name}: command timed out after {timeout:g}s") from None
        code, lost = stream.wait(timeout=5)
        stream.close()
        if code is None:
            raise RemoteError(f"{self.node.name}: {lost or 'no exit status'}")
        return code, "\n".join(lines)

    def start(self, command: str, stdin: bool = False) -> Stream:
        raise NotImplementedError

    def put(self, local: str, remote: str) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        return True

    def start_heartbeat(self, interval: float = 2.0) -> None:
        """Ask the node for a reply every `interval` seconds (see silent_for); nothing to do locally."""

    def silent_for(self) -> float:
        """Seconds since the oldest heartbeat the node has not answered yet (0: all answered)."""
        return 0.0

    def close(self) -> None:
        pass


# ---- local ----------------------------------------------------------------------------------------


class _LocalStream(Stream):
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def lines(self) -> Iterator[str]:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            yield raw.decode("utf-8", "replace").rstrip("\r\n")

    def wait(self, timeout: float | None = None) -> tuple[int | None, str | None]:
        try:
            return self.proc.wait(timeout=timeout), None
        except subprocess.TimeoutExpired:
            return None, "still running"

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except OSError as e:
            raise RemoteError(f"cannot write to the command's stdin: {e}") from None

    def close_stdin(self) -> None:
        if self.proc.stdin:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


class LocalSession(Session):
    """A node on this machine: commands run under /bin/sh in a new session, no SSH."""

    def start(self, command: str, stdin: bool = False) -> Stream:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return _LocalStream(proc)

    def put(self, local: str, remote: str) -> None:
        if os.path.abspath(local) != os.path.abspath(remote):
            Path(remote).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{remote}.{secrets.token_hex(4)}.tmp"
            shutil.copyfile(local, tmp)
            os.replace(tmp, remote)


# ---- SSH ------------------------------------------------------------------------------------------


class _SshStream(Stream):
    def __init__(self, channel: paramiko.Channel, transport: paramiko.Transport) -> None:
        self.channel = channel
        self.transport = transport
        self.lost: str | None = None

    def lines(self) -> Iterator[str]:
        """Read until the channel's buffer is drained and closed (recv returns b"").

        A recv that times out while the channel closed meanwhile is no loss: paramiko keeps the bytes
        that arrived with the close in the channel's buffer (its BufferedPipe.read can raise
        PipeTimeout though its wait ended with data there), so the next recv returns them, and b"" once
        they are drained. "Lost" means the transport died without the command's exit status (issue #19).
        """
        buf = b""
        while True:
            try:
                data = self.channel.recv(65536)
            except socket.timeout:
                if self.channel.closed:
                    continue  # closed: the next recv returns what is buffered, then b"" (never blocks)
                if not self.transport.is_active():
                    self.lost = LOST
                    break
                continue
            except (OSError, EOFError) as e:
                self.lost = f"{LOST}: {e}"
                break
            if not data:
                if self.channel.exit_status == -1 and not self.transport.is_active():
                    self.lost = LOST  # closed because the transport died, not because the command ended
                break
            buf += data
            *complete, buf = buf.split(b"\n")
            for raw in complete:
                yield raw.decode("utf-8", "replace").rstrip("\r")
        if buf:
            yield buf.decode("utf-8", "replace").rstrip("\r")

    def wait(self, timeout: float | None = None) -> tuple[int | None, str | None]:
        if not self.channel.status_event.wait(timeout):
            if not self.transport.is_active():
                return None, self.lost or LOST
            return None, "still running"
        code = self.channel.exit_status
        if code == -1:  # closed without an exit status: the connection went away, or a signal killed it
            if self.lost or not self.transport.is_active():
                return None, self.lost or LOST
            return None, "ended without an exit status (killed by a signal?)"
        return code, None

    def send(self, data: bytes) -> None:
        """All of `data`, however long the node takes to read it: the channel's POLL_S timeout also
        bounds paramiko's wait for window space, and sendall would give up on a busy node."""
        while data:
            try:
                data = data[self.channel.send(data) :]
            except socket.timeout:
                if self.channel.closed or not self.transport.is_active():
                    raise RemoteError("cannot write to the command's stdin: the channel closed") from None
            except (OSError, EOFError) as e:
                raise RemoteError(f"cannot write to the command's stdin: {e}") from None

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.channel.shutdown_write()

    def close(self) -> None:
        self.channel.close()


class SshSession(Session):
    """A Fabric connection to a node with host key checking always on (paramiko RejectPolicy)."""

    def __init__(self, node: Node, connect_timeout: float = 10) -> None:
        super().__init__(node)
        assert node.ssh is not None
        self.target = node.ssh
        self.connection = _connect(node.name, node.ssh, connect_timeout)
        self._heartbeat: threading.Thread | None = None
        self._unanswered_since: float | None = None
        self._closed = False

    def start(self, command: str, stdin: bool = False) -> Stream:
        try:
            channel = self.connection.create_session()
            channel.set_combine_stderr(True)
            channel.settimeout(POLL_S)  # paramiko closes every channel when its transport dies
            channel.exec_command(command)
        except Exception as e:  # paramiko raises SSHException, EOFError, OSError...
            raise RemoteError(
                f"{self.node.name}: cannot start a command: {one_line(str(e) or type(e).__name__)}"
            ) from e
        return _SshStream(channel, self.connection.transport)

    def put(self, local: str, remote: str) -> None:
        """Copy a file to the node atomically (temp file + rename), creating its directory."""
        parent = remote.rsplit("/", 1)[0] if "/" in remote else ""
        tmp = f"{remote}.{secrets.token_hex(4)}.tmp"
        if parent:
            code, out = self.exec(shlex.join(["mkdir", "-p", "--", parent]))
            if code != 0:
                raise RemoteError(f"{self.node.name}: cannot create {parent}: {one_line(out)}")
        try:
            self.connection.put(local, tmp)
        except Exception as e:
            raise RemoteError(f"{self.node.name}: cannot copy {local} to {remote}: {one_line(str(e))}") from e
        code, out = self.exec(shlex.join(["mv", "-f", "--", tmp, remote]))
        if code != 0:
            raise RemoteError(f"{self.node.name}: cannot rename {tmp} to {remote}: {one_line(out)}")

    def alive(self) -> bool:
        transport = self.connection.transport
        return transport is not None and transport.is_active()

    def start_heartbeat(self, interval: float = 2.0) -> None:
        """A thread sends an SSH global request that wants a reply (sshd answers every one, even unknown
        kinds) and waits for it; silent_for() says how long the current one has gone unanswered.

        paramiko's own keepalive wants no reply, so only TCP's retransmission timeout (20 s here) could
        notice a silent partition; this notices it after one unanswered round trip.
        """
        if self._heartbeat is not None:
            return
        transport = self.connection.transport

        def beat() -> None:
            while not self._closed and transport.is_active():
                self._unanswered_since = time.monotonic()
                transport.global_request("keepalive@openssh.com", wait=True)  # returns once answered/dead
                if not transport.is_active():
                    return
                self._unanswered_since = None
                time.sleep(interval)

        self._heartbeat = threading.Thread(target=beat, name=f"heartbeat-{self.node.name}", daemon=True)
        self._heartbeat.start()

    def silent_for(self) -> float:
        since = self._unanswered_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def close(self) -> None:
        self._closed = True
        self.connection.close()


def open_session(node: Node, connect_timeout: float = 10) -> Session:
    """A session on `node`: local, or a verified SSH connection (RemoteError with one clear line)."""
    if node.local or node.ssh is None:
        return LocalSession(node)
    return SshSession(node, connect_timeout)


def known_hosts_files(target: SshTarget) -> list[str]:
    """~/.ssh/known_hosts plus the UserKnownHostsFile/ddp_known_hosts_file files the inventory names."""
    files = [os.path.expanduser(DEFAULT_KNOWN_HOSTS)]
    files += [f for f in target.known_hosts_files if f not in files]
    return files


_known_hosts_cache: dict[tuple, paramiko.HostKeys] = {}
_known_hosts_lock = threading.Lock()


def _known_hosts(files: list[str]) -> paramiko.HostKeys:
    """The known_hosts files parsed once per process while they are unchanged: paramiko's load checks
    every entry against all before it (quadratic), which cost ~0.03 s of CPU per node at 64 nodes."""
    import paramiko

    stamp = []
    for path in files:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            stamp.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
    key = tuple(stamp)
    with _known_hosts_lock:
        keys = _known_hosts_cache.get(key)
        if keys is None:
            keys = paramiko.HostKeys()
            for path, *_ in stamp:
                keys.load(path)
            _known_hosts_cache.clear()
            _known_hosts_cache[key] = keys
    return keys


def _server(target: SshTarget) -> str:
    """The name paramiko looks the host key up under: host, or [host]:port off port 22."""
    return target.host if target.port == 22 else f"[{target.host}]:{target.port}"


def _host_keys(target: SshTarget) -> dict[str, paramiko.PKey]:
    """The known keys of the target (keytype -> key), under its HostKeyAlias when it has one."""
    keys = _known_hosts(known_hosts_files(target))
    found = dict(keys.lookup(_server(target)) or {})
    if target.host_key_alias:  # HostKeyAlias: OpenSSH looks the key up under the alias
        found.update(keys.lookup(target.host_key_alias) or {})
    return found


def _connect(name: str, target: SshTarget, timeout: float) -> Connection:
    gateway = target.proxy_command
    for hop in filter(None, (j.strip() for j in (target.proxy_jump or "").split(","))):
        user, _, hostport = hop.rpartition("@")
        host, _, port = hostport.partition(":")
        hop_target = SshTarget(
            host=host,
            port=int(port or 22),
            user=user or None,
            key_files=target.key_files,
            known_hosts_files=target.known_hosts_files,
        )
        gateway = _connection(hop_target, timeout, gateway)  # each hop tunnels through the previous one
    conn = _connection(target, timeout, gateway)
    try:
        conn.open()
    except Exception as e:
        conn.close()
        via = f" via {target.proxy_jump}" if target.proxy_jump else ""
        raise RemoteError(
            f"{name} ({target.describe()}{via}): {_explain(e, target, _server(target), timeout)}"
        ) from None
    _keepalive(conn)
    return conn


def _connection(target: SshTarget, timeout: float, gateway: Connection | str | None) -> Connection:
    """An unopened Fabric Connection that knows the host keys and rejects unknown ones."""
    import paramiko
    from fabric import Config, Connection

    # paramiko checks every packet's MAC with a pure-Python loop (util.constant_time_bytes_eq, ~8 % of
    # the controller's CPU at 64 nodes); the stdlib's C compare_digest is the same constant-time check.
    paramiko.util.constant_time_bytes_eq = hmac.compare_digest

    connect_kwargs: dict = {"timeout": timeout, "banner_timeout": timeout, "auth_timeout": timeout}
    if target.key_files:
        connect_kwargs["key_filename"] = list(target.key_files)
    if target.password:
        connect_kwargs["password"] = target.password
    conn = Connection(
        target.host,
        user=target.user,
        port=target.port,
        config=Config(),
        connect_kwargs=connect_kwargs,
        gateway=gateway,
    )
    _verify_keys(conn, target)
    # A jump host from ~/.ssh/config (ProxyJump) is a Connection Fabric built itself, whose client
    # accepts any key (fabric/connection.py: Connection.get_gateway, and __init__ sets AutoAddPolicy):
    # every such hop gets the same known_hosts and RejectPolicy as the target (issue #24).
    hop = conn.gateway if gateway is None else None
    while isinstance(hop, Connection):
        _verify_keys(hop, dataclasses.replace(target, host=hop.host, port=int(hop.port), host_key_alias=None))
        hop = hop.gateway
    return conn


def _verify_keys(conn: Connection, target: SshTarget) -> None:
    """The connection knows only the target's keys from known_hosts and rejects any other."""
    import paramiko

    server = _server(target)
    for keytype, key in _host_keys(target).items():  # only this host's: the client looks up no other
        conn.client.get_host_keys().add(server, keytype, key)
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())


def _explain(e: BaseException, target: SshTarget, server: str, timeout: float) -> str:
    import paramiko

    files = ", ".join(known_hosts_files(target))
    port = "" if target.port == 22 else f" -p {target.port}"
    scan = f"ssh-keyscan -H{port} {target.host} >> ~/.ssh/known_hosts"
    if isinstance(e, paramiko.BadHostKeyException):
        return (
            f"HOST KEY MISMATCH: the server offered {e.key.get_name()} {e.key.get_fingerprint().hex()} but "
            f"known_hosts ({files}) has another key for {server} (possible man-in-the-middle); if the host "
            f"was reinstalled, verify its new key and replace the entry (ssh-keygen -R {server})"
        )
    if isinstance(e, paramiko.SSHException) and "not found in known_hosts" in str(e):
        m = re.search(r"Server '([^']+)' not found", str(e))
        if m and m.group(1) != server:  # a jump host's key (ProxyJump, perhaps from ~/.ssh/config)
            return (
                f"host key unknown: jump host {m.group(1)} is not in {files}; verify its key out of band and "
                "add it there (host key checking is never disabled, on every hop)"
            )
        return (
            f"host key unknown: {server} is not in {files}; verify the host's key out of band, then: {scan} "
            "(host key checking is never disabled)"
        )
    if isinstance(e, paramiko.AuthenticationException):
        keys = ", ".join(target.key_files) or "default keys/agent"
        user = target.user or os.environ.get("USER", "?")
        return f"authentication failed for user {user} ({keys}): {one_line(str(e))}"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"connection timed out after {timeout:g}s (host down or a firewall drops port {target.port})"
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        errors = {str(err.strerror or err).lower() for err in e.errors.values()}
        return f"cannot connect to port {target.port}: {', '.join(sorted(errors))}"
    if isinstance(e, OSError):
        return f"cannot connect to port {target.port}: {e.strerror or e}"
    return f"ssh failed: {type(e).__name__}: {one_line(str(e))}"


def _keepalive(conn: Connection) -> None:
    """Notice a dead peer in ~20 s instead of TCP's default ~15 min, so fail-fast covers node loss."""
    transport = conn.transport
    transport.set_keepalive(5)
    sock = transport.sock
    if not isinstance(sock, socket.socket):
        return  # a ProxyCommand/jump channel: paramiko's keepalive is all we have
    # paramiko's transport thread wakes every 0.1 s (Transport._active_check_timeout) to poll for
    # close and keepalive; at 64 nodes those wake-ups were a third of the controller's CPU. Incoming
    # data still wakes it at once; close and the 5 s keepalive need no finer tick than POLL_S (issue #19).
    sock.settimeout(POLL_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (
        ("TCP_KEEPIDLE", 10),
        ("TCP_KEEPINTVL", 5),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", 20000),
    ):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
