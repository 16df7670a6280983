"""Stacks on demand for ddp-launch's stall watchdog, and its debug stall (ddp_train/launch/run/watchdog.py).

`install(rank)`: when DDP_STACK_DIR is set (the node agent sets it to its private 0700 directory, and
only such a directory of this user's is used), SIGUSR1 makes this rank write the
Python stack of all its threads to $DDP_STACK_DIR/r<rank>.txt (faulthandler: works even while the main
thread is blocked in C code such as a collective; https://docs.python.org/3/library/faulthandler.html).

DEBUG ONLY: DDP_DEBUG_STALL=RANK:STEP makes that rank block forever after finishing step STEP (in
`debug_stall_block`), so its peers hang in the next collective: how the watchdog is tested.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import time
from typing import IO

from ddp_train import storage

STACK_DIR_ENV = "DDP_STACK_DIR"
DEBUG_STALL_ENV = "DDP_DEBUG_STALL"
_file: IO[str] | None = None
_stall: tuple[int, int] | None = None


def install(rank: int) -> None:
    """Register the SIGUSR1 dump (when asked) and read the debug stall option."""
    global _file, _stall
    directory = os.environ.get(STACK_DIR_ENV)
    if directory and _file is None and _private(directory):
        path = os.path.join(directory, f"r{rank}.txt")
        try:
            _file = os.fdopen(storage.create_new(path, 0o600), "w", encoding="utf-8")
            faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True)
            atexit.register(_remove, path)
        except OSError:
            _file = None
    spec = os.environ.get(DEBUG_STALL_ENV, "")
    r, _, s = spec.partition(":")
    _stall = (int(r), int(s)) if r.isdigit() and s.isdigit() else None
    if _stall and _stall[0] != rank:
        _stall = None


def not_in_a_worker() -> None:
    """In a forked DataLoader worker: no SIGUSR1 dump. The worker inherits the rank's registration, its
    RANK and its open dump file, so node/stack.sh signalled it too and its stack (which also ends in the
    rank's `<module>` frames, where it was forked) landed in r<rank>.txt before or after the rank's own,
    at random: the watchdog then compared workers and said "every rank shows the same stack" instead of
    naming the stalled rank (a full run of stop 54). Ignored, SIGUSR1 is not in the worker's SigCgt, so
    stack.sh leaves it alone."""
    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def _private(directory: str) -> bool:
    """The directory is a real one of this user's, writable by nobody else (the agent's mkdtemp): a dump
    must never land where another user could have put a symlink (issue #24)."""
    if not os.path.isdir(directory) or os.path.islink(directory):
        return False  # the agent made it: never made here
    try:
        storage.own_dir(directory, links=False)
    except (storage.RefusedPath, OSError):
        return False
    return True


def _remove(path: str) -> None:
    """At a normal exit: no dump file left behind (the watchdog reads them while the rank runs)."""
    faulthandler.unregister(signal.SIGUSR1)
    with contextlib.suppress(OSError):
        os.unlink(path)  # the agent removes its directory once empty


def debug_stall(step: int) -> None:
    """Called after every step: blocks when the debug stall names this rank and step."""
    if _stall is not None and step == _stall[1]:
        debug_stall_block()


def debug_stall_block() -> None:
    while True:  # the frame the watchdog's stacks show for the stuck rank
        time.sleep(3600)
