"""SlurmBackend: the launch pipeline's Backend that submits the job with `sbatch --parsable` on the
submit host (over SSH with the launcher's own sessions) and follows it there until it ends.

prepare(): Slurm preflight on the submit host (reachable, partition exists and is UP, enough nodes,
--time within the partition's MaxTime; one line each, exit 3, nothing submitted), then the batch script
(driver.py's Python driver, the job inside it as base64 JSON; sbatch reads it on stdin) is submitted.
run(): polls squeue (scontrol once it ended) and copies the driver's per-node output into logs/<job>/
with the usual `[host rN]` prefix. SIGTERM (ddp-launch stop, a detached monitor's stop) is the clean
stop (`scancel --batch --signal=TERM`); Ctrl-C only detaches: the job is Slurm's and keeps running.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import shlex
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ddp_train import exitcodes
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.jobs import jobstate
from ddp_train.launch.pipeline import LaunchConfig, Refused, sync_nodes
from ddp_train.launch.plan.plan import JobPlan, replan
from ddp_train.launch.run.logs import JobLog
from ddp_train.launch.run.report import JobResult
from ddp_train.launch.run.trainerlog import Stopped, parse_stopped
from ddp_train.launch.slurm import jobctl
from ddp_train.launch.slurm.protocol import (
    ATTEMPT,
    DONE,
    DRIVER_LOG,
    GONE,
    REQUEUED,
    SUBMIT_UMASK,
    batch_dir,
    log_dir,
)
from ddp_train.launch.slurm.settings import SlurmSettings, minutes
from ddp_train.storage import size_text

if TYPE_CHECKING:
    from ddp_train.launch.remote.remote import Session
    from ddp_train.launch.remote.sync import Manifest

POLL_S = 1.0
BATCH_OUTPUT = "ddp-slurm-%j.out"  # with shared storage: in ddp_workdir (the batch script's --chdir)
# sbatch with SLURM_UMASK=0077: slurmstepd sets that umask before it creates the batch output file
# (ddp-slurm-<id>.out: the driver's lines, the nodes' output), so the file is 0600, not the submitter's
# umask (often 0644). sbatch(1), INPUT ENVIRONMENT VARIABLES: "SLURM_UMASK: If defined, Slurm will use
# the defined umask to set permissions when creating the output/error files for the job"; Slurm 22.05
# src/slurmd/slurmstepd/mgr.c: set_umask(job) before _setup_normal_io(job). No #SBATCH option sets it
# (--open-mode only chooses append or truncate). The batch script inherits that umask too: the driver
# puts back the submitter's own (DDP_SUBMIT_UMASK, driver.py restore_umask) for what the job creates.
# sh -c: whatever the login shell on the submit host is.
SBATCH = "sh -c " + shlex.quote(f'SLURM_UMASK=0077 {SUBMIT_UMASK}="$(umask)" exec sbatch --parsable')
COMPLETING_WAIT_S = 10.0  # a job whose batch script is done may stay COMPLETING this long before we report
# Without shared storage --sync travels inside the batch script (a tar.gz, base64 in the base64 job line):
# slurmctld refuses a script over max_script_size (SchedulerParameters, 4 MiB by default, slurm.conf(5);
# Slurm's DEFAULT_BATCH_SCRIPT_LIMIT). A directory bigger than STAGE_MAX_RAW is refused before it is packed.
SCRIPT_MAX_BYTES = 4 << 20
STAGE_MAX_RAW = 32 << 20


def stage_archive(manifest: Manifest) -> dict[str, str]:
    """--sync for a job without shared storage: the directory as one tar.gz (base64) that the driver's
    first step unpacks on every node into <ddp_workdir>/.ddp-launch/sync/<digest> (task.py --stage).
    LaunchError before anything is packed when the directory is over STAGE_MAX_RAW."""
    if manifest.total_bytes > STAGE_MAX_RAW:
        raise LaunchError(
            f"--sync {manifest.root}: {size_text(manifest.total_bytes)} in {len(manifest.entries)} file(s); "
            f"without shared storage (slurm_shared_workdir: false) it travels inside the batch script, at "
            f"most {size_text(STAGE_MAX_RAW)} before compression and {size_text(SCRIPT_MAX_BYTES)} of "
            "script (Slurm's max_script_size): leave data out (--sync-exclude, .ddpignore) or put the code "
            "on storage the nodes share; nothing was submitted"
        )
    import io
    import os
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as t:
        for rel in sorted(manifest.entries):
            t.add(os.path.join(manifest.root, rel), arcname=rel, recursive=False)
    tar = base64.b64encode(buf.getvalue()).decode()
    return {"name": manifest.name, "digest": manifest.digest, "tar": tar}


def batch_script(
    plan: JobPlan, s: SlurmSettings, preflight: bool = True, stage: dict[str, str] | None = None
) -> str:
    """The script sbatch gets: #SBATCH lines, then the driver with the job as base64 JSON.
    `preflight`: the driver checks the allocated nodes before training (--skip-preflight: not);
    `stage`: --sync for nodes without shared storage (stage_archive)."""
    p = plan.nodes[0]
    restart = plan.recovery.mode == "restart"
    check_storage(plan, s)
    config = None
    if plan.config and p.config_path:
        config = {"path": p.config_path, "text": Path(plan.config).read_text(encoding="utf-8")}
    job = {
        "job_id": plan.job_id,
        "argv": list(p.argv),
        "env": dict(p.env),
        "static": plan.rdzv == "static",
        "cidr": p.node.network_cidr,
        "port": plan.master_port,
        "venv": p.node.venv,
        "workdir": p.cwd,
        "logs_in": logs_base(plan, s),
        "config": config,
        "max_requeues": s.max_requeues,
        "resume_argv": list(replan(plan, (), plan.config).nodes[0].argv) if plan.options else None,
        "recovery": dataclasses.asdict(plan.recovery) if plan.recovery.mode == "restart" else None,
        "preflight": preflight,
        "gpu_health": p.node.gpu_health,
        "gpu_health_dcgm": p.node.gpu_health_dcgm,
        "shared": s.shared_workdir,
        "stage": stage,
    }
    blob = base64.b64encode(json.dumps(job).encode()).decode()
    lines = [f"#!{p.node.venv.rstrip('/')}/bin/python"]
    lines += [f"#SBATCH {o}" for o in s.sbatch_options(plan.job_id, len(plan.nodes), restart=restart)]
    if chdir := batch_dir(p.cwd, s.shared_workdir):
        lines.append(f"#SBATCH --chdir={chdir}")
    # Without shared storage the script starts in /tmp, where another user could make a predictable
    # ddp-slurm-<id>.out theirs first (reading the job's output, or failing it): none; driver.log keeps it.
    lines.append(f"#SBATCH --output={BATCH_OUTPUT if s.shared_workdir else '/dev/null'}")
    if s.gpus_unresolved():
        lines.append(f"# --gpus-per-node: from partition {s.partition or '(the default)'}'s Gres at submit")
    # Stop signals caught from the first line on, for the driver: Slurm may send a time limit's USR1 up to
    # 60 s before its lead (sbatch(1) --signal), at once in a short job, and USR1's default action kills.
    lines += [
        "import signal, sys",
        "early = []",
        "for trapped in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):",
        "    signal.signal(trapped, lambda signum, _frame: early.append(signum))",
        "from ddp_train.launch.slurm.driver import main",
        f'sys.exit(main("{blob}", early))',
        "",
    ]
    return "\n".join(lines)


def check_storage(plan: JobPlan, s: SlurmSettings) -> None:
    """Without shared storage (slurm_shared_workdir: false): ddp_workdir absolute, and no requeue or
    restart, whose new allocation would find neither the checkpoints nor the driver's attempts.json
    (on the earlier nodes' own disks). LaunchError, one line."""
    p = plan.nodes[0]
    if s.shared_workdir:
        return
    if not (p.node.workdir or "").startswith("/"):
        raise LaunchError(
            "slurm_shared_workdir: false needs ddp_workdir, an absolute path on each node's own disk "
            f"(the driver creates it there), not {p.node.workdir!r}"
        )
    if s.requeue or plan.recovery.mode == "restart":
        what = "--requeue / --max-requeues / slurm_requeue" if s.requeue else "ddp_on_node_loss: restart"
        raise LaunchError(
            f"{what} with slurm_shared_workdir: false: a requeued job or a new attempt would find neither "
            "the checkpoints nor the driver's attempts.json (each node's own disk); use storage the nodes "
            "share (slurm_shared_workdir: true), or run without it"
        )


def logs_base(plan: JobPlan, s: SlurmSettings) -> str | None:
    """Where the driver keeps its files (protocol.log_dir): the job's directory, or without shared storage
    ddp_workdir itself (the job's --sync copy is unpacked there only after the driver started)."""
    p = plan.nodes[0]
    return p.cwd if s.shared_workdir else p.node.workdir


def shown_script(plan: JobPlan, s: SlurmSettings) -> str:
    """The batch script for --dry-run: the job line's environment masked."""
    text = batch_script(plan, s)
    return "\n".join(
        ln
        if not ln.startswith("sys.exit(main(")
        else "sys.exit(main(<the job as base64 JSON, environment included>))"
        for ln in text.splitlines()
    )


def preflight(
    session: Session, s: SlurmSettings, nodes: int, note: Callable[[str], None] = lambda line: None
) -> tuple[list[str], SlurmSettings]:
    """Why the job cannot be submitted, one line each (empty: it can), and the settings with the GPU
    request resolved against the partition's nodes (gpu_request); `note`: what the user should know."""
    where = s.submit.name
    rc, out = session.exec("scontrol --oneliner show partition", 30)
    if rc != 0:
        first = next((ln for ln in out.splitlines() if ln.strip()), f"exit {rc}")
        return [f"Slurm is not reachable from {where}: scontrol show partition: {first}"], s
    parts = {}
    for ln in out.splitlines():
        f = jobctl.oneliner(ln)
        if "PartitionName" in f:
            parts[f["PartitionName"]] = f
    name = s.partition or next((n for n, f in parts.items() if f.get("Default") == "YES"), None)
    if name is None or name not in parts:
        what = f"partition {name!r} does not exist" if name else "no --partition and no default partition"
        return [f"{what} (partitions on {where}: {', '.join(parts) or 'none'})"], s
    part, problems = parts[name], []
    if part.get("State") != "UP":
        problems.append(f"partition {name} is {part.get('State')} (scontrol show partition {name})")
    total = int(part.get("TotalNodes", "0") or 0)
    want = s.nodes or nodes
    if want > total:
        problems.append(f"--nodes {want}: partition {name} has {total} node(s)")
    if s.time:
        limit = part.get("MaxTime", "UNLIMITED")
        cap = minutes(limit)
        if cap is not None and (minutes(s.time) or 0) > cap:
            problems.append(f"--time {s.time} is over partition {name}'s MaxTime {limit}")
    rc, out = session.exec(f"sinfo --noheader --partition={shlex.quote(name)} --format=%G", 30)
    if rc != 0:
        problems.append(f"sinfo --partition={name} --format=%G on {where}: {out.strip() or f'exit {rc}'}")
        return problems, s
    have, mixed = gres_gpus(out)
    gpus, problem = gpu_request(s, name, have)
    if mixed and gpus and not problem:
        note(
            f"partition {name} has nodes with and without GPUs (Gres): the job asks for {gpus} GPU(s) per "
            "node, so Slurm places it on GPU nodes only (--gpus-per-node 0: a CPU job)"
        )
    return problems + ([problem] if problem else []), dataclasses.replace(s, gpus_per_node=gpus)


GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


def gres_gpus(sinfo_gres: str) -> tuple[int, bool]:
    """(GPUs every GPU node of the partition has, whether it also has nodes without any): `sinfo
    --format=%G` prints one line per group of alike nodes (`gpu:8`, `gpu:h100:8(S:0-1)`,
    `gpu:a100:4,gpu:v100:2`, `(null)`); the fewest over the lines with GPUs (0: none has any). A job
    that requests GPUs is only given nodes that have them."""
    counts = [
        sum(int(n) for n in GRES_GPU.findall(ln.strip())) for ln in sinfo_gres.splitlines() if ln.strip()
    ]
    with_gpus = [n for n in counts if n]
    return min(with_gpus, default=0), bool(with_gpus) and len(with_gpus) < len(counts)


def gpu_request(s: SlurmSettings, partition: str, have: int) -> tuple[int, str | None]:
    """(GPUs per node to request, or 0; why the job cannot run as asked, or None) on a partition whose
    nodes have `have` GPUs each. A default one per process is dropped on a partition without GPUs (a CPU
    cluster); asked for explicitly, or with more processes than GPUs, it is refused."""
    where = f"partition {partition}'s nodes have {have or 'no'} GPU{'' if have == 1 else 's'} (Gres)"
    if s.gpus_per_node is not None:
        if s.gpus_per_node > have:
            return 0, f"--gpus-per-node / slurm_gpus_per_node {s.gpus_per_node}: {where}"
        return s.gpus_per_node, None
    if s.nproc.isdigit():
        n = int(s.nproc)
        if have and n > have:
            return 0, f"ddp_nproc_per_node {n}: {where}; one process per GPU"
        return (n if have else 0), None
    if s.nproc == "gpu" and not have:
        return 0, f"ddp_nproc_per_node gpu: {where}"
    return (have if s.nproc in ("gpu", "auto") else 0), None


BAD_INTERPRETER = re.compile(r"bad interpreter\(([^)]+)\)")


class SlurmBackend:
    """The job through sbatch/srun; every command on the submit host, through one SessionPool."""

    def __init__(self, cfg: LaunchConfig, log: JobLog, settings: SlurmSettings) -> None:
        from ddp_train.launch.remote.sessionpool import SessionPool

        self.cfg, self.log, self.s = cfg, log, settings
        self.pool = SessionPool(cfg.connect_timeout)
        self.slurm_id = ""
        self.stopped: list[Stopped] = []  # the ranks' `stopped` lines in their output
        self.done: int | None = None  # the driver's last line: the batch script's exit code
        self.gone = ""  # the driver's line naming nodes that went away without an exit status
        self.stop_sent = False
        self.detached = False
        self.pace = jobctl.Pace()  # when the driver's files are read through srun next (no shared storage)
        self.read_host = ""  # the batch host whose files `offsets` are of

    def __enter__(self) -> SlurmBackend:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.pool.close()

    def _session(self) -> Session:
        return self.pool.get(self.s.submit)

    def prepare(self, plan: JobPlan, on_plan: Callable[[JobPlan], None]) -> JobPlan:
        from ddp_train.launch.remote.remote import RemoteError

        log = self.log
        stage = None
        check_storage(plan, self.s)
        if self.cfg.skip_preflight and self.s.gpus_unresolved():
            log.note(
                f"ddp_nproc_per_node {self.s.nproc} with --skip-preflight: the GPU request comes from the "
                "partition's Gres, which only the preflight reads; give --gpus-per-node N (0: none); "
                "nothing was submitted"
            )
            raise Refused(exitcodes.BAD_INPUT)
        if plan.sync and not self.s.shared_workdir:
            # No shared storage, and the nodes may be reachable through Slurm alone: the directory goes
            # inside the batch script, and the driver's first step unpacks it on every node.
            try:
                stage = {**stage_archive(plan.sync), "dir": plan.nodes[0].sync_dir or ""}
            except LaunchError as e:
                log.note(str(e))
                raise Refused(exitcodes.BAD_INPUT) from None
            size = len(stage["tar"]) * 3 // 4
            log.note(f"sync: {len(plan.sync.entries)} file(s), {size} bytes inside the batch script")
        elif plan.sync:
            # One batch script, one --chdir: the synced copy must have one path on every node.
            dirs = sorted({p.sync_dir or "" for p in plan.nodes})
            if len(dirs) > 1:
                log.note(
                    f"--sync with --backend slurm: the nodes' copies would be in {len(dirs)} different "
                    f"directories ({', '.join(dirs[:3])}); give every node the same ddp_workdir; "
                    "nothing was submitted"
                )
                raise Refused(exitcodes.BAD_INPUT)
            # Over SSH to every node the partition may give the job, before sbatch. Where compute nodes
            # refuse SSH outside a job (pam_slurm_adopt), sync fails in one line per node: put the code
            # in a directory the nodes share instead.
            if not sync_nodes(plan, self.pool, self.cfg, log):
                raise Refused(exitcodes.NODE_FAILED)
        try:
            session = self._session()
            problems: list[str] = []
            if not self.cfg.skip_preflight:
                problems, self.s = preflight(session, self.s, len(plan.nodes), log.note)
            for line in problems:
                log.note(f"preflight failed: {line}")
            if problems:
                log.note("nothing was submitted (fix the lines above, or --skip-preflight)")
                raise Refused(exitcodes.PREFLIGHT)
            script = batch_script(plan, self.s, preflight=not self.cfg.skip_preflight, stage=stage)
            if stage and len(script.encode()) > SCRIPT_MAX_BYTES:
                log.note(
                    f"--sync {plan.sync.root if plan.sync else ''}: the batch script would be "
                    f"{size_text(len(script.encode()))} with it, over Slurm's max_script_size "
                    f"({size_text(SCRIPT_MAX_BYTES)} by default); without shared storage the directory "
                    "travels inside it: leave data out (--sync-exclude, .ddpignore) or put the code on "
                    "storage the nodes share; nothing was submitted"
                )
                raise Refused(exitcodes.BAD_INPUT)
            rc, out = session.exec(SBATCH, 60, stdin=script.encode())
        except RemoteError as e:
            log.note(f"preflight failed: Slurm is not reachable: {e}; nothing was submitted")
            raise Refused(exitcodes.PREFLIGHT) from None
        last = (out.strip().splitlines() or [""])[-1]
        slurm_id = last.split(";")[0].strip()
        if rc != 0 or not slurm_id.isdigit():
            log.note(f"sbatch on {self.s.submit.name} failed (exit {rc}): {out.strip()}")
            raise Refused(exitcodes.NODE_FAILED)
        self.slurm_id = slurm_id
        state = jobstate.state_path(self.cfg.log_dir, plan.job_id)
        jobstate.update_state(
            state,
            slurm={
                "id": slurm_id,
                "submit": self.s.submit.name,
                "group": self.s.group,
                "sources": [str(Path(x).resolve()) if Path(x).exists() else x for x in self.s.sources],
                "dir": log_dir(logs_base(plan, self.s), slurm_id),
                "shared": self.s.shared_workdir,
                "venv": plan.nodes[0].node.venv,
            },
        )
        log.note(
            f"submitted Slurm job {slurm_id} on {self.s.submit.name} ({self.s.nodes or len(plan.nodes)} "
            "nodes; "
            f"ddp-launch status/logs/stop {plan.job_id})"
        )
        return plan

    def run(self, plan: JobPlan, on_state: Callable[[str], None]) -> JobResult:
        traps = (signal.SIGTERM,) + (() if self.cfg.monitor else (signal.SIGINT, signal.SIGHUP))
        saved = {sig: signal.signal(sig, self._signal) for sig in traps}
        try:
            return self._follow(plan, on_state)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _signal(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM:
            self.stop_sent = True  # the loop sends the stop (no SSH round trip in a handler)
        else:
            self.detached = True

    def _follow(self, plan: JobPlan, on_state: Callable[[str], None]) -> JobResult:
        from ddp_train.launch.remote.remote import RemoteError

        log, slurm_id = self.log, self.slurm_id
        nodes = {p.node.name: p.node for p in plan.nodes}
        offsets: dict[str, int] = {}
        shown, stopped, pending = "", False, False
        s = jobctl.SlurmState("PENDING")
        t0 = time.monotonic()
        batch = ""  # the last batch host Slurm named (a requeued job has none)
        waited: float | None = None  # since when the batch script is done and the job still COMPLETING
        while True:
            try:
                session = self._session()
                s = jobctl.query(session, slurm_id)
                if self.stop_sent and not s.ended and (not stopped or (pending and s.state == "RUNNING")):
                    if not stopped:
                        on_state("stopping")
                    # a pending job is cancelled; one that started before the cancel took gets the stop once
                    pending = s.pending and not stopped
                    stopped = True
                    rc, out = jobctl.stop(session, slurm_id, pending)
                    log.note(f"stop: {jobctl.stop_line(slurm_id, pending, rc, out)}")
                if s.state != shown:
                    shown = s.state
                    log.note(s.line(slurm_id))
                    if s.state == "RUNNING" and not stopped:
                        on_state("running")
                batch = s.batch_host or batch
                self._copy_logs(s, nodes, plan, offsets)
            except RemoteError as e:
                log.note(f"cannot reach {self.s.submit.name}: {e}; retrying")
            if self.detached:
                log.note(
                    f"detached from Slurm job {slurm_id}; it keeps running (ddp-launch status/logs/stop "
                    f"{plan.job_id}; scancel {slurm_id})"
                )
                return JobResult(exitcodes.SIGINT, "detached", False, None, {}, time.monotonic() - t0)
            if s.ended:
                break
            if self.done is not None and s.state.startswith("COMPLETING"):
                # The batch script is done, but Slurm waits for a node that does not answer (its slurmd
                # is gone; slurmctld marks it DOWN after SlurmdTimeout, 300 s by default): the job's
                # outcome is known, so report it now instead of waiting with it.
                waited = waited if waited is not None else time.monotonic()
                if time.monotonic() - waited > COMPLETING_WAIT_S:
                    log.note(
                        f"Slurm job {slurm_id}: the batch script ended (exit {self.done}); Slurm still waits "
                        f"for {s.nodes or 'a node'} to confirm (COMPLETING)"
                    )
                    break
            time.sleep(POLL_S)
        code = jobctl.exit_code(s) if s.ended or self.done is None else self.done  # done, still COMPLETING
        world, ranks = {r.world for r in self.stopped}, {r.rank for r in self.stopped}
        every_rank_stopped = len(world) == 1 and len(ranks) in world
        if s.state.startswith("CANCELLED") and every_rank_stopped:
            # A plain `scancel JOB` (or `stop`): every rank finished its step and saved. Slurm's ExitCode
            # then says only how the batch script was ended (0:9 when killed with the job), not how it went.
            code, stopped = exitcodes.SIGTERM, True
        reason = s.line(slurm_id)
        failure = None if code in (0, exitcodes.SIGTERM) else (self.gone or reason)
        early = ""
        if failure and not offsets:
            early = (
                self._batch_output(plan, s, nodes.get(s.batch_host or batch))
                if self.s.shared_workdir
                else self._unread(plan, s.batch_host or batch)
            )
        if failure and (self.gone or early):
            failure = self.gone or early
            log.note(f"Slurm job {slurm_id} FAILED: {failure}")
        if code == exitcodes.SIGTERM and every_rank_stopped:
            # Slurm calls a batch script that exited 143 FAILED: say what it was, as the SSH backend does
            steps = ", ".join(str(step) for step in sorted({r.step for r in self.stopped}))
            log.note(
                f"Slurm job {slurm_id} stopped after step {steps}: every rank finished its step and saved; "
                "the same command resumes from it"
            )
        elapsed = time.monotonic() - t0
        return JobResult(code, reason, stopped and code == exitcodes.SIGTERM, failure, {}, elapsed)

    def _unread(self, plan: JobPlan, batch: str) -> str:
        """Without shared storage, a job that failed before the launcher read a line of its driver: there
        is no batch output (--output=/dev/null) to show; what it most likely was, in one line."""
        node = plan.nodes[0].node
        return (
            f"the job failed before the launcher read a line of its driver (without shared storage its "
            f"batch output is not kept): check that {batch or 'its batch host'} has ddp_venv {node.venv} "
            f"and that ddp_workdir {node.workdir} there is yours and not writable by others"
        )

    def _batch_output(self, plan: JobPlan, s: jobctl.SlurmState, batch: Any) -> str:
        """A job that failed before the driver wrote a line (the batch script's Python missing on the node,
        the driver failing to import): the batch output's last lines, said, and the failure's one line."""
        from ddp_train.launch.remote.remote import RemoteError

        if batch is None:
            return ""
        name = BATCH_OUTPUT.replace("%j", self.slurm_id)
        path = s.stdout or (f"{plan.nodes[0].cwd.rstrip('/')}/{name}" if plan.nodes[0].cwd else f"~/{name}")
        where = shlex.quote(path) if not path.startswith("~/") else f'"$HOME"/{shlex.quote(path[2:])}'
        try:
            rc, out = self.pool.get(batch).exec(f"tail -n 5 -- {where}", 20)
        except RemoteError:
            return ""
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()] if rc == 0 else []
        if not lines:
            return ""
        self.log.note(f"Slurm job {self.slurm_id} failed before its driver started; {path} on {batch.name}:")
        for line in lines:
            self.log.line(batch.name, f"{batch.name} batch", line)
        # slurmstepd's own line when the #! interpreter is missing: "execve(): bad interpreter(PATH): ..."
        missing = next((m.group(1) for ln in lines if (m := BAD_INTERPRETER.search(ln))), None)
        if missing:
            return (
                f"{batch.name} has no {missing}, the batch script's interpreter: set ddp_venv to the "
                "training venv every node has (playbooks/pytorch.yml installs it)"
            )
        return lines[-1]

    def _copy_logs(
        self, s: jobctl.SlurmState, nodes: dict[str, Any], plan: JobPlan, offsets: dict[str, int]
    ) -> None:
        """The driver's new lines, read where they are (jobctl.reader): on the batch host over SSH when it is
        an inventory node, else on the submit host (shared ddp_workdir), else through an srun step into
        the running job (no shared storage; as often as jobctl.Pace allows). Without shared storage the
        offsets start again when the job runs on another batch host (a requeue): its files are new."""
        if jobctl.moved(self.s.shared_workdir, self.read_host, s):  # requeued onto another batch host
            offsets.clear()
            self.pace = jobctl.Pace()
        self.read_host = s.batch_host or self.read_host
        where = jobctl.reader(self.slurm_id, s, self.s.shared_workdir, s.batch_host in nodes)
        if where is None:
            return
        host, through = where
        if through and not self.pace.due(time.monotonic()):
            return
        session = self.pool.get(nodes[s.batch_host]) if host == "batch" else self._session()
        directory = log_dir(logs_base(plan, self.s), self.slurm_id)
        python = f"{plan.nodes[0].node.venv.rstrip('/')}/bin/python"
        got = jobctl.read_logs(session, python, directory, offsets, through)
        if through:
            self.pace.done(time.monotonic(), jobctl.grew(got, offsets))
        # The ranks' files before the driver's: the driver wrote every line of an attempt before its
        # requeue or done line, and read_logs read driver.log first, so what the ranks printed before
        # that line is here, said before it and counted for the attempt it belongs to.
        for name, (offset, text) in sorted(got.items(), key=lambda item: item[0] == DRIVER_LOG):
            offsets[name] = offset
            host, label = jobctl.label(name)
            lines = text.splitlines()
            self.stopped += parse_stopped(lines)
            if host == "driver":
                for line in lines:
                    if REQUEUED.match(line) or ATTEMPT.match(line):  # the stops so far: an earlier attempt's
                        self.stopped, self.gone = [], ""
                    if m := DONE.match(line):
                        self.done = int(m.group(1))
                    elif m := GONE.match(line):
                        self.gone = m.group(1)
            for line in lines:
                self.log.line(host, label, line)


def slurm_backend(settings: SlurmSettings) -> Callable[[LaunchConfig, JobLog], SlurmBackend]:
    return lambda cfg, log: SlurmBackend(cfg, log, settings)
