"""The checkpoints already in a directory, for `--fresh`: a new run that finds some is refused before
anything starts (the trainer's own refusal, checkpoint.Checkpointer.newest, would fail the job).

    checkpoints CWD DIR

prints `DDP-CHECKPOINTS {"dir": absolute dir, "count": N, "newest": [step, file name, mtime] or null}`,
or `{"dir": ..., "error": strerror}`. The names are checkpoint.py's `step-<8+ digits>.pt` (a unit test
keeps the two patterns equal)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

MARK = "DDP-CHECKPOINTS "
NAME = re.compile(r"step-(\d{8,})\.pt")  # checkpoint._NAME; fullmatch


def main(argv: list[str]) -> int:
    cwd, directory = argv[0], argv[1]
    r: dict[str, Any] = {"dir": directory}
    try:
        os.chdir(cwd or ".")
        r["dir"] = path = os.path.abspath(os.path.expanduser(directory))
        found = []
        if os.path.isdir(path):
            for entry in os.scandir(path):
                m = NAME.fullmatch(entry.name)
                if m and entry.is_file():
                    found.append((int(m.group(1)), entry.name, entry.stat().st_mtime))
        found.sort()
        r.update(count=len(found), newest=list(found[-1]) if found else None)
    except OSError as e:
        r["error"] = e.strerror or str(e)
    print(MARK + json.dumps(r), flush=True)
    return 0
