"""The content walk and digest of a --sync copy: run both on the controller (sync.scan) and on every
node (sync, files), so the two sides can never disagree on what the digest covers: path, kind,
user-exec bit, size and content."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any

MANIFEST = ".ddp-sync.json"  # in each copy: its files, for the next sync and for preflight

Item = tuple[str, str, str, bool, int]  # (relative path, full path, "f"|"l", user-exec, size)
Entry = list[Any]  # [kind, exec, size, sha256]


def walk(root: str, skip: Callable[[str, bool], bool] | None = None) -> list[Item]:
    """Regular files and symlinks below `root`, sorted; `skip(rel, is_dir)` prunes (dirs: not entered)."""
    out: list[Item] = []
    for top, dirs, files in os.walk(root):
        rel_top = os.path.relpath(top, root).replace(os.sep, "/")
        rel_top = "" if rel_top == "." else rel_top + "/"
        kept = []
        for d in sorted(dirs):
            full = os.path.join(top, d)
            if os.path.islink(full):
                files.append(d)
            elif not (skip and skip(rel_top + d, True)):
                kept.append(d)
        dirs[:] = kept
        for f in files:
            rel, full = rel_top + f, os.path.join(top, f)
            if skip and skip(rel, False):
                continue
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                out.append((rel, full, "l", False, 0))
            elif stat.S_ISREG(st.st_mode):
                out.append((rel, full, "f", bool(st.st_mode & 0o100), st.st_size))
    out.sort()
    return out


def content_digest(full: str, kind: str) -> str:
    if kind == "l":
        return hashlib.sha256(os.fsencode(os.readlink(full))).hexdigest()
    h = hashlib.sha256()
    with open(full, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def listed(root: str) -> list[Item]:
    """The files the sync put in `root` (its manifest names them); what a run wrote there does not count."""
    with open(os.path.join(root, MANIFEST)) as f:
        paths = sorted(json.load(f))
    items: list[Item] = []
    for rel in paths:
        full = os.path.join(root, rel)
        st = os.lstat(full)
        kind = "l" if stat.S_ISLNK(st.st_mode) else "f"
        regular = kind == "f"
        items.append((rel, full, kind, regular and bool(st.st_mode & 0o100), st.st_size if regular else 0))
    return items


def shipped(root: str) -> str:
    """The digest of the copy in `root` (OSError, ValueError when it is missing or its manifest bad)."""
    return tree(listed(root))[1]


def tree(items: Iterable[Item]) -> tuple[dict[str, Entry], str]:
    """({path: [kind, exec, size, sha256]}, digest of the whole tree)."""
    entries: dict[str, Entry] = {}
    h = hashlib.sha256()
    for rel, full, kind, x, size in items:
        entries[rel] = [kind, x, size, content_digest(full, kind)]
        h.update((json.dumps([rel, *entries[rel]]) + "\n").encode("utf-8", "surrogateescape"))
    return entries, h.hexdigest()
