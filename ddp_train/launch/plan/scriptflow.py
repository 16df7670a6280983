"""The script check's value tracking (scriptcheck.py): simple data flow within one file.

A name assigned once in its function (or, if never in it, once at module level) stands for that value;
`args.x` stands for the default of the argparse option whose dest is x, unless some `.x` is assigned
in the file. Nothing crosses a module boundary and nothing is run: a value given on the command line,
read from a file or computed by a call is not known, and not a finding.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from ddp_train.launch.plan.scriptfiles import SCOPES, _File, _Flow, _name


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
