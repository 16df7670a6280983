"""A Slurm job seen from the submit host: state (squeue, then scontrol once it ended, then sacct),
the per-node output files on the batch host, and the clean stop (`scancel --batch --signal=TERM`:
the driver alone gets it and stops every node's torchrun, see driver.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddp_train import exitcodes
from ddp_train.launch.slurm.protocol import DRIVER_LOG, LAUNCHER, READ_ACK, READ_FAST_S, READ_SLOW_S

if TYPE_CHECKING:
    from ddp_train.launch.remote.remote import Session

ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


@dataclasses.dataclass(frozen=True)
class SlurmState:
    state: str  # PENDING, RUNNING, COMPLETED, ... (squeue's %T); UNKNOWN when Slurm forgot the job
    reason: str = ""
    nodes: str = ""
    batch_host: str = ""
    exit_code: int | None = None  # once ended: the batch script's exit code (128 + N after signal N)
    stdout: str = ""  # the batch script's output file (scontrol's StdOut, while Slurm remembers the job)

    @property
    def pending(self) -> bool:
        return self.state.split()[0] == "PENDING" if self.state else False

    @property
    def ended(self) -> bool:
        return self.state.split()[0] in ENDED or self.state == "UNKNOWN"

    def line(self, slurm_id: str) -> str:
        why = f" ({self.reason})" if self.reason and self.reason not in ("None", "(null)") else ""
        code = f", exit {self.exit_code}" if self.exit_code is not None and self.ended else ""
        where = f" on {self.nodes}" if self.nodes and self.nodes != "(null)" else ""
        return f"Slurm job {slurm_id}: {self.state}{why}{where}{code}"


def query(session: Session, slurm_id: str) -> SlurmState:
    rc, out = session.exec(f"squeue --noheader --jobs={shlex.quote(slurm_id)} --format='%T|%r|%N|%B'", 20)
    rows = [ln for ln in out.splitlines() if ln.count("|") == 3] if rc == 0 else []
    if rows:
        state, reason, nodes, batch = rows[0].split("|")
        if state not in ENDED:
            return SlurmState(state, reason, nodes, batch)
    rc, out = session.exec(f"scontrol --oneliner show job {shlex.quote(slurm_id)}", 20)
    if rc == 0 and "JobState=" in out:
        f = oneliner(out)
        return SlurmState(
            f.get("JobState", "UNKNOWN"),
            f.get("Reason", ""),
            f.get("NodeList", ""),
            f.get("BatchHost", ""),
            _exit(f.get("ExitCode", "")),
            f.get("StdOut", ""),
        )
    rc, out = session.exec(
        f"sacct --noheader --parsable2 --allocations --jobs={shlex.quote(slurm_id)} "
        "--format=State,ExitCode,NodeList",
        20,
    )
    rows = [ln for ln in out.splitlines() if ln.count("|") == 2] if rc == 0 else []
    if rows:
        state, code, nodes = rows[0].split("|")
        return SlurmState(state, "", nodes, "", _exit(code))
    return SlurmState("UNKNOWN")


def oneliner(line: str) -> dict[str, str]:
    """The Key=Value words of one `scontrol --oneliner show ...` record."""
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def _exit(text: str) -> int | None:
    """scontrol/sacct ExitCode "code:signal" -> an exit code (128 + signal when killed by one)."""
    code, _, sig = text.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(sig) if sig.isdigit() and int(sig) else int(code)


def exit_code(s: SlurmState) -> int:
    if s.exit_code is not None and s.exit_code != 0:
        return s.exit_code
    if s.state.startswith("COMPLETED"):
        return 0
    if s.state.startswith("TIMEOUT"):
        return exitcodes.TIMEOUT
    if s.state.startswith("CANCELLED"):
        return exitcodes.SIGTERM
    return exitcodes.NODE_FAILED


STOP_WAIT_S = 900.0  # `stop JOB` gives up waiting for the end after this (the job keeps its stop)


def stop(session: Session, slurm_id: str, pending: bool = False) -> tuple[int, str]:
    """The clean stop: SIGTERM to the driver alone (scancel(1) --batch). A pending job is cancelled
    plainly: nothing ran, nothing to save, and slurmctld refuses any signal but KILL to a pending job
    (ESLURM_JOB_PENDING "Job is pending execution"; scancel retries it, see Slurm's src/scancel/scancel.c)."""
    if pending:
        return cancel(session, slurm_id)
    return session.exec(f"scancel --batch --signal=TERM {shlex.quote(slurm_id)}", 20)


def stop_line(slurm_id: str, pending: bool, rc: int, out: str) -> str:
    """What stop() did, for the user."""
    what = (
        f"scancel {slurm_id} (it was pending: nothing ran, nothing to save)"
        if pending
        else f"scancel --batch --signal=TERM {slurm_id} (every rank finishes its step and saves)"
    )
    return what + ("" if rc == 0 else ": " + out.strip())


def cancel(session: Session, slurm_id: str) -> tuple[int, str]:
    return session.exec(f"scancel {shlex.quote(slurm_id)}", 20)


# Reads the per-node files a driver wrote (r<N>-<host>.log) from the given offsets: JSON on stdout. A file
# shorter than its offset is a new one (another batch host's): read from its start. With "ack READER"
# (through srun into the job: no shared storage) it also writes how much of driver.log that reader now
# has to READ_ACK.<reader> (protocol.ack_name), what the driver's end waits for.
_READ = r"""
import json, os, sys
d, offsets = sys.argv[1], json.loads(sys.stdin.readline())
out = {}
# driver.log first: a line of the ranks the driver wrote before its own newest line is then read too
for name in sorted(os.listdir(d), key=lambda n: (n != "driver.log", n)) if os.path.isdir(d) else []:
    if name.endswith(".log"):
        with open(os.path.join(d, name), "rb") as f:
            at = offsets.get(name, 0)
            at = at if at <= os.fstat(f.fileno()).st_size else 0
            f.seek(at)
            data = f.read(1 << 20)
        cut = data.rfind(b"\n") + 1
        out[name] = [at + cut, data[:cut].decode("utf-8", "replace")]
if sys.argv[2:3] == ["ack"] and os.path.isdir(d):
    ack = os.path.join(d, "READ_ACK." + sys.argv[3])
    with open(ack + ".tmp", "w") as f:
        f.write(str(out.get("driver.log", [offsets.get("driver.log", 0)])[0]))
    os.replace(ack + ".tmp", ack)
print("DDP-SLURM-LOGS " + json.dumps(out))
""".replace("READ_ACK", READ_ACK)
READER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a reader's name in its ack file's name


def read_logs(
    session: Session,
    python: str,
    directory: str,
    offsets: dict[str, int],
    through: Sequence[str] = (),
    reader: str = LAUNCHER,
) -> dict[str, Any]:
    """{file: [new offset, new whole lines]} of the driver's per-node files: on the session's host, or
    with `through` (srun_into) from the submit host through Slurm on the batch host, acknowledged as
    `reader`'s (protocol.ack_name)."""
    if not READER.fullmatch(reader):
        raise ValueError(f"reader {reader!r}: letters, digits, _ and -")
    cmd = shlex.join([*through, python, "-c", _READ, directory, *(["ack", reader] if through else [])])
    rc, out = session.exec(cmd, 30, stdin=(json.dumps(offsets) + "\n").encode())
    for ln in out.splitlines():
        if ln.startswith("DDP-SLURM-LOGS "):
            data: dict[str, Any] = json.loads(ln.split(" ", 1)[1])
            return data
    return {}


def srun_into(slurm_id: str, host: str) -> list[str]:
    """srun's argv for one task on `host` inside the running job, beside its steps (srun(1) --overlap,
    Slurm 20.11+): how the submit host reads the batch host's files without shared storage or SSH."""
    return [
        "srun", f"--jobid={slurm_id}", "--overlap", f"--nodelist={host}", "--nodes=1", "--ntasks=1",
        "--quiet", "--kill-on-bad-exit=0",
    ]  # fmt: skip


def reader(slurm_id: str, s: SlurmState, shared: bool, ssh_able: bool) -> tuple[str, list[str]] | None:
    """Where the driver's files of the job in state `s` are read: ("batch", []) over SSH on the batch host
    (an inventory node), ("submit", []) on the submit host (it sees the shared ddp_workdir), ("submit",
    srun_into(...)) from there through Slurm (no shared storage: only while the job runs); None: nowhere
    now."""
    if not s.batch_host:
        return None
    if ssh_able:
        return "batch", []
    if shared:
        return "submit", []
    if s.state.startswith("RUNNING"):
        return "submit", srun_into(slurm_id, s.batch_host)
    return None


def moved(shared: bool, before: str, s: SlurmState) -> bool:
    """Without shared storage the driver's files are on its batch host's own disk: a job requeued onto
    another batch host has new ones there, to be read from their start (and their ack with them)."""
    return not shared and bool(before) and bool(s.batch_host) and s.batch_host != before


class Pace:
    """When the driver's files are read through srun next: each read is a job step, and Slurm refuses a
    job's steps beyond MaxStepCount (40000 by default), the driver's own next srun included. Every
    READ_FAST_S while driver.log grows; twice as long after each read that found it unchanged, up to
    READ_SLOW_S (the ranks' lines then come that late)."""

    def __init__(self) -> None:
        self.every, self.last = READ_FAST_S, -1e18

    def due(self, now: float) -> bool:
        return now - self.last >= self.every

    def done(self, now: float, grew: bool) -> None:
        self.last = now
        self.every = READ_FAST_S if grew else min(self.every * 2, READ_SLOW_S)


def grew(got: dict[str, Any], offsets: dict[str, int]) -> bool:
    """Did this read find new lines in driver.log (the driver's events) since `offsets`?"""
    return DRIVER_LOG in got and got[DRIVER_LOG][0] != offsets.get(DRIVER_LOG, 0)


def label(name: str) -> tuple[str, str]:
    """r<N>-<host>.log -> (host, "host rN")."""
    if name == "driver.log":
        return "driver", "driver"
    rank, _, host = name[: -len(".log")].partition("-")
    return host, f"{host} {rank}"


# ---- ddp-launch status/logs/stop JOB for a job submitted through Slurm -------------------------------


def command(opts: Any, job_dir: Any, data: dict[str, Any]) -> int | None:
    """The job command for a Slurm job; None: the usual one goes on (it reads the local logs and job.json).

    status prints Slurm's state first. While the launcher (or its monitor) still follows the job, logs and
    stop are the usual ones (its SIGTERM handler sends the clean stop). Once nobody follows it (Ctrl-C
    detached, the monitor gone) they go to Slurm: stop = `scancel --batch --signal=TERM` (a pending job:
    `scancel`), logs = the driver's per-node files on the batch host."""
    import sys
    import time

    from ddp_train.launch.errors import LaunchError
    from ddp_train.launch.jobs import jobstate
    from ddp_train.launch.remote.remote import RemoteError

    slurm = data["slurm"]
    slurm_id = str(slurm["id"])
    followed = jobstate.effective_state(data) in jobstate.LIVE
    if opts.command in ("logs", "attach", "stop") and followed:
        return None
    try:
        session, nodes = _sessions(slurm)
        s = query(session, slurm_id)
        if opts.command == "status":
            print(s.line(slurm_id))
            return None
        if opts.command == "stop":
            if s.ended:
                print(f"ddp-launch: job {data['job_id']} is not running ({s.line(slurm_id)})")
                return 0
            pending = s.pending
            rc, out = stop(session, slurm_id, pending)
            print(f"ddp-launch: {stop_line(slurm_id, pending, rc, out)}", flush=True)
            deadline = time.monotonic() + STOP_WAIT_S
            while not s.ended:
                if time.monotonic() > deadline:
                    print(
                        f"ddp-launch: {s.line(slurm_id)}, still not ended {STOP_WAIT_S:.0f} s after the stop "
                        f"(scancel {slurm_id} ends it at once)",
                        file=sys.stderr,
                    )
                    return exitcodes.NODE_FAILED
                time.sleep(1)
                s = query(session, slurm_id)
                if pending and s.state == "RUNNING":  # it started before the cancel took: stop it once more
                    pending = False
                    rc, out = stop(session, slurm_id)
                    print(f"ddp-launch: {stop_line(slurm_id, False, rc, out)}", flush=True)
            print(s.line(slurm_id))
            return 0 if exit_code(s) in (0, exitcodes.SIGTERM) else exitcodes.NODE_FAILED
        offsets: dict[str, int] = {}
        shared, host, pace = bool(slurm.get("shared", True)), "", Pace()
        while True:  # logs [-f], attach
            if moved(shared, host, s):
                offsets, pace = {}, Pace()
            host = s.batch_host or host
            batch = nodes.get(s.batch_host)
            where = reader(slurm_id, s, shared, batch is not None)
            if where is not None and (not where[1] or pace.due(time.monotonic())):
                from ddp_train.launch.remote.remote import open_session

                on, through = (open_session(batch), []) if where[0] == "batch" else (session, where[1])
                venv = batch.venv if where[0] == "batch" else batch_venv(slurm)
                python = f"{venv.rstrip('/')}/bin/python"
                got = read_logs(on, python, slurm["dir"], offsets, through, f"logs-{os.getpid()}")
                if through:
                    pace.done(time.monotonic(), grew(got, offsets))
                for name, (offset, text) in sorted(got.items()):
                    offsets[name] = offset
                    for line in text.splitlines():
                        print(f"[{label(name)[1]}] {line}")
                sys.stdout.flush()
            if s.ended or not (getattr(opts, "follow", False) or opts.command == "attach"):
                return 0
            time.sleep(1)
            s = query(session, slurm_id)
    except (RemoteError, LaunchError) as e:
        print(f"ddp-launch: error: Slurm job {slurm_id}: {e}", file=sys.stderr)
        return exitcodes.NODE_FAILED
    except KeyboardInterrupt:
        return 0  # following only: the job keeps running


def batch_venv(slurm: dict[str, Any]) -> str:
    """The job's venv (job.json of a launcher before it recorded one: the inventory's default)."""
    from ddp_train.launch.plan.inventory import DEFAULT_REMOTE_VENV

    return str(slurm.get("venv") or DEFAULT_REMOTE_VENV)


def _sessions(slurm: dict[str, Any]) -> tuple[Session, dict[str, Any]]:
    from ddp_train.launch.plan.inventory import load_nodes
    from ddp_train.launch.remote.remote import open_session

    sources = list(slurm.get("sources") or [])
    submit = next(n for n in load_nodes(sources, group=slurm["group"]) if n.name == slurm["submit"])
    nodes = {n.name: n for n in load_nodes(sources)}
    return open_session(submit), nodes
