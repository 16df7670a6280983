"""The import graph of ddp_train/ (issue #47): no import circle, and layers that only point down.

Every import of a ddp_train module is an edge, read with `ast` (nothing is imported): at module level,
inside a function (a lazy import still ties the two modules together: it only moves the cost to the
first call) and under `if TYPE_CHECKING:` (a type named in a signature is a dependency too).
`from pkg import mod` is an edge to pkg.mod; `from mod import name` one to mod.

LAYERS is the order docs/architecture.md draws, top first: a module may import its own layer or one
below it. An import that runs back up is allowed only where UPWARD lists it, with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_train"

# Top first, as docs/architecture.md draws them; modules without their `ddp_train.` prefix (__init__:
# the package itself). An entry names a module and everything under it; the longest match wins.
LAYERS_TEXT = """
entry points:        __main__ launch.cli
launcher commands:   launch.runargs launch.jobs launch.remote.stage
slurm backend:       launch.slurm
launcher grammar:    launch.cliparse
pipeline:            launch.pipeline
preflight:           launch.preflight
a running job:       launch.run launch.jobs.metricsview
the plan:            launch.plan
reaching nodes:      launch.remote
launcher records:    launch launch.errors launch.plan.inventory launch.plan.vault launch.jobs.jobstate
node code:           launch.node
trainer programs:    trainer prepare agent allreduce compilecheck
loop parts:          hooks meter replica
components:          checkpoint asyncsave data models optim evaluate metrics tbwriter tokenizer plugins
                     workerproc cachedirs stackdump
collectives:         distributed
config and storage:  config storage
base:                __init__ errors text exitcodes digest console cliargs batchplan
"""


def _layers(text: str) -> list[tuple[str, tuple[str, ...]]]:
    layers: list[tuple[str, tuple[str, ...]]] = []
    for line in text.strip().splitlines():
        name, sep, entries = line.partition(":")
        if not sep:  # a continued line: more entries of the layer above
            name, entries = "", line
        full = tuple("ddp_train" if e == "__init__" else f"ddp_train.{e}" for e in entries.split())
        if name.strip():
            layers.append((name.strip(), full))
        else:
            layers[-1] = (layers[-1][0], layers[-1][1] + full)
    return layers


LAYERS = _layers(LAYERS_TEXT)

# (importer, imported) -> why it runs back up. At most 2; each also has a comment at the import.
UPWARD: dict[tuple[str, str], str] = {}
MAX_UPWARD = 2
# Circles not yet undone, each with what undoes it. Any other circle fails, and so does one listed here
# once it is gone (delete it then).
KNOWN_CIRCLES: dict[tuple[str, ...], str] = {}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def graph() -> dict[str, set[str]]:
    """module -> the ddp_train modules it imports (anywhere in its file)."""
    mods = modules()

    def known(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out |= {known(a.name) for a in node.names if a.name.split(".")[0] == "ddp_train"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                if base.split(".")[0] != "ddp_train":
                    continue
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base) for a in node.names}
        out.discard(name)
        edges[name] = out
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    """The index of the module's layer in LAYERS (0: the top)."""
    best, depth = -1, -1
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and len(e) > depth:
                best, depth = i, len(e)
    return best


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in edges.items() for b in bs if layer(b) < layer(a))


def test_every_module_has_a_layer() -> None:
    assert [m for m in modules() if layer(m) < 0] == []


def test_no_import_circle() -> None:
    edges = graph()
    found = circles(edges)
    print()
    for comp in found:
        print(f"circle of {len(comp)}:")
        for a in comp:
            for b in sorted(edges[a] & set(comp)):
                print(f"  {a} -> {b}")
        print(f"  {KNOWN_CIRCLES.get(tuple(comp), 'NOT ALLOWED')}")
    new = [c for c in found if tuple(c) not in KNOWN_CIRCLES]
    assert new == [], f"{len(new)} import circle(s): " + "; ".join(" ".join(c) for c in new)
    assert [c for c in KNOWN_CIRCLES if list(c) not in found] == [], "KNOWN_CIRCLES lists one that is gone"


def test_imports_only_point_down() -> None:
    found = upward(graph())
    print()
    for a, b in found:
        why = UPWARD.get((a, b), "NOT ALLOWED")
        print(f"upward: {a} ({LAYERS[layer(a)][0]}) -> {b} ({LAYERS[layer(b)][0]}): {why}")
    assert len(UPWARD) <= MAX_UPWARD
    assert [e for e in found if e not in UPWARD] == []
    assert [e for e in UPWARD if e not in found] == [], "UPWARD lists an import that is gone"


def test_the_graph_sees_lazy_and_type_only_imports() -> None:
    """The reader itself: a function-level import and one under TYPE_CHECKING are edges."""
    edges = graph()
    assert "ddp_train.launch.pipeline" in edges["ddp_train.launch.cli"]  # lazy, in _launch
    assert "ddp_train.launch.slurm.settings" in edges["ddp_train.launch.cli"]  # TYPE_CHECKING only
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
