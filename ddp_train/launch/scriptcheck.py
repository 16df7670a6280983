"""The script check: DDP mistakes in the user's script and the local modules it imports, read with `ast`.

Nothing is executed. Each finding is one line `file:line: what is wrong; what to write instead`; a
`# ddp-launch: ignore[<code>]` comment on the finding's line (or any line of its statement) silences it.
The backend check (`backend`) needs preflight's GPU facts per node, so it runs after preflight.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

MODES = ("strict", "warn", "off")
CODES = {
    "init-args": "init_process_group given a literal rank, world_size or init_method address",
    "local-rank-arg": "rank read from an argparse --local_rank/--local-rank option torchrun does not pass",
    "mpi-env": "rank or size read from mpirun's environment (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK)",
    "cuda-device": "CUDA used with no device chosen per process (all processes share GPU 0)",
    "set-epoch": "a DistributedSampler and no set_epoch call (every epoch sees the same order)",
    "sampler-shuffle": "DataLoader(shuffle=True, sampler=...): a ValueError on every rank",
    "save-rank": "torch.save not guarded by a rank check (every rank writes the same file)",
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


class _Project:
    def __init__(self, roots: Sequence[Path], shown_base: Path) -> None:
        self.roots = roots
        self.base = shown_base
        self.files: list[_File] = []
        self.seen: set[Path] = set()
        self.errors: list[Finding] = []

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
        parents, nodes = _index(tree)
        return _File(path, shown, tree, ignores, parents, nodes, source.splitlines())

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

    def _inside(self, path: Path) -> bool:
        return any(path.is_relative_to(r) for r in self.roots)

    # ---- the checks ---------------------------------------------------------------------------------

    def check(self) -> ScriptCheck:
        facts = _Facts()
        for f in self.files:
            _collect(f, facts)
        found = list(self.errors) + facts.findings
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
class _Facts:
    findings: list[Finding] = dataclasses.field(default_factory=list)
    cuda_uses: list[tuple[_File, ast.AST, str]] = dataclasses.field(default_factory=list)
    pinned: list[tuple[_File, ast.AST, str]] = dataclasses.field(default_factory=list)  # literal index
    device_choice: bool = False
    samplers: list[tuple[_File, ast.AST]] = dataclasses.field(default_factory=list)
    set_epoch: bool = False
    saves: list[tuple[_File, ast.Call]] = dataclasses.field(default_factory=list)
    backends: list[tuple[Backend, ast.AST, _File]] = dataclasses.field(default_factory=list)


INDEXED = (ast.Call, ast.Subscript, ast.JoinedStr, ast.Constant, ast.Assign, ast.Import, ast.ImportFrom)


def _index(tree: ast.Module) -> tuple[dict[ast.AST, ast.AST], list[ast.AST]]:
    """One pass over the tree (ast.walk is several times slower): every node's parent, and the nodes
    the checks look at, in source order."""
    parents: dict[ast.AST, ast.AST] = {}
    nodes: list[ast.AST] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, INDEXED):
            nodes.append(node)
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                for child in value:
                    if isinstance(child, ast.AST) and not isinstance(child, ast.expr_context):
                        parents[child] = node
                        stack.append(child)
            elif isinstance(value, ast.AST) and not isinstance(value, ast.expr_context):
                parents[value] = node
                stack.append(value)
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))  # type: ignore[attr-defined]
    return parents, nodes


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
                facts.device_choice = True
        elif isinstance(node, ast.Constant) and str(node.value) in ("cuda:", "cuda:%d", "cuda:%s", "cuda:{}"):
            facts.device_choice = True  # "cuda:" + str(i), "cuda:%d" % i, "cuda:{}".format(i)
        elif (
            isinstance(node, ast.Assign)
            and not isinstance(node.value, ast.Call)
            and _mentions(f, node, "cuda")
        ):
            for sub in ast.walk(node.value):
                if _cuda_str(sub) and not isinstance(f.parents.get(sub), ast.Compare):
                    _cuda_use(f, sub, _cuda_str(sub) or "cuda", facts, f"{_src(node.targets[0])} = ...")


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
    want = MPI_ENV[var]
    facts.findings.append(Finding(f.shown, node.lineno, "mpi-env", (
        f"{var} is mpirun's variable and torchrun does not set it, so this read fails or gets the "
        f"default on every process; read int(os.environ['{want}']) (torchrun sets RANK, WORLD_SIZE, "
        "LOCAL_RANK)")))  # fmt: skip


def _statement(f: _File, node: ast.AST) -> ast.AST:
    while not isinstance(node, ast.stmt) and node in f.parents:
        node = f.parents[node]
    return node


def _call(f: _File, node: ast.Call, facts: _Facts) -> None:
    name = _name(node.func)
    kw = {k.arg: k.value for k in node.keywords if k.arg}
    if name == "init_process_group":
        _init(f, node, kw, facts)
    elif name == "add_argument":
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        hit = next((x for x in flags if x in ("--local_rank", "--local-rank")), None)
        if hit and "LOCAL_RANK" not in _strings(kw.get("default", ast.Constant(None))):
            facts.findings.append(Finding(f.shown, node.lineno, "local-rank-arg", (
                f"the argparse option {hit} is never passed by torchrun (it sets LOCAL_RANK in the "
                "environment), so every process gets the default; read int(os.environ['LOCAL_RANK']) "
                f"(or keep the option with default=int(os.environ.get('LOCAL_RANK', 0)))")))  # fmt: skip
    elif name in ("get", "getenv") and node.args:
        key = node.args[0]
        on_env = name == "getenv" or (isinstance(node.func, ast.Attribute) and _is_environ(node.func.value))
        if on_env and isinstance(key, ast.Constant) and key.value in MPI_ENV:
            _mpi(f, node, key.value, facts)
    elif name in ("set_device", "set_device_index"):
        facts.device_choice = True
    elif name == "cuda" and isinstance(node.func, ast.Attribute):
        index = node.args[0] if node.args else kw.get("device")
        if index is None:
            _cuda_use(f, node, "cuda", facts, f"{_src(node.func)}()")
        elif _literal(index):
            facts.pinned.append((f, node, f"{_src(node)}"))
        else:
            facts.device_choice = True
    elif name == "to" and isinstance(node.func, ast.Attribute):
        target = node.args[0] if node.args else kw.get("device")
        if _cuda_str(target):
            _cuda_use(f, node, _cuda_str(target) or "cuda", facts, _src(node))
    elif name == "device" and node.args and _cuda_str(node.args[0]):
        if len(node.args) > 1 or "index" in kw:
            index = node.args[1] if len(node.args) > 1 else kw["index"]
            if _literal(index):
                facts.pinned.append((f, node, _src(node)))
            else:
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
    if name != "to":  # device="cuda" keyword on tensor factories, modules, ...
        dev = kw.get("device")
        if _cuda_str(dev) and name not in ("device", "cuda"):
            _cuda_use(f, node, _cuda_str(dev) or "cuda", facts, f"{_src(node.func)}(device={dev.value!r})")  # type: ignore[union-attr]
    ids = kw.get("device_ids")
    if isinstance(ids, (ast.List, ast.Tuple)) and ids.elts:
        if all(_literal(e) for e in ids.elts):
            facts.pinned.append((f, node, f"device_ids={_src(ids)}"))
        else:
            facts.device_choice = True


def _init(f: _File, node: ast.Call, kw: dict, facts: _Facts) -> None:
    given = dict(kw)
    for i, key in INIT_POSITIONS.items():
        if len(node.args) > i:
            given[key] = node.args[i]
    backend = node.args[0] if node.args else kw.get("backend")
    if isinstance(backend, ast.Constant) and isinstance(backend.value, str):
        facts.backends.append((Backend(f.shown, node.lineno, backend.value.lower()), node, f))
    bad = []
    for key in ("init_method", "world_size", "rank"):
        value = given.get(key)
        if key == "init_method":
            text = _init_method_text(value)
            if text is not None and not text.startswith("env://"):
                bad.append(f"init_method={text!r}")
        elif _literal(value) and not (isinstance(value, ast.UnaryOp) and key != "init_method"):
            bad.append(f"{key}={_src(value)}")  # -1 (a UnaryOp) is torch's own "from the environment"
    if bad:
        facts.findings.append(Finding(f.shown, node.lineno, "init-args", (
            f"init_process_group hard-codes {', '.join(bad)}, so under a launcher every process believes "
            "it is that rank of that world on that address (a hang or a wrong world); write "
            "init_process_group(backend) with the default env:// (ddp-launch sets MASTER_ADDR, "
            "MASTER_PORT, RANK, WORLD_SIZE)")))  # fmt: skip


def _init_method_text(value: ast.AST | None) -> str | None:
    """The init_method if it is written in the script (a literal, or an f-string with a literal host)."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value
    if isinstance(value, ast.JoinedStr):
        head = "".join(str(v.value) for v in value.values if isinstance(v, ast.Constant))
        host = re.match(r"^(tcp|file)://([^:{/]*)", head)
        if host and host.group(2):
            return ast.unparse(value)
    return None


def _cuda_use(f: _File, node: ast.AST, text: str, facts: _Facts, shown: str) -> None:
    if text != "cuda":  # "cuda:0": a fixed GPU whatever the process
        facts.pinned.append((f, node, shown))
    else:
        facts.cuda_uses.append((f, node, shown))


def _cuda_findings(facts: _Facts) -> list[Finding]:
    out = []
    uses = [(f, n, s) for f, n, s in facts.cuda_uses if not _ignored_node(f, n, "cuda-device")]
    if uses and not facts.device_choice:
        f, node, shown = uses[0]
        more = f" (and {len(uses) - 1} more CUDA uses)" if len(uses) > 1 else ""
        out.append(Finding(f.shown, node.lineno, "cuda-device", (
            f"{shown} uses CUDA{more} but no process chooses its own GPU, so all processes of a node share "
            "GPU 0 (an OOM or a hang); call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before the "
            "first CUDA use")))  # fmt: skip
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
        if _guarded(f, node, files, depth=3):
            continue
        out.append(Finding(f.shown, node.lineno, "save-rank", (
            "torch.save runs on every rank, so every rank writes the same file at once (a torn or "
            "clobbered checkpoint); save on one rank: `if dist.get_rank() == 0: torch.save(...)`, then "
            "dist.barrier() before the others read it")))  # fmt: skip
    return out


def _guarded(f: _File, node: ast.AST, files: Sequence[_File], depth: int) -> bool:
    """Inside an `if` on a rank test, after an early `if <rank test>: return`, or in a function
    whose every call is guarded."""
    child = node
    cur = f.parents.get(node)
    while cur is not None:
        if isinstance(cur, (ast.If, ast.IfExp)) and RANK_WORDS.search(ast.unparse(cur.test)):
            return True
        if isinstance(cur, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if _early_return(cur, child):
                return True
            if depth <= 0:
                return False
            calls = [(g, c) for g in files for c in g.nodes if _calls(c, cur.name)]
            return bool(calls) and all(_guarded(g, c, files, depth - 1) for g, c in calls)
        if isinstance(cur, ast.stmt):
            child = cur
        cur = f.parents.get(cur)
    return False


def _calls(node: ast.AST, name: str) -> bool:
    """A call of the function `name` (f() or obj.f(), never torch.f())."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == name and not (isinstance(func.value, ast.Name) and func.value.id == "torch")
    return isinstance(func, ast.Name) and func.id == name


def _early_return(func: ast.AST, stmt: ast.AST) -> bool:
    for s in getattr(func, "body", []):
        if s is stmt or s.lineno >= getattr(stmt, "lineno", 0):
            return False
        leaves = isinstance(s, ast.If) and any(isinstance(b, (ast.Return, ast.Raise)) for b in s.body)
        if leaves and RANK_WORDS.search(ast.unparse(s.test)):  # type: ignore[attr-defined]
            return True
    return False
