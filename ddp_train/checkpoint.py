"""Atomic full-state checkpoints: `step-NNNNNNNN.pt` files, keep_latest_k, newest-valid resume.

A file is published only by os.replace of a fully written, fsynced temp file in the same directory,
so a crash leaves either the old set of checkpoints or the new one, plus at most a `*.tmp` that no
scan ever picks up. Readers check the zip CRCs before trusting a file (and a replica's sha256: see
replica.py); a corrupt newest file is moved aside as `*.corrupt` and the previous checkpoint is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import random
import re
import socket
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddp_train import distributed, storage
from ddp_train.asyncsave import BackgroundSave
from ddp_train.config import Config, ConfigError
from ddp_train.digest import file_sha256
from ddp_train.distributed import DistEnv
from ddp_train.errors import UserError
from ddp_train.text import first_line, one_line, when

FORMAT = "ddp-train-checkpoint/1"
BEST_FORMAT = "ddp-train-best/1"  # best.pt: the weights of the best step, no optimizer/data/RNG state
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "scheduler", "data", "rng", "config")
_NAME = re.compile(r"step-(\d{8,})\.pt")  # fullmatch: "$" would also match before a final "\n"
REPLICA_INFO = ".replica.json"  # beside a replica: {"sha256", "from", "size"} (replica.Receiver)

log = logging.getLogger("ddp_train.checkpoint")


class CheckpointError(UserError):
    """A checkpoint that cannot be used; one line naming the file."""

    def __init__(self, path: Path | str, message: str) -> None:
        super().__init__(str(path), None, message)


class CorruptCheckpoint(CheckpointError):
    """Unreadable bytes (truncated, bad CRC, not a torch zip, missing keys)."""


def params_sha256(model: nn.Module) -> str:
    """sha256 (hex) over the raw float32 bytes of all parameters, in named_parameters order."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        t = p.detach().to("cpu", torch.float32).contiguous()
        if t.numel():
            h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def seed_rng(seed: int) -> None:
    """Seed this process's torch (CPU and CUDA) and python RNGs."""
    torch.manual_seed(seed)
    random.seed(seed)


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


def restore_rng(state: dict[str, Any], env: DistEnv, device: torch.device, fallback_seed: int) -> None:
    """This rank's RNG states from a checkpoint (every rank's, in rank order); a rank the checkpoint's
    smaller world did not have seeds with `fallback_seed`. A world size change is a warning."""
    rngs = state["rng"]
    if state.get("world_size") != env.world_size:
        logging.getLogger("ddp_train").warning(
            "checkpoint world size %s, now %d: the ranks' RNG streams differ from an uninterrupted run",
            state.get("world_size"),
            env.world_size,
        )
    if env.rank < len(rngs):
        set_rng_state(rngs[env.rank], device)
    else:
        seed_rng(fallback_seed)


def provenance() -> dict[str, Any]:
    """What a resume's first line names, stored in each checkpoint at the moment it is built."""
    return {"saved_at": time.time(), "job": os.environ.get("DDP_JOB_ID")}


def resumed_line(path: Path, state: dict[str, Any], host: str, src: int) -> str:
    """Rank 0's first line of a resumed run: what it continues, so a stale run is seen at once (a
    checkpoint from before `provenance` has no job and save time: those parts are left out)."""
    job = f" of job {state['job']}" if state.get("job") else ""
    saved = f", saved {when(state['saved_at'])}" if state.get("saved_at") else ""
    copy = f", a replica sent by {state['replica_from']}" if state.get("replica_from") else ""
    where = f" (on {host}, rank {src})" if src != 0 else ""
    return f"resumed from {path} at step {state['step']}{job}{saved}{copy}{where}"


def saved_at(path: Path) -> str:
    """When the checkpoint at `path` was published (its mtime: the rename keeps the write's time)."""
    try:
        return when(path.stat().st_mtime)
    except OSError:
        return "time unknown"


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` optimizer steps."""
    return f"step-{step:08d}.pt"


def step_of(name: str) -> int | None:
    """The step of a checkpoint file name, None for any other name."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Published checkpoints as (step, path), oldest first; temp and corrupt files are never listed."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _NAME.fullmatch(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def save(state: dict[str, Any], directory: Path, step: int, delay_s: float = 0.0) -> Path:
    """Write `state` as step-NNNNNNNN.pt atomically: temp file, flush, fsync, rename, fsync dir."""
    return save_file(state, directory / checkpoint_name(step), delay_s)


def save_file(state: dict[str, Any], final: Path, delay_s: float = 0.0) -> Path:
    """Write `state` to `final` atomically (also best.pt, which no listing or pruning ever sees)."""
    replica_info(final).unlink(missing_ok=True)  # this node's own save: no longer a replica
    return storage.publish(final, lambda f: torch.save(state, f), delay_s)


def best_note(best: dict[str, Any], step: int) -> str:
    """What the log line of a new best.pt adds: its val loss and step."""
    return f" (val_loss {best['val_loss']:.4f} at step {step})"


def best_state(weights: dict[str, Any], step: int, best: dict[str, Any], config: dict[str, Any]) -> dict:
    """best.pt written on its own: the weights alone, a third of a full checkpoint under AdamW."""
    return {"format": BEST_FORMAT, "step": step, "best": dict(best), "model": weights, "config": config,
            "torch_version": str(torch.__version__)}  # fmt: skip


def kept(directory: Path) -> str:
    """What a failed write left usable, for its error line: the newest checkpoint, untouched."""
    found = list_checkpoints(directory)
    if not found:
        return f"no checkpoint in {directory} yet"
    step, path = found[-1]
    return f"checkpoint step {step} is intact ({path})"


def prune(directory: Path, keep_latest_k: int) -> list[Path]:
    """Delete all but the newest `keep_latest_k` checkpoints (0 keeps all); returns what was deleted."""
    if keep_latest_k <= 0:
        return []
    doomed = [p for _, p in list_checkpoints(directory)[:-keep_latest_k]]
    for path in doomed:
        path.unlink(missing_ok=True)
        replica_info(path).unlink(missing_ok=True)
    return doomed


def replica_info(path: Path) -> Path:
    """The file beside a replica that holds its sha256 and origin."""
    return path.with_name(path.name + REPLICA_INFO)


def write_replica_info(path: Path, info: dict[str, Any]) -> None:
    """Record (atomically) that `path` is a replica with this sha256 and origin, before it is published."""
    storage.publish(replica_info(path), lambda f: f.write(json.dumps(info).encode()))


def check_replica(path: Path) -> str | None:
    """For a replica: its origin host, after its sha256 matched the one sent with it (else
    CorruptCheckpoint); None for a checkpoint this node saved itself."""
    try:
        info = json.loads(replica_info(path).read_text())
        want, origin = str(info["sha256"]), str(info.get("from") or "another node")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(
            path, f"unreadable {replica_info(path).name} ({type(exc).__name__})"
        ) from None
    got = file_sha256(path)
    if got != want:
        raise CorruptCheckpoint(path, f"replica sha256 {got[:12]} differs from {want[:12]} sent by {origin}")
    return origin


def remove_stale_temps(directory: Path) -> list[Path]:
    """Delete `step-*.pt.tmp` left by a writer that died mid-save."""
    if not directory.is_dir():
        return []
    stale = [p for p in directory.glob("step-*.pt.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def verify(path: Path) -> None:
    """Raise CorruptCheckpoint unless `path` is a complete torch zip whose CRCs all match."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CorruptCheckpoint(path, f"unreadable checkpoint ({type(exc).__name__}: {exc})") from None
    if bad is not None:
        raise CorruptCheckpoint(path, f"corrupt checkpoint (CRC mismatch in {bad})")


def load(path: Path) -> dict[str, Any]:
    """Verify and load one checkpoint on CPU (weights_only: plain data and tensors only).

    mmap=True: the tensors are views of the file's pages (private, copy-on-write), read as they are
    used instead of all copied into memory first (torch.load docs, `mmap`); files are only ever
    replaced by rename, never written in place, so a mapping stays valid.

    Not read-only, on purpose (#46): torch maps only writable (UntypedStorage.from_file, 2.11 and 2.13);
    MAP_SHARED would let AdamW's in-place step on a CPU state tensor write into the checkpoint. Private
    writable is charged against the commit limit (mm/mmap.c accountable_mapping) only until the state
    is on the GPU (on CPU: the moments' own memory); mmap=False charges the same, all resident.
    """
    verify(path)
    origin = check_replica(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise CorruptCheckpoint(
            path, f"cannot load ({type(exc).__name__}: {one_line(str(exc), None)})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptCheckpoint(path, f"not a ddp-train checkpoint (expected format {FORMAT!r})")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CorruptCheckpoint(path, f"checkpoint lacks {', '.join(missing)}")
    if origin:
        state["replica_from"] = origin
    return state


def load_weights(state: dict[str, Any], path: Path | str, model: nn.Module, optimizer: Any) -> None:
    """A checkpoint's model and optimizer state into `model` and `optimizer`; CheckpointError (torch's
    first line) when they do not fit, e.g. a checkpoint of another model size."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = first_line(exc, type(exc).__name__)
        raise CheckpointError(path, f"does not fit this model/optimizer: {first}") from None


def load_latest(directory: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest loadable checkpoint, falling back past corrupt ones (then moved aside as *.corrupt).

    Returns None when there is none; raises CheckpointError when files exist but none is usable
    (nothing is moved then, so a restart cannot silently start from scratch).
    """
    candidates = list_checkpoints(directory)
    corrupt: list[tuple[Path, CorruptCheckpoint]] = []
    for _, path in reversed(candidates):
        try:
            state = load(path)
        except CorruptCheckpoint as exc:
            corrupt.append((path, exc))
            continue
        for bad, exc in corrupt:
            aside = bad.with_name(bad.name + ".corrupt")
            os.replace(bad, aside)
            replica_info(bad).unlink(missing_ok=True)
            log.warning("%s; moved it to %s, falling back to %s", exc, aside.name, path.name)
        return state, path
    if corrupt:
        raise CheckpointError(
            directory, f"no usable checkpoint ({len(corrupt)} corrupt; newest: {corrupt[0][1]})"
        )
    return None


def source_rank(reports: list[dict[str, Any]]) -> int | None:
    """The rank whose node holds the checkpoint to resume from: the newest step wins; on a tie a node's
    own save (it may be the origin of the other's replica) over a replica, then the lowest rank."""
    steps = [
        (r["step"], not r.get("copy"), -rank) for rank, r in enumerate(reports) if r.get("step") is not None
    ]
    return -max(steps)[2] if steps else None


class Replication(Protocol):
    """The hook for whatever keeps copies of this node's checkpoints on others (replica.Replicas, which
    the trainer hands in): the startup report's entry, the gathered reports, each new checkpoint, the end."""

    def offer(self) -> dict[str, Any]: ...

    def connect(self, reports: list[dict[str, Any]]) -> None: ...

    def send(self, path: Path, best: Path | None = None) -> None: ...

    def send_best(self, best: Path) -> None: ...

    def finish(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class NoReplication:
    """No copies (a Checkpointer given no Replication)."""

    def offer(self) -> dict[str, Any]:
        return {}

    def connect(self, reports: list[dict[str, Any]]) -> None: ...

    def send(self, path: Path, best: Path | None = None) -> None: ...

    def send_best(self, best: Path) -> None: ...

    def finish(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class Checkpointer:
    """The save/resume protocol of a run, over a state dict; every rank calls save() and restore().

    Checkpoints are written on rank 0's node only (atomically, keep_latest_k rotation). After a restart
    in which another node became rank 0 (c10d orders nodes by address) they may live on a node that is
    now rank 3. So on restore one rank per node (LOCAL_RANK 0) lists its directory, the newest step wins
    (rank 0 on a tie, e.g. a shared directory), and that rank loads, checks and broadcasts it straight
    into the other ranks' tensors (distributed.broadcast_state): no shared disk, no CPU copy per rank.
    Long I/O on one rank is waited for on the store (distributed.wait_for_io), not in a collective.
    With `replicas`, each save is also copied to the next node(s) in the background (replica.py), so
    the newest step survives the loss of rank 0's node.
    """

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        local_rank: int,
        resume: str = "auto",
        keep_latest_k: int = 0,
        io_timeout_s: float = 1800.0,
        save_delay_s: float = 0.0,
        interval_steps: int = 0,
        best_path: Path | None = None,
        replicas: Replication | None = None,
        async_save: bool = False,
    ) -> None:
        self.directory, self.rank, self.local_rank = directory, rank, local_rank
        self.resume, self.keep_latest_k = resume, keep_latest_k
        self.io_timeout_s, self.save_delay_s = io_timeout_s, save_delay_s
        self.interval_steps = interval_steps
        # <run dir>/best.pt: beside checkpoints/, so keep_latest_k rotation never sees it
        self.best_path = best_path
        self.replicas: Replication = replicas if replicas is not None else NoReplication()
        # rank 0's writes in a thread, after a copy to host memory (asyncsave.py); None: in the step
        self.background = BackgroundSave() if async_save and rank == 0 else None

    @classmethod
    def from_config(
        cls, cfg: Config, env: DistEnv, save_delay_s: float = 0.0, replicas: Replication | None = None
    ) -> Checkpointer:
        """The run's checkpointer (`checkpoint.*`); `save_delay_s` is a test hook (hooks.DebugHooks),
        `replicas` what copies each save to other nodes (replica.Replicas.from_config)."""
        c = cfg.checkpoint
        return cls(
            cfg.checkpoint_dir,
            rank=env.rank,
            local_rank=env.local_rank,
            resume=c.resume,
            keep_latest_k=c.keep_latest_k,
            io_timeout_s=c.io_timeout_s,
            save_delay_s=save_delay_s,
            interval_steps=c.interval_steps,
            best_path=cfg.run_dir / "best.pt",
            replicas=replicas,
            async_save=c.async_save,
        )

    def due(self, step: int, last: bool) -> bool:
        """Whether `step` ends with a periodic checkpoint (every interval_steps; never the last step,
        which the run saves once it ended, however it ended)."""
        return bool(self.interval_steps) and step % self.interval_steps == 0 and not last

    def newest_step(self) -> int | None:
        """This node's newest checkpoint step (by name; its contents are checked when it is loaded)."""
        found = self.newest()
        return found[0] if found else None

    def newest(self) -> tuple[int, Path] | None:
        """This node's newest checkpoint (step, path), after the --fresh refusal and temp cleanup."""
        if self.resume == "never":
            existing = list_checkpoints(self.directory)
            if existing:
                step, newest = existing[-1]
                raise ConfigError(
                    "config",
                    "checkpoint.resume",
                    f"'never' (--fresh) but {self.directory} already holds {len(existing)} checkpoint(s), "
                    f"the newest of step {step} ({newest.name}, saved {saved_at(newest)}); use another "
                    "run.name (or checkpoint.dir), delete that directory to start over, or resume from it "
                    "without --fresh (checkpoint.resume: auto)",
                )
            return None
        for tmp in remove_stale_temps(self.directory):
            log.warning("removed %s left by an interrupted save", tmp.name)
        found = list_checkpoints(self.directory)
        return found[-1] if found else None

    def restore(
        self, device: Any, into: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], str, int, str | None] | None:
        """(state, path, source rank, its host) of the newest checkpoint on any node; None if none.

        `into` maps top-level keys to state dicts whose tensors receive the broadcast in place
        (distributed.broadcast_state); optimizer tensors stay on the device they arrive on.
        """
        report: dict[str, Any] = {"step": None}
        if self.local_rank == 0:
            try:
                newest = self.newest()
                report = {"step": newest[0] if newest else None, "host": socket.gethostname()}
                report["copy"] = newest is not None and replica_info(newest[1]).exists()
            except UserError as exc:
                report = {"error": [exc.source, exc.field, exc.message]}
            report.update(self.replicas.offer())
        reports = distributed.all_gather_objects(report)
        for r in reports:
            if "error" in r:
                raise UserError(*r["error"])
        self.replicas.connect(reports)
        src = source_rank(reports)
        if src is None:
            return None
        header: dict[str, Any] = {"path": None}
        found = None
        if self.rank == src:
            try:
                found = load_latest(self.directory)
                header = {"path": str(found[1]) if found else None}
            except UserError as exc:
                header = {"error": [exc.source, exc.field, exc.message]}
        # the read + CRC check happen on one rank: the others wait on the store, not in a collective
        distributed.wait_for_io(src, self.io_timeout_s, "reading its newest checkpoint")
        header = distributed.broadcast_object(header, src)
        if "error" in header:
            raise UserError(*header["error"])
        if header["path"] is None:
            return None
        state = distributed.broadcast_state(found[0] if found else None, device, src, into, ("optimizer",))
        return state, header["path"], src, reports[src].get("host")

    def save(
        self,
        local: Any,
        build: Callable[[list[Any]], dict[str, Any]],
        step: int,
        path: Path | None = None,
        note: str = "",
        best: dict[str, Any] | None = None,
    ) -> None:
        """Gather every rank's `local` (its RNG state); rank 0 writes build(gathered) atomically as the
        checkpoint of `step` (or to `path`, e.g. best.pt, outside the rotation); all wait for it, or, with
        checkpoint.async_save, for its copy to host memory while a thread writes (a failure of the
        previous background save is this save's). `best` (a new best val loss at this step): best.pt
        becomes a hard link to this checkpoint, not a second write."""
        gathered = distributed.all_gather_objects(local)
        what = f"its checkpoint of step {step}" if path is None else f"its {path.name} of step {step}"
        if self.rank == 0:
            try:
                if self.background is None:
                    self._write(build(gathered), step, path, note, best)
                else:
                    self.background.wait()  # at most one in flight, and its host buffers free again
                    state = self.background.snapshot.copy(build(gathered))
                    write = lambda: self._write(state, step, path, note, best)  # noqa: E731
                    self.background.start(write, f"step {step}")
            except UserError as exc:  # a StorageError, or a RefusedPath (storage.own_dir)
                # the others stop with one line naming this failure instead of a lost connection
                distributed.wait_for_io(0, self.io_timeout_s, what, failed=str(exc))
                raise
        # rank 0's write + fsync may outlast the collective timeout: wait on the store, sized for I/O
        distributed.wait_for_io(0, self.io_timeout_s, what)

    def finish(self) -> None:
        """After the run's last save (every rank): rank 0 waits for its background write, then for its
        replica, or says it did not complete; the others wait on the store, so the receiving rank is
        still there to finish it."""
        failed: UserError | None = None
        if self.background is not None:
            try:
                self.background.wait()
            except UserError as exc:  # a StorageError of the last save: every rank stops with its line
                failed = exc
        distributed.wait_for_io(0, self.io_timeout_s, "the write of its last checkpoint",
                                failed=str(failed) if failed else None)  # fmt: skip
        if failed is not None:
            raise failed
        if self.rank == 0:
            # half the others' wait: a stalled replica is a warning here, never their TimeoutError
            self.replicas.finish(self.io_timeout_s / 2)
        distributed.wait_for_io(0, self.io_timeout_s, "the replica of its last checkpoint")
        self.replicas.close()

    def drain(self) -> None:
        """After an error (no collective any more): let a save still in flight end, up to
        checkpoint.io_timeout_s, and log its failure instead of raising it; the ranks exit with os._exit,
        which would cut the thread off. A no-op after finish()."""
        if self.background is None:
            return
        try:
            if not self.background.wait(self.io_timeout_s):
                log.error("a background checkpoint save did not end within %gs", self.io_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the run is failing already: its own error is the one raised
            log.error("a background checkpoint save failed: %s", exc)

    def save_best(
        self, weights: dict[str, Any], step: int, best: dict[str, Any], config: dict[str, Any]
    ) -> None:
        """The weights alone to best.pt (atomically), after a new best val loss: a third of a full
        checkpoint under AdamW (two fp32 moments per weight), never a second write of the same state.
        No optimizer, data or RNG state: a resume uses the regular checkpoints, whose `best` entry
        keeps the best val loss."""

        def build(_rngs: list[Any]) -> dict[str, Any]:
            return best_state(weights, step, best, config)

        assert self.best_path is not None, "Checkpointer without a best_path"
        self.save(None, build, step, self.best_path, best_note(best, step))

    def _write(
        self, state: dict[str, Any], step: int, path: Path | None, note: str, best: dict | None = None
    ) -> None:
        t0 = time.perf_counter()
        final = self.directory / checkpoint_name(step) if path is None else path
        operation = f"saving checkpoint step {step}" if path is None else f"saving {path.name} of step {step}"
        with storage.guarded(operation, final, lambda: kept(self.directory)):
            if path is None:
                save(state, self.directory, step, self.save_delay_s)
                pruned = prune(self.directory, self.keep_latest_k)
                deleted = f" (deleted {len(pruned)} older)" if pruned else ""
            else:
                save_file(state, path)
                deleted = note
        # "saved ... in N.NNs": ddp-launch reads it to size the grace period of a stop (launch/run/job.py)
        seconds = time.perf_counter() - t0
        logging.getLogger("ddp_train").info("saved %s in %.2fs%s", final, seconds, deleted)
        linked = path is None and best is not None and self._link_best(final, state, step, best)
        if path is None:  # in the background: the next step does not wait for it
            self.replicas.send(final, self.best_path if linked else None)
        elif path == self.best_path:
            self.replicas.send_best(path)  # best.pt survives the loss of this node too

    def _link_best(self, final: Path, state: dict[str, Any], step: int, best: dict[str, Any]) -> bool:
        """best.pt as a hard link to this step's checkpoint (True); written on its own (the weights
        alone) where a link cannot be made (checkpoint.dir on another filesystem than the run directory)."""
        assert self.best_path is not None, "Checkpointer without a best_path"
        note = best_note(best, step)
        what = f"linking {self.best_path.name} to {final.name}"
        with storage.guarded(what, self.best_path, lambda: kept(self.directory)):
            try:
                storage.link(final, self.best_path)
            except OSError as exc:
                log.info("%s cannot be a link to %s (%s): writing the weights alone", self.best_path.name,
                         final.name, exc.strerror)  # fmt: skip
                alone = best_state(state["model"], step, best, state["config"])
                self._write(alone, step, self.best_path, note)
                return False
        logging.getLogger("ddp_train").info("%s is %s%s (a hard link)", self.best_path, final.name, note)
        return True
