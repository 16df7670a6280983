"""`ddp-launch stage`, review findings: ~ in DEST, what `serve` hands out and to whom, part files in a
shared DEST, a source file that changes between the scan and the push."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.node import stage as node
from ddp_train.launch.remote import stage


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def frame(rel: str, data: bytes) -> bytes:
    head = {"rel": rel, "size": len(data), "sha256": digest(data), "offset": 0}
    return json.dumps(head).encode() + b"\n" + data + b"{}\n"


def test_a_tilde_dest_is_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    (tmp_path / "home").mkdir()
    (tmp_path / "login").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "login")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"{}")))
    assert node.main(["inspect", "~/data"]) == 0
    assert (tmp_path / "home" / "data").is_dir()
    assert not (tmp_path / "login" / "~").exists()


# ---- serve ---------------------------------------------------------------------------------------


@contextmanager
def serving(dest: Path, staged: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> Iterator[int]:
    """`stage serve` in a thread with token `tok`; its port."""
    r, w = os.pipe()
    os.write(w, b"tok\n" + json.dumps(staged).encode() + b"\n")
    t = threading.Thread(target=node.serve, args=(str(dest), "127.0.0.1", os.fdopen(r, "rb")), daemon=True)
    t.start()
    out, deadline = "", time.monotonic() + 20
    while node.SERVE_MARK not in out and time.monotonic() < deadline:
        time.sleep(0.05)
        out += capsys.readouterr().out
    try:
        yield int(json.loads(out.split(node.SERVE_MARK, 1)[1].splitlines()[0])["port"])
    finally:
        os.close(w)
        t.join(10)


def ask(port: int, payload: bytes) -> bytes:
    """What the server sends back before it closes (the client gives up after 5 s: TimeoutError)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        try:
            c.sendall(payload)
            while block := c.recv(1 << 16):
                got += block
        except (ConnectionResetError, BrokenPipeError):
            pass
    return got


def request(rel: str, offset: int = 0, token: bytes = b"tok") -> bytes:
    return token + b"\n" + json.dumps({"rel": rel, "offset": offset}).encode() + b"\n"


def test_serve_hands_out_only_the_staged_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (dest / "a.bin").write_bytes(b"0123456789")
    (dest / "private.txt").write_bytes(b"not staged")
    (dest / "link.bin").symlink_to(outside / "secret")
    (dest / "sub").symlink_to(outside)
    staged = {"a.bin": [10, ""], "link.bin": [6, ""], "sub/secret": [6, ""]}
    with serving(dest, staged, capsys) as port:
        assert ask(port, request("a.bin", 4)) == b"456789"
        assert ask(port, request("a.bin", token=b"bad")) == b""
        assert ask(port, request("private.txt")) == b""
        assert ask(port, request("link.bin")) == b""
        assert ask(port, request("sub/secret")) == b""
        assert ask(port, b'tok\n["not", "a", "request"]\n') == b""


def test_serve_drops_a_silent_client_and_an_endless_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.bin").write_bytes(b"a")
    monkeypatch.setattr(node, "AUTH_TIMEOUT", 0.5)
    with serving(tmp_path, {"a.bin": [1, ""]}, capsys) as port:
        assert ask(port, b"") == b""  # closed after AUTH_TIMEOUT, not left open
        assert ask(port, b"t" * (node.LINE_MAX + 1)) == b""
        assert ask(port, request("a.bin")) == b"a"


# ---- part files ----------------------------------------------------------------------------------


def test_part_directory_is_private_and_the_file_gets_the_usual_mode(tmp_path: Path) -> None:
    node.recv(str(tmp_path), io.BytesIO(frame("a.bin", b"data")))
    assert stat.S_IMODE((tmp_path / node.PARTS).stat().st_mode) == 0o700
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "a.bin").stat().st_mode) == 0o666 & ~mask


def test_a_symlinked_part_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / node.PARTS).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match=r"\.ddp-stage is not a directory"):
        node.recv(str(tmp_path / "dest"), io.BytesIO(frame("a.bin", b"data")))
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_symlinked_part_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tmp_path / "dest" / node.PARTS).mkdir(parents=True)
    Path(node.part_path(str(tmp_path / "dest"), digest(b"data"))).symlink_to(victim)
    with pytest.raises(SystemExit, match=r"\.part: "):
        node.recv(str(tmp_path / "dest"), io.BytesIO(frame("a.bin", b"data")))
    assert victim.read_bytes() == b"keep me"


def test_a_part_directory_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / node.PARTS).mkdir()
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(SystemExit, match=f"belongs to user id {uid},"):
        node.recv(str(tmp_path), io.BytesIO(frame("a.bin", b"data")))


# ---- push ----------------------------------------------------------------------------------------


class Stream:
    """What push sends; `after_head` runs once the first header is out (the file changes mid-copy)."""

    def __init__(self, after_head: Any = None) -> None:
        self.sent, self.after_head = bytearray(), after_head

    def send(self, data: bytes) -> None:
        self.sent += data
        if self.after_head and data.endswith(b"}\n") and len(self.sent) == len(data):
            self.after_head()

    def lines(self) -> Iterator[str]:
        return iter([])

    def close_stdin(self) -> None:
        pass

    def wait(self, timeout: float) -> tuple[int, str]:
        return 0, ""

    def close(self) -> None:
        pass


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_push_stops_when_a_file_changed_since_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       when: str, change: str) -> None:  # fmt: skip
    data = os.urandom(3 * stage.CHUNK + 5)
    path = tmp_path / "a.bin"
    path.write_bytes(data)
    source = stage.scan(str(path))

    def alter() -> None:
        if change == "shorter":
            os.truncate(path, stage.CHUNK + 1)
        else:
            with open(path, "ab") as f:
                f.write(b"more")

    if when == "before":
        alter()
    fake = Stream(alter if when == "during" else None)
    monkeypatch.setattr(stage, "_recv_stream", lambda *a: fake)
    with pytest.raises(LaunchError, match=f"^stage SRC {path}: changed since the scan; run stage again$"):
        stage.push(None, None, "d", source, {"a.bin": 0}, stage.Progress(len(data), io.StringIO()))  # type: ignore[arg-type]
    body = bytes(fake.sent).split(b"\n", 1)[1] if fake.sent else b""
    assert len(body) <= len(data)  # never past the scanned size: the node's stream stays in step
    if when == "before":
        assert not fake.sent
