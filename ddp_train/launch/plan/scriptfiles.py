"""The script check's reading (scriptcheck.py): the script and the local modules it imports, each
parsed once and indexed (every node's parent and function, the nodes the checks look at, the
`# ddp-launch: ignore[...]` lines), and the records a finding is made of.

Its underscored names are the script check's own, shared by its modules (scriptfiles, scriptflow,
scriptfacts, scriptrules, scriptcheck); the public API is scriptcheck.py's.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path

MAX_FILES = 300  # local modules followed; a project bigger than this is checked partly

MAX_BYTES = 2_000_000  # a bigger "module" is data, not code

IGNORE = re.compile(r"#\s*ddp-launch:\s*ignore\[([A-Za-z0-9_,\s-]+)\]")

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.While, ast.With,
            ast.Try, ast.AsyncFor, ast.AsyncWith)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Finding:
    """One mistake: where, its code (for ignore[...]) and the line to print."""

    path: str
    line: int
    code: str
    message: str  # "what is wrong; what to write instead"

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend written as a literal in init_process_group (checked against the nodes later)."""

    path: str
    line: int
    name: str  # nccl | gloo | ...


@dataclasses.dataclass
class _File:
    path: Path
    shown: str
    tree: ast.Module
    ignores: dict[int, set[str]]
    parents: dict[ast.AST, ast.AST]
    nodes: list[ast.AST]  # the kinds the checks look at, in source order
    lines: list[str]
    scopes: dict[ast.AST, ast.AST]  # each indexed node's function (or the module)
    source: str
    flow: _Flow | None = None  # built on first use


class _Project:
    def __init__(self, roots: Sequence[Path], shown_base: Path) -> None:
        self.roots = roots
        self.base = shown_base
        self.files: list[_File] = []
        self.seen: set[Path] = set()
        self.errors: list[Finding] = []
        self.listings: dict[Path, set[str]] = {}

    def shown(self, path: Path) -> str:
        if self.base == Path("/"):
            return str(path)
        return str(path.relative_to(self.base))

    def load(self, script: Path) -> None:
        queue = [script]
        while queue and len(self.files) < MAX_FILES:
            path = queue.pop(0)
            if path in self.seen:
                continue
            self.seen.add(path)
            f = self._parse(path)
            if f is None:
                continue
            self.files.append(f)
            queue += [p for p in self._imports(f) if p not in self.seen]

    def _parse(self, path: Path) -> _File | None:
        shown = self.shown(path)
        try:
            if path.stat().st_size > MAX_BYTES:
                return None
            source = path.read_bytes().decode("utf-8")
            tree = ast.parse(source, filename=shown)
        except OSError as e:
            why = f"cannot read it ({e.strerror}); make it readable"
            self.errors.append(Finding(shown, 1, "syntax", why))
            return None
        except UnicodeDecodeError as e:
            self.errors.append(Finding(shown, 1, "syntax", f"not UTF-8 ({e.reason}); save it as UTF-8"))
            return None
        except SyntaxError as e:
            self.errors.append(Finding(shown, e.lineno or 1, "syntax", (
                f"cannot parse it ({e.msg}), so every rank would fail at start; fix the syntax "
                "(the check reads the script, it does not run it)")))  # fmt: skip
            return None
        ignores: dict[int, set[str]] = {}
        for i, text in enumerate(source.splitlines(), 1):
            if "ddp-launch" in text:
                m = IGNORE.search(text)
                if m:
                    ignores[i] = {c.strip() for c in m.group(1).split(",") if c.strip()}
        parents, nodes, scopes = _index(tree)
        return _File(path, shown, tree, ignores, parents, nodes, source.splitlines(), scopes, source)

    def _imports(self, f: _File) -> list[Path]:
        found: list[Path] = []
        for node in f.nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found += self._module(alias.name, self.roots)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = f.path.parent
                    for _ in range(node.level - 1):
                        base = base.parent
                    bases = [base]
                    name = node.module or ""
                else:
                    bases, name = list(self.roots), node.module or ""
                if name:
                    found += self._module(name, bases)
                for alias in node.names:  # `from pkg import mod`: mod may be a submodule
                    sub = f"{name}.{alias.name}" if name else alias.name
                    found += self._module(sub, bases, whole_only=True)
        return found

    def _module(self, name: str, bases: Sequence[Path], whole_only: bool = False) -> list[Path]:
        """The local files importing `name` runs: each package's __init__.py and the module itself."""
        parts = name.split(".")
        for base in bases:
            if not self._listed(base) & {parts[0], f"{parts[0]}.py"}:
                continue  # `import torch`: one directory listing, not a stat per path tried
            out = []
            for i in range(1, len(parts) + 1):
                stem = base.joinpath(*parts[:i])
                last = i == len(parts)
                if (stem / "__init__.py").is_file():
                    if not whole_only or last:
                        out.append((stem / "__init__.py").resolve())
                elif stem.with_suffix(".py").is_file() and last:
                    out.append(stem.with_suffix(".py").resolve())
                elif not stem.is_dir():
                    out = [] if last or not out else out
                    break
            if out:
                return [p for p in out if self._inside(p)]
        return []

    def _listed(self, base: Path) -> set[str]:
        if base not in self.listings:
            try:
                self.listings[base] = set(os.listdir(base))
            except OSError:
                self.listings[base] = set()
        return self.listings[base]

    def _inside(self, path: Path) -> bool:
        return any(path.is_relative_to(r) for r in self.roots)


def _ignored_span(f: _File, finding: Finding) -> bool:
    """An ignore comment on any line of the statement that holds the finding's line."""
    for node in f.parents:
        end = node.end_lineno or node.lineno if isinstance(node, ast.stmt) else 0
        if end and node.lineno <= finding.line <= end and not isinstance(node, COMPOUND):
            return any(finding.code in f.ignores.get(i, ()) for i in range(node.lineno, end + 1))
    return False


def _ignored_node(f: _File, node: ast.AST, code: str) -> bool:
    return code in f.ignores.get(node.lineno, ()) or _ignored_span(f, Finding(f.shown, node.lineno, code, ""))


INDEXED = (ast.Call, ast.Subscript, ast.JoinedStr, ast.Constant, ast.Assign, ast.Import, ast.ImportFrom,
           ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.For, ast.AsyncFor, ast.With, ast.AsyncWith,
           ast.FunctionDef, ast.AsyncFunctionDef)  # fmt: skip

_INDEXED = frozenset(INDEXED)

_SCOPES = frozenset(SCOPES)

_LEAVES = frozenset((ast.Constant, ast.Name))

# fields that never hold a node the checks need: names, operators, contexts, flags
_NOT_NODES = frozenset(("ctx", "id", "attr", "arg", "name", "op", "ops", "type_comment", "kind",
                        "conversion", "level", "module", "is_async", "simple"))  # fmt: skip

_FIELDS: dict[type, tuple[str, ...]] = {}


def _index(tree: ast.Module) -> tuple[dict[ast.AST, ast.AST], list[ast.AST], dict[ast.AST, ast.AST]]:
    """One pass over the tree (ast.walk is several times slower): every node's parent, the nodes the
    checks look at, in source order, and the function (or module) each of those is in."""
    parents: dict[ast.AST, ast.AST] = {}
    nodes: list[ast.AST] = []
    scopes: dict[ast.AST, ast.AST] = {}
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    AST = ast.AST
    while stack:
        node, scope = stack.pop()
        cls = type(node)
        if cls in _INDEXED:
            nodes.append(node)
            scopes[node] = scope
        inner = node if cls in _SCOPES else scope
        fields = _FIELDS.get(cls)
        if fields is None:
            fields = () if cls in _LEAVES else tuple(f for f in cls._fields if f not in _NOT_NODES)
            _FIELDS[cls] = fields
        for field in fields:
            value = getattr(node, field, None)
            if value.__class__ is list:
                for child in value:
                    if isinstance(child, AST):
                        parents[child] = node
                        stack.append((child, inner))
            elif isinstance(value, AST):
                parents[value] = node
                stack.append((value, inner))
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]
    return parents, nodes, scopes


@dataclasses.dataclass
class _Flow:
    names: dict[tuple[ast.AST, str], list[ast.AST | None]]  # (scope, name) -> values (None: unknown)
    params: set[tuple[ast.AST, str]]  # (function, parameter)
    options: dict[str, tuple[ast.AST | None, int, str]]  # argparse dest -> (default, line, flag)
    attrs: dict[str, list[tuple[ast.AST | None, ast.AST]]]  # `x.attr = value`: attr -> (value, scope)
    functions: dict[str, list[ast.AST]]


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _src(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # unparse of odd trees; the message stays useful without it
        return "..."
    return text if len(text) <= 60 else text[:57] + "..."
