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
# rank 0's last line of a run (trainer.py _log_run_throughput): wall-clock beside compute-only tokens/s
THROUGHPUT = re.compile(
    r"ddp-train\[rank 0\] INFO throughput: (\d+) steps in (\d+(?:\.\d+)?)s wall: (\d+) tok/s wall-clock, "
    r"(\d+) tok/s compute-only"
)


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


def parse_throughput(lines: list[str]) -> dict[str, float] | None:
    """The run's throughput from rank 0's last `throughput:` line among `lines`, or None."""
    for line in reversed(lines):
        m = THROUGHPUT.search(line)
        if m:
            steps, wall, wall_tok, tok = m.groups()
            return {
                "steps": int(steps),
                "wall_s": float(wall),
                "wall_tokens_per_s": float(wall_tok),
                "tokens_per_s": float(tok),
            }
    return None


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
    wall_s_per_step: float | None = None  # from the stamps of the step lines: evals, saves, waits included

    def eta_s(self) -> float | None:
        """Steps left x the wall time per step over the log's tail (else the trainer's s/step)."""
        if self.last_step is None:
            return None
        left = max(0, self.last_step.total - self.last_step.step)
        return left * self.wall_s_per_step if self.wall_s_per_step else self.last_step.eta_s()


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
    first: tuple[int, float] | None = None  # the oldest step line of the tail: (step, time)
    last_at: float | None = None
    for line in reversed(text.splitlines()):
        m = STAMP.match(line)
        at = _stamp_time(m.group(1), m.group(2)) if m else None
        if out.last_line_at is None and m and line.strip():
            out.last_line_at, out.last_line = at, line[m.end() :]
        step = parse_step(line)
        if step is None or at is None:
            continue
        if out.last_step is None:
            out.last_step, last_at = step, at
        elif step.step < out.last_step.step:
            first = (step.step, at)
    if first and out.last_step and last_at is not None and last_at > first[1]:
        out.wall_s_per_step = (last_at - first[1]) / (out.last_step.step - first[0])
    return out


def _stamp_time(seconds: str, fraction: str | None) -> float:
    return time.mktime(time.strptime(seconds, "%Y-%m-%dT%H:%M:%S")) + float(fraction or 0)
