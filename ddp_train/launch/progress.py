"""Training progress from the trainer's step lines (what `status`, the live line and the watchdog read).

The trainer's rank 0 logs `ddp-train[rank 0] INFO step 12/30 loss 1.2345 lr 0.001 1234 tok/s
0.123 s/step` (trainer.py _log_step); DDP keeps every rank at the same step, so rank 0's line is the
job's progress.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

STEP_LINE = re.compile(
    r"ddp-train\[rank (\d+)\] INFO step (\d+)/(\d+) loss (\S+)(?: .*?)? (\d+(?:\.\d+)?) tok/s "
    r"(\d+(?:\.\d+)?) s/step"
)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)? ")  # logs.py _stamp


@dataclasses.dataclass(frozen=True)
class Step:
    rank: int
    step: int
    total: int
    loss: float
    tokens_per_s: float
    step_time_s: float

    def eta_s(self) -> float:
        return max(0, self.total - self.step) * self.step_time_s


def parse_step(line: str) -> Step | None:
    m = STEP_LINE.search(line)
    if not m:
        return None
    try:
        loss = float(m.group(4))
    except ValueError:
        loss = float("nan")
    return Step(int(m.group(1)), int(m.group(2)), int(m.group(3)), loss, float(m.group(5)), float(m.group(6)))


def duration(seconds: float | None) -> str:
    """12s, 3m04s, 2h05m, 1d03h."""
    if seconds is None or seconds != seconds:
        return "-"
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def live_line(step: Step) -> str:
    """The one-line status: step/max, loss, tokens/s, ETA."""
    return (
        f"step {step.step}/{step.total} loss {step.loss:.4f} {step.tokens_per_s:.0f} tok/s "
        f"ETA {duration(step.eta_s())}"
    )


@dataclasses.dataclass
class HostLog:
    """What one node's log file says: its newest step line and when it last printed anything."""

    last_step: Step | None = None
    last_line_at: float | None = None  # epoch seconds
    last_line: str = ""


def read_host_log(path: Path, max_bytes: int = 4 << 20) -> HostLog:
    """The newest step line and the time of the last line of logs/<job>/<host>.log (its tail only)."""
    out = HostLog()
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return out
    lines = text.splitlines()
    for line in reversed(lines):
        if not line.strip():
            continue
        if out.last_line_at is None:
            m = STAMP.match(line)
            if m:
                out.last_line_at = time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S"))
                out.last_line = line[m.end() :]
        step = parse_step(line)
        if step is not None:
            out.last_step = step
            break
    return out
