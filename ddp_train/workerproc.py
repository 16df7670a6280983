"""Worker processes that leave a job's stop to their parent: DataLoader workers, `prepare`'s pool.

torchrun (os.killpg of each rank's session), the node agent, slurmstepd, `ddp-launch stop` and a
terminal's Ctrl-C signal every process of the job or group, workers included. A worker killed by one
fails its parent before the parent has finished its step and saved (or removed what it half wrote); so a
worker ignores SIGTERM/SIGINT, the parent alone decides when to stop and ends its workers, and a worker
whose parent is gone exits at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """SIGTERM/SIGINT held back (blocked, not lost) in this thread while workers start.

    A worker inherits the blocked mask from the thread that forks it, or from a forkserver started under
    it, so a stop that lands before the worker's `leave_stops_to` waits instead of killing it; the parent's
    own handler sees the signal as soon as the block ends (its other threads never blocked it)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def leave_stops_to(parent_pid: int) -> None:
    """In a worker, first thing: ignore SIGTERM/SIGINT and exit as soon as process `parent_pid` is gone.

    Waiting on the parent's pidfd (pidfd_open(2), Linux >= 5.3) also covers a worker whose own parent is
    a forkserver: the server lives until every worker has exited, so neither PR_SET_PDEATHSIG nor
    torch's DataLoader watchdog (which polls the direct parent every 5 s, and only while the worker is
    idle) ever fires for it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # the mask stops_held passed down
    try:
        parent = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(0)  # the parent died while this worker started
    except (OSError, AttributeError):
        # no pidfd (a kernel before 5.3, not Linux): a fork()ed worker gets SIGKILL when its parent dies
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return
    threading.Thread(target=_exit_with, args=(parent,), name="ddp-train parent watch", daemon=True).start()


def _exit_with(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once that process has exited
    os._exit(0)
