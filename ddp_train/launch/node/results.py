"""`ddp-launch fetch` on rank 0's node: which file `best`, `last` or `metrics` is, its size and sha256.

results WHAT RUN-DIR CKPT-DIR     -> DDP-RESULT {"path", "size", "sha256"} or {"error"}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

MARK = "DDP-RESULT "
CHECKPOINT = re.compile(r"^step-(\d{8,})\.pt$")  # ddp_train/checkpoint.py checkpoint_name


def locate(what: str, run_dir: str, ckpt_dir: str) -> str:
    if what == "best":
        return os.path.join(run_dir, "best.pt")
    if what == "metrics":
        return os.path.join(run_dir, "metrics.jsonl")
    try:
        names = [n for n in os.listdir(ckpt_dir) if CHECKPOINT.match(n)]
    except OSError as e:
        raise FileNotFoundError(f"{ckpt_dir}: {e.strerror}") from None
    if not names:
        raise FileNotFoundError(f"no step-*.pt in {ckpt_dir}")
    return os.path.join(ckpt_dir, max(names, key=lambda n: int(CHECKPOINT.match(n).group(1))))  # type: ignore[union-attr]


def main(argv: list[str]) -> int:
    what, run_dir, ckpt_dir = argv[0], os.path.expanduser(argv[1]), os.path.expanduser(argv[2])
    r: dict[str, Any]
    try:
        path = locate(what, run_dir, ckpt_dir)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        r = {"path": path, "size": os.path.getsize(path), "sha256": h.hexdigest()}
    except OSError as e:
        r = {"error": f"{e.filename}: {e.strerror}" if e.filename else str(e)}
    print(MARK + json.dumps(r), flush=True)
    return 0
