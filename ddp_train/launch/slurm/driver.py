"""On the allocation: the batch script's driver (node 0) and the program srun starts on every node.

The batch script is Python (`#!<ddp_venv>/bin/python`), so the driver is a Python process, not a shell
that defers its traps while a foreground child runs (scancel(1), "the batch shell ... will not
receive the signal until the foreground process exits"). The driver

1. picks MASTER_ADDR = its own address in ddp_network_cidr (no DNS, no `scontrol`) and the first
   MASTER_PORT from ddp_master_port up that binds there;
2. runs `srun --ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 --label python -m
   ddp_train.launch.slurm.driver --node`, writing the job (environment included) as one JSON line to
   srun's stdin, which srun broadcasts to every task (srun(1) --input, default "all") - never in argv;
3. prints each task's lines as `[host rN] line` and keeps them per node in <workdir>/.ddp-launch/
   slurm-<id>/r<N>-<host>.log (what `ddp-launch logs` reads);
4. turns SIGTERM (`ddp-launch stop`: `scancel --batch --signal=TERM`) and SIGUSR1 (`--signal=B:USR1@lead`
   before the time limit) into one "stop" line on srun's stdin: each node's program sends SIGTERM to its
   torchrun alone, the SSH backend's stop (every rank finishes its step, saves, exit 143). Slurm's own
   step signal would reach every process of the step at once, and a worker would then get SIGTERM twice
   (from slurmstepd and from torchrun). With --requeue, a USR1 stop that ends in 143 is followed by
   `scontrol requeue`, and the job starts again and resumes from the newest checkpoint.

The node program: node rank = SLURM_NODEID, its own interface in the CIDR (GLOO/NCCL_SOCKET_IFNAME,
--local-addr, as preflight/netif.py sets them for the SSH backend), plan.py's torchrun argv with the
driver's address and port, then `python -m ddp_train.agent` with the environment on its stdin.
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
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

STOP = b"stop\n"
SUBMIT_UMASK = "DDP_SUBMIT_UMASK"  # the submit shell's umask, in the batch script's environment (submit.py)
DRIVER_LOG = "driver.log"  # the driver's own lines (and srun's), beside the nodes' r<N>-<host>.log
LABEL = re.compile(r"^\s*(\d+): ?(.*)$")  # srun --label: "<task id>: line"
STOP_DELAY_S = 1.0  # a stop line waits this long for Slurm's own SIGTERM of the same scancel
PORT_SPAN = 64  # MASTER_PORT: the first of ddp_master_port .. +63 that binds
PROBE_TIMEOUT_S = 180  # the in-job preflight step: the probe allows itself 120 s (launch/node/probe.py)
DRIVER = "ddp_train.launch.slurm.driver"
SRUN_WAIT_S = 60  # srun --wait: the other tasks' end after the first one exited
RUNNING_TASKS = re.compile(r"StepId=\S+ tasks? ([\d,-]+): running")
# The driver's lines the launcher acts on (submit.py): its last one, the requeue (the ranks' stops before
# it were the earlier attempt's) and the one naming nodes that went away without an exit status.
DONE = re.compile(r"^ddp-slurm: job \d+: done, exit (\d+)$")
REQUEUED = re.compile(r"^ddp-slurm: job \d+: requeued \(")
GONE = re.compile(r"^ddp-slurm: job \d+: (.* did not end with the other nodes .*)$")
# ddp_on_node_loss: restart, a node lost inside the allocation: the next attempt as a new step on the others
ATTEMPT = re.compile(r"^ddp-slurm: job \d+: attempt (\d+) on ")


def log_dir(workdir: str | None, slurm_job: str) -> str:
    """Where the driver keeps each node's output (relative: to the job's working directory)."""
    base = f"{workdir.rstrip('/')}/" if workdir else ""
    return f"{base}.ddp-launch/slurm-{slurm_job}"


def torchrun_argv(
    template: Sequence[str],
    *,
    rank: int,
    nnodes: int,
    addr: str,
    port: int,
    local_addr: str | None,
    static: bool,
) -> list[str]:
    """plan.py's torchrun argv for this node: the driver's address and port, rank = SLURM_NODEID."""
    out = list(template)
    endpoint = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    values = {
        "--nnodes": str(nnodes),
        "--master-addr": addr,
        "--master-port": str(port),
        "--rdzv-endpoint": endpoint,
    }
    if static:
        values["--node-rank"] = str(rank)
    if local_addr and not static:
        values["--local-addr"] = local_addr
    i = 1
    while i + 1 < len(out) and out[i].startswith("--"):  # torchrun's own "--flag value" pairs
        if out[i] in values:
            out[i + 1] = values.pop(out[i])
        i += 2
    if "--local-addr" in values:
        from ddp_train.launch.preflight.netif import with_local_addr

        out = list(with_local_addr(out, values["--local-addr"]))
    return out


def own_address(cidr: str | None) -> tuple[str, str | None]:
    """(this node's address in the CIDR, its interface); without a CIDR the hostname's address."""
    if not cidr:
        return socket.gethostbyname(socket.gethostname()), None
    from ddp_train.launch.node.probe import collect_netif
    from ddp_train.launch.preflight.netif import choose, network

    net = network(cidr)
    targets = [str(t) for t in ([net[-2], net[1], net[2]] if net.num_addresses >= 4 else list(net))]
    choice = choose(cidr, collect_netif(cidr, targets))
    return choice.address, choice.dev


def free_port(addr: str, first: int) -> int:
    for port in range(first, min(first + PORT_SPAN, 65536)):
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    raise SystemExit(f"ddp-slurm: no free port in {first}-{first + PORT_SPAN - 1} on {addr}")


# ---- the driver (the batch script, on node 0) -------------------------------------------------------


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
    out_dir = Path(log_dir(job.get("workdir"), slurm_job))
    moved = _fresh_log_dir(out_dir) if restarts == 0 else None
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    code = _attempts(job, slurm_job, hosts, out_dir, say, stop, restarts, record)
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
    return code


ATTEMPTS_FILE = "attempts.json"  # beside driver.log: what the job's allocations had, across requeues


class Attempts:
    """The job's attempts across its allocations (a requeue starts the batch script again, on the same
    shared workdir): the step attempts so far, the lost nodes (never used again, counted against
    ddp_max_node_losses), the time-limit requeues this driver made (--max-requeues counts only those),
    and the batch host of a driver that has not ended: one that never does was lost with its host."""

    def __init__(self, path: Path, restarts: int) -> None:
        self.path = path
        data: dict[str, Any] = {}
        if restarts:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
        self.attempt = int(data.get("attempt") or 0)
        self.lost: list[dict[str, str]] = list(data.get("lost") or [])
        self.usr1 = int(data.get("usr1") or 0)
        self.started: str | None = data.get("started")

    def start(self, batch_host: str) -> None:
        self.started = batch_host
        self._save()

    def next(self) -> int:
        self.attempt += 1
        self._save()
        return self.attempt

    def lose(self, host: str, why: str) -> None:
        self.lost.append({"host": host, "why": why})
        self._save()

    def end(self, usr1: bool = False) -> None:
        self.started, self.usr1 = None, self.usr1 + int(usr1)
        self._save()

    @property
    def lost_hosts(self) -> list[str]:
        return [x["host"] for x in self.lost]

    def _save(self) -> None:
        data = {"attempt": self.attempt, "lost": self.lost, "usr1": self.usr1, "started": self.started}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


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


def limit_reached(losses: int, remaining: int, policy: Mapping[str, Any]) -> str:
    """Why a restart after `losses` lost nodes, with `remaining` left, is not allowed ('' if it is): the
    rule of launch/run/nodeloss.py, inside one Slurm allocation."""
    if losses > int(policy.get("max_losses", 0)):
        return f"{losses} node(s) lost, more than ddp_max_node_losses {policy.get('max_losses')}"
    if remaining < int(policy.get("min_nodes", 1)):
        return f"{remaining} node(s) would remain, fewer than ddp_min_nodes {policy.get('min_nodes')}"
    return ""


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
        DRIVER,
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
    argv = [*_step(len(hosts), excluded), f"--wait={SRUN_WAIT_S}", python, "-m", DRIVER, "--probe"]
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


# ---- every node (an srun task) ------------------------------------------------------------------------


def node_main() -> None:
    job: dict[str, Any] = json.loads(_read_line())
    rank = int(os.environ["SLURM_NODEID"])
    env: dict[str, str] = dict(job["env"])
    local_addr = None
    if job.get("cidr"):
        try:
            local_addr, dev = own_address(job["cidr"])
        except ValueError as e:
            print(f"ddp-slurm: {socket.gethostname()}: {e}", flush=True)
            os._exit(3)
        from ddp_train.launch.preflight.netif import Choice, settings

        env.update(settings(Choice(dev=dev or "", address=local_addr, prefixlen=0), env)[0])
    argv = torchrun_argv(
        job["argv"],
        rank=rank,
        nnodes=int(job["nnodes"]),
        addr=job["master_addr"],
        port=int(job["master_port"]),
        local_addr=local_addr,
        static=bool(job["static"]),
    )
    workdir = job.get("workdir") or None
    if job.get("config"):
        _write_config(job["config"]["path"], job["config"]["text"], workdir)
    signalled = threading.Event()  # Slurm's own step signal (a plain scancel) reaches torchrun directly
    signal.signal(signal.SIGTERM, lambda *_: signalled.set())
    python = f"{job['venv'].rstrip('/')}/bin/python"
    proc = subprocess.Popen(
        [python, "-m", "ddp_train.agent", *argv],
        stdin=subprocess.PIPE,
        cwd=workdir,
        env=_agent_env(job["job_id"]),
    )
    assert proc.stdin is not None
    proc.stdin.write((json.dumps(env) + "\n").encode())
    proc.stdin.close()

    def watch() -> None:
        while _read_line():  # the only other line the driver sends is STOP
            # after a plain scancel torchrun got Slurm's SIGTERM already (and the driver's stop line
            # follows it): a second one would cut its shutdown short
            if not signalled.wait(STOP_DELAY_S) and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    code = proc.wait()
    if code < 0:  # srun --kill-on-bad-exit ended the step while this node's ranks were still exiting
        code = 128 - code
    sys.stdout.flush()
    os._exit(code)  # not through the interpreter's shutdown while `watch` blocks in a read of stdin


def _read_line() -> bytes:
    """One line of stdin, read byte by byte from the descriptor (no buffer that reads ahead)."""
    line = b""
    while not line.endswith(b"\n"):
        c = os.read(0, 1)
        if not c:
            break
        line += c
    return line


def _agent_env(job_id: str) -> Mapping[str, str]:
    env = dict(os.environ, DDP_JOB_ID=job_id, DDP_SLURM_STEP="1")
    env.pop("SLURM_CPU_BIND", None)
    return env


def _write_config(path: str, text: str, workdir: str | None) -> None:
    full = Path(workdir or ".", path) if not path.startswith("/") else Path(path)
    full.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def probe_main() -> int:
    """The in-job preflight's task on every node: the SSH preflight's probe, with the job's environment
    (less its id and secrets: launch/preflight/preflight.py probe_env) and its GPU health options."""
    from ddp_train.launch.node import probe
    from ddp_train.launch.plan.plan import is_secret
    from ddp_train.launch.preflight import gpuhealth

    job: dict[str, Any] = json.loads(_read_line())
    env = {k: v for k, v in job["env"].items() if k != "DDP_JOB_ID" and not is_secret(k, v)}
    os.environ.update(env)
    gpu = gpuhealth.probe_args(job.get("gpu_health", "strict"), bool(job.get("gpu_health_dcgm")))
    return probe.main([job["venv"], job.get("workdir") or "", *gpu])


if __name__ == "__main__":
    if sys.argv[1:] == ["--node"]:
        node_main()
    if sys.argv[1:] == ["--probe"]:
        sys.exit(probe_main())
    sys.exit(f"usage: {sys.argv[0]} --node | --probe (what the driver's srun runs)")
