"""The code that runs on nodes (ddp_train/launch/node): stdlib-only modules shipped from the package's
own files, the environment on stdin (never argv), one parser for their marked output lines."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_train.launch import node

NODE_DIR = Path(node.__file__).parent
MODULES = sorted(p.stem for p in NODE_DIR.glob("*.py") if p.stem != "__init__")
RUN_ON_NODES = [m for m in MODULES if m not in ("boot", "envexec", "tree")]  # the others are parts


def imports(path: Path) -> list[tuple[int, str]]:
    """(level, top-level module) of every import in the file."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out += [(0, a.name.split(".")[0]) for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            out.append((n.level, (n.module or "").split(".")[0]))
    return out


@pytest.mark.parametrize("module", MODULES)
def test_node_modules_import_only_the_stdlib_and_each_other(module: str) -> None:
    """A node runs them with whatever python its venv has: nothing of ours but the shipped siblings.
    The probe alone imports torch and ddp_train, inside a try, as the facts it reports."""
    allowed = set(sys.stdlib_module_names) | ({"torch", "ddp_train"} if module == "probe" else set())
    for level, name in imports(NODE_DIR / f"{module}.py"):
        assert level == 1 or name in allowed, f"{module}.py imports {name}"


def test_a_script_carries_the_module_and_the_siblings_it_imports_first() -> None:
    assert list(node.sources("files")) == ["tree", "files"]
    assert list(node.sources("sync")) == ["tree", "sync"]
    assert list(node.sources("connector")) == ["connector"]
    text = node.script("files")
    assert text.startswith((NODE_DIR / "boot.py").read_text())
    shipped = eval(text.rsplit("\nrun(", 1)[1].rsplit(", ", 1)[0])  # noqa: S307 (our own literal)
    assert shipped == {m: (NODE_DIR / f"{m}.py").read_text() for m in ("tree", "files")}


@pytest.mark.parametrize("module", RUN_ON_NODES)
def test_every_shipped_module_has_a_main_and_compiles_as_its_script(module: str) -> None:
    compile(node.script(module), module, "exec")
    assert "def main(argv: list[str]" in (NODE_DIR / f"{module}.py").read_text()


def test_a_node_module_runs_from_its_script_alone_in_an_empty_directory(tmp_path: Path) -> None:
    """No ddp_train on the path: python -I ignores PYTHONPATH and the current directory."""
    (tmp_path / "a.txt").write_text("hello")
    argv = [sys.executable, "-I", "-c", node.script("files"), str(tmp_path), "", json.dumps(["a.txt", "b"])]
    res = subprocess.run(argv, cwd="/", capture_output=True, text=True, timeout=60)
    found = node.marked_json(res.stdout, "DDP-FILES ")
    assert found["files"]["a.txt"][0] == 5 and found["files"]["b"] == "No such file or directory", res.stderr


def test_a_failing_step_exits_non_zero_with_its_message(tmp_path: Path) -> None:
    cmd = node.command(sys.prefix, "sync", "finish", str(tmp_path), "x", str(tmp_path / "none"), "0" * 64)
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "content digest" in res.stderr and "expected 0000" in res.stderr


def test_the_environment_goes_on_stdin_never_on_the_command_line() -> None:
    secret = "s3cr3t-" + os.urandom(4).hex()
    cmd = node.command(sys.prefix, "connector", "[]", "token", "1", env=True)
    assert secret not in cmd and cmd.startswith("exec ")
    # envexec reads its first stdin line as the environment, then execs the script with it
    argv = shlex.split(cmd)[1:4] + ["import os; print('GOT', os.environ['DDP_T_SECRET'])"]
    res = subprocess.run(argv, input=node.env_line({"DDP_T_SECRET": secret}), capture_output=True, timeout=60)
    assert res.stdout.decode().split() == ["GOT", secret], res.stderr
    res = subprocess.run(["bash", "-c", cmd], input=node.env_line({}), capture_output=True, timeout=60)
    assert node.marked_json(res.stdout.decode(), "DDP-CONNECT ") == {}


def test_without_env_the_command_reads_no_stdin_and_has_no_exec() -> None:
    cmd = node.command("/v/", "space", "", "[]")
    assert shlex.split(cmd)[:2] == ["/v/bin/python", "-c"]


def test_marked_json_takes_the_last_marked_line() -> None:
    out = 'noise\nDDP-X {"a": 1}\nDDP-XY 2\nDDP-X {"a": 2}\ntail'
    assert node.marked_json(out, "DDP-X ") == {"a": 2}
    assert node.marked_json("nothing here", "DDP-X ") is None
    with pytest.raises(ValueError):
        node.marked_json("DDP-X {not json", "DDP-X ")


@pytest.mark.slow
def test_ruff_and_mypy_pass_on_the_node_modules(tmp_path: Path) -> None:
    """The node code is linted and type-checked like the rest ([tool.mypy] in pyproject: strict here)."""
    pytest.importorskip("mypy")
    repo = NODE_DIR.parents[2]
    ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(NODE_DIR)], cwd=repo,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ruff.returncode == 0, ruff.stdout + ruff.stderr
    mypy = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)], cwd=repo,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert mypy.returncode == 0, mypy.stdout + mypy.stderr
