"""The user's errors: bad input or an environment that refuses (config, data, checkpoint, disk).

Each is one line `<source>: <field>: <message>` and exit 2 (exitcodes.BAD_INPUT), never a traceback;
whoever means "any user error" catches UserError.
"""

from __future__ import annotations

from ddp_train.text import one_line


class UserError(Exception):
    """Bad user input or environment: rendered as one line `<source>: <field>: <message>`."""

    def __init__(self, source: str, field: str | None, message: str) -> None:
        self.source, self.field, self.message = source, field, message
        parts = [source] + ([field] if field else []) + [message]
        super().__init__(one_line(": ".join(parts), None))
