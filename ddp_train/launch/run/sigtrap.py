"""Signal trapping as a context manager: the handlers only count; the job's loop polls them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any


class SignalTrap:
    """Within `with`: the signals are caught and counted (`first`, `count`); the previous handlers
    come back on exit. Outside the main thread (where Python allows no handler) it traps nothing."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.signals = tuple(signals)
        self.first: int | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        # Only set fields here: the main loop polls them (no locks taken in a signal handler).
        self.first = self.first or signum
        self.count += 1

    def reason(self) -> str:
        return f"received {signal.Signals(self.first).name}" if self.first else "interrupted"

    def __enter__(self) -> SignalTrap:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in self.signals}
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
