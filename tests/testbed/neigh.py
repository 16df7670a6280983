"""The kernel's neighbour table thresholds, sized for the testbeds that are up and restored at `down`.

The table is one per kernel, not per network namespace: N namespace hosts that all talk to each other
hold about N x N entries (each host one per peer, plus the bridge's), and the defaults 128/512/1024
overflow at ~32 hosts ("neighbor table overflow!", connects failing with EHOSTUNREACH; issue #19).

Several testbeds (and other tools) share the kernel, so the state lives in one file under /run,
changed under a lock: every live testbed records what it needs; a value is only ever raised; at
`down` a value goes back to the largest of what the remaining testbeds need and what it was before
the first of them, and only if it is still the value the testbeds set (someone else changed it
meanwhile: theirs stands).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path

STATE = Path("/run/ddp-testbed/neigh.json")
SYSCTLS = tuple(f"net.{family}.neigh.default.gc_thresh{i}" for family in ("ipv4", "ipv6") for i in (1, 2, 3))


def wanted(n: int) -> dict[str, int]:
    """Thresholds for n hosts: thresh1 (no GC below) covers the full mesh, thresh3 four times it."""
    entries = n * (n + 1)  # each host: n-1 peers + the bridge; the bridge: n hosts
    per = {1: entries, 2: 2 * entries, 3: 4 * entries}
    return {name: per[int(name[-1])] for name in SYSCTLS if _path(name).exists()}  # ipv6 may be off


def _path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def read(name: str) -> int:
    return int(_path(name).read_text())


def _write(name: str, value: int) -> None:
    _path(name).write_text(f"{value}\n")


@contextlib.contextmanager
def held() -> Iterator[None]:
    """No testbed changes the thresholds meanwhile (for a test that reads and sets them itself)."""
    STATE.parent.mkdir(parents=True, exist_ok=True)
    with open(STATE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _locked() -> Iterator[dict]:
    with held():
        try:
            state = json.loads(STATE.read_text()) if STATE.exists() else {}
        except ValueError:
            state = {}
        state.setdefault("before", {})
        state.setdefault("set", {})
        state.setdefault("holders", {})
        yield state
        if state["holders"]:
            STATE.write_text(json.dumps(state, indent=1))
        else:
            STATE.unlink(missing_ok=True)


def acquire(holder: str, n: int) -> list[str]:
    """Raise the thresholds to what `holder` (a testbed prefix) needs for n hosts; says what changed."""
    notes = []
    with _locked() as state:
        state["holders"][holder] = wanted(n)
        for name, want in wanted(n).items():
            now = read(name)
            if state["set"].get(name) != now:  # first holder, or someone else changed it: a new baseline
                state["before"][name] = now
            if want > now:
                _write(name, want)
                state["set"][name] = want
                notes.append(f"{name} {now} -> {want}")
            else:
                state["set"][name] = now
    return notes


def release(holder: str) -> list[str]:
    """Drop `holder`; lower each threshold it raised back to what the others (or the kernel before) need."""
    notes = []
    with _locked() as state:
        if state["holders"].pop(holder, None) is None:
            return notes
        for name in SYSCTLS:
            if not _path(name).exists():
                continue
            now, ours = read(name), state["set"].get(name)
            if ours is None or now != ours:
                continue  # changed since by someone else: leave it
            keep = max(
                [state["before"].get(name, now)] + [h[name] for h in state["holders"].values() if name in h]
            )
            if keep < now:
                _write(name, keep)
                notes.append(f"{name} {now} -> {keep}")
            state["set"][name] = min(keep, now)
    return notes
