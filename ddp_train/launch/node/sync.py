"""--sync on a node: `inspect` the copy there, `unpack` the changed files next to the unchanged ones,
`finish` (check the digest, rename into place). Each prints its result as one marked line."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import tarfile
from typing import Any

from . import tree

INSPECT_MARK, DONE_MARK = "DDP-SYNC ", "DDP-SYNC-DONE"


def inspect(base: str, name: str, want: str) -> dict[str, object]:
    """Is the copy there already, intact? If not, the newest earlier copy (to send only the
    differences). A copy whose files were changed on the node is moved aside and sent again."""
    os.makedirs(base, exist_ok=True)
    final = os.path.join(base, name)
    r: dict[str, object] = {"present": False, "rsync": bool(shutil.which("rsync"))}
    if os.path.isdir(final):
        with contextlib.suppress(OSError, ValueError):
            r["present"] = tree.shipped(final) == want
        if not r["present"]:
            aside = f"{final}.tmp-bad-{os.getpid()}"
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
    if not r["present"]:
        pattern = os.path.join(glob.escape(base), "*", tree.MANIFEST)
        olds = [m for m in glob.glob(pattern) if ".tmp-" not in m]
        if olds:
            newest = max(olds, key=os.path.getmtime)
            r["prev"] = os.path.basename(os.path.dirname(newest))
            try:  # hashed, not read from the manifest: files are hard-linked between copies
                r["prev_entries"] = tree.tree(tree.listed(os.path.dirname(newest)))[0]
            except (OSError, ValueError):
                r["prev_entries"] = {}
    return r


def unpack(base: str, tmp: str, archive: str, prev: str, keep: list[str]) -> None:
    """Link unchanged files from the earlier copy, unpack the archive of changed ones."""
    os.makedirs(tmp)
    for rel in keep:
        src, dst = os.path.join(base, prev, rel), os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    if archive:
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                parts = m.name.split("/")
                if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.issym()):
                    raise SystemExit(f"unsafe archive member {m.name!r}")
            # the "tar" filter where this python has it (PEP 706: 3.12, backported to 3.9.17 and later)
            safe: dict[str, Any] = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
            t.extractall(tmp, **safe)  # noqa: S202
        os.unlink(archive)


def finish(base: str, name: str, tmp: str, want: str) -> None:
    """Check the new copy against the digest, add its manifest (what the next sync starts from and what
    preflight verifies) and rename it into place in one step; someone sharing the workdir may have done
    so first: then keep theirs."""
    entries, got = tree.tree(tree.walk(tmp))
    if got != want:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"content digest {got[:16]} after the copy, expected {want[:16]}")
    with open(os.path.join(tmp, tree.MANIFEST), "w") as f:
        json.dump(entries, f)
    final = os.path.join(base, name)
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, tree.MANIFEST)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    """inspect BASE NAME DIGEST | unpack BASE TMP ARCHIVE PREV KEEP-JSON | finish BASE NAME TMP DIGEST"""
    what, args = argv[0], argv[1:]
    if what == "inspect":
        print(INSPECT_MARK + json.dumps(inspect(*args[:3])), flush=True)
    elif what == "unpack":
        unpack(args[0], args[1], args[2], args[3], json.loads(args[4]))
    elif what == "finish":
        finish(*args[:4])
        print(DONE_MARK, flush=True)
    else:
        sys.exit(f"unknown sync step {what!r}")
    return 0
