"""The run's test hooks in one place (config `debug.*`, DDP_DEBUG_STALL): slow steps and saves, per-rank
batch index dumps, a stalled rank; none of them changes what is trained."""

from __future__ import annotations

import time
from pathlib import Path

from ddp_train import stackdump
from ddp_train.config import Config
from ddp_train.meter import StepMeter


class DebugHooks:
    """What `debug.*` asks of rank `rank`; every hook is off by default."""

    def __init__(self, cfg: Config, rank: int) -> None:
        d = cfg.debug
        self.step_delay_s = d.step_delay_s
        self.save_delay_s = d.save_delay_s  # checkpoint.save_file: a window in which to kill the writer
        self.index_log: Path | None = cfg.run_dir / f"indices-rank{rank}.jsonl" if d.dump_indices else None

    def after_step(self, step: int, meter: StepMeter) -> None:
        stackdump.debug_stall(step)  # DDP_DEBUG_STALL: the watchdog's test only
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
            meter.pause(self.step_delay_s)  # keep throughput figures honest
