"""The training loop's step meter (stats read one step late without a host sync, throughput windows)
and step log (what a step reports: metrics.jsonl record and log line)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddp_train.config import Config
from ddp_train.evaluate import perplexity
from ddp_train.metrics import JsonlWriter, ProgressBar, mfu

log = logging.getLogger("ddp_train")


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
        self.last_stamp = self.started_clock

    def now(self) -> float:
        """Training-clock time: wall time minus what `pause` excluded."""
        return time.perf_counter() - self._paused

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
        self.last_stamp = p.stamp
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
        log.info("%s", line)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


class StepLog:
    """What the steps report through a StepMeter: a record in metrics.jsonl and a log line every
    log.interval_steps, at the last step, at a stop and at a validation (`val` holds the val losses
    of steps not reported yet); the run's throughput totals at the end."""

    def __init__(
        self, cfg: Config, meter: StepMeter, world_size: int, flops_per_token: float, peak: float | None
    ) -> None:
        self.cfg, self.meter, self.world = cfg, meter, world_size
        self.flops_per_token, self.peak = flops_per_token, peak
        self.val: dict[int, float] = {}

    def start(self, device: Any, backend: str, params: int, step: int, batches_per_epoch: int) -> None:
        """The run's first line (call on rank 0): world, device, model and where the steps start."""
        cfg = self.cfg
        log.info(
            "world=%d device=%s backend=%s model=%s params=%d flops/token=%.3g step=%d/%d "
            "batches/epoch/rank=%d",
            self.world,
            device,
            backend,
            cfg.model.name,
            params,
            self.flops_per_token,
            step,
            cfg.train.max_steps,
            batches_per_epoch,
        )

    def due(self, step: int, stop: Any) -> bool:
        """Whether `step` is reported (`stop`: the run stops after it)."""
        every, total = self.cfg.log.interval_steps, self.cfg.train.max_steps
        return step % every == 0 or step == total or bool(stop) or step in self.val

    def write(self, p: PendingStep, loss: float, grad_norm: float, best_val: float | None) -> None:
        """Report step `p` (mean `loss` and `grad_norm` over ranks) and close its throughput window."""
        cfg, world = self.cfg, self.world
        seconds, wall, tokens, steps = self.meter.close_window(p)
        tok_s, wall_tok_s = tokens / seconds, tokens / wall
        samples = steps * cfg.train.batch_size * cfg.train.grad_accum_steps * world
        record: dict[str, Any] = {
            "step": p.step,
            "epoch": p.epoch,
            "loss": round(loss, 6),
            "lr": p.lr,
            "grad_norm": round(grad_norm, 6) if cfg.train.grad_clip > 0 else None,
            "samples_per_s": round(samples / seconds, 3),
            "tokens_per_s": round(tok_s, 3),  # compute-only: eval and checkpoint time paused out
            "wall_tokens_per_s": round(wall_tok_s, 3),  # wall-clock: nothing left out
            "step_time_s": round(seconds / steps, 6),
        }
        if self.peak:  # of the compute-only figure, and of the wall clock (nothing paused out: #46)
            record["mfu"] = round(mfu(tok_s, self.flops_per_token, self.peak, world), 5)
            record["wall_mfu"] = round(mfu(wall_tok_s, self.flops_per_token, self.peak, world), 5)
        val_text = ""
        val = self.val.pop(p.step, None)
        if val is not None:
            record["val_loss"] = round(val, 6)
            val_text = f" val_loss {val:.4f}"
            if cfg.model.name == "gpt" or cfg.data.name == "tokens":
                record["val_ppl"] = round(perplexity(val), 4)
                val_text += f" val_ppl {record['val_ppl']:.2f}"
            if best_val is not None:
                record["best_val_loss"] = round(best_val, 6)
        mfu_text = f" mfu {record['mfu']:.1%}" if "mfu" in record else ""
        wall_mfu = f" mfu {record['wall_mfu']:.1%}" if "wall_mfu" in record else ""
        line = (
            f"step {p.step}/{cfg.train.max_steps} loss {loss:.4f}{val_text} lr {p.lr:.3g} "
            f"{tok_s:.0f} tok/s {record['step_time_s']:.3f} s/step{mfu_text} wall {wall_tok_s:.0f} tok/s"
            f"{wall_mfu}"
        )
        self.meter.emit(record, line)  # metrics.jsonl + the log line: the one place a step is reported

    def run_throughput(self) -> None:
        """The run's totals (call on rank 0): wall-clock tokens/s (from the loop's start to now, after the
        last step's numbers came back: the last evaluation included) beside the compute-only figure, and
        the time between them (eval, best.pt, checkpoints, debug delays). ddp-launch reads this line
        (launch/run/progress.py parse_throughput)."""
        m = self.meter
        steps, tokens = m.total_steps, m.total_tokens
        wall, compute = time.perf_counter() - m.started, m.last_stamp - m.started_clock
        if not (steps and compute > 0):
            return
        mfus = ""
        if self.peak:
            fpt, world = self.flops_per_token, self.world
            mfus = f"; mfu {mfu(tokens / wall, fpt, self.peak, world):.1%} wall-clock, "
            mfus += f"{mfu(tokens / compute, fpt, self.peak, world):.1%} compute-only"
        log.info(
            "throughput: %d steps in %.1fs wall: %.0f tok/s wall-clock, %.0f tok/s compute-only "
            "(%.1fs of eval, checkpoints and delays paused out)%s",
            steps,
            wall,
            tokens / wall,
            tokens / compute,
            wall - compute,
            mfus,
        )
