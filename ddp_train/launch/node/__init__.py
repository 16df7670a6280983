"""Code that runs on the nodes: stdlib-only modules, shipped from this package's own files.

Each command runs `<venv>/bin/python -c SCRIPT ARGS`, where SCRIPT is `boot.py`, the sources of the
module and of the sibling modules it imports (`from . import x`), and a call of the module's `main`.
The job's environment is never on that command line: with `env=True` the command first reads it as one
JSON line from its stdin (`env_line`), then execs the script with it (`envexec.py`, issue #24).
"""

from __future__ import annotations

import ast
import functools
import json
import shlex
import threading
from collections.abc import Mapping
from importlib import resources
from typing import Any

PACKAGE = __name__
# ast on CPython 3.11 is not thread-safe: concurrent parses (one per node's session thread) can raise
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). Parsed once, under a lock.
_PARSE_LOCK = threading.Lock()


def _text(module: str) -> str:
    return resources.files(PACKAGE).joinpath(f"{module}.py").read_text(encoding="utf-8")


@functools.cache
def _siblings(module: str) -> tuple[str, ...]:
    """The modules `module` imports with `from . import x` (each before the module that imports it)."""
    out: list[str] = []
    with _PARSE_LOCK:
        tree = ast.parse(_text(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out += [n.split(".")[0] for n in names]
    return tuple(out)


def sources(module: str) -> dict[str, str]:
    """`module` and every sibling it needs, dependencies first: name -> source text."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in _siblings(name):
            visit(dep)
        order.append(name)

    visit(module)
    return {name: _text(name) for name in order}


def script(module: str) -> str:
    """The `python -c` source that runs `module.main(sys.argv[1:])` on a node and exits with its code."""
    return f"{_text('boot')}\nrun({sources(module)!r}, {module!r})\n"


def command(venv: str, module: str, *args: str, env: bool = False) -> str:
    """The shell command (shlex-quoted) running node module `module` with the node's venv python.

    env=False: the command reads nothing and runs without the job's environment (file operations).
    env=True: its first stdin line must be `env_line(...)`; the module runs with that environment."""
    python = f"{venv.rstrip('/')}/bin/python"
    if env:
        return shlex.join(["exec", python, "-c", _text("envexec"), script(module), *args])
    return shlex.join([python, "-c", script(module), *args])


def env_line(env: Mapping[str, str]) -> bytes:
    """The first stdin line of an env=True `command`: the variables to run with, as JSON."""
    return (json.dumps(dict(env), ensure_ascii=True) + "\n").encode()


def marked_json(output: str, mark: str) -> Any:
    """The JSON value on the last line of `output` that starts with `mark`; None when there is none.

    ValueError when that line is not JSON (the caller names what it was reading)."""
    lines = [ln for ln in output.splitlines() if ln.startswith(mark)]
    if not lines:
        return None
    return json.loads(lines[-1][len(mark) :])
