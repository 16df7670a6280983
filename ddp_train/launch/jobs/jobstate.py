"""A job's state in files under logs/<job>/ (no daemon): job.json, written by the process that runs it.

job.json holds the job id, the pid of the launcher or detached monitor running it (with its start
time and the boot id: a pid reused by another process is never taken for it), its state
(starting, running, stopping, then finished with an exit code), the nodes (host, rank, address), the
master address and port, the start time, the working directory and the command; with
`ddp_on_node_loss: restart` also its attempts (nodes, master, steps, how each ended), the nodes it lost
(when, why, in which attempt) and the policy, while it is "restarting" between two. A job whose state is
not final while its pid is gone is reported "lost" (the monitor was killed; the nodes stop themselves,
see launch/run/lifeline.py). Two jobs on the same node and port are refused by `conflict`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STATE_FILE = "job.json"
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700  # a job's directory and files: its owner's only (issue #24)
CONSOLE_FILE = "console.log"  # a detached monitor's stdout and stderr: what a foreground run prints
LIVE = ("starting", "running", "stopping", "restarting")  # restarting: after a lost node (nodeloss.py)


def state_path(log_dir: Path | str, job_id: str) -> Path:
    return Path(log_dir) / job_id / STATE_FILE


def private_dir(path: Path | str) -> Path:
    """Create a job's directory (and its parents) if needed, readable by its owner only."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR)
    return path


def open_private(path: Path | str, append: bool = True) -> int:
    """A file descriptor on `path` for writing, mode 0600, never through a symlink."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)  # an older file of the same name may have had a wider mode
    return fd


def write_private(path: Path | str, data: bytes) -> None:
    """Atomically (temp file + rename) write a 0600 file: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


def write_state(path: Path, data: dict[str, Any]) -> None:
    """Atomically (temp file + rename): a reader never sees half a file; 0600 in a 0700 directory."""
    private_dir(path.parent)
    write_private(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def update_state(path: Path, **fields: Any) -> dict[str, Any]:
    data = read_state(path) or {}
    data.update(fields)
    write_state(path, data)
    return data


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) no longer runs anything
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22, proc(5)): with the boot
    id, what tells this process from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def identity(pid: int) -> dict[str, Any]:
    """What job.json records of the process running the job, besides its pid."""
    return {"pid_start": start_time(pid), "boot_id": boot_id()}


def monitor_alive(data: dict[str, Any]) -> bool:
    """The job's recorded process still runs, and is that process: after a reboot or once it died its
    pid may be anyone's, which must never be signalled (issue #24). A job.json without the start time
    (an older ddp-launch) counts only when the pid's command line is a ddp-launch one."""
    pid = data.get("pid")
    if not pid_alive(pid):
        return False
    if data.get("pid_start") is not None or data.get("boot_id") is not None:
        return data.get("boot_id") == boot_id() and data.get("pid_start") == start_time(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ddp" in f.read()
    except OSError:
        return False


def effective_state(data: dict[str, Any]) -> str:
    """The recorded state, or "lost" when it says live but its process is gone (or is another one)."""
    state = str(data.get("state") or "unknown")
    if state in LIVE and not monitor_alive(data):
        return "lost"
    return state


def list_jobs(log_dir: Path | str) -> list[dict[str, Any]]:
    """Every job with a job.json under log_dir, oldest first (each with "state" made effective)."""
    jobs = []
    root = Path(log_dir)
    if not root.is_dir():
        return []
    for path in root.glob(f"*/{STATE_FILE}"):
        data = read_state(path)
        if data and data.get("job_id"):
            data["state"] = effective_state(data)
            data["dir"] = str(path.parent)
            jobs.append(data)
    jobs.sort(key=lambda d: (float(d.get("started") or 0), str(d["job_id"])))
    return jobs


def conflict(log_dir: Path | str, job_id: str, hosts: Iterable[str], port: int) -> str | None:
    """One line naming a live job of log_dir that uses one of these hosts and the same master port."""
    wanted = set(hosts)
    for job in list_jobs(log_dir):
        if job["job_id"] == job_id or job["state"] not in LIVE or job.get("master_port") != port:
            continue
        shared = sorted(wanted & {n.get("host") for n in job.get("nodes") or []} - {None})
        if shared:
            return (
                f"job {job['job_id']} (pid {job.get('pid')}, {job['state']}) already runs on "
                f"{', '.join(shared)} with master port {port}: stop it (ddp-launch stop {job['job_id']}) "
                "or pick another --master-port"
            )
    return None


def initial_state(plan: Any, argv: list[str], detached: bool) -> dict[str, Any]:
    return {
        "job_id": plan.job_id,
        "pid": os.getpid(),
        **identity(os.getpid()),
        "state": "starting",
        "detached": detached,
        "started": time.time(),
        "cwd": os.getcwd(),
        "argv": argv,
        "master": plan.master_name,  # the node at master_addr (`restart` checks that it is still there)
        "master_addr": plan.master_addr,
        "master_port": plan.master_port,
        "nodes": [{"host": p.node.name, "rank": p.rank, "where": p.node.where} for p in plan.nodes],
    }
