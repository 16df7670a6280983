"""The launch pipeline: LaunchConfig -> launch() -> exit code (as torch.distributed.run's launch_agent).

launch() keeps the job's state (job.json) and log, then asks a `Backend` to prepare the nodes and run
the job. The SSH backend: --sync -> preflight -> each node's interface (netif) -> the script's backend
check -> RDMA ports -> the config copied -> Job; every connection through one SessionPool that the
backend opens and closes. A Slurm backend plugs in as another `Backend`.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ddp_train import exitcodes
from ddp_train.launch.jobs import jobstate
from ddp_train.launch.plan.plan import JobPlan, NodePlan, command, mask_argv
from ddp_train.launch.run.logs import JobLog
from ddp_train.launch.run.report import JobResult

if TYPE_CHECKING:
    from ddp_train.launch.plan.scriptcheck import Finding
    from ddp_train.launch.remote.sessionpool import SessionPool


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What a launch needs besides its plan: the run's options of the command line."""

    plan: JobPlan
    argv: Sequence[str]  # the command line, for job.json (secrets masked there)
    log_dir: str = "logs"
    monitor: bool = False  # the detached monitor runs it (no terminal; SIGHUP ignored)
    connect_timeout: float = 10
    net_timeout: float = 3
    skip_preflight: bool = False
    strict: bool = False
    sync_via: str = "auto"
    grace: float | None = None
    timeout: float | None = None
    stall_timeout: float | None = None
    overrides: Sequence[str] = ()
    prepared: bool = False  # the controller prepared the nodes: a monitor on the cluster only runs it


class Refused(Exception):
    """A backend refuses to start the job (the log says why); `code` is the launcher's exit code, `failed`
    the nodes at fault when preflight failed (each with its first failure: Report.at_fault)."""

    def __init__(self, code: int, failed: dict[str, str] | None = None) -> None:
        super().__init__(code)
        self.code, self.failed = code, dict(failed or {})


class Backend(Protocol):
    """Where the job runs: prepares the nodes, runs the job, closes what it opened (a context manager)."""

    def prepare(self, plan: JobPlan, on_plan: Callable[[JobPlan], None]) -> JobPlan:
        """Ready every node; the plan as the nodes refine it (on_plan sees each change). Refused if not."""
        ...

    def run(self, plan: JobPlan, on_state: Callable[[str], None]) -> JobResult: ...

    def __enter__(self) -> Backend: ...

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None: ...


def launch(cfg: LaunchConfig, backend: Callable[[LaunchConfig, JobLog], Backend] | None = None) -> int:
    """Run the job in this process (foreground, or as the detached monitor), its state in job.json."""
    plan = cfg.plan
    if cfg.monitor:  # the detached monitor: no terminal, so no SIGHUP; and it ignores one besides
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log = JobLog(Path(cfg.log_dir), plan.job_id, secrets=plan.secrets())
    state = jobstate.state_path(cfg.log_dir, plan.job_id)
    busy = jobstate.conflict(cfg.log_dir, plan.job_id, [p.node.name for p in plan.nodes], plan.master_port)
    if busy:
        log.note(f"preflight failed: {busy}; nothing was started")
        log.close()
        return exitcodes.PREFLIGHT
    argv = mask_argv(list(cfg.argv), plan.secrets())  # job.json keeps no secret of the command line
    jobstate.write_state(state, jobstate.initial_state(plan, argv, detached=cfg.monitor))
    code = exitcodes.NODE_FAILED
    try:
        for p in plan.nodes:
            log.note(f"{p.label} ({p.node.where}): {command(p, masked=True)}", console=False)
        if plan.script_check and plan.script_check.findings:
            for f in plan.script_check.findings:
                log.block(str(f))
            log.note(plan.script_check.summary())
        with (backend or SshBackend)(cfg, log) as nodes:
            code = _attempts(cfg, plan, nodes, log, state)
        return code
    finally:
        log.close()
        jobstate.update_state(state, state="finished", exit_code=code, ended=time.time())


def _attempts(cfg: LaunchConfig, plan: JobPlan, nodes: Backend, log: JobLog, state: Path) -> int:
    """Run the job; with ddp_on_node_loss: restart, again on the other nodes after each lost node, as
    the next attempt of the same job (launch/run/nodeloss.py decides), until it ends otherwise."""
    from ddp_train.launch.errors import LaunchError
    from ddp_train.launch.jobs import metricsview
    from ddp_train.launch.plan.plan import replan
    from ddp_train.launch.run.nodeloss import decide, decide_preflight
    from ddp_train.launch.run.report import Loss
    from ddp_train.launch.run.sigtrap import SignalTrap

    attempts: list[dict[str, Any]] = []
    lost: list[dict[str, Any]] = []

    def on_plan(p: JobPlan) -> None:  # netif re-ranks under c10d (torchrun orders by --local-addr)
        jobstate.update_state(state, nodes=_nodes(p))

    try:
        plan = nodes.prepare(plan, on_plan)
    except Refused as e:
        return e.code
    if plan.config:
        jobstate.write_private(log.dir / Path(plan.config).name, Path(plan.config).read_bytes())
    restartable = isinstance(nodes, SshBackend)  # Slurm has requeue of its own (docs/slurm.md)
    # Ctrl-C, SIGTERM (`ddp-launch stop`) or, in the foreground, SIGHUP from the end of an attempt to the
    # start of the next: the next one is not started
    stops = (signal.SIGINT, signal.SIGTERM) + (() if cfg.monitor else (signal.SIGHUP,))
    while True:
        fetcher = metricsview.start(plan, plan.config, cfg.overrides, log.dir, cfg.connect_timeout)
        started = time.time()
        result = nodes.run(plan, lambda s: jobstate.update_state(state, state=s))
        with SignalTrap(stops) as trap:
            jobstate.update_state(state, reason=result.reason, stopped_cleanly=result.stopped_cleanly)
            shown = metricsview.finish(fetcher, log.dir)
            if shown:
                log.note(shown)
            if not (restartable and plan.recovery.mode == "restart"):
                return result.code
            n = len(attempts) + 1
            decision = decide(result, plan.recovery, lost, [p.node.name for p in plan.nodes], n)
            attempts.append(_attempt_record(n, plan, started, result))
            lost += [x.record(n) for x in result.lost if not x.job_error]
            jobstate.update_state(state, attempt=n, attempts=attempts, lost=lost,
                                  policy=dataclasses.asdict(plan.recovery))  # fmt: skip
            for line in decision.lines:
                log.note(line)
            if not decision.restart:
                return result.code
            jobstate.update_state(state, state="restarting")
            log.next_attempt()
            ended, exclude = plan, decision.exclude
            while True:  # preflight on the remaining nodes; a node that fails it is lost too
                try:
                    plan = nodes.prepare(replan(ended, exclude, ended.config), lambda _p: None)
                    break
                except LaunchError as e:
                    log.note(f"cannot restart: {e}")
                    jobstate.update_state(state, reason=f"{result.reason}; cannot restart: {e}")
                    return result.code
                except Refused as e:
                    names = [p.node.name for p in ended.nodes if p.node.name not in exclude]
                    failed = [Loss(h, f"failed the preflight of attempt {n + 1}: {why}", time.time())
                              for h, why in e.failed.items()]  # fmt: skip
                    more = decide_preflight(failed, ended.recovery, lost, names, n)
                    lost += [x.record(n) for x in failed if more.lines]
                    jobstate.update_state(state, lost=lost)
                    for line in more.lines:
                        log.note(line)
                    if not more.restart:
                        why = f"attempt {n + 1} refused before it started (the lines above say why)"
                        jobstate.update_state(state, reason=f"{result.reason}; {why}")
                        return e.code
                    exclude = (*exclude, *more.exclude)
            if trap.first:
                log.note(f"{trap.reason()} while restarting: attempt {n + 1} was not started")
                jobstate.update_state(state, reason=f"{trap.reason()} while restarting")
                return 128 + trap.first
            jobstate.update_state(state, attempt=n + 1, master=plan.master_name, master_addr=plan.master_addr,
                                  nodes=_nodes(plan))  # fmt: skip


def _attempt_record(n: int, plan: JobPlan, started: float, result: JobResult) -> dict[str, Any]:
    """An attempt's entry in job.json's "attempts" (ddp-launch status shows them)."""
    return {
        "n": n,
        "nodes": [p.node.name for p in plan.nodes],
        "master": plan.master_name,
        "started": round(started, 3),
        "ended": round(time.time(), 3),
        "exit_code": result.code,
        "reason": result.reason,
        "resumed_step": result.resumed_step,
        "last_step": result.last_step,
        "first_step_at": result.first_step_at and round(result.first_step_at, 3),
    }


def _nodes(plan: JobPlan) -> Any:
    return jobstate.initial_state(plan, [], False)["nodes"]


class SshBackend:
    """Every node over SSH (or a local process for a local node), through one SessionPool."""

    def __init__(self, cfg: LaunchConfig, log: JobLog) -> None:
        from ddp_train.launch.remote.sessionpool import SessionPool

        self.cfg, self.log = cfg, log
        self.pool = SessionPool(cfg.connect_timeout)
        self.prepared = cfg.prepared  # the first attempt only: a restart's nodes are prepared here
        self.deadline: float | None = None  # --timeout: for the job, whatever its attempts

    def __enter__(self) -> SshBackend:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.pool.close()

    def prepare(self, plan: JobPlan, on_plan: Callable[[JobPlan], None]) -> JobPlan:
        from ddp_train.launch.preflight import netif, rdma
        from ddp_train.launch.preflight.preflight import check_space, run_preflight

        cfg, log = self.cfg, self.log
        prepared, self.prepared = self.prepared, False
        if prepared:  # launch/jobs/clustermon.py: the controller did all of this before the handoff
            return plan
        if plan.sync and not sync_nodes(plan, self.pool, cfg, log):
            raise Refused(exitcodes.NODE_FAILED)
        if cfg.skip_preflight and (why := netif.master_unchecked(plan)):
            log.note(why)
            raise Refused(exitcodes.PREFLIGHT)
        if not cfg.skip_preflight:
            report = run_preflight(
                plan,
                connect_timeout=cfg.connect_timeout,
                net_timeout=cfg.net_timeout,
                sessions=self.pool.sessions(),
            )
            self.pool.adopt(report.sessions())
            if not plan.script and (trainer_cfg := trainer_config(plan.config, cfg.overrides)) is not None:
                check_space(report.checks, trainer_cfg, cfg.strict)  # rank 0's disk: two checkpoints + best
            for line in report.warning_lines():
                log.note(f"preflight warning: {line}")
            if not report.ok:
                log.block(report.render())
                log.note(
                    f"preflight failed on {len({c.name for c in report.checks if c.failures})} node(s); "
                    "nothing was started (fix the lines above, or --skip-preflight)"
                )
                raise Refused(exitcodes.PREFLIGHT, report.at_fault())
            log.note(f"preflight ok on {len(plan.nodes)} nodes")
            plan = netif.apply(plan, report.checks, log.note)  # each node's interface in ddp_network_cidr
            if not check_backend(plan, report, log):
                raise Refused(exitcodes.PREFLIGHT)
            plan, notes = rdma.with_ib_hca(plan, report.checks)  # NCCL_IB_HCA: each node's active ports
            for line in notes:
                log.note(f"rdma: {line}")
            on_plan(plan)
        first = plan.options is None or plan.options.attempt == 1  # a later one resumes: no --fresh
        if first and not plan.script and (line := _fresh_refusal(plan, cfg, self.pool)):
            log.note(line)
            raise Refused(exitcodes.BAD_INPUT)
        if plan.config and not self._ship_config(plan):
            raise Refused(exitcodes.NODE_FAILED)
        return plan

    def run(self, plan: JobPlan, on_state: Callable[[str], None]) -> JobResult:
        from ddp_train.launch.run.job import Job
        from ddp_train.launch.run.trainerlog import StepTimes
        from ddp_train.launch.run.watchdog import StallWatch

        cfg, times = self.cfg, StepTimes()
        if cfg.timeout is not None and self.deadline is None:
            self.deadline = time.monotonic() + cfg.timeout
        job = Job(
            plan,
            self.log,
            pool=self.pool,
            grace=cfg.grace,
            timeout=None if self.deadline is None else max(0.0, self.deadline - time.monotonic()),
            on_state=on_state,
            trap=(signal.SIGINT, signal.SIGTERM) + (() if cfg.monitor else (signal.SIGHUP,)),
            watch=StallWatch(plan.job_id, self.log.dir, cfg.stall_timeout, times),
            times=times,
        )
        result = job.run()
        return dataclasses.replace(result, resumed_step=times.resumed_step, last_step=times.last_step,
                                   first_step_at=times.first_step_at)  # fmt: skip

    def _ship_config(self, plan: JobPlan) -> bool:
        from ddp_train.launch.remote.fanout import parallel
        from ddp_train.launch.remote.remote import RemoteError

        assert plan.config is not None
        config = plan.config

        def ship(p: NodePlan) -> str | None:
            try:
                self.pool.get(p.node).put(config, p.config_path)
            except RemoteError as e:
                return str(e)
            return None

        errors = [e for e in parallel(ship, list(plan.nodes)) if e]
        for e in errors:
            self.log.note(f"cannot copy --config: {e}; nothing was started")
        return not errors


def sync_nodes(plan: JobPlan, pool: SessionPool, cfg: LaunchConfig, log: JobLog) -> bool:
    """Ship --sync to every remote node in parallel; one line per node. False if any node failed.
    Both backends: the SSH one before its preflight, Slurm's before sbatch (every node the partition may
    give the job)."""
    from ddp_train.launch.remote.fanout import parallel
    from ddp_train.launch.remote.remote import RemoteError
    from ddp_train.launch.remote.sync import SyncError, sync_node

    assert plan.sync is not None
    manifest = plan.sync

    def one(p: NodePlan) -> tuple[Any, str | None]:
        if p.node.local or p.node.ssh is None:
            return None, None
        try:
            s = pool.open(p.node)
            return sync_node(s, p.node, manifest, cfg.sync_via, cfg.connect_timeout), None
        except (RemoteError, SyncError) as e:
            return None, str(e)

    results = parallel(one, list(plan.nodes))
    record = {}
    for p, (res, err) in zip(plan.nodes, results):
        if err:
            log.note(f"sync failed: {err}; nothing was started")
        elif res is None:
            log.note(f"sync: {p.node.name}: local node, runs in {p.sync_dir}")
        else:
            log.note(res.line(p.sync_dir or ""))
            record[p.node.name] = {"via": res.via, "files": res.files, "bytes": res.bytes,
                                   "dir": p.sync_dir}  # fmt: skip
    log.write_json("sync.json", {"source": manifest.root, "content": manifest.digest, "nodes": record})
    return not any(err for _, err in results)


def _fresh_refusal(plan: JobPlan, cfg: LaunchConfig, pool: SessionPool) -> str | None:
    """--fresh with checkpoints already on a node: the one line refusing the launch (preflight/fresh.py)."""
    from ddp_train.launch.preflight import fresh

    found = fresh.existing(plan, trainer_config(plan.config, cfg.overrides), lambda p: pool.get(p.node))
    return fresh.refusal(found)


def trainer_config(path: str | None, overrides: Sequence[str]) -> Any:
    """The trainer's resolved config (--config and --set), or None when it cannot be read here."""
    try:
        from ddp_train.config import ConfigError, load_config

        return load_config(path, list(overrides or []))
    except (ImportError, ConfigError):
        return None


def check_backend(plan: JobPlan, report: Any, log: JobLog) -> bool:
    """Finding 8, with preflight's GPU count of every node; False when --strict refuses to launch."""
    from ddp_train.launch.plan.scriptcheck import backend_findings

    if plan.script_check is None or not plan.script_check.backends:
        return True
    gpus = {c.name: int(c.facts.get("gpus") or 0) for c in report.checks if c.facts}
    found = backend_findings(plan.script_check, gpus)
    for f in found:
        log.block(str(f))
    if found and plan.script_check_mode == "strict":
        log.note(refusal(found, "--strict or ddp_script_check: strict") + "; nothing was started")
        return False
    return True


def refusal(findings: Sequence[Finding], why: str) -> str:
    codes = ", ".join(dict.fromkeys(f.code for f in findings))
    return (
        f"script check: {len(findings)} finding(s) above ({codes}) and {why} refuses to launch; fix them "
        "as each line says, or silence one with `# ddp-launch: ignore[<code>]` on its line"
    )
