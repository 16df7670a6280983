"""The training loop's step meter: stats read one step late without a host sync, throughput windows."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddp_train.metrics import JsonlWriter, ProgressBar


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


@dataclass
class PendingStep:
    """A step whose all-reduced numbers are still on their way to the host."""

    step: int
    epoch: int
    lr: float
    tokens: int
    stamp: float  # training-clock time at which the step was enqueued
    wall: float  # wall-clock time at the same moment (nothing paused out)
    host: torch.Tensor  # where the numbers land (pinned memory on CUDA; the tensor itself on CPU)
    ready: Any  # a CUDA event recorded after the copy, or the async all-reduce's work, or None


class StepMeter:
    """The step loop's bookkeeping: pending stats, throughput window, progress bar and metrics file.

    `push` stamps a finished step and starts its numbers' trip to the host without waiting: on CUDA
    the all-reduce's work is joined to the compute stream (work.wait does not block the host on NCCL),
    the numbers are copied non_blocking into pinned memory and an event is recorded behind the copy.
    `pop`, one step later, waits on that event only, which the GPU passed while it was already running
    the next step: no per-step host-device sync (a .tolist() on the device tensor would wait for every
    kernel queued so far). torch docs: "Pinned memory", CUDA semantics / non_blocking; torch.cuda.Event.

    Throughput windows run from stamp to stamp, in training time (`pause` removes eval, save and debug
    delays), so the last window is as long as the others; each window also has its wall-clock length,
    nothing paused out, so time spent outside the steps is never hidden. `drain` waits for the pending
    step's numbers (so for the device to finish that step) before anything is timed and paused out.
    """

    def __init__(self, cuda: bool, bar: ProgressBar, writer: JsonlWriter) -> None:
        self.cuda, self.bar, self.writer = cuda, bar, writer
        self._paused = 0.0
        self._pending: PendingStep | None = None
        self.started = self.window_wall = time.perf_counter()
        self.started_clock = self.window_start = self.now()
        self.window_tokens = self.window_steps = 0
        self.total_tokens = self.total_steps = 0  # over the run, for its wall-clock and compute totals
        self.last_wall, self.last_stamp = self.started, self.started_clock

    def now(self) -> float:
        """Training-clock time: wall time minus what `pause` excluded."""
        return time.perf_counter() - self._paused

    @property
    def paused(self) -> float:
        """Seconds left out of the training clock so far."""
        return self._paused

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (eval, checkpoint, debug delay) out of the compute-only throughput figures."""
        self._paused += seconds

    def drain(self) -> None:
        """Wait until the pending step's numbers are on the host, i.e. the device finished that step,
        without taking them: time measured afterwards (and paused out) is not that step's compute."""
        p = self._pending
        if p is not None and p.ready is not None:
            if isinstance(p.ready, torch.cuda.Event):
                p.ready.synchronize()
            else:
                p.ready.wait()
            p.ready = None

    def push(self, step: int, epoch: int, lr: float, tokens: int, stats: torch.Tensor, work: Any) -> None:
        """Enqueue a finished step's device stats (being all-reduced by `work`); one is pending at most."""
        assert self._pending is None, "pop() the previous step first"
        stamp, wall = self.now(), time.perf_counter()
        if self.cuda:
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the all-reduce; the host does not
            host = _pinned_like(stats)
            host.copy_(stats, non_blocking=True)
            ready: Any = torch.cuda.Event()
            ready.record()
        else:
            host, ready = stats, work
        self._pending = PendingStep(step, epoch, lr, tokens, stamp, wall, host, ready)

    def pop(self) -> tuple[PendingStep, list[float]] | None:
        """The pending step and its numbers (waiting for them if still in flight); None if none."""
        p, self._pending = self._pending, None
        if p is None:
            return None
        if p.ready is not None:
            if isinstance(p.ready, torch.cuda.Event):
                p.ready.synchronize()
            else:
                p.ready.wait()
        values = p.host.tolist()
        self.window_tokens += p.tokens
        self.window_steps += 1
        self.total_tokens += p.tokens
        self.total_steps += 1
        self.last_wall, self.last_stamp = p.wall, p.stamp
        return p, values

    def close_window(self, p: PendingStep) -> tuple[float, float, int, int]:
        """(training seconds, wall seconds, tokens, steps) of the window ending with step `p`; starts the
        next one."""
        seconds = max(p.stamp - self.window_start, 1e-9)
        wall = max(p.wall - self.window_wall, seconds)
        out = (seconds, wall, self.window_tokens, self.window_steps)
        self.window_start, self.window_wall, self.window_tokens, self.window_steps = p.stamp, p.wall, 0, 0
        return out

    def emit(self, record: dict[str, Any], line: str) -> None:
        """The one place a step's metrics leave the process: metrics.jsonl and the log line."""
        self.writer.write(record)
        logging.getLogger("ddp_train").info("%s", line)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
