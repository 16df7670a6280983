"""--sync without SSH: excludes, size limit, content digest, the archive path into a fake remote node
(a LocalSession standing in for the SSH one), and the command line of a user's script."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from ddp_train.launch.cli import main
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.node import command
from ddp_train.launch.plan.inventory import Node, SshTarget
from ddp_train.launch.plan.plan import NodePlan, Options, build_plan
from ddp_train.launch.remote.remote import LocalSession
from ddp_train.launch.remote.sync import (
    MANIFEST_NAME,
    SyncError,
    remote_dir,
    scan,
    ssh_command,
    sync_node,
)

REPO = Path(__file__).resolve().parents[2]
LOCAL_INV = str(REPO / "inventory" / "local")


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_gitignore_style_excludes(tmp_path: Path) -> None:
    tree(tmp_path, {
        ".gitignore": "# comment\n*.log\n!keep.log\n/build/\ndata/\n**/secret?.txt\n",
        ".ddpignore": "ckpt\n",
        "a.py": "", "keep.log": "", "x.log": "", "sub/y.log": "", "build/out.o": "", "sub/build/ok.py": "",
        "data/big.bin": "", "sub/data/big.bin": "", "datafile": "", "sub/deep/secret1.txt": "",
        "ckpt/model.pt": "", "sub/.gitignore": "local.txt\n", "sub/local.txt": "", "local.txt": "",
        ".git/HEAD": "", "pkg/__pycache__/m.cpython-311.pyc": "", "pkg/m.py": "", "odd name 'q' \"d\".py": "",
        "notes.tmp": "",
    })  # fmt: skip
    got = sorted(scan(str(tmp_path), exclude=["*.tmp"]).entries)
    assert got == sorted([
        ".ddpignore", ".gitignore", "a.py", "keep.log", "sub/build/ok.py", "datafile", "sub/.gitignore",
        "local.txt", "pkg/m.py", "odd name 'q' \"d\".py",
    ])  # fmt: skip


def test_digest_covers_content_and_exec_bit_not_mtime(tmp_path: Path) -> None:
    tree(tmp_path, {"train.py": "print(1)\n", "pkg/m.py": "X = 1\n"})
    first = scan(str(tmp_path)).digest
    os.utime(tmp_path / "train.py", (1, 1))
    assert scan(str(tmp_path)).digest == first
    (tmp_path / "train.py").chmod(0o755)
    assert scan(str(tmp_path)).digest != first
    (tmp_path / "train.py").chmod(0o644)
    (tmp_path / "pkg" / "m.py").write_text("X = 2\n")
    assert scan(str(tmp_path)).digest != first


def test_size_limit_is_one_line_naming_the_biggest_entries(tmp_path: Path) -> None:
    tree(tmp_path, {"train.py": "x" * 10})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.bin").write_bytes(b"\0" * 3000)
    (tmp_path / "data" / "b.bin").write_bytes(b"\0" * 3000)
    (tmp_path / "model.pt").write_bytes(b"\0" * 2000)
    with pytest.raises(LaunchError) as e:
        scan(str(tmp_path), max_bytes=4096)
    msg = str(e.value)
    assert "\n" not in msg
    assert "7.8 KiB is over the 4.0 KiB limit; biggest: data/ 5.9 KiB, model.pt 2.0 KiB, train.py 10 B" in msg
    assert len(scan(str(tmp_path), exclude=["data/"], max_bytes=4096).entries) == 2


def fake_remote(tmp_path: Path, workdir: Path, **ssh) -> Node:
    """A node that looks remote (so it gets a per-content copy) but is reached with a LocalSession."""
    return Node(name="n1", address="10.0.0.1", local=False, ssh=SshTarget(host="10.0.0.1", **ssh),
                venv=sys.prefix, workdir=str(workdir), nproc="1", master_port=29500, env={})  # fmt: skip


def verify(p: NodePlan, manifest) -> str:
    """What preflight's file check reports for the node's copy."""
    code, out = LocalSession(p.node).exec(command(p.node.venv, "files", "", p.sync_dir or "", "[]"))
    assert code == 0, out
    return json.loads(out.split("DDP-FILES ", 1)[1])["sync"]


def test_archive_sends_everything_then_nothing_then_only_the_changed_file(tmp_path: Path) -> None:
    src = tree(tmp_path / "my proj", {"train.py": "print(1)\n", "pkg/m.py": "X = 1\n", "odd 'name'.txt": "o"})
    (src / "train.py").chmod(0o755)
    node = fake_remote(tmp_path, tmp_path / "work dir")
    (tmp_path / "work dir").mkdir()

    def sync() -> tuple:
        m = scan(str(src))
        p = NodePlan(node=node, rank=1, env={}, argv=(), config_path=None, sync_dir=remote_dir(node, m))
        return sync_node(LocalSession(node), node, m, via="archive"), p, m

    res, p, m = sync()
    assert (res.via, res.files) == ("archive", 3) and res.bytes > 0
    copy = Path(p.sync_dir)
    assert copy.parent == tmp_path / "work dir" / ".ddp-launch" / "sync" and copy.name == m.name
    assert (copy / "pkg" / "m.py").read_text() == "X = 1\n" and os.access(copy / "train.py", os.X_OK)
    assert verify(p, m) == m.digest

    res, _, _ = sync()
    assert (res.via, res.files, res.bytes) == ("up-to-date", 0, 0)
    assert res.line("D") == "sync: n1: up to date (D), 0 files, 0 bytes sent"

    (src / "pkg" / "m.py").write_text("X = 2\n")
    res, p2, m2 = sync()
    assert (res.via, res.files) == ("archive", 1)
    new = Path(p2.sync_dir)
    assert new != copy and (new / "pkg" / "m.py").read_text() == "X = 2\n"
    assert (new / "train.py").stat().st_ino == (copy / "train.py").stat().st_ino  # linked, not sent
    assert verify(p2, m2) == m2.digest

    (new / "__pycache__").mkdir()  # what a run leaves next to the files does not count
    (new / "__pycache__" / "m.pyc").write_bytes(b"x")
    assert verify(p2, m2) == m2.digest
    (new / "odd 'name'.txt").write_text("changed on the node")
    assert verify(p2, m2) != m2.digest
    res, _, _ = sync()  # a copy changed on the node is sent again
    assert res.via == "archive" and verify(p2, m2) == m2.digest
    assert json.loads((new / MANIFEST_NAME).read_text()).keys() == m2.entries.keys()


def test_rsync_is_refused_with_a_password_and_ssh_keeps_host_key_checking(tmp_path: Path) -> None:
    src = tree(tmp_path / "p", {"a.py": ""})
    (tmp_path / "w").mkdir()
    node = fake_remote(tmp_path, tmp_path / "w", password="pw", known_hosts_files=("/k/one", "/k two"))
    m = scan(str(src))
    with pytest.raises(SyncError, match="n1: --sync-via rsync: password authentication"):
        sync_node(LocalSession(node), node, m, via="rsync")
    res = sync_node(LocalSession(node), node, m, via="auto")  # falls back to the archive, and says why
    assert (res.via, res.files) == ("archive", 1) and res.note.startswith("rsync: password authentication")
    assert "(rsync: password authentication" in res.line("D")
    argv = ssh_command(node.ssh, 10)
    assert "StrictHostKeyChecking=yes" in argv and "BatchMode=yes" in argv
    assert f'UserKnownHostsFile={os.path.expanduser("~/.ssh/known_hosts")} /k/one "/k two"' in argv
    assert "pw" not in " ".join(argv)


def test_plan_runs_the_script_in_the_copy_with_it_on_pythonpath(tmp_path: Path) -> None:
    src = tree(tmp_path / "proj", {"train.py": ""})
    m = scan(str(src))
    remote = fake_remote(tmp_path, tmp_path / "w")
    home = Node(**{**remote.__dict__, "name": "n2", "workdir": None, "env": {"PYTHONPATH": "/x"}})
    plan = build_plan([remote, home], Options(script="train.py", script_args=("--lr", "1"), sync=m,
                                              config=None, master_port=29500))  # fmt: skip
    a, b = plan.nodes
    assert a.cwd == f"{tmp_path}/w/.ddp-launch/sync/{m.name}" and a.env["PYTHONPATH"] == a.cwd
    assert b.cwd == f".ddp-launch/sync/{m.name}" and b.env["PYTHONPATH"] == ".:/x"
    assert a.argv[-3:] == ("train.py", "--lr", "1")
    plan = build_plan([home], Options(sync=m, config="/c/t.yaml", job_id="j1", master_port=29500))
    argv = plan.nodes[0].argv
    assert argv[argv.index("--config") + 1] == "../../j1/t.yaml"  # = ~/.ddp-launch/j1/t.yaml from the copy


def dry(argv: list[str], capsys, cwd: Path | None = None) -> tuple[int, str, str]:
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        try:
            code = main(["--dry-run", *argv])
        except SystemExit as e:
            code = int(e.code or 0)
    finally:
        os.chdir(old)
    out, err = capsys.readouterr()
    return code, out, err


def node_argv(out: str) -> list[str]:
    line = next(ln for ln in out.splitlines() if ln.startswith("cd -- "))
    return shlex.split(line.split(" && ", 1)[1])


def test_script_and_module_have_torchruns_meaning(tmp_path: Path, capsys) -> None:
    tree(tmp_path / "proj", {"train.py": "", "pkg/__init__.py": "", "pkg/mod.py": ""})
    code, out, err = dry(["--hosts", LOCAL_INV, "--sync", "proj", "proj/train.py", "--lr", "3",
                          "--", "x", "--dry-run"], capsys, tmp_path)  # fmt: skip
    assert code == 0, err
    argv = node_argv(out)
    assert argv[argv.index("--master-port") + 2 :] == ["train.py", "--lr", "3", "--", "x", "--dry-run"]
    assert "# sync " in out and f"cd -- {tmp_path}/proj " in out
    code, out, err = dry(["--hosts", LOCAL_INV, "--sync", "proj", "-m", "pkg.mod", "--x"], capsys, tmp_path)
    assert code == 0, err
    assert node_argv(out)[-3:] == ["-m", "pkg.mod", "--x"]
    code, out, err = dry(["--hosts", LOCAL_INV, "--set", "train.max_steps=3", "--", "--y"], capsys, tmp_path)
    assert code == 0 and node_argv(out)[-5:] == ["-m", "ddp_train", "--set", "train.max_steps=3", "--y"]
    code, out, err = dry(["--hosts", LOCAL_INV, "-e", "ddp_sync_dir=proj", "proj/train.py"], capsys, tmp_path)
    assert code == 0 and "# sync " in out and node_argv(out)[-1] == "train.py"
    code, out, err = dry(["--hosts", LOCAL_INV, "-e", "ddp_sync_dir=proj", "--no-sync"], capsys, tmp_path)
    assert code == 0 and "# sync " not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sync", "proj", "elsewhere.py"], "elsewhere.py: not inside the synced directory"),
        (["--sync", "proj", "proj/skip.log"], "proj/skip.log: not among the synced files"),
        (
            ["--sync", "proj", "--config", "proj/c.yaml", "proj/train.py"],
            "--config/--set/--fresh/`-- args` are for",
        ),
        (["-m"], "-m/--module: name the module to run"),
        (["--sync", "nodir", "t.py"], "--sync nodir: not a directory"),
        (
            ["--sync", "proj", "--sync-max-size", "12", "proj/train.py"],
            "--sync proj: 18 B is over the 12 B limit",
        ),
        (["--sync", "proj", "--sync-max-size", "lots"], "--sync-max-size 'lots': expected a size"),
        (
            ["-e", '{"ddp_sync_exclude": [1]}', "--sync", "proj"],
            "ddp_sync_exclude: expected a list of patterns",
        ),
    ],
)
def test_bad_script_or_sync_input_is_one_line_and_exit_2(argv, message, tmp_path: Path, capsys) -> None:
    tree(tmp_path / "proj", {"train.py": "x" * 10, "c.yaml": "{}", ".gitignore": "*.log\n", "skip.log": ""})
    (tmp_path / "elsewhere.py").write_text("")
    code, out, err = dry(["--hosts", LOCAL_INV, *argv], capsys, tmp_path)
    assert code == 2, out + err
    assert message in err and err.count("\n") == 1 and err.startswith("ddp-launch: error: "), err
