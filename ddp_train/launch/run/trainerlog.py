"""The trainer's output contract: the lines the trainer prints (meter.py, checkpoint.py) that the
launcher reads.

Rank 0 logs `ddp-train[rank 0] INFO step 12/30 loss 1.2345 lr 0.001 1234 tok/s 0.123 s/step`
(meter.StepLog.write; DDP keeps every rank at the same step, so rank 0's line is the job's progress),
`INFO saved <file>.pt in 3.21s` after each checkpoint, `INFO throughput: ...` last; each rank that
stops on a signal prints `ddp-train: stopped rank=R world=W step=S signal=NAME` once its checkpoint is
saved. Every line is parsed here once (StepTimes.feed); status, the live line, a stop's grace and the
stall watchdog read the result.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable

STEP_LINE = re.compile(
    r"ddp-train\[rank (\d+)\] INFO step (\d+)/(\d+) loss (\S+)(?: .*?)? (\d+(?:\.\d+)?) tok/s "
    r"(\d+(?:\.\d+)?) s/step"
)
# after "s/step": the wall-clock figures (meter.StepLog.report), the MFU where the device's peak is known
WALL_PART = re.compile(
    r" s/step(?: mfu (\d+(?:\.\d+)?)%)? wall (\d+(?:\.\d+)?) tok/s(?: mfu (\d+(?:\.\d+)?)%)?"
)
SAVE_LINE = re.compile(r" INFO saved .+\.pt in (\d+(?:\.\d+)?)s")
STOPPED_LINE = re.compile(r"ddp-train: stopped rank=(\d+) world=(\d+) step=(\d+) signal=(\w+)")
# rank 0's first line when it continues a checkpoint (checkpoint.resumed_line)
RESUMED_LINE = re.compile(r"ddp-train\[rank 0\] INFO resumed from .* at step (\d+)")
# rank 0's last line of a run (meter.StepLog.run_throughput): wall-clock beside compute-only tokens/s
THROUGHPUT = re.compile(
    r"ddp-train\[rank 0\] INFO throughput: (\d+) steps in (\d+(?:\.\d+)?)s wall: (\d+) tok/s wall-clock, "
    r"(\d+) tok/s compute-only(?:.*; mfu (\d+(?:\.\d+)?)% wall-clock, (\d+(?:\.\d+)?)% compute-only)?"
)


@dataclasses.dataclass(frozen=True)
class Step:
    rank: int
    step: int
    total: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    wall_tokens_per_s: float | None = None
    mfu: float | None = None  # percent, compute-only
    wall_mfu: float | None = None  # percent, on the wall clock

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
    w = WALL_PART.search(line, m.end() - len(" s/step"))
    wall = {}
    if w:
        wall = {"wall_tokens_per_s": float(w.group(2)), "mfu": float(w.group(1)) if w.group(1) else None,
                "wall_mfu": float(w.group(3)) if w.group(3) else None}  # fmt: skip
    return Step(
        int(m.group(1)), int(m.group(2)), int(m.group(3)), loss, float(m.group(5)), float(m.group(6)), **wall
    )


@dataclasses.dataclass(frozen=True)
class Stopped:
    """One rank's `stopped` line: it finished its step and (rank 0) saved."""

    rank: int
    step: int
    signal: str
    world: int = 0


def parse_stopped(lines: Iterable[str]) -> list[Stopped]:
    return [Stopped(int(m[1]), int(m[3]), m[4], int(m[2])) for m in map(STOPPED_LINE.search, lines) if m]


def parse_throughput(lines: list[str]) -> dict[str, float] | None:
    """The run's throughput from rank 0's last `throughput:` line among `lines`, or None."""
    for line in reversed(lines):
        m = THROUGHPUT.search(line)
        if m:
            steps, wall, wall_tok, tok, wall_mfu, mfu = m.groups()
            return {
                "steps": int(steps),
                "wall_s": float(wall),
                "wall_tokens_per_s": float(wall_tok),
                "tokens_per_s": float(tok),
                **({"wall_mfu": float(wall_mfu), "mfu": float(mfu)} if mfu else {}),
            }
    return None


@dataclasses.dataclass
class StepTimes:
    """The longest checkpoint save and step the trainer reported: they size a stop's grace and the stall
    watchdog's timeout. Also the run's progress for job.json's attempts: the step it resumed from, its
    last step, and when (time.time()) its first step line came."""

    longest_save: float = 0.0  # seconds
    longest_step: float = 0.0
    resumed_step: int | None = None
    last_step: int | None = None
    first_step_at: float | None = None

    def feed(self, line: str) -> Step | None:
        """Take one output line; its step, if it is a step line."""
        step = parse_step(line)
        if step is not None:
            self.longest_step = max(self.longest_step, step.step_time_s)
            self.last_step = max(self.last_step or 0, step.step)
            if self.first_step_at is None:
                self.first_step_at = time.time()
            return step
        m = SAVE_LINE.search(line)
        if m:
            self.longest_save = max(self.longest_save, float(m.group(1)))
        elif self.resumed_step is None and (m := RESUMED_LINE.search(line)):
            self.resumed_step = int(m.group(1))
        return None
