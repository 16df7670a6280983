"""Atomic full-state checkpoints: `step-NNNNNNNN.pt` files, keep_latest_k, newest-valid resume.

A file is published only by os.replace of a fully written, fsynced temp file in the same directory,
so a crash leaves either the old set of checkpoints or the new one, plus at most a `*.tmp` that no
scan ever picks up. Readers check the zip CRCs before trusting a file; a corrupt newest file is moved
aside as `*.corrupt` and the previous checkpoint is used instead.
"""

from __future__ import annotations

import logging
import os
import re
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from ddp_train.config import ConfigError

FORMAT = "ddp-train-checkpoint/1"
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "scheduler", "data", "rng", "config")
_NAME = re.compile(r"^step-(\d{8,})\.pt$")

log = logging.getLogger("ddp_train.checkpoint")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; one line naming the file."""

    def __init__(self, path: Path | str, message: str) -> None:
        super().__init__(str(path), None, message)


class CorruptCheckpoint(CheckpointError):
    """Unreadable bytes (truncated, bad CRC, not a torch zip, missing keys)."""


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint taken after `step` optimizer steps."""
    return f"step-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Published checkpoints as (step, path), oldest first; temp and corrupt files are never listed."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _NAME.match(entry.name)
        if m and entry.is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def save(state: dict[str, Any], directory: Path, step: int, delay_s: float = 0.0) -> Path:
    """Write `state` as step-NNNNNNNN.pt atomically: temp file, flush, fsync, rename, fsync dir."""
    return save_file(state, directory / checkpoint_name(step), delay_s)


def save_file(state: dict[str, Any], final: Path, delay_s: float = 0.0) -> Path:
    """Write `state` to `final` atomically (also best.pt, which no listing or pruning ever sees)."""
    directory = final.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (final.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        if delay_s:
            time.sleep(delay_s)  # test hook: a window in which the writer can be killed
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return final


def prune(directory: Path, keep_latest_k: int) -> list[Path]:
    """Delete all but the newest `keep_latest_k` checkpoints (0 keeps all); returns what was deleted."""
    if keep_latest_k <= 0:
        return []
    doomed = [p for _, p in list_checkpoints(directory)[:-keep_latest_k]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


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


def _brief(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    marker = "WeightsUnpickler error: "  # torch's weights_only refusal buries the reason in a long text
    if marker in text:
        text = text.split(marker, 1)[1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load(path: Path) -> dict[str, Any]:
    """Verify and load one checkpoint on CPU (weights_only: plain data and tensors only)."""
    verify(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise CorruptCheckpoint(
            path, f"cannot load ({type(exc).__name__}: {' '.join(str(exc).split())})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptCheckpoint(path, f"not a ddp-train checkpoint (expected format {FORMAT!r})")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CorruptCheckpoint(path, f"checkpoint lacks {', '.join(missing)}")
    return state


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
            log.warning("%s; moved it to %s, falling back to %s", exc, aside.name, path.name)
        return state, path
    if corrupt:
        raise CheckpointError(
            directory, f"no usable checkpoint ({len(corrupt)} corrupt; newest: {corrupt[0][1]})"
        )
    return None
