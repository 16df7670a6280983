"""One home for the helpers that make messages fit one line (config, checkpoint and launcher errors)."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any


def one_line(text: str, limit: int | None = 400) -> str:
    """Collapse whitespace so a message fits one line; cut it to `limit` characters (None: never)."""
    flat = " ".join(str(text).split())
    return flat if limit is None or len(flat) <= limit else flat[: limit - 3] + "..."


def first_line(text: object, default: str = "") -> str:
    """The first non-blank line of `text` (an exception's message, say), stripped; `default` if none."""
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), default)


def short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a value quoted inside an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def when(seconds: float, now: float | None = None) -> str:
    """A save time for a log line: `2026-12-04 16:40:01 UTC, 3h12m ago` (a resume, a --fresh refusal)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
    age = max(0, int((time.time() if now is None else now) - seconds))
    ago = f"{age // 3600}h{age % 3600 // 60:02d}m" if age >= 3600 else f"{age // 60}m{age % 60:02d}s"
    return f"{stamp}, {ago} ago"


def install_hint(package: str, extra: str) -> str:
    """How to add the optional `package` to the Python running now (the venv that lacks it, named by
    its own interpreter), and, on a controller made by install.sh, the switch that does it."""
    return f"{shlex.quote(sys.executable)} -m pip install {package} (install.sh: ./install.sh --with {extra})"
