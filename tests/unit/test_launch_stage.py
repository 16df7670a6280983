"""`ddp-launch stage`: bad input is one line and exit 2; the node side resumes, repairs and refuses unsafe
paths; two local nodes (no SSH) get a directory, a rerun sends nothing, a corrupted file is repaired."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from ddp_train.launch import cli
from ddp_train.launch.node import stage as node
from ddp_train.launch.plan.inventory import load_nodes
from ddp_train.launch.remote import stage


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def local_inventory(tmp_path: Path, hosts: int = 2) -> Path:
    hv = {f"l{i}": {"ddp_workdir": str(tmp_path / f"work {i}")} for i in range(hosts)}
    for v in hv.values():
        Path(v["ddp_workdir"]).mkdir()
    inv = {"all": {"hosts": hv, "vars": {"ansible_connection": "local", "ddp_venv": sys.prefix}}}
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["stage", "SRC"], "--to"),
        (["stage", "--to", "x"], "SRC"),
        (["stage", "{missing}", "--to", "d", "--hosts", "{inv}"], "stage SRC"),
        (["stage", "{src}", "--to", "d", "--hosts", "{tmp}/nope.yml"], "nope.yml"),
        (["stage", "{src}", "--to", "", "--hosts", "{inv}"], "--to"),
        (["stage", "{src}", "--to", "d", "--hosts", "{inv}", "--forks", "0"], "--forks"),
        (["stage", "{src}", "--to", "d", "--hosts", "{inv}", "--connect-timeout", "x"], "--connect-timeout"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          needle: str) -> None:  # fmt: skip
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a")
    fill = {"src": str(src), "inv": str(local_inventory(tmp_path)), "missing": str(tmp_path / "missing"),
            "tmp": str(tmp_path)}  # fmt: skip
    argv = [a.format(**fill) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert needle in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_symlink_in_source_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link").symlink_to("/etc/hostname")
    with pytest.raises(Exception, match=r"link is a symbolic link"):
        stage.scan(str(tmp_path / "d"))


def test_help_says_how_a_relative_dest_resolves(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["stage", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "A relative DEST is taken against ddp_workdir, as a relative data.tokens.path is" in text


def test_dest_dir(tmp_path: Path) -> None:
    n = load_nodes([str(local_inventory(tmp_path, 1))])[0]
    assert stage.dest_dir(n, "data/x") == f"{tmp_path}/work 0/data/x"
    assert stage.dest_dir(n, "/abs") == "/abs"
    assert stage.dest_dir(n, "~/d") == "~/d"


def test_unsafe_paths_are_refused(tmp_path: Path) -> None:
    for rel in ("../x", "/etc/passwd", "a//b", ".ddp-stage/x.part", ""):
        with pytest.raises(SystemExit, match="unsafe path"):
            node.safe(str(tmp_path), rel)


def frame(rel: str, data: bytes, offset: int = 0) -> bytes:
    head = {"rel": rel, "size": len(data), "sha256": digest(data), "offset": offset}
    return json.dumps(head).encode() + b"\n" + data[offset:]


def test_recv_continues_a_part_and_redoes_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = os.urandom(300_000)
    part = Path(node.part_path(str(tmp_path), digest(data)))
    part.parent.mkdir()
    part.write_bytes(data[:100_000])
    node.recv(str(tmp_path), io.BytesIO(frame("sub/a.bin", data, 100_000) + b"{}\n"))
    assert (tmp_path / "sub" / "a.bin").read_bytes() == data
    assert not part.exists()
    part.write_bytes(b"x" * 100_000)  # a part that is not the file's start: the hash check throws it away
    node.recv(str(tmp_path), io.BytesIO(frame("b.bin", data, 100_000) + b"{}\n"))
    lines = [json.loads(ln.split(" ", 1)[1]) for ln in capsys.readouterr().out.splitlines()]
    assert lines == [{"rel": "sub/a.bin", "ok": True}, {"rel": "b.bin", "ok": False}]
    assert not (tmp_path / "b.bin").exists() and not part.exists()


def test_recv_keeps_the_part_when_the_controller_goes_away(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    with pytest.raises(SystemExit, match="went away after 20000 of 50000"):
        node.recv(str(tmp_path), io.BytesIO(frame("a.bin", data)[:-30_000]))
    assert Path(node.part_path(str(tmp_path), digest(data))).read_bytes() == data[:20_000]


def test_inspect_reports_missing_wrong_and_partial(tmp_path: Path) -> None:
    good, bad, half = b"good", b"bad!", os.urandom(1000)
    (tmp_path / "good").write_bytes(good)
    (tmp_path / "bad").write_bytes(b"BAD!")
    Path(node.part_path(str(tmp_path), digest(half))).parent.mkdir()
    Path(node.part_path(str(tmp_path), digest(half))).write_bytes(half[:400])
    wanted = {"good": [4, digest(good)], "bad": [4, digest(bad)], "half": [1000, digest(half)]}
    assert node.inspect(str(tmp_path), "", wanted)["need"] == {"bad": 0, "half": 400}


def test_two_local_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pushed to one, pulled node to node by the other; a rerun sends nothing; a corrupted file is redone."""
    src = tmp_path / "corpus"
    (src / "shards").mkdir(parents=True)
    blobs = {
        "meta.json": b'{"v": 1}',
        "shards/0.bin": os.urandom(3 << 20),
        "shards/1.bin": os.urandom(1 << 20),
    }
    for rel, data in blobs.items():
        (src / rel).write_bytes(data)
    inv = local_inventory(tmp_path)
    argv = ["stage", str(src), "--to", "data/corpus", "--hosts", str(inv)]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "stage: l0: 3 file(s), 4194312 bytes sent from this machine" in out
    assert "stage: l1: 3 file(s) from l0 (127.0.0.1)" in out
    for i in range(2):
        for rel, data in blobs.items():
            assert (tmp_path / f"work {i}" / "data/corpus" / rel).read_bytes() == data
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert out.count("up to date") == 2
    (tmp_path / "work 1/data/corpus/shards/1.bin").write_bytes(b"corrupt")
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert "stage: l0: up to date" in out
    assert "stage: l1: 1 file(s) from l0" in out
    assert (tmp_path / "work 1/data/corpus/shards/1.bin").read_bytes() == blobs["shards/1.bin"]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_tty_and_lines_otherwise() -> None:
    tty, said = Tty(), []
    p = stage.Progress(100 << 20, tty)
    say = p.wrap(lambda text: said.append((text, tty.getvalue())))
    p.add(50 << 20)
    assert tty.getvalue().startswith("\rstage: [" + "#" * 15 + " " * 15 + "] 50.0 MiB/100.0 MiB 50%")
    say("stage: node1: ...")
    assert said[0][1].endswith("\r\033[K")  # the bar is cleared before the line
    p.add(50 << 20)
    p.end()
    assert (
        tty.getvalue().endswith("100%" + tty.getvalue().rsplit("100%", 1)[1]) and tty.getvalue()[-1] == "\n"
    )
    plain = io.StringIO()
    p = stage.Progress(100, plain)
    for _ in range(100):
        p.add(1)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("stage: 100 B/100 B 100%"), lines
