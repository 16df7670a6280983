"""The script check's rules over the whole project (scriptcheck.py): the findings that need every file's
facts (scriptfacts.py): init_process_group's fixed arguments and mp.spawn, --local_rank, CUDA with no
device per process, torch.save not guarded by the global rank.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from ddp_train.launch.plan.scriptfacts import _Facts
from ddp_train.launch.plan.scriptfiles import Finding, _File, _ignored_node, _name, _src
from ddp_train.launch.plan.scriptflow import _flow, _is_param, _scope, _value

RANK_WORDS = re.compile(r"rank|master|main_process|is_main|primary|leader|is_zero", re.IGNORECASE)

LOCAL_WORDS = re.compile(r"local|^gpu|device_id", re.IGNORECASE)  # a rank within the node

RANK_ENV = {"RANK": "global", "SLURM_PROCID": "global", "OMPI_COMM_WORLD_RANK": "global",
            "PMI_RANK": "global", "LOCAL_RANK": "local", "SLURM_LOCALID": "local",
            "OMPI_COMM_WORLD_LOCAL_RANK": "local"}  # fmt: skip

RANK_CALLS = {"get_rank": "global", "get_global_rank": "global", "get_local_rank": "local",
              "current_device": "local", "get_node_local_rank": "local"}  # fmt: skip

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
