"""Free space where rank 0 will write: each directory (relative to the node's working directory) or
its nearest existing parent, as shutil.disk_usage sees it.

    space CWD DIRS-JSON

prints `DDP-SPACE {dir: [existing path, free bytes, total bytes] or the error}`."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

MARK = "DDP-SPACE "


def main(argv: list[str]) -> int:
    cwd, dirs = argv[0], json.loads(argv[1])
    if cwd:
        os.chdir(cwd)
    r: dict[str, Any] = {}
    for d in dirs:
        p = os.path.abspath(os.path.expanduser(d))
        while not os.path.exists(p) and os.path.dirname(p) != p:
            p = os.path.dirname(p)
        try:
            u = shutil.disk_usage(p)
            r[d] = [p, u.free, u.total]
        except OSError as e:
            r[d] = str(e)
    print(MARK + json.dumps(r), flush=True)
    return 0
