"""One home for the helpers that make messages fit one line (config, checkpoint and launcher errors)."""

from __future__ import annotations

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
