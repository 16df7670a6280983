"""Every relative link in README.md, docs/*.md and bench/README.md resolves: to a file or directory of the
repository and, with a #fragment, to a heading of that Markdown file (GitHub's anchor rule)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's: lower case, punctuation but '-' and '_' dropped, each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    return {anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(md: Path) -> list[str]:
    return [t for t in LINK.findall(FENCE.sub("", md.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(md: Path) -> None:
    broken = []
    for target in links(md):
        path, _, frag = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists() or (frag and dest.suffix == ".md" and frag not in anchors(dest)):
            broken.append(target)
    assert not broken, f"{md.relative_to(REPO)}: broken links {broken}"


def test_anchor_follows_github() -> None:
    assert anchor("Code on every node: `--sync DIR`") == "code-on-every-node---sync-dir"
    assert anchor("Slurm (the launcher's backend)") == "slurm-the-launchers-backend"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n[b](b.md) [x](#a) [y](#nope) [z](https://example.org)\n")
    assert links(tmp_path / "a.md") == ["b.md", "#a", "#nope"]
    assert anchors(tmp_path / "a.md") == {"a"}
