"""Errors the launcher reports as one line instead of a traceback."""

from __future__ import annotations


class LaunchError(Exception):
    """Bad input (inventory, flags, config): one line naming the file and field, exit code 2."""


def one_line(text: str, limit: int = 400) -> str:
    """Collapse whitespace so a message fits one line; cut very long ones."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
