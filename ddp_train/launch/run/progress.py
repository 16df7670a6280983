"""Training progress from the trainer's step lines (launch/run/trainerlog.py): `status` and the live line."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

from ddp_train.launch.run.trainerlog import Step, parse_step

STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)? ")  # logs.py _stamp


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
    """The one-line status: step/max, loss, tokens/s on the wall clock (evals and saves included: what an
    overnight run gets; the compute-only figure where the trainer's line has none), MFU, ETA."""
    tok_s = step.wall_tokens_per_s if step.wall_tokens_per_s is not None else step.tokens_per_s
    mfu = f" mfu {step.wall_mfu:.1f}%" if step.wall_mfu is not None else ""
    eta = duration(step.eta_s())
    return f"step {step.step}/{step.total} loss {step.loss:.4f} {tok_s:.0f} tok/s{mfu} ETA {eta}"


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
