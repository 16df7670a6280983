"""The script check: DDP mistakes in the user's script and the local modules it imports, read with `ast`.

Nothing is executed. Each finding is one line `file:line: what is wrong; what to write instead`; a
`# ddp-launch: ignore[<code>]` comment on the finding's line (or any line of its statement) silences it.
The backend check (`backend`) needs preflight's GPU facts per node, so it runs after preflight.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

CODES = {
    "init-args": "init_process_group given a fixed rank, world_size or init_method address (a literal, a "
    "constant, an argparse default, mp.spawn's index or torch.cuda.device_count())",
    "local-rank-arg": "rank read from an argparse --local_rank/--local-rank option torchrun does not pass",
    "mpi-env": "rank or size read from mpirun's environment (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK)",
    "cuda-device": "CUDA used with no device chosen per process (all processes share GPU 0)",
    "set-epoch": "a DistributedSampler and no set_epoch call (every epoch sees the same order)",
    "sampler-shuffle": "DataLoader(shuffle=True, sampler=...): a ValueError on every rank",
    "env-set": "MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE or LOCAL_RANK assigned in os.environ "
    "(overrides torchrun's)",
    "spawn": "mp.spawn / mp.Process starting the DDP workers (a single-node launcher, under torchrun)",
    "save-rank": "torch.save not guarded by the global rank (every rank, or once per node, writes the "
    "same file)",
    "backend": "backend hard-coded against the nodes' GPUs (nccl without GPUs, gloo on GPU nodes)",
    "syntax": "a file the check cannot read or parse",
}
MAX_FILES = 300  # local modules followed; a project bigger than this is checked partly
MAX_BYTES = 2_000_000  # a bigger "module" is data, not code
IGNORE = re.compile(r"#\s*ddp-launch:\s*ignore\[([A-Za-z0-9_,\s-]+)\]")
MPI_ENV = {
    "OMPI_COMM_WORLD_RANK": "RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
    "PMI_RANK": "RANK",
    "PMI_SIZE": "WORLD_SIZE",
    "PMIX_RANK": "RANK",
    "MV2_COMM_WORLD_RANK": "RANK",
    "MV2_COMM_WORLD_SIZE": "WORLD_SIZE",
}
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
RANK_WORDS = re.compile(r"rank|master|main_process|is_main|primary|leader|is_zero", re.IGNORECASE)
LOCAL_WORDS = re.compile(r"local|^gpu|device_id", re.IGNORECASE)  # a rank within the node
RANK_ENV = {"RANK": "global", "SLURM_PROCID": "global", "OMPI_COMM_WORLD_RANK": "global",
            "PMI_RANK": "global", "LOCAL_RANK": "local", "SLURM_LOCALID": "local",
            "OMPI_COMM_WORLD_LOCAL_RANK": "local"}  # fmt: skip
RANK_CALLS = {"get_rank": "global", "get_global_rank": "global", "get_local_rank": "local",
              "current_device": "local", "get_node_local_rank": "local"}  # fmt: skip
# what torchrun sets for each process: a script that assigns one overrides it
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
TORCHRUN_VARS = frozenset((*LAUNCH_ENV, "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"))
OTHER_LAUNCHERS = frozenset((*MPI_ENV, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID"))
CUDA_LITERAL = re.compile(r"^cuda(:\d+)?$")
# init_process_group(backend, init_method, timeout, world_size, rank, ...)
INIT_POSITIONS = {1: "init_method", 3: "world_size", 4: "rank"}
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


@dataclasses.dataclass(frozen=True)
class ScriptCheck:
    """What the check found in the script and its local modules."""

    findings: tuple[Finding, ...]
    files: tuple[str, ...]  # every file read, the script first
    backends: tuple[Backend, ...] = ()

    def summary(self, findings: Sequence[Finding] | None = None) -> str:
        """One line after the findings: how many, their codes in order, how to silence one."""
        found = self.findings if findings is None else findings
        codes = ", ".join(f.code for f in found)
        return (
            f"script check: {len(found)} finding(s) in {len(self.files)} file(s) (codes, in order: {codes}); "
            "silence one with `# ddp-launch: ignore[<code>]` on its line, or set ddp_script_check: off"
        )


def check_script(script: str | Path, roots: Iterable[str | Path] = ()) -> ScriptCheck:
    """Read `script` and the modules it imports from its own directory and `roots` (the synced dir)."""
    script = Path(script).resolve()
    search = [script.parent, *(Path(r).resolve() for r in roots)]
    search = list(dict.fromkeys(search))
    project = _Project(search, shown_base=_shown_base(script, search))
    project.load(script)
    return project.check()


def module_file(module: str, exists: Callable[[str], bool], init: bool = True) -> str | None:
    """The file `python -m module` runs, relative to its root: pkg/mod.py, else pkg/mod/__main__.py, else
    (with `init`) pkg/mod/__init__.py (read for the script check: it runs first); None when `exists` has
    none of them. `check-script -m` passes init=False: a package without __main__.py cannot be run.

    `exists(rel)`: whether that file is there (a directory on disk, or a --sync manifest's entries)."""
    rel = module.replace(".", "/")
    found = (f"{rel}.py", f"{rel}/__main__.py") + ((f"{rel}/__init__.py",) if init else ())
    return next((f for f in found if exists(f)), None)


def backend_findings(check: ScriptCheck, gpus: Mapping[str, int]) -> list[Finding]:
    """Finding 8: a literal nccl on nodes without a usable GPU, or gloo on nodes with GPUs.

    `gpus`: the GPU count preflight found on each node (0: none usable)."""
    out = []
    without = [n for n, g in gpus.items() if not g]
    with_gpus = [n for n, g in gpus.items() if g]
    for b in check.backends:
        if b.name == "nccl" and without:
            out.append(Finding(b.path, b.line, "backend", (
                f"backend 'nccl' is hard-coded but {', '.join(without)} {_have(without)} no usable GPU "
                "(NCCL needs one per process, the job would fail at its first collective); write "
                "init_process_group('nccl' if torch.cuda.is_available() else 'gloo')")))  # fmt: skip
        elif b.name == "gloo" and with_gpus and not without:
            out.append(Finding(b.path, b.line, "backend", (
                f"backend 'gloo' is hard-coded but {', '.join(with_gpus)} {_have(with_gpus)} GPUs "
                "(gloo moves CUDA tensors through the CPU, many times slower than NCCL); write "
                "init_process_group('nccl' if torch.cuda.is_available() else 'gloo')")))  # fmt: skip
    return out


def _have(nodes: Sequence[str]) -> str:
    return "has" if len(nodes) == 1 else "have"


def _shown_base(script: Path, roots: Sequence[Path]) -> Path:
    """Paths are shown relative to the current directory when inside it, else as they are."""
    try:
        script.relative_to(Path.cwd())
        return Path.cwd()
    except ValueError:
        return Path("/")


# ---- reading the project ------------------------------------------------------------------------


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

    # ---- the checks ---------------------------------------------------------------------------------

    def check(self) -> ScriptCheck:
        facts = _Facts()
        for f in self.files:
            _collect(f, facts)
        found = list(self.errors) + facts.findings
        found += _init_findings(self.files, facts)
        found += _local_rank_findings(self.files, facts)
        found += _cuda_findings(facts)
        if facts.samplers and not facts.set_epoch:
            f, node = facts.samplers[0]
            found.append(Finding(f.shown, node.lineno, "set-epoch", (
                "DistributedSampler without any sampler.set_epoch(epoch) call, so every epoch sees the same "
                "order of samples; call sampler.set_epoch(epoch) at the start of each epoch")))  # fmt: skip
        found += _save_findings(self.files, facts)
        kept = [x for x in found if not self._ignored(x)]
        kept.sort(key=lambda x: (self._order(x.path), x.line, x.code))
        backends = [b for b, node, f in facts.backends if not _ignored_node(f, node, "backend")]
        return ScriptCheck(tuple(kept), tuple(f.shown for f in self.files), tuple(backends))

    def _order(self, shown: str) -> int:
        return next((i for i, f in enumerate(self.files) if f.shown == shown), len(self.files))

    def _ignored(self, finding: Finding) -> bool:
        f = next((x for x in self.files if x.shown == finding.path), None)
        if f is None:
            return False
        return finding.code in f.ignores.get(finding.line, ()) or _ignored_span(f, finding)


def _ignored_span(f: _File, finding: Finding) -> bool:
    """An ignore comment on any line of the statement that holds the finding's line."""
    for node in f.parents:
        end = node.end_lineno or node.lineno if isinstance(node, ast.stmt) else 0
        if end and node.lineno <= finding.line <= end and not isinstance(node, COMPOUND):
            return any(finding.code in f.ignores.get(i, ()) for i in range(node.lineno, end + 1))
    return False


def _ignored_node(f: _File, node: ast.AST, code: str) -> bool:
    return code in f.ignores.get(node.lineno, ()) or _ignored_span(f, Finding(f.shown, node.lineno, code, ""))


@dataclasses.dataclass
class _Init:
    """An init_process_group call: what is wrong in it already, and arguments that are a spawned
    function's parameters (wrong only when that function runs under mp.spawn)."""

    file: _File
    node: ast.Call
    bad: list[str]
    params: list[tuple[str, ast.AST]]  # ("rank=rank", the function whose parameter it is)
    options: list[str]  # argparse options whose defaults are among `bad`


@dataclasses.dataclass
class _Facts:
    findings: list[Finding] = dataclasses.field(default_factory=list)
    cuda_uses: list[tuple[_File, ast.AST, str]] = dataclasses.field(default_factory=list)
    pinned: list[tuple[_File, ast.AST, str]] = dataclasses.field(default_factory=list)  # literal index
    device_choice: bool = False
    one_gpu_each: bool = False  # CUDA_VISIBLE_DEVICES set per process: GPU 0 is the process's own
    samplers: list[tuple[_File, ast.AST]] = dataclasses.field(default_factory=list)
    set_epoch: bool = False
    saves: list[tuple[_File, ast.Call]] = dataclasses.field(default_factory=list)
    backends: list[tuple[Backend, ast.AST, _File]] = dataclasses.field(default_factory=list)
    inits: list[_Init] = dataclasses.field(default_factory=list)
    local_rank_options: list[tuple[_File, ast.Call, str, str]] = dataclasses.field(default_factory=list)
    spawns: list[tuple[_File, ast.Call, ast.AST]] = dataclasses.field(default_factory=list)  # (.., fn)


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


# ---- simple data flow within one file ---------------------------------------------------------------
# A name assigned once in its function (or, if never in it, once at module level) stands for that value;
# `args.x` stands for the default of the argparse option whose dest is x, unless some `.x` is assigned
# in the file. Nothing crosses a module boundary and nothing is run: a value given on the command line,
# read from a file or computed by a call is not known, and not a finding.


@dataclasses.dataclass
class _Flow:
    names: dict[tuple[ast.AST, str], list[ast.AST | None]]  # (scope, name) -> values (None: unknown)
    params: set[tuple[ast.AST, str]]  # (function, parameter)
    options: dict[str, tuple[ast.AST | None, int, str]]  # argparse dest -> (default, line, flag)
    attrs: dict[str, list[tuple[ast.AST | None, ast.AST]]]  # `x.attr = value`: attr -> (value, scope)
    functions: dict[str, list[ast.AST]]


@dataclasses.dataclass(frozen=True)
class _Val:
    node: ast.AST
    scope: ast.AST
    options: tuple[str, ...] = ()  # the argparse options whose defaults it went through


def _scope(f: _File, node: ast.AST) -> ast.AST:
    known = f.scopes.get(node)
    if known is not None:
        return known
    cur = f.parents.get(node)
    while cur is not None and not isinstance(cur, SCOPES):
        cur = f.parents.get(cur)
    return cur if cur is not None else f.tree


def _flow(f: _File) -> _Flow:
    if f.flow is None:
        f.flow = _build_flow(f)
    return f.flow


def _build_flow(f: _File) -> _Flow:
    fl = _Flow({}, set(), {}, {}, {})

    def bind(scope: ast.AST, target: ast.AST, value: ast.AST | None) -> None:
        if isinstance(target, ast.Name):
            fl.names.setdefault((scope, target.id), []).append(value)
        elif isinstance(target, (ast.Tuple, ast.List)):
            same = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
            values = value.elts if same else [None] * len(target.elts)  # type: ignore[union-attr]
            for t, v in zip(target.elts, values):
                bind(scope, t, None if isinstance(t, ast.Starred) else v)
        elif isinstance(target, ast.Starred):
            bind(scope, target.value, None)
        elif isinstance(target, ast.Attribute):
            fl.attrs.setdefault(target.attr, []).append((value, scope))

    for node in f.nodes:
        if isinstance(node, ast.Assign):
            scope = _scope(f, node)
            for t in node.targets:
                bind(scope, t, node.value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            bind(_scope(f, node), node.target, node.value)
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor)):
            bind(_scope(f, node), node.target, None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    bind(_scope(f, node), item.optional_vars, None)
        elif isinstance(node, ast.NamedExpr):
            bind(_scope(f, node), node.target, node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fl.functions.setdefault(node.name, []).append(node)
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg):
                if arg is not None:
                    fl.params.add((node, arg.arg))
            fl.names.setdefault((_scope(f, node), node.name), []).append(None)
        elif isinstance(node, ast.Call) and _name(node.func) == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            longs = [x for x in flags if x.startswith("--")] or flags
            dest = kw.get("dest")
            name = dest.value if isinstance(dest, ast.Constant) else (longs[0].lstrip("-") if longs else "")
            if name:
                flag = longs[0] if longs else str(name)
                fl.options[str(name).replace("-", "_")] = (kw.get("default"), node.lineno, flag)
    return fl


def _value(f: _File, node: ast.AST, scope: ast.AST, options: bool = True, depth: int = 8) -> _Val | None:
    """What `node` stands for, followed through names assigned once, module constants and (with
    `options`) argparse defaults: the last node reached, or None when it has several values."""
    fl = _flow(f)
    via: tuple[str, ...] = ()
    for _ in range(depth):
        if isinstance(node, ast.Name):
            if (scope, node.id) in fl.params:  # the caller's value, unless the function assigns it
                return None if (scope, node.id) in fl.names else _Val(node, scope, via)
            values = fl.names.get((scope, node.id))
            if values is None and scope is not f.tree:
                scope, values = f.tree, fl.names.get((f.tree, node.id))
            if values is None:
                return _Val(node, scope, via)  # imported, a builtin, or from another module
            if len(values) != 1 or values[0] is None:
                return None
            node = values[0]
        elif (
            options
            and isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr in fl.options
            and node.attr not in fl.attrs
        ):
            default, line, flag = fl.options[node.attr]
            if default is None:
                return None
            node, scope, via = default, f.tree, (*via, f"{flag} at line {line}")
        else:
            return _Val(node, scope, via)
    return None


def _text(f: _File, node: ast.AST, scope: ast.AST, via: list[str], depth: int = 4) -> str | None:
    """A string as far as this file writes it: the parts it does not know as `{?}`; None if none."""
    v = _value(f, node, scope)
    if v is None or depth <= 0:
        return None
    via += v.options
    n = v.node
    if isinstance(n, ast.Constant):
        return None if n.value is None else str(n.value)
    if isinstance(n, ast.JoinedStr):
        parts = []
        for part in n.values:
            if isinstance(part, ast.Constant):
                parts.append(str(part.value))
            elif isinstance(part, ast.FormattedValue):
                parts.append(_text(f, part.value, v.scope, via, depth - 1) or "{?}")
        return "".join(parts)
    if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
        left = _text(f, n.left, v.scope, via, depth - 1)
        right = _text(f, n.right, v.scope, via, depth - 1)
        return None if left is None and right is None else (left or "{?}") + (right or "{?}")
    if isinstance(n, ast.Call) and _name(n.func) == "str" and len(n.args) == 1:
        return _text(f, n.args[0], v.scope, via, depth - 1)
    fmt, args = None, []
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "format":
        fmt, args, slot = n.func.value, n.args, r"\{(\d*)\}"  # "tcp://{}:{}".format(host, port)
    elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
        fmt, slot = n.left, r"%()[sd]"  # "tcp://%s:%d" % (host, port)
        args = n.right.elts if isinstance(n.right, ast.Tuple) else [n.right]
    if fmt is None:
        return None
    template = _text(f, fmt, v.scope, via, depth - 1)
    if template is None or any(isinstance(a, ast.Starred) for a in args):
        return None
    values = [_text(f, a, v.scope, via, depth - 1) or "{?}" for a in args]
    counter = iter(range(len(values)))

    def fill(m: re.Match) -> str:
        i = int(m.group(1)) if m.group(1) else next(counter, len(values))
        return values[i] if i < len(values) else "{?}"

    return re.sub(slot, fill, template)


def _is_param(f: _File, v: _Val | None) -> bool:
    return v is not None and isinstance(v.node, ast.Name) and (v.scope, v.node.id) in _flow(f).params


# ---- the checks, per node --------------------------------------------------------------------------


def _mentions(f: _File, node: ast.AST, word: str) -> bool:
    start, end = node.lineno, node.end_lineno or node.lineno  # type: ignore[attr-defined]
    return any(word in line for line in f.lines[start - 1 : end])


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _literal(node: ast.AST | None) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value is not None


def _src(node: ast.AST) -> str:
    try:
        text = ast.unparse(node)
    except Exception:  # unparse of odd trees; the message stays useful without it
        return "..."
    return text if len(text) <= 60 else text[:57] + "..."


def _cuda_str(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and CUDA_LITERAL.match(node.value):
        return node.value
    return None


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _collect(f: _File, facts: _Facts) -> None:
    for node in f.nodes:
        if isinstance(node, ast.Call):
            _call(f, node, facts)
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and key.value in MPI_ENV and _is_environ(node.value):
                _mpi(f, node, key.value, facts)
        elif isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and str(first.value).startswith("cuda:") and node.values[1:]:
                part = node.values[1]
                kind = _index_kind(f, part.value) if isinstance(part, ast.FormattedValue) else "chosen"
                if kind == "chosen":
                    facts.device_choice = True
                elif kind == "pinned":
                    facts.pinned.append((f, node, _src(node)))
        elif isinstance(node, ast.Constant) and str(node.value) in ("cuda:", "cuda:%d", "cuda:%s", "cuda:{}"):
            facts.device_choice = True  # "cuda:" + str(i), "cuda:%d" % i, "cuda:{}".format(i)
        elif isinstance(node, ast.Assign):
            if not isinstance(node.value, ast.Call) and _mentions(f, node, "cuda"):
                for sub in ast.walk(node.value):
                    if _cuda_str(sub) and not isinstance(f.parents.get(sub), ast.Compare):
                        _cuda_use(f, sub, _cuda_str(sub) or "cuda", facts, f"{_src(node.targets[0])} = ...")
            for target in node.targets:
                if isinstance(target, ast.Subscript) and _is_environ(target.value):
                    _env_set(f, node, target, facts)
                    key = target.slice
                    if isinstance(key, ast.Constant) and key.value == "CUDA_VISIBLE_DEVICES":
                        # one GPU visible per process (from LOCAL_RANK): "cuda", cuda:0 are its own GPU
                        facts.one_gpu_each = facts.one_gpu_each or not _literal(node.value)


def _is_environ(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "environ"
        or (isinstance(node, ast.Name) and node.id == "environ")
    )


def _mpi(f: _File, node: ast.AST, var: str, facts: _Facts) -> None:
    stmt = _statement(f, node)
    if any(s in TORCHRUN_ENV for s in _strings(stmt)):  # a fallback after torchrun's own variable
        return
    if _env_fallback(f, node):  # the branch for mpirun, next to the one for torchrun
        return
    want = MPI_ENV[var]
    facts.findings.append(Finding(f.shown, node.lineno, "mpi-env", (
        f"{var} is mpirun's variable and torchrun does not set it, so this read fails or gets the "
        f"default on every process; read int(os.environ['{want}']) (torchrun sets RANK, WORLD_SIZE, "
        "LOCAL_RANK)")))  # fmt: skip


def _statement(f: _File, node: ast.AST) -> ast.AST:
    while not isinstance(node, ast.stmt) and node in f.parents:
        node = f.parents[node]
    return node


def _env_fallback(f: _File, node: ast.AST) -> bool:
    """In a branch that does not run under torchrun, or is meant for running without it: any branch of
    an if/elif chain that tests torchrun's variables (`if "RANK" not in os.environ:`, or
    `if args.dist_on_itp: ... elif "RANK" in os.environ:`), or the body of an `if` on another
    launcher's variable (`if "SLURM_PROCID" in os.environ:`)."""
    child, cur = node, f.parents.get(node)
    while cur is not None:
        if isinstance(cur, ast.If):
            if any(_strings(t) & TORCHRUN_VARS for t in _if_chain(f, cur)):
                return True
            if child in cur.body and _strings(cur.test) & OTHER_LAUNCHERS:
                return True
        elif isinstance(cur, ast.IfExp) and _strings(cur.test) & (TORCHRUN_VARS | OTHER_LAUNCHERS):
            return True
        child, cur = cur, f.parents.get(cur)
    return False


def _if_chain(f: _File, node: ast.If) -> list[ast.AST]:
    """The tests of the whole if/elif chain `node` is part of."""
    head = node
    parent = f.parents.get(head)
    while isinstance(parent, ast.If) and parent.orelse == [head]:
        head, parent = parent, f.parents.get(parent)
    tests: list[ast.AST] = []
    cur: ast.AST | None = head
    while isinstance(cur, ast.If):
        tests.append(cur.test)
        cur = cur.orelse[0] if len(cur.orelse) == 1 else None
    return tests


ENV_EFFECT = {
    "MASTER_ADDR": "every node's processes look for the rendezvous at {v}, not at node 0 (each node "
    "forms its own world, or waits forever)",
    "MASTER_PORT": "every process looks for the rendezvous on port {v}, not the launcher's (a hang)",
    "RANK": "the ranks are this script's numbering, not the job's (duplicate ranks across nodes: a hang)",
    "WORLD_SIZE": "the world size is this script's count, not the job's (a hang or a wrong world)",
    "LOCAL_RANK": "the local rank is this script's numbering, not torchrun's",
}


def _env_set(f: _File, node: ast.Assign, target: ast.Subscript, facts: _Facts) -> None:
    key = target.slice
    if not (isinstance(key, ast.Constant) and key.value in LAUNCH_ENV):
        return
    if key.value in _strings(node.value) or _env_fallback(f, node):  # = os.environ.get("MASTER_ADDR", ...)
        return
    effect = ENV_EFFECT[key.value].format(v=_src(node.value))
    facts.findings.append(Finding(f.shown, node.lineno, "env-set", (
        f"os.environ[{key.value!r}] = {_src(node.value)} overrides what torchrun set for this process, so "
        f"{effect}; delete the line (ddp-launch's torchrun sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE "
        "and LOCAL_RANK for every process)")))  # fmt: skip


def _index_kind(f: _File, index: ast.AST) -> str:
    """A GPU index: "pinned" (a literal, maybe through a name), "current" (torch.cuda.current_device()
    or a plain "cuda": GPU 0 until something chose), or "chosen" (anything else: per process)."""
    v = _value(f, index, _scope(f, index), options=False)
    if v is None:
        return "chosen"
    n = v.node
    if isinstance(n, ast.Attribute) and n.attr == "index":  # device.index
        return _index_kind(f, n.value)
    if _literal(n) and not _cuda_str(n):
        return "pinned" if not isinstance(n, ast.Constant) or isinstance(n.value, int) else "chosen"
    if isinstance(n, ast.Call) and _name(n.func) == "current_device":
        return "current"
    if isinstance(n, ast.Call) and _name(n.func) == "device" and n.args and _cuda_str(n.args[0]) == "cuda":
        named = [k.value for k in n.keywords if k.arg == "index"]
        index = n.args[1] if len(n.args) > 1 else (named[0] if named else None)
        return "current" if index is None else _index_kind(f, index)
    text = _cuda_str(n)
    if text:
        return "current" if text == "cuda" else "pinned"
    return "chosen"


CALLS = frozenset(("init_process_group", "add_argument", "get", "getenv", "set_device", "set_device_index",
                   "current_device", "cuda", "to", "device", "DistributedSampler", "set_epoch", "DataLoader",
                   "save", "spawn", "start_processes", "Process"))  # fmt: skip


def _call(f: _File, node: ast.Call, facts: _Facts) -> None:
    name = _name(node.func)
    if not node.keywords and name not in CALLS:
        return
    kw = {k.arg: k.value for k in node.keywords if k.arg}
    if name == "init_process_group":
        _init(f, node, kw, facts)
    elif name == "add_argument":
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        hit = next((x for x in flags if x in ("--local_rank", "--local-rank")), None)
        default = kw.get("default", ast.Constant(None))
        if hit and "LOCAL_RANK" not in _strings(default):
            facts.local_rank_options.append((f, node, hit, _src(default)))
    elif name in ("get", "getenv") and node.args:
        key = node.args[0]
        on_env = name == "getenv" or (isinstance(node.func, ast.Attribute) and _is_environ(node.func.value))
        if on_env and isinstance(key, ast.Constant) and key.value in MPI_ENV:
            _mpi(f, node, key.value, facts)
    elif name in ("set_device", "set_device_index"):
        facts.device_choice = True
    elif name == "current_device" and _src(node.func).startswith(("torch.cuda", "cuda")):
        _cuda_use(f, node, "cuda", facts, _src(node))
    elif name == "cuda" and isinstance(node.func, ast.Attribute):
        index = node.args[0] if node.args else kw.get("device")
        kind = "current" if index is None else _index_kind(f, index)
        if index is None:
            _cuda_use(f, node, "cuda", facts, f"{_src(node.func)}()")
        elif kind == "pinned":
            facts.pinned.append((f, node, f"{_src(node)}{_resolved(f, index)}"))
        elif kind == "chosen":
            facts.device_choice = True
    elif name == "to" and isinstance(node.func, ast.Attribute):
        target = node.args[0] if node.args else kw.get("device")
        if _cuda_str(target):
            _cuda_use(f, node, _cuda_str(target) or "cuda", facts, _src(node))
    elif name == "device" and node.args and _src(node.func).endswith("cuda.device"):
        if _index_kind(f, node.args[0]) == "chosen":  # with torch.cuda.device(local_rank):
            facts.device_choice = True
    elif name == "device" and node.args and _cuda_str(node.args[0]):
        if len(node.args) > 1 or "index" in kw:
            kind = _index_kind(f, node.args[1] if len(node.args) > 1 else kw["index"])
            if kind == "pinned":
                facts.pinned.append((f, node, _src(node)))
            elif kind == "chosen":
                facts.device_choice = True
        else:
            _cuda_use(f, node, _cuda_str(node.args[0]) or "cuda", facts, _src(node))
    elif name == "DistributedSampler":
        shuffle = kw.get("shuffle")
        if not (isinstance(shuffle, ast.Constant) and shuffle.value is False):
            facts.samplers.append((f, node))
    elif name == "set_epoch":
        facts.set_epoch = True
    elif name == "DataLoader":
        shuffle, sampler = kw.get("shuffle"), kw.get("sampler")
        on = isinstance(shuffle, ast.Constant) and shuffle.value is True
        if on and sampler is not None and not (isinstance(sampler, ast.Constant) and sampler.value is None):
            facts.findings.append(Finding(f.shown, node.lineno, "sampler-shuffle", (
                "DataLoader(shuffle=True, sampler=...) raises ValueError (sampler option is mutually "
                "exclusive with shuffle) on every rank; drop shuffle=True from the DataLoader and give "
                "DistributedSampler(..., shuffle=True), which shuffles per epoch")))  # fmt: skip
    elif name == "save" and _is_torch_save(f, node):
        facts.saves.append((f, node))
    elif name in ("spawn", "start_processes", "Process"):
        _spawn(f, node, name, kw, facts)
    if name != "to":  # device="cuda" keyword on tensor factories, modules, ...
        dev = kw.get("device")
        if _cuda_str(dev) and name not in ("device", "cuda"):
            _cuda_use(f, node, _cuda_str(dev) or "cuda", facts, f"{_src(node.func)}(device={dev.value!r})")  # type: ignore[union-attr]
    ids = kw.get("device_ids")
    if isinstance(ids, (ast.List, ast.Tuple)) and ids.elts:
        kinds = [_index_kind(f, e) for e in ids.elts]
        if all(k == "pinned" for k in kinds):
            facts.pinned.append((f, node, f"device_ids={_src(ids)}"))
        elif "chosen" in kinds:
            facts.device_choice = True
        # "current": torch.cuda.current_device() is a CUDA use of its own, GPU 0 until a choice


def _resolved(f: _File, node: ast.AST) -> str:
    """` with GPU = 0` when `node` is a name standing for a literal, else nothing."""
    v = _value(f, node, _scope(f, node), options=False)
    return f" with {_src(node)} = {_src(v.node)}" if v is not None and v.node is not node else ""


def _spawn(f: _File, node: ast.Call, name: str, kw: dict, facts: _Facts) -> None:
    """mp.spawn(fn, ...), start_processes(fn, ...), mp.Process(target=fn): kept when fn is found."""
    if name == "Process":
        fn = kw.get("target")
    else:
        fn = node.args[0] if node.args else kw.get("fn")
        if "multiprocessing" not in _src(node.func) and not _src(node.func).startswith("mp."):
            imported = any(
                isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch.multiprocessing")
                for n in f.nodes
            )
            if not imported:
                return
    if isinstance(fn, ast.Call) and _name(fn.func) == "partial" and fn.args:
        fn = fn.args[0]
    if fn is not None and not _env_fallback(f, node):
        facts.spawns.append((f, node, fn))


LOCAL_RANK_READ = re.compile(r"\.local_rank\b(?!\s*=[^=])")
LOCAL_RANK_SET = re.compile(r"(?<!self)\.local_rank\s*=(?!=)")


def _local_rank_findings(files: Sequence[_File], facts: _Facts) -> list[Finding]:
    """An argparse --local_rank whose value is read (`args.local_rank`) and never set from the
    environment by the files read (`args.local_rank = int(os.environ["LOCAL_RANK"])` in a helper)."""
    out = []
    for f, node, flag, default in facts.local_rank_options:
        sources = [g.source for g in files if "local_rank" in g.source]
        read = any(LOCAL_RANK_READ.search(s) for s in sources)
        if not read or any(LOCAL_RANK_SET.search(s) for s in sources):
            continue  # never read, or set from the environment by a helper
        out.append(Finding(f.shown, node.lineno, "local-rank-arg", (
            f"the argparse option {flag} is never passed by torchrun (it sets LOCAL_RANK in the "
            f"environment), so every process gets the default ({default}) and the same GPU; read "
            "int(os.environ['LOCAL_RANK']) and drop the option (or keep it with "
            "default=int(os.environ.get('LOCAL_RANK', 0)))")))  # fmt: skip
    return out


def _init(f: _File, node: ast.Call, kw: dict, facts: _Facts) -> None:
    given = dict(kw)
    for i, key in INIT_POSITIONS.items():
        if len(node.args) > i:
            given[key] = node.args[i]
    scope = _scope(f, node)
    backend = node.args[0] if node.args else kw.get("backend")
    b = _value(f, backend, scope) if backend is not None else None
    if b is not None and isinstance(b.node, ast.Constant) and isinstance(b.node.value, str):
        facts.backends.append((Backend(f.shown, node.lineno, b.node.value.lower()), node, f))
    bad: list[str] = []
    params: list[tuple[str, ast.AST]] = []
    options: list[str] = []
    for key in ("init_method", "world_size", "rank"):
        value = given.get(key)
        if value is None:
            continue
        shown = f"{key}={_src(value)}"
        if key == "init_method":
            via: list[str] = []
            text = _text(f, value, scope, via)
            if text is not None and _fixed_address(text):
                written = isinstance(value, ast.Constant)
                bad.append(shown if written else f"{shown} ({_origin(repr(text), via)})")
                options += via
            continue
        v = _value(f, value, scope)
        if v is None:
            continue
        n = v.node
        if _literal(n) and not isinstance(n, ast.UnaryOp):  # -1 (a UnaryOp) is torch's "from the env"
            bad.append(shown if n is value else f"{shown} ({_origin(_src(n), list(v.options))})")
            options += v.options
        elif key == "world_size" and isinstance(n, ast.Call) and _name(n.func) == "device_count":
            bad.append(f"{shown} (torch.cuda.device_count(): this node's GPUs, not the job's processes)")
        elif _is_param(f, v):
            params.append((shown, v.scope))
    facts.inits.append(_Init(f, node, bad, params, options))


def _fixed_address(text: str) -> bool:
    """An init_method written out in the script: all of it, or a tcp:// or file:// with a literal host."""
    if text.startswith("env://"):
        return False
    if "{?}" not in text:
        return True
    host = re.match(r"^(tcp|file)://([^:{/]*)", text)
    return bool(host and host.group(2))


def _origin(value: str, via: Sequence[str]) -> str:
    if via:
        return f"= {value}, the argparse default of {', '.join(dict.fromkeys(via))}"
    return f"= {value}"


def _init_findings(files: Sequence[_File], facts: _Facts) -> list[Finding]:
    """init-args, and spawn: a spawned function's index and arguments as rank and world size."""
    out = []
    spawned: dict[ast.AST, tuple[_File, ast.Call]] = {}  # function reached from a spawn -> the spawn
    for f, node, fn in facts.spawns:
        targets = _functions_passed(files, f, fn)
        reached, inits = _reach(files, targets)
        target = targets[0] if targets else _src(fn)
        if not inits:
            continue  # workers that never join a process group: not DDP's
        spawned.update({d: (f, node) for d in reached})
        out.append(Finding(f.shown, node.lineno, "spawn", (
            f"{_src(node.func)}({target}, ...) starts this script's DDP workers itself, which only works on "
            "one node: under ddp-launch torchrun already starts one process per GPU on every node, and each "
            f"of them would start its own workers (a world per node, or ports in use); drop the spawn, call "
            f"{target}() once per process and read LOCAL_RANK, RANK and WORLD_SIZE from torchrun's "
            "env")))  # fmt: skip
    for init in facts.inits:
        bad = list(init.bad)
        spawn_at = [spawned[s] for _, s in init.params if s in spawned]
        if spawn_at:
            line = spawn_at[0][1].lineno
            bad.append(f"{', '.join(p for p, s in init.params if s in spawned)} (the spawn's process index "
                       f"and arguments, line {line}: one node's numbering)")  # fmt: skip
        if not bad:
            continue
        drop = sorted({o.split(" at line")[0] for o in init.options})
        tail = f", which makes {', '.join(drop)} unnecessary" if drop else ""
        out.append(Finding(init.file.shown, init.node.lineno, "init-args", (
            f"init_process_group hard-codes {', '.join(bad)}, so under a launcher every process believes "
            "it is that rank of that world on that address (a hang or a wrong world); write "
            "init_process_group(backend) with the default env:// (ddp-launch sets MASTER_ADDR, "
            f"MASTER_PORT, RANK, WORLD_SIZE{tail})")))  # fmt: skip
    return out


def _functions_passed(files: Sequence[_File], f: _File, fn: ast.AST) -> list[str]:
    """The names of the functions `fn` (a spawn's target) stands for: its own name, or, when it is a
    parameter (`def run_demo(demo_fn, n): mp.spawn(demo_fn, ...)`), what the callers pass there."""
    v = _value(f, fn, _scope(f, fn), options=False)
    if not _is_param(f, v):
        return [_name(fn)] if _name(fn) else []
    func = v.scope  # type: ignore[union-attr]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []  # a lambda's parameter
    params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]  # type: ignore[attr-defined]
    name = v.node.id  # type: ignore[union-attr]
    pos = params.index(name) if name in params else -1
    out = []
    for g in files:
        for c in g.nodes:
            if _calls(c, func.name):  # type: ignore[attr-defined]
                given = {k.arg: k.value for k in c.keywords}  # type: ignore[attr-defined]
                arg = c.args[pos] if 0 <= pos < len(c.args) else given.get(name)  # type: ignore[attr-defined]
                if arg is not None and _name(arg):
                    out.append(_name(arg))
    return out


def _reach(files: Sequence[_File], targets: Sequence[str], depth: int = 4) -> tuple[set[ast.AST], bool]:
    """The functions (by name, in any file read) that `targets` run, and whether one of them calls
    init_process_group."""
    seen: set[ast.AST] = set()
    frontier, inits = set(targets), False
    for _ in range(depth):
        nxt: set[str] = set()
        for g in files:
            for name in frontier:
                for d in _flow(g).functions.get(name, ()):
                    if d in seen:
                        continue
                    seen.add(d)
                    for c in ast.walk(d):
                        if isinstance(c, ast.Call):
                            called = _name(c.func)
                            inits = inits or called == "init_process_group"
                            nxt.add(called)
        frontier = nxt - {""}
    return seen, inits


def _cuda_use(f: _File, node: ast.AST, text: str, facts: _Facts, shown: str) -> None:
    if text != "cuda":  # "cuda:0": a fixed GPU whatever the process
        facts.pinned.append((f, node, shown))
    else:
        facts.cuda_uses.append((f, node, shown))


def _cuda_findings(facts: _Facts) -> list[Finding]:
    out = []
    if facts.one_gpu_each:
        return []
    uses = [(f, n, s) for f, n, s in facts.cuda_uses if not _ignored_node(f, n, "cuda-device")]
    if uses and not facts.device_choice:
        f, node, shown = uses[0]
        more = f" (and {len(uses) - 1} more CUDA uses)" if len(uses) > 1 else ""
        current = [(g, n) for g, n, _ in uses if isinstance(n, ast.Call) and _name(n.func) != "cuda"]
        current = [(g, n) for g, n in current if _name(n.func) == "current_device"]  # type: ignore[attr-defined]
        said = ""
        if current:
            g, n = current[0]
            where = "it" if n is node else f"torch.cuda.current_device() at {g.shown}:{n.lineno}"
            said = f", and {where} is GPU 0 then: it reads the current GPU, it does not choose one"
        out.append(Finding(f.shown, node.lineno, "cuda-device", (
            f"{shown} uses CUDA{more} but no process chooses its own GPU, so all processes of a node share "
            f"GPU 0 (an OOM or a hang){said}; call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
            "before the first CUDA use")))  # fmt: skip
    for f, node, shown in facts.pinned:
        out.append(Finding(f.shown, node.lineno, "cuda-device", (
            f"{shown} names a fixed GPU, so every process of a node uses that same GPU; use the process's "
            "own: torch.cuda.set_device(local_rank) then 'cuda', or f'cuda:{local_rank}' with "
            "local_rank = int(os.environ['LOCAL_RANK'])")))  # fmt: skip
    return out


def _is_torch_save(f: _File, node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Attribute):
        return isinstance(func.value, ast.Name) and func.value.id == "torch"
    if isinstance(func, ast.Name):  # `from torch import save`
        return any(
            isinstance(n, ast.ImportFrom) and n.module == "torch" and any(a.name == "save" for a in n.names)
            for n in f.nodes
        )
    return False


def _save_findings(files: Sequence[_File], facts: _Facts) -> list[Finding]:
    out = []
    for f, node in facts.saves:
        named = [k.value for k in node.keywords if k.arg == "f"]
        target = node.args[1] if len(node.args) > 1 else (named[0] if named else None)
        if target is not None and RANK_WORDS.search(ast.unparse(target)):
            continue  # one file per rank: not the same file
        if target is not None and _in_memory(f, target):
            continue  # torch.save(obj, io.BytesIO()): no file at all
        guard = _guard(f, node, files, depth=3)
        if guard and guard[0] in ("global", "never"):
            continue
        if guard:
            out.append(Finding(f.shown, node.lineno, "save-rank", (
                f"torch.save is guarded by {guard[1]}, a rank within the node, so it runs once per node, "
                "not once per job: on a shared filesystem every node writes the same file at once (a torn "
                "or clobbered checkpoint), on node-local disks each node keeps its own copy; guard it with "
                "the global rank: `if dist.get_rank() == 0:` (or int(os.environ['RANK']) == "
                "0)")))  # fmt: skip
            continue
        out.append(Finding(f.shown, node.lineno, "save-rank", (
            "torch.save runs on every rank, so every rank writes the same file at once (a torn or "
            "clobbered checkpoint); save on one rank: `if dist.get_rank() == 0: torch.save(...)`, then "
            "dist.barrier() before the others read it")))  # fmt: skip
    return out


def _in_memory(f: _File, target: ast.AST) -> bool:
    v = _value(f, target, _scope(f, target), options=False)
    buffers = ("BytesIO", "SpooledTemporaryFile")
    return v is not None and isinstance(v.node, ast.Call) and _name(v.node.func) in buffers


def _guard(f: _File, node: ast.AST, files: Sequence[_File], depth: int) -> tuple[str, str] | None:
    """The rank test that decides whether `node` runs: ("global" | "local", the test), from an `if`
    around it, an early `if <rank test>: return` before it, or every call of its function; None: none."""
    child = node
    cur = f.parents.get(node)
    while cur is not None:
        if isinstance(cur, (ast.If, ast.IfExp)):
            kind = _guard_test(files, f, cur.test, _scope(f, cur))
            if kind:
                return kind
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            early = _early_return(files, f, cur, child)
            if early:
                return early
            if depth <= 0:
                return None
            calls = [(g, c) for g in files for c in g.nodes if _calls(c, cur.name)]
            if not calls and not cur.name.startswith("__") and not _referenced(files, cur.name):
                return "never", ""  # nothing in the files read calls it or passes it on
            guards = [_guard(g, c, files, depth - 1) for g, c in calls]
            owner = f.parents.get(cur)
            if (not guards or None in guards) and isinstance(owner, ast.ClassDef):
                made = [(g, c) for g in files for c in g.nodes if _calls(c, owner.name)]
                guards = [_guard(g, c, files, depth - 1) for g, c in made]  # objects made on one rank
            if not guards or None in guards:
                return None
            return next((g for g in guards if g and g[0] == "local"), guards[0])
        if isinstance(cur, ast.stmt):
            child = cur
        cur = f.parents.get(cur)
    return None


def _referenced(files: Sequence[_File], name: str) -> bool:
    """`name` is used other than by its `def`, an import or a string (`__all__`): passed as a
    callback, registered, stored."""
    word = re.compile(rf"(?<!['\"])\b{re.escape(name)}\b(?!['\"])")
    defined = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(name)}\b")
    for g in files:
        if name not in g.source:
            continue
        imports = {
            i
            for n in g.nodes
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for i in range(n.lineno, (n.end_lineno or n.lineno) + 1)
        }
        for i, line in enumerate(g.lines, 1):
            if i not in imports and word.search(line) and not defined.match(line):
                return True
    return False


def _rank_kind(files: Sequence[_File], f: _File, expr: ast.AST, scope: ast.AST, depth: int = 3) -> str | None:
    """Whether `expr` tests the global rank ("global"), a rank within the node ("local": LOCAL_RANK,
    a GPU index, `rank % gpus_per_node`), or no rank (None). Names are followed as in _value,
    attributes (`self.rank`) through what the files assign to them."""
    kinds = {kind for kind, _ in _rank_parts(files, f, expr, scope, depth)}
    return "global" if "global" in kinds else ("local" if kinds else None)


def _rank_parts(
    files: Sequence[_File], f: _File, expr: ast.AST, scope: ast.AST, depth: int = 3
) -> list[tuple[str, ast.AST]]:
    """The parts of `expr` that are a rank, each with its kind, in source order."""
    parts: list[tuple[str, ast.AST]] = []
    stack = [expr]
    while stack:
        n = stack.pop()
        mod = isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)
        if mod and _rank_kind(files, f, n.left, scope, depth):  # type: ignore[attr-defined]
            parts.append(("local", n))  # rank % gpus_per_node
            continue
        kind = _ident_kind(files, f, n, scope, depth)
        if kind:
            parts.append((kind, n))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(n))))
    return parts


def _guard_test(files: Sequence[_File], f: _File, test: ast.AST, scope: ast.AST) -> tuple[str, str] | None:
    """("global" | "local", the part of the test that is the rank) for a test on a rank, else None."""
    parts = _rank_parts(files, f, test, scope)
    for kind in ("global", "local"):
        part = next((n for k, n in parts if k == kind), None)
        if part is not None:
            return kind, _src(part)
    return None


def _ident_kind(files: Sequence[_File], f: _File, n: ast.AST, scope: ast.AST, depth: int) -> str | None:
    if isinstance(n, ast.Constant) and isinstance(n.value, str):
        return RANK_ENV.get(n.value)
    if isinstance(n, ast.Call) and _name(n.func) in RANK_CALLS:
        return RANK_CALLS[_name(n.func)]
    if isinstance(n, ast.Name):
        v = _value(f, n, scope, options=False)
        if v is not None and v.node is not n and depth > 0:
            kind = _rank_kind(files, f, v.node, v.scope, depth - 1)
            if kind:
                return kind
        return _word_kind(n.id)
    if isinstance(n, ast.Attribute):
        if depth > 0:
            kinds = {
                _rank_kind(files, g, value, s, depth - 1)
                for g in files
                for value, s in _flow(g).attrs.get(n.attr, ())
                if value is not None
            }
            if len(kinds) == 1 and None not in kinds:
                return kinds.pop()
        return _word_kind(n.attr)
    return None


def _word_kind(word: str) -> str | None:
    if LOCAL_WORDS.search(word):
        return "local"
    return "global" if RANK_WORDS.search(word) else None


def _calls(node: ast.AST, name: str) -> bool:
    """A call of the function `name` (f() or obj.f(), never torch.f())."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == name and not (isinstance(func.value, ast.Name) and func.value.id == "torch")
    return isinstance(func, ast.Name) and func.id == name


def _early_return(files: Sequence[_File], f: _File, func: ast.AST, stmt: ast.AST) -> tuple[str, str] | None:
    for s in getattr(func, "body", []):
        if s is stmt or s.lineno >= getattr(stmt, "lineno", 0):
            return None
        leaves = isinstance(s, ast.If) and any(isinstance(b, (ast.Return, ast.Raise)) for b in s.body)
        if leaves:
            kind = _guard_test(files, f, s.test, func)  # type: ignore[attr-defined]
            if kind:
                return kind
    return None
