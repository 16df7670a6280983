"""The DDP training loop: setup (model, data, optimizer, resume), steps, checkpoints, final check."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import logging
import math
import os
import random
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_train import checkpoint, distributed, exitcodes, stackdump, storage, tbwriter
from ddp_train.config import Config, ConfigError, dump_yaml
from ddp_train.console import emit_line
from ddp_train.data import (
    ShardedBatches,
    build_dataset,
    build_val_dataset,
    resolve_vocab,
    worker_start_method,
)
from ddp_train.distributed import DistEnv
from ddp_train.evaluate import Evaluator, perplexity
from ddp_train.meter import PendingStep, StepMeter
from ddp_train.metrics import JsonlWriter, ProgressBar, attach_progress_bar, mfu, peak_flops, setup_logging
from ddp_train.models import build_model, flops_per_token
from ddp_train.optim import build_optimizer, build_scheduler

log = logging.getLogger("ddp_train")
_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def params_sha256(model: nn.Module) -> str:
    """sha256 (hex) over the raw float32 bytes of all parameters, in named_parameters order."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        t = p.detach().to("cpu", torch.float32).contiguous()
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch, CUDA and python RNG states."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what rng_state returned."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    random.setstate(state["python"])


class StopRequest:
    """Records SIGTERM/SIGINT instead of dying, so the loop can finish the step and save first."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def flags(self) -> list[float]:
        """This rank's stop flags [SIGTERM, SIGINT] (1.0 when received), summed over ranks with the loss."""
        return [float(self.signum == signal.SIGTERM), float(self.signum == signal.SIGINT)]

    @staticmethod
    def decode(sigterm_ranks: float, sigint_ranks: float) -> signal.Signals | None:
        """The signal behind the summed flags (SIGINT wins over SIGTERM), or None."""
        if sigint_ranks > 0:
            return signal.SIGINT
        return signal.SIGTERM if sigterm_ranks > 0 else None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        signal.signal(signum, signal.SIG_DFL)  # a second signal of the same kind kills at once


class GarbageCollection:
    """Python's GC on a schedule, the same on every rank, as torchtitan does (torchtitan/tools/utils.py
    GarbageCollection, training.gc_freq): an automatic collection pauses one rank at a random moment
    and the others wait for it in the next all-reduce (a straggler). After setup everything alive is
    frozen (gc.freeze: never scanned again, and fork()ed DataLoader workers do not touch its pages),
    automatic collection is off, and every `every` steps a generation-1 collection runs on all ranks.
    `every` 0 leaves the interpreter's GC alone. close() restores it."""

    def __init__(self, every: int) -> None:
        self.every = every
        if every:
            gc.collect()
            gc.freeze()
            gc.disable()

    def step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.every:
            gc.unfreeze()
            gc.enable()


class Trainer:
    """One rank's training job; `fit()` returns the process exit code."""

    def __init__(
        self, cfg: Config, env: DistEnv, device: torch.device, stop: StopRequest | None = None
    ) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.stop = stop or StopRequest()
        self.step, self.last_loss, self.saved_step = 0, float("nan"), -1
        self.meter: StepMeter | None = None
        # [SIGTERM, SIGINT] flags, filled with Python scalars each step: a kernel launch, no host-device copy
        self._flags = torch.zeros(2, device=device)
        t = cfg.train
        if t.precision == "fp16" and device.type != "cuda":
            raise ConfigError("config", "train.precision", "'fp16' needs CUDA (use bf16 or fp32 on CPU)")
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        resolve_vocab(cfg)  # 'auto' from meta.json, or refuse a model too small for the data, before step 1
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model = build_model(cfg).to(device)
        self.optimizer = build_optimizer(self.model, t, device)
        self.scheduler = build_scheduler(self.optimizer, t)
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
        self.autocast = (
            torch.autocast(device.type, dtype=_AMP_DTYPES[t.precision])
            if t.precision in _AMP_DTYPES
            else contextlib.nullcontext()
        )
        if env.is_main or cfg.debug.dump_indices:
            with storage.guarded("creating the run directory", cfg.run_dir):
                cfg.run_dir.mkdir(parents=True, exist_ok=True)
        index_log = cfg.run_dir / f"indices-rank{env.rank}.jsonl" if cfg.debug.dump_indices else None
        train_set = build_dataset(cfg)
        val_set = build_val_dataset(cfg, train_set) if cfg.eval.interval_steps else None
        self.evaluator = (
            Evaluator(val_set, t.batch_size, cfg.eval.batches, env.rank, env.world_size, device)
            if val_set is not None
            else None
        )
        self.best: dict[str, Any] = {"val_loss": None, "step": None}
        self._val: dict[int, float] = {}  # val loss of steps whose log record is not written yet
        self.batches = ShardedBatches(
            train_set,
            t.batch_size,
            env.rank,
            env.world_size,
            cfg.seed,
            num_workers=cfg.data.num_workers,
            pin_memory=device.type == "cuda",
            index_log=index_log,
            prefetch_factor=cfg.data.prefetch_factor,
            worker_start=worker_start_method(device, train_set) if cfg.data.num_workers else None,
        )
        self.checkpoints = checkpoint.Checkpointer(
            cfg.checkpoint_dir,
            rank=env.rank,
            local_rank=env.local_rank,
            resume=cfg.checkpoint.resume,
            keep_latest_k=cfg.checkpoint.keep_latest_k,
            io_timeout_s=cfg.checkpoint.io_timeout_s,
            save_delay_s=cfg.debug.save_delay_s,
        )
        if not self._resume():
            torch.manual_seed(cfg.seed + env.rank)
            random.seed(cfg.seed + env.rank)
        net: nn.Module = torch.compile(self.model) if t.compile else self.model  # raw module stays self.model
        self.ddp: nn.Module = net
        self.net = net  # evaluated without DDP: no gradient, so no reducer or buffer broadcast needed
        # One rank has nothing to average: DDP would only copy gradients into buckets, all-reduce them
        # with itself and split the compiled graph at every bucket (DDPOptimizer).
        if env.distributed and env.world_size > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.ddp = DDP(net, device_ids=ids, gradient_as_bucket_view=True)
        # The gradients are views into DDP's all-reduce buckets from the first step on, as long as they
        # are zeroed in place: set_to_none=True destroys the alias every step, so each backward allocates
        # new gradients and copies them into the buckets (torch 2.13 nn/parallel/distributed.py, the
        # `batched_grad_copy` doc: "the bucket view alias is destroyed every iteration"; the test
        # test_ddp_gradients_stay_views_of_the_buckets checks it). Without DDP, None frees the memory
        # between steps instead.
        self._grads_to_none = not isinstance(self.ddp, DDP)
        # Compiled, the first training step and the first validation compile on every rank, at different
        # speeds, and the first collective after them waits for the slowest: dist.compile_timeout_s
        # applies until the first step ran (run() starts the group with it) and during the first
        # validation, collective_timeout_s otherwise.
        self._compiling = {"train", "eval"} if t.compile and env.distributed else set()
        self.ddp.train()  # once: evaluate() puts the mode back (a train() per step walked every module)
        self.flops_per_token = flops_per_token(self.model)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        # the peak of the precision the matmuls run at (fp32 runs as TF32: allow_tf32 above)
        self.peak = peak_flops(name, cfg.log.peak_tflops, t.precision) if device.type == "cuda" else None

    # --- resume / save ----------------------------------------------------------------------------

    def _resume(self) -> bool:
        """Resume from the newest valid checkpoint found on any node (checkpoint.Checkpointer.restore)."""
        # the model's own tensors receive the broadcast: no rank but the reader holds a copy of the state
        found = self.checkpoints.restore(self.device, into={"model": self.model.state_dict()})
        if found is None:
            return False
        state, path, src, host = found
        self.load_state_dict(state, path)
        where = f" (on {host}, rank {src})" if src != 0 else ""
        log.info("resumed from %s at step %d%s", path, self.step, where)
        if self.step >= self.cfg.train.max_steps:
            log.info(
                "checkpoint step %d >= train.max_steps %d: nothing left to train",
                self.step,
                self.cfg.train.max_steps,
            )
        return True

    def load_state_dict(self, state: dict[str, Any], path: str) -> None:
        """Apply a checkpoint's state (what state_dict returned); CheckpointError if it does not fit."""
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise checkpoint.CheckpointError(path, f"does not fit this model/optimizer: {first}") from None
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["data"])
        self.step = self.saved_step = int(state["step"])
        self.last_loss = float(state.get("loss", float("nan")))
        self.best = dict(state.get("best") or {"val_loss": None, "step": None})
        rngs = state["rng"]
        if state.get("world_size") != self.env.world_size:
            log.warning(
                "checkpoint world size %s, now %d: data order and RNG streams differ from an "
                "uninterrupted run",
                state.get("world_size"),
                self.env.world_size,
            )
        if self.env.rank < len(rngs):
            set_rng_state(rngs[self.env.rank], self.device)
        else:
            torch.manual_seed(self.cfg.seed + self.env.rank + self.step)
            random.seed(self.cfg.seed + self.env.rank + self.step)

    def state_dict(self, rngs: list[Any]) -> dict[str, Any]:
        """Everything a bit-exact resume needs; `rngs` holds every rank's RNG state, in rank order."""
        return {
            "format": checkpoint.FORMAT,
            "step": self.step,
            "loss": self.last_loss,
            "best": dict(self.best),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "data": self.batches.state_dict(),
            "rng": rngs,
            "world_size": self.env.world_size,
            "config": self.cfg.to_dict(),
            "torch_version": str(torch.__version__),
        }

    @property
    def best_path(self) -> Path:
        """<run dir>/best.pt: beside checkpoints/, so keep_latest_k rotation never sees it."""
        return self.cfg.run_dir / "best.pt"

    def best_state(self) -> dict[str, Any]:
        """What best.pt holds: the weights of the best step and what they are (no optimizer, data or RNG
        state: a resume uses the regular checkpoints, whose `best` entry keeps the best val loss)."""
        return {
            "format": checkpoint.BEST_FORMAT,
            "step": self.step,
            "best": dict(self.best),
            "model": self.model.state_dict(),
            "config": self.cfg.to_dict(),
            "torch_version": str(torch.__version__),
        }

    def save_best(self) -> None:
        """The weights alone to best.pt (atomically), after a new best val loss: a third of a full
        checkpoint under AdamW (two fp32 moments per weight), never a second write of the same state."""
        note = f" (val_loss {self.best['val_loss']:.4f} at step {self.step})"
        self.checkpoints.save(None, lambda _rngs: self.best_state(), self.step, self.best_path, note)

    def validate(self) -> float:
        """Val loss of the current model on every rank's slice (collective); keeps the best."""
        assert self.evaluator is not None
        if self.meter is not None:
            # The host runs a step ahead: without this the clock below would start while the device
            # still runs this step, and its time would be paused out as eval's (as save's is not:
            # fit() pops the meter before saving).
            self.meter.drain()
        t0 = time.perf_counter()
        first_compiled = "eval" in self._compiling
        if first_compiled:
            distributed.set_collective_timeout(first_step_timeout_s(self.cfg))
        loss = self.evaluator.evaluate(self.net, self.autocast)
        if first_compiled:
            self._compiled("eval")
        self._val[self.step] = loss
        best = self.best.get("val_loss")
        if math.isfinite(loss) and (best is None or loss < best):
            self.best = {"val_loss": loss, "step": self.step}
            if self.cfg.eval.keep_best:
                self.save_best()
        self._pause(time.perf_counter() - t0)  # compute-only tokens/s and MFU; the wall figure keeps it
        return loss

    def _compiled(self, phase: str) -> None:
        """`phase` ("train" or "eval") has run compiled on every rank: back to the collective timeout
        unless the first training step is still on its way (validate raises it again for its first)."""
        self._compiling.discard(phase)
        if "train" not in self._compiling:
            distributed.set_collective_timeout(self.cfg.dist.collective_timeout_s)

    def save(self) -> None:
        """A checkpoint of this step: every rank's RNG state gathered, rank 0 writes, all wait for it."""
        t0 = time.perf_counter()
        self.checkpoints.save(rng_state(self.device), self.state_dict, self.step)
        self.saved_step = self.step
        self._pause(time.perf_counter() - t0)

    def _pause(self, seconds: float) -> None:
        if self.meter is not None:
            self.meter.pause(seconds)

    # --- training ---------------------------------------------------------------------------------

    def _micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches.next()
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            raise ConfigError("config", "data", "dataset items must be (inputs, targets) pairs")
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step over grad_accum_steps micro-batches; (local loss, grad norm, tokens)."""
        t = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for micro in range(t.grad_accum_steps):
            x, y = self._micro_batch()
            last = micro == t.grad_accum_steps - 1
            sync = contextlib.nullcontext() if last or not isinstance(self.ddp, DDP) else self.ddp.no_sync()
            with sync:
                with self.autocast:
                    loss = self.ddp(x, y)
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                    raise ConfigError("config", "model", "forward(inputs, targets) must return a scalar loss")
                self.scaler.scale(loss / t.grad_accum_steps).backward()
            loss_sum += loss.detach().float() / t.grad_accum_steps
            tokens += y.numel()
        gnorm = torch.zeros((), device=self.device)
        if t.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip).float()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=self._grads_to_none)
        self.scheduler.step()
        return loss_sum, gnorm, tokens

    def fit(self) -> int:
        """Train to max_steps (or until SIGTERM/SIGINT), checkpointing; print the final line; exit code."""
        cfg, env, total = self.cfg, self.env, self.cfg.train.max_steps
        show_bar = cfg.log.progress == "always" or (cfg.log.progress == "auto" and sys.stderr.isatty())
        bar = ProgressBar(total, show_bar and env.is_main)
        attach_progress_bar(log, bar)
        metrics = cfg.run_dir / "metrics.jsonl"
        with storage.guarded("opening the metrics file", metrics):
            writer = JsonlWriter(metrics if env.is_main and cfg.log.jsonl else None)
        writer = tbwriter.tee(writer, cfg, env.is_main)  # + TensorBoard when log.tensorboard
        self._log_start()
        meter = self.meter = StepMeter(self.device.type == "cuda", bar, writer)
        collector = GarbageCollection(cfg.train.gc_interval_steps)
        stopped: signal.Signals | None = None
        try:
            while self.step < total and not stopped:
                lr = self.optimizer.param_groups[0]["lr"]
                loss, gnorm, tokens = self.train_step()
                self.step += 1
                # Mean loss, grad norm and stop flags (a SIGTERM on any rank stops every rank after the
                # same step) travel in one small async all-reduce, read one step later (StepMeter).
                sigterm, sigint = self.stop.flags()
                self._flags[0].fill_(sigterm)
                self._flags[1].fill_(sigint)
                stats = torch.cat([torch.stack([loss, gnorm]), self._flags])
                finished = meter.pop()
                if finished is not None and "train" in self._compiling:
                    self._compiled("train")  # its all-reduce is back: every rank compiled and ran it
                meter.push(
                    self.step,
                    self.batches.epoch,
                    lr,
                    tokens * env.world_size,
                    stats,
                    distributed.all_reduce_sum_async(stats),
                )
                stopped = self._report(finished)
                every = cfg.eval.interval_steps
                if (
                    self.evaluator
                    and every
                    and (self.step % every == 0 or self.step == total)
                    and not stopped
                ):
                    self.validate()
                interval = cfg.checkpoint.interval_steps
                if interval and self.step % interval == 0 and self.step < total and not stopped:
                    stopped = self._report(meter.pop())  # the stop vote of this step, before saving
                    self.save()
                stackdump.debug_stall(self.step)  # DDP_DEBUG_STALL: the watchdog's test only
                if cfg.debug.step_delay_s:
                    time.sleep(cfg.debug.step_delay_s)
                    meter.pause(cfg.debug.step_delay_s)  # keep throughput figures honest
                collector.step(self.step)
            stopped = self._report(meter.pop()) or stopped
            self._log_run_throughput(meter)
            bar.close()
            if self.saved_step != self.step:
                self.save()
        finally:
            meter.close()
            collector.close()
            self.batches.close()
        if self.best.get("step") is not None and env.is_main:
            where = f" ({self.best_path})" if cfg.eval.keep_best else ""
            log.info("best val_loss %.4f at step %d%s", self.best["val_loss"], self.best["step"], where)
        if stopped and self.step < total:
            code = 128 + int(stopped)
            log.warning(
                "stopped by %s after step %d, checkpoint saved; exit %d", stopped.name, self.step, code
            )
            where = f"rank={env.rank} world={env.world_size} step={self.step}"
            emit_line(f"ddp-train: stopped {where} signal={stopped.name}")
            return code
        return self._final_check()

    def _log_start(self) -> None:
        cfg, env = self.cfg, self.env
        if not env.is_main:
            return
        with storage.guarded("writing the run's config", cfg.run_dir / "config.yaml"):
            (cfg.run_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
        log.info(
            "world=%d device=%s backend=%s model=%s params=%d flops/token=%.3g step=%d/%d "
            "batches/epoch/rank=%d",
            env.world_size,
            self.device,
            torch.distributed.get_backend() if distributed.active() else "none",
            cfg.model.name,
            sum(p.numel() for p in self.model.parameters()),
            self.flops_per_token,
            self.step,
            cfg.train.max_steps,
            self.batches.batches_per_epoch,
        )

    def _report(self, finished: tuple[PendingStep, list[float]] | None) -> signal.Signals | None:
        """A step's all-reduced numbers: progress bar, log line and metrics when due; the stop signal."""
        if finished is None:
            return None
        p, (loss_sum, gnorm_sum, sigterm, sigint) = finished
        world, cfg, meter = self.env.world_size, self.cfg, self.meter
        assert meter is not None
        self.last_loss = loss_sum / world
        meter.bar.update(p.step, f"loss {self.last_loss:.4f}")
        stop = StopRequest.decode(sigterm, sigint)
        due = p.step % cfg.log.interval_steps == 0 or p.step == cfg.train.max_steps
        if due or stop or p.step in self._val:
            self._log_step(p, gnorm_sum / world, *meter.close_window(p))
        return stop

    def _log_run_throughput(self, meter: StepMeter) -> None:
        """The run's totals on rank 0: wall-clock tokens/s (from the loop's start to now, after the last
        step's numbers came back: the last evaluation included) beside the compute-only figure, and the
        time between them (eval, best.pt, checkpoints, debug delays)."""
        steps, tokens = meter.total_steps, meter.total_tokens
        wall, compute = time.perf_counter() - meter.started, meter.last_stamp - meter.started_clock
        if not (self.env.is_main and steps and compute > 0):
            return
        log.info(
            "throughput: %d steps in %.1fs wall: %.0f tok/s wall-clock, %.0f tok/s compute-only "
            "(%.1fs of eval, checkpoints and delays paused out)",
            steps,
            wall,
            tokens / wall,
            tokens / compute,
            wall - compute,
        )

    def _log_step(
        self, p: PendingStep, grad_norm: float, seconds: float, wall: float, tokens: int, steps: int
    ) -> None:
        cfg, world = self.cfg, self.env.world_size
        tok_s, wall_tok_s = tokens / seconds, tokens / wall
        samples = steps * cfg.train.batch_size * cfg.train.grad_accum_steps * world
        record: dict[str, Any] = {
            "step": p.step,
            "epoch": p.epoch,
            "loss": round(self.last_loss, 6),
            "lr": p.lr,
            "grad_norm": round(grad_norm, 6) if cfg.train.grad_clip > 0 else None,
            "samples_per_s": round(samples / seconds, 3),
            "tokens_per_s": round(tok_s, 3),  # compute-only: eval and checkpoint time paused out
            "wall_tokens_per_s": round(wall_tok_s, 3),  # wall-clock: nothing left out
            "step_time_s": round(seconds / steps, 6),
        }
        if self.peak:
            record["mfu"] = round(mfu(tok_s, self.flops_per_token, self.peak, world), 5)
        val_text = ""
        val = self._val.pop(p.step, None)
        if val is not None:
            record["val_loss"] = round(val, 6)
            val_text = f" val_loss {val:.4f}"
            if self.cfg.model.name == "gpt" or self.cfg.data.name == "tokens":
                record["val_ppl"] = round(perplexity(val), 4)
                val_text += f" val_ppl {record['val_ppl']:.2f}"
            if self.best.get("val_loss") is not None:
                record["best_val_loss"] = round(self.best["val_loss"], 6)
        mfu_text = f" mfu {record['mfu']:.1%}" if "mfu" in record else ""
        line = (
            f"step {p.step}/{cfg.train.max_steps} loss {self.last_loss:.4f}{val_text} lr {p.lr:.3g} "
            f"{tok_s:.0f} tok/s {record['step_time_s']:.3f} s/step{mfu_text} wall {wall_tok_s:.0f} tok/s"
        )
        assert self.meter is not None
        self.meter.emit(record, line)  # metrics.jsonl + the log line: the one place a step is reported

    def _final_check(self) -> int:
        digest = params_sha256(self.model)
        digests = distributed.all_gather_objects(digest)
        env = self.env
        emit_line(
            f"ddp-train: final rank={env.rank} world={env.world_size} step={self.step} "
            f"loss={self.last_loss:.6f} params_sha256={digest[:16]}"
        )
        if len(set(digests)) != 1:
            log.error("ranks ended with different parameters: %s", ", ".join(d[:16] for d in digests))
            return exitcodes.RANKS_DIFFER
        return exitcodes.OK


# PyTorch's NCCL flight recorder: on a collective timeout the watchdog dumps the last collectives of every
# rank. TORCH_NCCL_DUMP_ON_TIMEOUT needs a trace buffer > 0 and TORCH_NCCL_ENABLE_MONITORING (on by
# default); the files are <dump file prefix><rank> (torch 2.13: c10d/ProcessGroupNCCL.hpp and
# FlightRecorder.hpp, where TORCH_FR_BUFFER_SIZE / TORCH_FR_DUMP_TEMP_FILE are the current names and
# TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE the deprecated ones that still work).
# Read when the group is created, so set before init.
FLIGHT_RECORDER_BUFFER = "2000"


def flight_recorder_env(run_dir: Any, environ: Any = None) -> dict[str, str]:
    """The flight recorder defaults this run adds (a variable the user set, under either name, wins)."""
    env = os.environ if environ is None else environ
    added = {}
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        added["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env and "TORCH_FR_BUFFER_SIZE" not in env:
        added["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_BUFFER
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env and "TORCH_FR_DUMP_TEMP_FILE" not in env:
        added["TORCH_FR_DUMP_TEMP_FILE"] = f"{run_dir}/nccl_trace_rank_"
    return added


def first_step_timeout_s(cfg: Config) -> float:
    """The collective timeout until the compiled steps ran once (Trainer._compiled)."""
    d = cfg.dist
    return max(d.compile_timeout_s, d.collective_timeout_s) if cfg.train.compile else d.collective_timeout_s


def compile_threads_env(env: DistEnv, environ: Any = None) -> dict[str, str]:
    """TORCHINDUCTOR_COMPILE_THREADS = this node's cores / its ranks, unless set. Inductor otherwise
    gives every rank min(32, cores) compile workers (torch 2.13 _inductor/config.py
    decide_compile_threads, read once when torch._inductor.config is first imported: set it before)."""
    environ = os.environ if environ is None else environ
    if "TORCHINDUCTOR_COMPILE_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"TORCHINDUCTOR_COMPILE_THREADS": str(max(1, cores // max(1, env.local_world_size)))}


def make_dump_dirs(environ: Any = None) -> None:
    """Create the directory of the flight recorder's dump files on this rank. torch's writer creates no
    directory: DebugInfoWriter::write opens a std::ofstream and only logs "Error opening file for
    writing Flight Recorder debug info" (torch 2.13 c10d/FlightRecorderDetail.hpp), and only rank 0
    creates the run directory, so without this every other rank's trace would be lost.
    Both names, whichever the user set; a directory that cannot be made is a warning only."""
    env = os.environ if environ is None else environ
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if env.get(name):
            directory = Path(env[name]).parent
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("%s: cannot create %s for NCCL trace dumps: %s", name, directory, exc)


# What gloo, NCCL and the TCPStore raise in a rank whose peer died or closed its connections (gloo
# tcp/pair.cc "Connection closed by peer ... typically caused by a remote worker crash"; c10d's
# DistNetworkError from the store's socket; NCCL's aborted communicator).
PEER_GONE = re.compile(
    r"closed by peer|reset by peer|remote worker|Broken pipe|Connection refused|communicator was aborted|"
    r"Failed to recv|Socket Timeout",
    re.IGNORECASE,
)
# Where an error of the process group itself comes from: gloo's and c10d's C++ sources name themselves
# in the message ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] ..."); NCCL's say NCCL.
FROM_DIST = re.compile(r"\[[\w./-]+\.(?:cc|cpp|hpp|h):\d+\]|\bgloo\b|\bc10d\b|\bNCCL\b|ProcessGroup\w+")


def consequence(exc: BaseException, signum: int | None) -> str | None:
    """Why `exc` is the consequence of another rank's failure or of a stop, in a few words; None when
    it is this rank's own failure (then its traceback is the report)."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    # only an error of the process group counts: a plug-in's own "Connection reset by peer", or a bug
    # met during a stop's final save, is this rank's failure and keeps its traceback
    dist = [e for e in chain if isinstance(e, torch.distributed.DistError) or FROM_DIST.search(str(e))]
    if not dist:
        return None
    lost = any(isinstance(e, torch.distributed.DistNetworkError) or PEER_GONE.search(str(e)) for e in dist)
    if signum is not None:
        name = signal.Signals(signum).name
        how = "a peer went away" if lost else "it failed"
        return f"{name} received during a collective, then {how}: {type(exc).__name__}: {first}"
    if lost:
        return f"a peer rank went away (its host log has the cause): {type(exc).__name__}: {first}"
    return None


def indented_traceback(exc: BaseException) -> str:
    """The traceback with every line indented: nothing in it reads as the rank's own error line."""
    lines = "".join(traceback.format_exception(exc)).splitlines()
    return "".join((ln if ln.startswith(("Traceback", " ")) else "  " + ln) + "\n" for ln in lines)


def run(cfg: Config, source: str = "config") -> int:
    """Run one rank (alone or under torchrun): set up the process group, train, tear it down."""
    stop = StopRequest()
    stop.install()  # from here on SIGTERM/SIGINT mean "finish the step, save, exit 128 + signal"
    trainer: Trainer | None = None
    try:
        env = distributed.read_env()
        setup_logging(env.rank, cfg.log.level)
        stackdump.install(env.rank)  # SIGUSR1 -> this rank's stack, for ddp-launch's stall watchdog
        device = distributed.select_device(cfg.dist, env)
        os.environ.update(flight_recorder_env(cfg.run_dir))
        make_dump_dirs()  # on every rank: only rank 0 creates the run directory
        if cfg.train.compile:
            os.environ.update(compile_threads_env(env))
        distributed.init(cfg.dist, env, device, first_step_timeout_s(cfg))
        trainer = Trainer(cfg, env, device, stop)
        code = trainer.fit()
        distributed.barrier()  # no rank tears down its connections while a peer still uses them
        return code
    except storage.StorageError as exc:
        if not exc.kept:
            exc = exc.with_kept(checkpoint.kept(cfg.checkpoint_dir))
        emit_line(f"ddp-train: error: {exc}", sys.stderr)
        return exitcodes.BAD_INPUT
    except ConfigError as exc:
        if exc.source == "config":
            exc = ConfigError(source, exc.field, exc.message)
        emit_line(f"ddp-train: error: {exc}", sys.stderr)
        return exitcodes.BAD_INPUT
    except distributed.PeerFailure as exc:
        emit_line(f"ddp-train: stopped: {exc}", sys.stderr)
        return 128 + stop.signum if stop.signum else exitcodes.FAILURE
    except Exception as exc:
        why = consequence(exc, stop.signum)
        if why is None:
            # this rank's own failure: its traceback and error line now, before the finally below takes
            # the process group down (its peers then print "stopped:" lines that must not come first)
            sys.stderr.write("".join(traceback.format_exception(exc)))
            first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
            emit_line(f"ddp-train: error: {type(exc).__name__}" + (f": {first}" if first else ""), sys.stderr)
            return exitcodes.FAILURE
        # the traceback for the host log (ddp-launch keeps indented traceback lines off its console),
        # then the one line that says why this rank failed
        sys.stderr.write(indented_traceback(exc))
        emit_line(f"ddp-train: stopped: {why}", sys.stderr)
        return 128 + stop.signum if stop.signum else exitcodes.FAILURE
    finally:
        # DDP's reducer keeps the process group alive; free it now, while the interpreter is intact
        # (a gloo group destroyed during interpreter shutdown can abort the process with SIGABRT).
        trainer = None
        gc.collect()
        distributed.shutdown()
        stop.restore()
