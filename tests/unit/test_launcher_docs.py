"""docs/launcher.md's table of inventory variables is the set of `ddp_*` variables the launcher reads:
every string literal `ddp_...` in ddp_train/launch (ast), less the names that are not variables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_VARIABLES = {"ddp_train", "ddp_train_error"}  # the package, and a preflight fact's key


def read_by_the_launcher() -> set[str]:
    names: set[str] = set()
    for path in (REPO / "ddp_train" / "launch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and re.fullmatch(r"ddp_[a-z0-9_]+", value):
                names.add(value)
    return names - NOT_VARIABLES


def documented() -> set[str]:
    text = (REPO / "docs" / "launcher.md").read_text(encoding="utf-8")
    section = text.split("## Inventory variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(ddp_[a-z0-9_]+)` \|", section, re.M))


def test_every_variable_the_launcher_reads_is_in_the_table_and_no_other() -> None:
    code, docs = read_by_the_launcher(), documented()
    assert len(code) > 20, code  # the scan found the reads
    assert code - docs == set(), f"read by ddp_train/launch, missing from docs/launcher.md: {code - docs}"
    assert docs - code == set(), f"in docs/launcher.md's table, read nowhere: {docs - code}"
