"""CPU per test, counting every process a test started: testbed sshd and what runs under them, Ansible's
modules on the namespace hosts, torchrun and its ranks. pytest's own timings give wall time only,
which on 2 cores under `-n 4` says little; the suite is CPU-bound there (stop 37: 3879 s of CPU in
a 2054 s run, both cores busy throughout), so CPU is what to cut.

    DDP_CPU_PROFILE=/tmp/cpu.jsonl .venv/bin/python -m pytest -p tests.cpuprofile -n 4 --dist loadfile ...
    .venv/bin/python -m tests.cpuprofile /tmp/cpu.jsonl      # CPU and wall per module, largest first

Each pytest process (each xdist worker) moves itself into a cgroup-v1 cpuacct group of its own
(children inherit it, daemonized or not) and writes one JSON line per test: its CPU seconds from
setup to teardown (module fixtures count in the first test of the module), wall seconds, worker.
Needs root and the cpuacct controller at /sys/fs/cgroup/cpuacct; without them it says so once and
records nothing. The groups are removed at the end when empty.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_state: dict = {"group": None, "out": None, "start": {}}


def _usage() -> int:
    return int((_state["group"] / "cpuacct.usage").read_text())


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get("DDP_CPU_PROFILE")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = CPUACCT / f"ddp-cpuprofile-{worker}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        print(f"tests.cpuprofile: no cpuacct group ({e}); nothing recorded", file=sys.stderr)
        return
    _state.update(group=group, out=Path(out))


def pytest_unconfigure(config: pytest.Config) -> None:
    group = _state["group"]
    if group is not None:  # back to the parent group, then the (empty) group goes
        with contextlib.suppress(OSError):
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _state["group"] is not None:
        _state["start"][item.nodeid] = (_usage(), time.monotonic())


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if nodeid not in _state["start"]:
        return
    cpu0, wall0 = _state["start"].pop(nodeid)
    record = {
        "test": nodeid,
        "cpu_s": round((_usage() - cpu0) / 1e9, 3),
        "wall_s": round(time.monotonic() - wall0, 3),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
    }
    with _state["out"].open("a") as f:  # one line per write: the workers append to the same file
        f.write(json.dumps(record) + "\n")


def report(path: Path, top: int = 40) -> str:
    cpu: collections.Counter = collections.Counter()
    wall: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        r = json.loads(line)
        module = r["test"].split("::")[0]
        cpu[module] += r["cpu_s"]
        wall[module] += r["wall_s"]
        count[module] += 1
    lines = [
        f"{sum(count.values())} tests, {sum(cpu.values()):.0f} s CPU, {sum(wall.values()):.0f} s wall summed"
    ]
    lines += ["   CPU s   wall s  tests  module"]
    lines += [f"{t:8.0f} {wall[m]:8.0f} {count[m]:6d}  {m}" for m, t in cpu.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.cpuprofile FILE.jsonl")
    print(report(Path(sys.argv[1])))
