"""Whole-line output for processes that share a terminal or pipe (every rank under torchrun)."""

from __future__ import annotations

import os
import sys
from typing import TextIO


def emit_line(line: str, stream: TextIO | None = None) -> None:
    """Write `line` + newline with a single write(2), so lines of different ranks never interleave."""
    stream = stream or sys.stdout
    stream.flush()
    data = (" ".join(line.splitlines()) + "\n").encode("utf-8", "backslashreplace")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream (pytest) has no descriptor
        stream.write(data.decode())
        stream.flush()
        return
    os.write(fd, data)
