"""The argument parser every command line of ddp_train uses: errors as one line, exit BAD_INPUT."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ddp_train import exitcodes


class Parser(argparse.ArgumentParser):
    """argparse's default error prints the usage too and exits 2; this one prints one line,
    `LABEL: error: MESSAGE (see HINT)`, and exits exitcodes.BAD_INPUT. `label` defaults to the prog,
    `hint` to `PROG --help`; subcommand parsers made by add_subparsers inherit both."""

    def __init__(self, *args: Any, label: str | None = None, hint: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.label, self.hint = label, hint

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        hint = self.hint or f"{self.prog} --help"
        self.exit(exitcodes.BAD_INPUT, f"{self.label or self.prog}: error: {text} (see {hint})\n")
