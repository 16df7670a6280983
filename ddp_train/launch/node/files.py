"""Preflight's file check: the synced copy's content digest and the files the run needs, as seen from
the run's directory.

    files CWD SYNC-DIR REQUIRED-JSON      (SYNC-DIR "": no synced copy to verify)

prints `DDP-FILES {"sync": digest or why not, "files": {path: [size, mtime] or strerror}}`."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from . import tree

MARK = "DDP-FILES "


def main(argv: list[str]) -> int:
    cwd, sync_dir, required = argv[0], argv[1], json.loads(argv[2])
    files: dict[str, Any] = {}
    r: dict[str, Any] = {"files": files}
    if sync_dir:  # before the chdir: both paths are relative to the login dir
        try:
            r["sync"] = tree.shipped(sync_dir)
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or e
            r["sync"] = "missing" if not os.path.isdir(sync_dir) else f"incomplete ({why})"
    cwd_error = None
    try:
        os.chdir(cwd or ".")
    except OSError as e:
        cwd_error = e.strerror
    for p in required:
        if cwd_error and not os.path.isabs(os.path.expanduser(p)):
            files[p] = cwd_error
            continue
        try:
            st = os.stat(os.path.expanduser(p))
            # a directory (data.tokens.path): its size and mtime say nothing of its files, and differ
            # between nodes that got the same files at different times (`ddp-launch stage` checks hashes)
            files[p] = [0, 0] if stat.S_ISDIR(st.st_mode) else [st.st_size, int(st.st_mtime)]
        except OSError as e:
            files[p] = e.strerror
    print(MARK + json.dumps(r), flush=True)
    return 0
