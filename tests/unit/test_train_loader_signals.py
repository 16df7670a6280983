"""Loader workers and the job's stop signals (#42): a SIGTERM/SIGINT to the rank's whole process group
(torchrun's os.killpg, the node agent, slurmstepd, `ddp-launch stop`) leaves every DataLoader worker
serving until the rank has finished its step and saved; the rank then shuts them down; a worker whose
rank is gone exits at once. Both ways workers start: fork (CPU) and forkserver (CUDA), persistent.

Each case runs a "rank" (tests/unit/loader_rank.py) in its own session, as torchrun starts one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK = Path(__file__).with_name("loader_rank.py")
STARTS = ["fork", "forkserver"]


def proc_state(pid: int) -> str:
    """'R', 'S', ... of a process; 'gone' once it left /proc or is a zombie (dead, not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return "gone"
    state = stat.rsplit(")", 1)[1].split()[0]
    return "gone" if state in ("Z", "X") else state


def status_masks(pid: int, *fields: str) -> tuple[int, ...]:
    """Signal masks of /proc/PID/status (SigBlk, SigIgn) as ints, all from one read: the kernel writes
    them together, while two reads can straddle a worker's whole init and show SigIgn from before it
    with SigBlk from after (neither ignored nor held: a full run saw 0x1001000 and 0)."""
    masks = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    missing = [f for f in fields if f not in masks]
    assert not missing, f"no {missing} in /proc/{pid}/status"
    return tuple(int(masks[f].strip(), 16) for f in fields)


def status_mask(pid: int, field: str) -> int:
    """One signal mask of /proc/PID/status as an int."""
    return status_masks(pid, field)[0]


def has(mask: int, sig: signal.Signals) -> bool:
    return bool(mask >> (sig - 1) & 1)


class Rank:
    """The rank script, in a session of its own; speaks one JSON object a line."""

    def __init__(self, start: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(RANK), start, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        return json.loads(line)

    def say(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def assert_workers_never_open_to_a_stop(ready: dict) -> None:
    """From its first instruction on, a worker holds the job signals back (the mask it inherits) or
    ignores them (its init): there is never a moment when a stop would kill it."""
    for pid in ready["workers"]:
        deadline = time.monotonic() + 20
        while True:
            ignored, held = status_masks(pid, "SigIgn", "SigBlk")
            for sig in (signal.SIGTERM, signal.SIGINT):
                assert has(ignored | held, sig), (pid, hex(ignored), hex(held))
            # the init ignores the signals, then lifts the inherited mask: sampled between the two
            # (once in a full run), it is ignored and still held; wait for the mask to go too
            done = has(ignored, signal.SIGTERM) and not has(held, signal.SIGTERM)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert has(ignored, signal.SIGTERM) and has(ignored, signal.SIGINT), hex(ignored)
        assert not has(held, signal.SIGTERM)  # ignored, not left pending
    if ready["forkserver"]:
        # the workers are its children and inherit its mask: it holds them from its own start on
        held = status_mask(ready["forkserver"], "SigBlk")
        assert has(held, signal.SIGTERM) and has(held, signal.SIGINT), hex(held)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("start", "sig"),
    [("fork", signal.SIGTERM), ("forkserver", signal.SIGINT), ("forkserver", signal.SIGTERM)],
    ids=["fork-SIGTERM", "forkserver-SIGINT", "forkserver-SIGTERM"],
)
def test_a_stop_to_the_process_group_leaves_the_workers_serving_until_the_rank_closes_them(
    start: str, sig: signal.Signals
) -> None:
    rank = Rank(start)
    try:
        ready = rank.read()
        workers = ready["workers"]
        assert len(workers) == 2 and all(proc_state(p) != "gone" for p in workers)
        assert_workers_never_open_to_a_stop(ready)
        # the stall watchdog's SIGUSR1 (node/stack.sh signals what catches it) is the rank's alone: a
        # worker's dump in r<rank>.txt hid the rank's own (stackdump.not_in_a_worker)
        assert all(has(status_mask(p, "SigIgn"), signal.SIGUSR1) for p in workers)
        assert not has(status_mask(rank.proc.pid, "SigBlk"), signal.SIGTERM)  # the rank's is lifted
        os.killpg(rank.proc.pid, sig)  # what torchrun does to each rank on a stop
        time.sleep(0.5)  # a worker with the default action is dead by now, and the rank would see it
        rank.say("after-stop")
        after = rank.read()
        assert after["signum"] == sig, after  # the rank itself got the stop, to save and exit on
        assert after["batches"] == 12 and after["alive"] == [True, True], after
        assert rank.read() == {"closed": [False, False]}
        assert rank.proc.wait(timeout=60) == 0, rank.proc.stderr.read()
    finally:
        rank.kill()
    assert [proc_state(p) for p in workers] == ["gone", "gone"]


@pytest.mark.slow
@pytest.mark.parametrize("start", STARTS)
def test_workers_of_a_killed_rank_exit_at_once(start: str) -> None:
    """torch's own watchdog notices a dead parent only every 5 s, and only while a worker is idle."""
    rank = Rank(start, "--busy")
    try:
        workers = rank.read()["workers"]
        rank.proc.kill()
        rank.proc.wait(timeout=30)
        t0 = time.monotonic()
        while any(proc_state(p) != "gone" for p in workers) and time.monotonic() - t0 < 4:
            time.sleep(0.02)
        assert [proc_state(p) for p in workers] == ["gone", "gone"], time.monotonic() - t0
    finally:
        rank.kill()
        for pid in workers if "workers" in locals() else []:
            if proc_state(pid) != "gone":
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # torch waits 5 s for the worker first
def test_close_kills_a_worker_stuck_in_a_slow_item() -> None:
    """torch ends a worker that does not leave within 5 s with SIGTERM, which ours ignore."""
    rank = Rank("fork", "--busy")
    try:
        workers = rank.read()["workers"]
        rank.say("close")
        assert rank.read() == {"closed": [False, False]}
        assert rank.proc.wait(timeout=60) == 0, rank.proc.stderr.read()
        assert [proc_state(p) for p in workers] == ["gone", "gone"]
    finally:
        rank.kill()
