"""The script check's first pass (scriptcheck.py): what each node of each file says, gathered into
`_Facts` (CUDA uses, samplers, saves, init_process_group calls, spawns, environment reads and writes);
the findings a single node proves are made here, the ones that need the whole project in scriptrules.py.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence

from ddp_train.launch.plan.scriptfiles import Backend, Finding, _File, _name, _src
from ddp_train.launch.plan.scriptflow import _is_param, _scope, _text, _value

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

# what torchrun sets for each process: a script that assigns one overrides it
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")

TORCHRUN_VARS = frozenset((*LAUNCH_ENV, "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"))

OTHER_LAUNCHERS = frozenset((*MPI_ENV, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID"))

CUDA_LITERAL = re.compile(r"^cuda(:\d+)?$")

# init_process_group(backend, init_method, timeout, world_size, rank, ...)
INIT_POSITIONS = {1: "init_method", 3: "world_size", 4: "rank"}


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


def _mentions(f: _File, node: ast.AST, word: str) -> bool:
    start, end = node.lineno, node.end_lineno or node.lineno  # type: ignore[attr-defined]
    return any(word in line for line in f.lines[start - 1 : end])


def _literal(node: ast.AST | None) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value is not None


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


def _cuda_use(f: _File, node: ast.AST, text: str, facts: _Facts, shown: str) -> None:
    if text != "cuda":  # "cuda:0": a fixed GPU whatever the process
        facts.pinned.append((f, node, shown))
    else:
        facts.cuda_uses.append((f, node, shown))


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
