"""On the allocation: the batch script's driver (node 0); task.py is the program srun starts on every node.

The batch script is Python (`#!<ddp_venv>/bin/python`), so the driver is a Python process, not a shell
that defers its traps while a foreground child runs (scancel(1), "the batch shell ... will not
receive the signal until the foreground process exits"). The driver

1. picks MASTER_ADDR = its own address in ddp_network_cidr (no DNS, no `scontrol`) and the first
   MASTER_PORT from ddp_master_port up that binds there;
2. runs `srun --ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 --label python -m
   ddp_train.launch.slurm.task --node`, writing the job (environment included) as one JSON line to
   srun's stdin, which srun broadcasts to every task (srun(1) --input, default "all") - never in argv;
3. prints each task's lines as `[host rN] line` and keeps them per node in <workdir>/.ddp-launch/
   slurm-<id>/r<N>-<host>.log (what `ddp-launch logs` reads; protocol.py names the files and lines);
4. turns SIGTERM (`ddp-launch stop`: `scancel --batch --signal=TERM`) and SIGUSR1 (`--signal=B:USR1@lead`
   before the time limit) into one "stop" line on srun's stdin: each node's program sends SIGTERM to its
   torchrun alone, the SSH backend's stop (every rank finishes its step, saves, exit 143). Slurm's own
   step signal would reach every process of the step at once, and a worker would then get SIGTERM twice
   (from slurmstepd and from torchrun). With --requeue, a USR1 stop that ends in 143 is followed by
   `scontrol requeue`, and the job starts again and resumes from the newest checkpoint;
5. with ddp_on_node_loss: restart, runs the job again on the nodes left after a node loss, as long as
   recovery.py's record of the attempts and its limits allow.

Without shared storage (slurm_shared_workdir: false) it first creates ddp_workdir on every node and
unpacks the job's --sync copy there (one srun step, `task --stage`), and its last line waits until the
launcher, reading through srun, has it (protocol.READ_ACK).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ddp_train.errors import UserError
from ddp_train.launch.slurm.protocol import (
    DRIVER_LOG,
    LAUNCHER,
    READ_ACK,
    READ_SLOW_S,
    STOP,
    SUBMIT_UMASK,
    log_dir,
)
from ddp_train.launch.slurm.recovery import ATTEMPTS_FILE, Attempts, limit_reached
from ddp_train.launch.slurm.task import own_address

LABEL = re.compile(r"^\s*(\d+): ?(.*)$")  # srun --label: "<task id>: line"
PORT_SPAN = 64  # MASTER_PORT: the first of ddp_master_port .. +63 that binds
PROBE_TIMEOUT_S = 180  # the in-job preflight step: the probe allows itself 120 s (launch/node/probe.py)
TASK = "ddp_train.launch.slurm.task"  # what srun runs on every node (task.py)
SRUN_WAIT_S = 60  # srun --wait: the other tasks' end after the first one exited
RUNNING_TASKS = re.compile(r"StepId=\S+ tasks? ([\d,-]+): running")
STAGE_TIMEOUT_S = 300  # the --sync copy unpacked on every node (no shared storage)
# No shared storage: the last line waits this long for the launcher to have read it (its reads come at
# least every READ_SLOW_S, each an srun step of a few seconds) ...
ACK_WAIT_S = READ_SLOW_S + 30
# ... unless it read before and not within this: it detached (another reader's ack counts then)
ACK_FRESH_S = 2 * READ_SLOW_S + 15


def free_port(addr: str, first: int) -> int:
    for port in range(first, min(first + PORT_SPAN, 65536)):
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    raise SystemExit(f"ddp-slurm: no free port in {first}-{first + PORT_SPAN - 1} on {addr}")


def main(blob: str, early: Sequence[int] = ()) -> int:
    """The batch script's driver; `early`: stop signals its prologue caught before this ran (a time
    limit's USR1 can come at once: Slurm sends it up to 60 s before its lead, sbatch(1) --signal)."""
    private_output()
    restore_umask()
    job: dict[str, Any] = json.loads(base64.b64decode(blob))
    slurm_job = os.environ.get("SLURM_JOB_ID", "0")
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    shared = job.get("shared", True)
    out_dir = Path(log_dir(job.get("logs_in", job.get("workdir")), slurm_job))
    if not shared:  # ddp_workdir on this node's own disk: the batch script started in /tmp
        try:
            own_workdir(job["logs_in"])
        except (UserError, OSError) as e:  # said to the batch output alone (/dev/null): the exit code tells
            print(f"ddp-slurm: job {slurm_job}: {e}", flush=True)
            return 2
        os.chdir(job["logs_in"])
    moved = _fresh_log_dir(out_dir) if restarts == 0 else None
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not shared:
        for old in out_dir.glob(f"{READ_ACK}.*"):  # an earlier driver's readers (a requeue onto this node)
            old.unlink(missing_ok=True)
    say = _Say(out_dir / DRIVER_LOG)
    if moved:
        say(f"ddp-slurm: job {slurm_job}: the logs of an earlier job {slurm_job} moved to {moved}")
    stop = _Stop(say)
    for trapped in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(trapped, stop.handle)
    for signum in early:
        stop.handle(signum, None)
    if restarts and job.get("resume_argv"):  # requeued: resume (--fresh dropped), the global batch kept
        job = {**job, "argv": job["resume_argv"]}
    record = Attempts(out_dir / ATTEMPTS_FILE, restarts)
    if restarts and record.started is not None:  # its driver never said how it ended: its host went down
        record.lose(record.started, "the batch host of the allocation before: Slurm requeued the job after a "
                    "node failure (sbatch --requeue)")  # fmt: skip
    record.start(hosts[0])
    if not shared:
        ok = stage(job, hosts, say)
        job = {k: v for k, v in job.items() if k != "stage"}  # the later steps' line without the archive
    if shared or ok:
        code = _attempts(job, slurm_job, hosts, out_dir, say, stop, restarts, record)
    else:
        say(f"ddp-slurm: job {slurm_job}: ddp_workdir could not be prepared on every node; nothing started")
        code = 3
    max_requeues = int(job.get("max_requeues") or 0)
    if stop.signum == signal.SIGUSR1 and code == 143 and record.usr1 < max_requeues:
        record.end(usr1=True)
        subprocess.run(["scontrol", "requeue", slurm_job], check=False)
        say(
            f"ddp-slurm: job {slurm_job}: requeued ({record.usr1}/{max_requeues}); it resumes from the "
            "newest checkpoint"
        )
    else:
        record.end()
        say(f"ddp-slurm: job {slurm_job}: done, exit {code}")  # DONE: the launcher ends here (submit.py)
    if not shared:
        wait_read(out_dir, LAUNCHER)
    return code


def own_workdir(path: str) -> None:
    """ddp_workdir on this node's own disk (often under a world-writable /scratch or /tmp): made, or
    checked to be this user's and not writable by others, who could otherwise swap the --sync copy
    unpacked there (storage.own_dir; RefusedPath, one line)."""
    from ddp_train.storage import own_dir

    own_dir(path, fix="set ddp_workdir to a directory of yours")


def stage(job: Mapping[str, Any], hosts: Sequence[str], say: Callable[[str], None]) -> bool:
    """No shared storage: ddp_workdir created on every node, the job's --sync copy (if any) unpacked there
    (one srun step, its archive on the step's stdin, which srun gives every task). False when a node
    failed (its lines said)."""
    python = f"{job['venv'].rstrip('/')}/bin/python"
    argv = [*_step(len(hosts)), f"--wait={SRUN_WAIT_S}", python, "-m", TASK, "--stage"]
    line = (json.dumps(job) + "\n").encode()
    try:
        res = subprocess.run(argv, input=line, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=STAGE_TIMEOUT_S)  # fmt: skip
        output, code = res.stdout.decode("utf-8", "replace"), res.returncode
    except subprocess.TimeoutExpired as e:
        output, code = (e.stdout or b"").decode("utf-8", "replace"), 124
    for text in output.splitlines():
        m = LABEL.match(text)
        if m and int(m.group(1)) < len(hosts):  # the task's own failure line names its node already
            line, host = m.group(2), hosts[int(m.group(1))]
            say(line if line.startswith("ddp-slurm: ") else f"ddp-slurm: stage: {host}: {line}")
        elif text.strip():
            say(text)
    if code != 0:
        say(f"ddp-slurm: stage: the step exited {code}")
    return code == 0


def wait_read(
    out_dir: Path, reader: str = LAUNCHER, wait_s: float = ACK_WAIT_S, fresh_s: float = ACK_FRESH_S
) -> bool:
    """Without shared storage nothing reads the driver's files once the job ended: wait (at most wait_s)
    until `reader` (the launcher), reading through srun, had all of driver.log (protocol.ack_name). Its
    ack not there yet: it may not have read at all (a job that failed in seconds), so wait for it. Its ack
    stale (not within fresh_s: it detached): the other readers that read within fresh_s (`logs -f`), if
    any, else no wait. True when they had it."""
    log = out_dir / DRIVER_LOG
    deadline = time.monotonic() + wait_s
    while True:
        size, now = _size(log), time.time()
        acks = _acks(out_dir)
        own = acks.pop(reader, None)
        if own is None or now - own[1] <= fresh_s:
            need = [own[0]] if own else []
        else:
            need = [at for at, mtime in acks.values() if now - mtime <= fresh_s]
            if not need:
                return False
        if need and min(need) >= size:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _acks(out_dir: Path) -> dict[str, tuple[int, float]]:
    """{reader: (how much of driver.log it had, when it said so)} from the read-offset.<reader> files."""
    acks = {}
    for path in out_dir.glob(f"{READ_ACK}.*"):
        reader = path.name[len(READ_ACK) + 1 :]
        if reader.endswith(".tmp"):
            continue
        try:
            acks[reader] = (int(path.read_text() or 0), path.stat().st_mtime)
        except (OSError, ValueError):
            continue
    return acks


def private_output(fd: int = 1) -> None:
    """The batch output file (the driver's stdout) 0600, as sbatch's SLURM_UMASK=0077 made it (submit.py
    SBATCH); also one an earlier job of the same number left with another mode (--open-mode=truncate
    keeps a file's mode). A pipe, a terminal or another user's file is left as it is."""
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except OSError:
        pass


def restore_umask(environ: Mapping[str, str] = os.environ) -> None:
    """The submitter's umask for what the job creates (checkpoints, logs): sbatch ran with SLURM_UMASK=0077
    for its output file, and slurmstepd gave the batch script that umask too. DDP_SUBMIT_UMASK is the
    submit shell's `umask` (submit.py SBATCH); without it (sbatch --export=NONE) 0077 stays."""
    value = environ.get(SUBMIT_UMASK, "")
    if re.fullmatch(r"0?[0-7]{3}", value):
        os.umask(int(value, 8))


def _fresh_log_dir(out_dir: Path) -> Path | None:
    """A job's first start finds its log directory taken when Slurm numbers jobs from 1 again (a wiped
    StateSaveLocation, another cluster sharing the workdir): the launcher would replay those lines as
    this job's. Move them aside (a requeued start, SLURM_RESTART_COUNT > 0, appends to its own)."""
    if not out_dir.exists():
        return None
    aside = out_dir.with_name(f"{out_dir.name}.before-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        out_dir.rename(aside)
    except OSError:
        return None
    return aside


def _attempts(
    job: dict[str, Any],
    slurm_job: str,
    hosts: Sequence[str],
    out_dir: Path,
    say: Callable[[str], None],
    stop: _Stop,
    restarts: int,
    record: Attempts,
) -> int:
    """The job on the allocation; with ddp_on_node_loss: restart (job "recovery"), again on the other
    nodes each time a node went away inside it (sbatch --no-kill keeps the allocation: a new step with
    srun --exclude, preflight first, resuming from the newest checkpoint with the global batch kept), as
    long as ddp_max_node_losses and ddp_min_nodes allow, counting the nodes earlier allocations lost
    (`record`). The batch script's exit code."""
    from ddp_train.launch.plan.plan import KEEP_GLOBAL_BATCH

    policy = job.get("recovery") or {}
    restart = policy.get("mode") == "restart"
    kept = (
        "the global batch kept"
        if KEEP_GLOBAL_BATCH in (job.get("resume_argv") or [])
        else "its argv as given"
    )
    if restart and record.lost:  # lost in an allocation before this one (its batch host, its nodes)
        left = [h for h in hosts if h not in record.lost_hosts]
        if why := limit_reached(len(record.lost), len(left), policy):
            say(f"ddp-slurm: job {slurm_job}: giving up: {why} ({', '.join(record.lost_hosts)} lost)")
            return 1
    while True:
        excluded = [h for h in hosts if h in record.lost_hosts] if restart else []
        live = [h for h in hosts if h not in excluded]
        n = record.next()
        if n > 1 and restart and record.lost:
            say(
                f"ddp-slurm: job {slurm_job}: attempt {n} on {','.join(live)} without "
                f"{','.join(record.lost_hosts)} (lost {len(record.lost)} of ddp_max_node_losses "
                f"{policy.get('max_losses')}): it resumes from the newest checkpoint, {kept}"
            )
        stop.detach()  # the stop line goes to this attempt's step, not to the ended one
        code, gone = _run(job, slurm_job, live, out_dir, say, stop, restarts, excluded=excluded)
        if not gone or stop.signum or not restart:
            return code
        why = limit_reached(len(record.lost) + len(gone), len(live) - len(gone), policy)
        for host in gone:
            record.lose(host, f"did not end with the other nodes of attempt {n} (srun --wait)")
        if why:
            say(f"ddp-slurm: job {slurm_job}: giving up: {why}")
            return code
        job = {**job, "argv": job.get("resume_argv") or job["argv"]}


def _run(
    job: dict[str, Any],
    slurm_job: str,
    hosts: Sequence[str],
    out_dir: Path,
    say: Callable[[str], None],
    stop: _Stop,
    restarts: int,
    excluded: Sequence[str] = (),
) -> tuple[int, list[str]]:
    """Preflight, then the training step on `hosts` (the allocation less `excluded`): the batch script's
    exit code, and the nodes that went away without an exit status."""
    try:
        addr, _dev = own_address(job.get("cidr"))
    except ValueError as e:
        say(f"ddp-slurm: {hosts[0]}: {e}")
        return 3, []
    port = free_port(addr, int(job["port"]))
    say(
        f"ddp-slurm: job {slurm_job} ({job['job_id']}) on {','.join(hosts)}: MASTER_ADDR={addr} "
        f"MASTER_PORT={port}{f', restart {restarts}' if restarts else ''}"
    )
    line = json.dumps({**job, "master_addr": addr, "master_port": port, "nnodes": len(hosts)}) + "\n"
    python = f"{job['venv'].rstrip('/')}/bin/python"
    if job.get("preflight", True) and not preflight(job, hosts, line, say, excluded):
        say(f"ddp-slurm: job {slurm_job}: preflight failed on the allocation; nothing was started")
        return 3, []
    if stop.signum:
        say(f"ddp-slurm: job {slurm_job}: stopped before training started")
        return 143, []
    argv = [
        *_step(len(hosts), excluded),
        "--kill-on-bad-exit=1",
        f"--wait={SRUN_WAIT_S}",
        python,
        "-m",
        TASK,
        "--node",
    ]
    srun = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert srun.stdin is not None and srun.stdout is not None
    srun.stdin.write(line.encode())
    srun.stdin.flush()
    stop.attach(srun.stdin)
    srun_lines = _relay(srun.stdout, hosts, out_dir, say)
    code = srun.wait()
    say(f"ddp-slurm: job {slurm_job}: srun exited {code}")
    gone = [hosts[t] for t in stragglers(srun_lines) if t < len(hosts)]
    if gone and not stop.signum:
        say(
            f"ddp-slurm: job {slurm_job}: {', '.join(gone)} did not end with the other nodes (srun gave "
            f"it {SRUN_WAIT_S} s): the node, its slurmd or its slurmstepd is gone; the other nodes' "
            "errors are its consequence"
        )
        return 1, gone
    if code > 128 and not stop.signum:
        # nobody stopped the job: one node failed and srun (--kill-on-bad-exit) ended the others
        say(f"ddp-slurm: job {slurm_job}: a node failed (above); srun ended the others")
        return 1, []
    if code > 128:
        return 143, []  # the others were ended by srun while exiting after their save (their lines say so)
    return code, []


def stragglers(srun_lines: Sequence[str]) -> list[int]:
    """The tasks srun still saw running after its --wait ran out ("srun: StepId=5.1 task 2: running",
    "tasks 0-1,3: running"): their node went away without an exit status."""
    tasks: set[int] = set()
    for text in srun_lines:
        m = RUNNING_TASKS.search(text)
        if not m:
            continue
        for part in m.group(1).split(","):
            first, _, last = part.partition("-")
            tasks.update(range(int(first), int(last or first) + 1))
    return sorted(tasks)


def preflight(job: Mapping[str, Any], hosts: Sequence[str], line: str, say: Callable[[str], None],
              excluded: Sequence[str] = ()) -> bool:  # fmt: skip
    """Inside the allocation, before training: the SSH preflight's node checks (preflight.judge_probed:
    versions equal on every node, torch and the trainer importable, torchrun there, hostnames not on
    loopback, GPU counts and health) over every node's probe, run as one srun step, since compute nodes
    may refuse SSH outside a job (pam_slurm_adopt). One line per failure; False when any failed."""
    from ddp_train.launch.plan.inventory import Node
    from ddp_train.launch.plan.plan import NodePlan
    from ddp_train.launch.preflight.preflight import judge_probed, read_probe
    from ddp_train.launch.preflight.preflight_model import NodeCheck

    python = f"{job['venv'].rstrip('/')}/bin/python"
    argv = [*_step(len(hosts), excluded), f"--wait={SRUN_WAIT_S}", python, "-m", TASK, "--probe"]
    try:
        out, both = subprocess.PIPE, subprocess.STDOUT
        res = subprocess.run(argv, input=line.encode(), stdout=out, stderr=both, timeout=PROBE_TIMEOUT_S)
        output = res.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode("utf-8", "replace")
        say(f"ddp-slurm: preflight: the probe step did not end within {PROBE_TIMEOUT_S}s")
    per_task: dict[int, list[str]] = {i: [] for i in range(len(hosts))}
    for text in output.splitlines():
        m = LABEL.match(text)
        if m and int(m.group(1)) in per_task:
            per_task[int(m.group(1))].append(m.group(2))
        elif text.strip():
            say(text)  # srun's own lines
    checks = []
    for i, host in enumerate(hosts):
        node = Node(
            name=host, address=host, local=False, ssh=None, venv=job["venv"], workdir=job.get("workdir"),
            nproc="auto", master_port=int(job["port"]), env={},
            gpu_health=job.get("gpu_health", "strict"), gpu_health_dcgm=bool(job.get("gpu_health_dcgm")),
        )  # fmt: skip
        c = NodeCheck(NodePlan(node=node, rank=i, env=job["env"], argv=tuple(job["argv"]), config_path=None))
        lines = per_task[i]
        read_probe(c, 0 if lines else 1, "\n".join(lines) or "no output from its srun task")
        checks.append(c)
    judge_probed(checks)
    for c in checks:
        for w in c.warnings:
            say(f"ddp-slurm: preflight: {c.name}: warning: {w}")
    failed = [f"{c.name}: {m}" for c in checks for m in c.failures]
    for f in failed:
        say(f"ddp-slurm: preflight failed: {f}")
    if not failed:
        say(f"ddp-slurm: preflight ok on {len(hosts)} nodes (in the allocation)")
    return not failed


def _step(n: int, excluded: Sequence[str] = ()) -> list[str]:
    """srun's options for a step of one task per node over the allocation, less `excluded` (lost nodes,
    whose earlier step Slurm may count as running until SlurmdTimeout: --overlap lets the new step share
    the CPUs that step still holds; srun(1) --overlap, Slurm 20.11+)."""
    argv = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--label"]
    if excluded:
        argv += [f"--exclude={','.join(excluded)}", "--overlap"]
    if os.environ.get("SLURM_CPUS_PER_TASK"):  # 22.05 srun no longer reads it (RELEASE_NOTES 22.05)
        argv.insert(1, f"--cpus-per-task={os.environ['SLURM_CPUS_PER_TASK']}")
    return argv


class _Stop:
    """SIGTERM/SIGINT/SIGUSR1 on the driver: one "stop" line to every node, once (as soon as the training
    step's stdin is attached; a stop before that means the step never starts)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.stdin: IO[bytes] | None = None
        self.signum, self.say = 0, say
        self.lock, self.sent = threading.Lock(), False  # a signal during attach() must not send it twice

    def handle(self, signum: int, _frame: object) -> None:
        if self.signum:
            return
        self.signum = signum
        self.say(
            f"ddp-slurm: got {signal.Signals(signum).name}: every node stops its torchrun (each rank "
            "finishes its step and saves)"
        )
        if self.stdin is not None:
            threading.Thread(target=self._send, daemon=True).start()  # no blocking write in a handler

    def attach(self, stdin: IO[bytes]) -> None:
        self.stdin = stdin
        if self.signum:
            self._send()

    def detach(self) -> None:
        """Between two steps (an in-allocation restart): a stop until the next attach waits for it."""
        with self.lock:
            self.stdin = None

    def _send(self) -> None:
        with self.lock:
            if self.sent or self.stdin is None:
                return
            try:
                self.stdin.write(STOP)
                self.stdin.flush()
                self.sent = True
            except (OSError, ValueError):
                pass


class _Say:
    """The driver's own lines: on its stdout (the batch output) and in driver.log beside the nodes'."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.file = os.fdopen(fd, "a", encoding="utf-8")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def _relay(stream: IO[bytes], hosts: Sequence[str], out_dir: Path, say: Callable[[str], None]) -> list[str]:
    """Each task's lines to its log and the batch output, prefixed; srun's own lines said and returned."""
    files: dict[int, IO[str]] = {}
    own: list[str] = []
    for raw in stream:
        text = raw.decode("utf-8", "replace").rstrip("\n")
        m = LABEL.match(text)
        if m and int(m.group(1)) < len(hosts):
            task = int(m.group(1))
            f = files.get(task)
            if f is None:
                fd = os.open(
                    out_dir / f"r{task}-{hosts[task]}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
                )
                f = files[task] = os.fdopen(fd, "a", encoding="utf-8")
            f.write(m.group(2) + "\n")
            f.flush()
            print(f"[{hosts[task]} r{task}] {m.group(2)}", flush=True)
        else:
            say(text)
            own.append(text)
    for f in files.values():
        f.close()
    return own
