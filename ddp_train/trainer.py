"""The DDP training loop: setup (model, data, optimizer, resume), steps, checkpoints, final check."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_train import batchplan, cachedirs, checkpoint, distributed, exitcodes, stackdump, storage
from ddp_train.checkpoint import Checkpointer, params_sha256
from ddp_train.config import Config, ConfigError
from ddp_train.console import emit_line
from ddp_train.data import build_dataset, build_val_dataset, resolve_vocab, train_batches
from ddp_train.distributed import DistEnv
from ddp_train.errors import UserError
from ddp_train.evaluate import BestValLoss, Evaluator
from ddp_train.hooks import DebugHooks
from ddp_train.meter import PendingStep, StepLog, StepMeter
from ddp_train.metrics import device_peak_flops, open_outputs, setup_logging
from ddp_train.models import build_model, flops_per_token
from ddp_train.optim import build_optimizer, build_scheduler, mixed_precision
from ddp_train.replica import Replicas
from ddp_train.text import first_line

log = logging.getLogger("ddp_train")


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
        # A second signal of the same kind kills at once; not SIGTERM in a Slurm step, where slurmstepd
        # and torchrun each send one for the same `scancel` (launch/slurm/driver.py)
        if not (signum == signal.SIGTERM and os.environ.get("DDP_SLURM_STEP")):
            signal.signal(signum, signal.SIG_DFL)


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


def input_pair(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
        raise ConfigError("config", "data", "dataset items must be (inputs, targets) pairs")
    return batch[0], batch[1]


def scalar_loss(loss: Any) -> torch.Tensor:
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ConfigError("config", "model", "forward(inputs, targets) must return a scalar loss")
    return loss


class Trainer:
    """One rank's training job; `fit()` returns the process exit code.

    The model under three roles: `model` is the module itself (its weights are what is checkpointed
    and checked), `eval_model` what validation runs (compiled when train.compile), `train_model` what
    the steps run (eval_model in DDP when there are ranks to average with, else eval_model itself).
    """

    def __init__(
        self, cfg: Config, env: DistEnv, device: torch.device, stop: StopRequest | None = None
    ) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.stop = stop or StopRequest()
        self.hooks = DebugHooks(cfg, env.rank)
        self.step, self.last_loss, self.saved_step = 0, float("nan"), -1
        self.best_pending: dict[str, Any] | None = None  # a new best of this step, for its checkpoint
        self.best = BestValLoss()
        self.meter: StepMeter | None = None
        self.steplog: StepLog | None = None
        # [SIGTERM, SIGINT] flags, filled with Python scalars each step: a kernel launch, no host-device copy
        self._flags = torch.zeros(2, device=device)
        t = cfg.train
        self.scaler, self.autocast = mixed_precision(t, device)
        resolve_vocab(cfg)  # 'auto' from meta.json, or refuse a model too small for the data, before step 1
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        self.model = build_model(cfg).to(device)
        self.optimizer = build_optimizer(self.model, t, device)
        self.scheduler = build_scheduler(self.optimizer, t)
        if env.is_main or self.hooks.index_log:
            with storage.guarded("creating the run directory", cfg.run_dir):
                # this user's, and no other user's symlink on the way (issue #44): checked as named
                storage.own_dir(named_run_dir(cfg), fix="set run.dir to a directory of yours")
        if cfg.checkpoint.dir and env.is_main:  # checked as named too, before anything is saved there
            with storage.guarded("creating the checkpoint directory", cfg.checkpoint_dir):
                named = Path.cwd() / Path(cfg.checkpoint.dir).expanduser()
                storage.own_dir(named, fix="set checkpoint.dir to a directory of yours")
        train_set = build_dataset(cfg)
        val_set = build_val_dataset(cfg, train_set) if cfg.eval.interval_steps else None
        self.evaluator = Evaluator.from_config(cfg, val_set, env, device) if val_set is not None else None
        replicas = Replicas.from_config(cfg, env)  # copies of each save on other nodes (replica.py)
        self.checkpoints = Checkpointer.from_config(cfg, env, self.hooks.save_delay_s, replicas)
        # the checkpoint first: train.global_batch 'auto' keeps its global batch, which shapes the batches
        found = self.checkpoints.restore(device, into={"model": self.model.state_dict()})
        said = self._keep_global_batch(found[0] if found else None)
        self.batches = train_batches(cfg, train_set, env.rank, env.world_size, device, self.hooks.index_log)
        resumed = self._resume(found)
        if said and env.is_main:
            log.info("%s", said)
        if not resumed:
            checkpoint.seed_rng(cfg.seed + env.rank)
        # validation needs no DDP: no gradient, so no reducer or buffer broadcast
        self.eval_model: nn.Module = torch.compile(self.model) if t.compile else self.model
        self.train_model = distributed.wrap(self.eval_model, env, device, cfg.dist.bucket_cap_mb)
        self._no_sync = distributed.no_sync(self.train_model)
        self._grads_to_none = distributed.grads_to_none(self.train_model)
        self.timeouts = distributed.CompileTimeouts(cfg.dist, t.compile, env.distributed)
        # once: evaluate() puts the mode back (a train() per step walked every module)
        self.train_model.train()
        if resumed and not t.compile:  # a bit-exact resume for any world size (compiled: not promised)
            distributed.settle_buckets(self.train_model, lambda: self._first_items_loss(train_set), device)
        self.flops_per_token = flops_per_token(self.model)
        # the peak of the precision the matmuls run at (fp32 runs as TF32: optim.mixed_precision)
        self.peak = device_peak_flops(device, cfg.log.peak_tflops, t.precision)

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> int:
        """Train to max_steps (or until SIGTERM/SIGINT), checkpointing; print the final line; exit code."""
        total = self.cfg.train.max_steps
        steplog = self._open_log()
        meter = steplog.meter
        collector = GarbageCollection(self.cfg.train.gc_interval_steps)
        stopped: signal.Signals | None = None
        try:
            while self.step < total and not stopped:
                lr = self.optimizer.param_groups[0]["lr"]
                loss, gnorm, tokens = self.train_step()
                self.step += 1
                stopped = self._exchange(lr, loss, gnorm, tokens)  # sends this step's, reads the last one's
                last = self.step == total
                if self.evaluator and self.evaluator.due(self.step, last) and not stopped:
                    # a checkpoint of this step follows (periodic, or the end's): best.pt will link to it
                    self.validate(link_best=self.checkpoints.due(self.step, last) or last)
                if self.checkpoints.due(self.step, last) and not stopped:
                    stopped = self._report(meter.pop())  # the stop vote of this step, before saving
                    self.save()
                self.hooks.after_step(self.step, meter)
                collector.step(self.step)
            stopped = self._report(meter.pop()) or stopped
            if self.env.is_main:
                steplog.run_throughput()
            meter.bar.close()
            if self.saved_step != self.step and (stopped or self.cfg.checkpoint.at_end):
                self.save()
            self.checkpoints.finish()  # the replica of the last save, before any rank exits
        finally:
            self.checkpoints.drain()  # an error left a save in flight: finished, or its failure logged
            meter.close()
            collector.close()
            self.batches.close()
        if self.best.step is not None and self.env.is_main:
            where = f" ({self.checkpoints.best_path})" if self.cfg.eval.keep_best else ""
            log.info("best val_loss %.4f at step %d%s", self.best.val_loss, self.best.step, where)
        if stopped and self.step < total:
            return stopped_exit(stopped, self.step, self.env)
        return final_check(self.model, self.env, self.step, self.last_loss)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step over grad_accum_steps micro-batches; (local loss, grad norm, tokens)."""
        t = self.cfg.train
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for micro in range(t.grad_accum_steps):
            x, y = self._micro_batch()
            # gradients are averaged over ranks in the last micro-step's backward only
            with self._no_sync() if micro < t.grad_accum_steps - 1 else contextlib.nullcontext():
                with self.autocast:
                    loss = scalar_loss(self.train_model(x, y))
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

    def _first_items_loss(self, dataset: Any) -> torch.Tensor:
        """The loss of the dataset's first batch_size items, drawn without the sampler (which stays where
        the checkpoint left it)."""
        n = min(self.cfg.train.batch_size, len(dataset))
        x, y = input_pair(torch.utils.data.default_collate([dataset[i] for i in range(n)]))
        with self.autocast:
            return scalar_loss(self.train_model(x.to(self.device), y.to(self.device)))

    def _micro_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = input_pair(self.batches.next())
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _exchange(
        self, lr: float, loss: torch.Tensor, gnorm: torch.Tensor, tokens: int
    ) -> signal.Signals | None:
        """Start the all-reduce of this step's mean loss, grad norm and stop flags (a SIGTERM on any rank
        stops every rank after the same step) and report the previous step's, back by now (StepMeter)."""
        assert self.meter is not None
        sigterm, sigint = self.stop.flags()
        self._flags[0].fill_(sigterm)
        self._flags[1].fill_(sigint)
        stats = torch.cat([torch.stack([loss, gnorm]), self._flags])
        finished = self.meter.pop()
        if finished is not None:
            self.timeouts.ran("train")  # its all-reduce is back: every rank compiled and ran it
        work = distributed.all_reduce_sum_async(stats)
        self.meter.push(self.step, self.batches.epoch, lr, tokens * self.env.world_size, stats, work)
        return self._report(finished)

    def _report(self, finished: tuple[PendingStep, list[float]] | None) -> signal.Signals | None:
        """A step's all-reduced numbers: progress bar, log line and metrics when due; the stop signal."""
        if finished is None:
            return None
        assert self.meter is not None and self.steplog is not None
        p, (loss_sum, gnorm_sum, sigterm, sigint) = finished
        self.last_loss = loss_sum / self.env.world_size
        self.meter.bar.update(p.step, f"loss {self.last_loss:.4f}")
        stop = StopRequest.decode(sigterm, sigint)
        if self.steplog.due(p.step, stop):
            self.steplog.write(p, self.last_loss, gnorm_sum / self.env.world_size, self.best.val_loss)
        return stop

    def _open_log(self) -> StepLog:
        """The run's progress bar, config.yaml, metrics file (+ TensorBoard), step meter and log; logs the
        run's start."""
        bar, writer = open_outputs(self.cfg, self.env.is_main, log)
        self.meter = StepMeter(self.device.type == "cuda", bar, writer)
        self.steplog = StepLog(self.cfg, self.meter, self.env.world_size, self.flops_per_token, self.peak)
        if self.env.is_main:
            backend = torch.distributed.get_backend() if distributed.active() else "none"
            params = sum(p.numel() for p in self.model.parameters())
            self.steplog.start(self.device, backend, params, self.step, self.batches.batches_per_epoch)
        return self.steplog

    # --- validation -------------------------------------------------------------------------------

    def validate(self, link_best: bool = False) -> float:
        """Val loss of the current model on every rank's slice (collective); keeps the best: best.pt is
        written now, or with `link_best` made a hard link to the checkpoint this step saves next."""
        assert self.evaluator is not None
        if self.meter is not None:
            # The host runs a step ahead: without this the clock below would start while the device still
            # runs this step, and its time would be paused out as eval's (not save's: fit() pops it first).
            self.meter.drain()
        t0 = time.perf_counter()
        self.timeouts.before("eval")
        loss = self.evaluator.evaluate(self.eval_model, self.autocast)
        self.timeouts.ran("eval")
        if self.steplog is not None:
            self.steplog.val[self.step] = loss
        if self.best.update(loss, self.step) and self.cfg.eval.keep_best:
            best = self.best.state_dict()
            if link_best:
                self.best_pending = best
            else:
                self.checkpoints.save_best(self.model.state_dict(), self.step, best, self.cfg.to_dict())
        self._pause(time.perf_counter() - t0)  # compute-only tokens/s and MFU; the wall figure keeps it
        return loss

    # --- resume / save ----------------------------------------------------------------------------

    def _keep_global_batch(self, state: dict[str, Any] | None) -> str | None:
        """train.global_batch: batch_size and grad_accum_steps for this world size (batchplan.py); 'auto'
        is the checkpoint's global batch, or on a fresh start what the configured ones make. The line
        to log when they changed; a world size that cannot make it is a ConfigError (exit 2)."""
        t, world = self.cfg.train, self.env.world_size
        if t.global_batch == "auto":
            then = batchplan.shape(state) if state is not None else None
            b, w, a = then if then is not None else (t.batch_size, world, t.grad_accum_steps)
            t.global_batch = b * w * a
        if not t.global_batch:
            return None
        try:
            return batchplan.apply(t, world)
        except batchplan.BatchError as e:
            raise ConfigError("config", "train.global_batch", str(e)) from None

    def _resume(self, found: tuple | None) -> bool:
        """Resume from the newest valid checkpoint found on any node (checkpoint.Checkpointer.restore;
        the model's own tensors received its broadcast: no rank but the reader holds a copy)."""
        if found is None:
            log.info("fresh start (no checkpoint in %s)", self.cfg.checkpoint_dir)
            return False
        state, path, src, host = found
        said, warn = self.load_state_dict(state, path)
        log.info("%s", checkpoint.resumed_line(path, state, host, src))  # the run's first INFO line
        if said and self.env.is_main:  # where the epoch goes on, when the world size changed
            log.log(logging.WARNING if warn else logging.INFO, "%s", said)
        if self.step >= (total := self.cfg.train.max_steps):
            log.info("checkpoint step %d >= train.max_steps %d: nothing left to train", self.step, total)
        return True

    def load_state_dict(self, state: dict[str, Any], path: str) -> tuple[str | None, bool]:
        """Apply a checkpoint's state (what state_dict returned); CheckpointError if it does not fit.
        What to say of the batch and the data position when the shape changed, and whether to warn."""
        checkpoint.load_weights(state, path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        t = self.cfg.train
        now = (t.batch_size, self.env.world_size, t.grad_accum_steps)
        data, said, warn = batchplan.resumed_data(state["data"], batchplan.shape(state), now)
        self.batches.load_state_dict(data)
        self.step = self.saved_step = int(state["step"])
        self.last_loss = float(state.get("loss", float("nan")))
        self.best = BestValLoss(state.get("best"))
        checkpoint.restore_rng(state, self.env, self.device, self.cfg.seed + self.env.rank + self.step)
        return said, warn

    def state_dict(self, rngs: list[Any]) -> dict[str, Any]:
        """Everything a bit-exact resume needs; `rngs` holds every rank's RNG state, in rank order."""
        return {
            "format": checkpoint.FORMAT,
            "step": self.step,
            "loss": self.last_loss,
            "best": self.best.state_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "data": self.batches.state_dict(),
            "rng": rngs,
            "world_size": self.env.world_size,
            "config": self.cfg.to_dict(),
            "torch_version": str(torch.__version__),
            **checkpoint.provenance(),
        }

    def save(self) -> None:
        """A checkpoint of this step: every rank's RNG state gathered, rank 0 writes, all wait for it."""
        t0 = time.perf_counter()
        best, self.best_pending = self.best_pending, None
        self.checkpoints.save(checkpoint.rng_state(self.device), self.state_dict, self.step, best=best)
        self.saved_step = self.step
        self._pause(time.perf_counter() - t0)

    def _pause(self, seconds: float) -> None:
        if self.meter is not None:
            self.meter.pause(seconds)


def stopped_exit(stopped: signal.Signals, step: int, env: DistEnv) -> int:
    """The exit of a run stopped by a signal after `step` (checkpoint saved): its lines, 128 + signal."""
    code = 128 + int(stopped)
    log.warning("stopped by %s after step %d, checkpoint saved; exit %d", stopped.name, step, code)
    where = f"rank={env.rank} world={env.world_size} step={step}"
    emit_line(f"ddp-train: stopped {where} signal={stopped.name}")
    return code


def final_check(model: nn.Module, env: DistEnv, step: int, loss: float) -> int:
    """The final line of every rank (step, loss, parameter digest); RANKS_DIFFER unless all agree."""
    digest = params_sha256(model)
    digests = distributed.all_gather_objects(digest)
    emit_line(
        f"ddp-train: final rank={env.rank} world={env.world_size} step={step} "
        f"loss={loss:.6f} params_sha256={digest[:16]}"
    )
    if len(set(digests)) != 1:
        log.error("ranks ended with different parameters: %s", ", ".join(d[:16] for d in digests))
        return exitcodes.RANKS_DIFFER
    return exitcodes.OK


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
    first = first_line(exc, type(exc).__name__)
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


def named_run_dir(cfg: Config) -> Path:
    """The run directory as run.dir and run.name name it, absolute, its symbolic links kept (cfg.run_dir
    resolves them): storage.own_dir checks each link on the way, so another user's is refused."""
    return Path.cwd() / Path(cfg.run.dir).expanduser() / cfg.run.name


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
        dumps = distributed.flight_recorder_env(named_run_dir(cfg))  # its links checked, not resolved
        os.environ.update(dumps)
        distributed.make_dump_dirs(ours=dumps)  # on every rank: only rank 0 creates the run directory
        if cfg.train.compile:
            os.environ.update(distributed.compile_threads_env(env))
            os.environ.update(cachedirs.compile_cache_env(os.environ))  # inductor/Triton caches: 0700, ours
        distributed.init(cfg.dist, env, device, distributed.first_step_timeout_s(cfg.dist, cfg.train.compile))
        trainer = Trainer(cfg, env, device, stop)
        code = trainer.fit()
        distributed.barrier()  # no rank tears down its connections while a peer still uses them
        return code
    except storage.StorageError as exc:
        if not exc.kept:
            exc = exc.with_kept(checkpoint.kept(cfg.checkpoint_dir))
        emit_line(f"ddp-train: error: {exc}", sys.stderr)
        return exitcodes.BAD_INPUT
    except UserError as exc:
        if exc.source == "config":
            exc = UserError(source, exc.field, exc.message)
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
            first = first_line(exc)
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
