"""Errors the launcher reports as one line instead of a traceback."""

from __future__ import annotations

from ddp_train.text import one_line

__all__ = ["LaunchError", "one_line"]  # one_line lives in ddp_train/text.py; launcher modules import it here


class LaunchError(Exception):
    """Bad input (inventory, flags, config): one line naming the file and field, exit code 2."""
