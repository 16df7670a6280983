"""How a job ended: the table, the verdict, summary.json, and the `JobResult` that `Job.run()` returns."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence

from ddp_train import exitcodes
from ddp_train.launch.errors import one_line
from ddp_train.launch.plan.plan import JobPlan
from ddp_train.launch.run.logs import JobLog, first_error, table
from ddp_train.launch.run.noderun import NodeRun
from ddp_train.launch.run.trainerlog import parse_stopped, parse_throughput

# A node whose error only says a peer went away is a victim, not the cause.
PEER_FAILURE = re.compile(
    r"closed by peer|reset by peer|remote worker|Broken pipe|Connection refused|communicator was aborted|"
    r"Socket Timeout|timed out|TCPStore|rendezvous|ddp-train: stopped: ",
    re.IGNORECASE,
)
OUR_SIGNAL = re.compile(r"SignalException|got signal: 15")  # what torchrun says after our SIGTERM


@dataclasses.dataclass(frozen=True)
class Ending:
    """What the job's policy decided: its exit code, why, and (after a failure or stall) the cause."""

    code: int
    reason: str
    cause: NodeRun | None = None  # the root cause of a failure, the suspect of a stall
    stop_signal: int | None = None  # what a stop sent to the nodes
    stalled: bool = False  # the stall watchdog stopped the job


@dataclasses.dataclass(frozen=True)
class Loss:
    """A node that ended the job by itself: the root cause of a failure, the stall watchdog's suspect, or a
    node that could not be reached when the job started (what an unattended restart leaves out)."""

    host: str
    reason: str  # one line
    at: float  # when (time.time())
    code: int | None = None  # its exit code, if it exited

    @property
    def job_error(self) -> bool:
        """Its ranks refused the job itself (exit 2: config, data, checkpoint; 3: ranks differ): every
        node would do the same, so it is no node loss."""
        return self.code in (exitcodes.BAD_INPUT, exitcodes.RANKS_DIFFER)

    def record(self, attempt: int) -> dict[str, object]:
        """Its entry in job.json's "lost"."""
        return {"host": self.host, "reason": self.reason, "at": round(self.at, 3), "attempt": attempt}


@dataclasses.dataclass(frozen=True)
class JobResult:
    code: int
    reason: str
    stopped_cleanly: bool  # after a stop: every node ended as asked (its ranks saved): it can resume
    first_failure: str | None
    leftovers: dict[str, list[str]]
    elapsed_s: float
    lost: tuple[Loss, ...] = ()  # the nodes that ended it by themselves (launch/run/nodeloss.py)
    # rank 0's progress as its lines said: the step it resumed from, its last step, when its first step came
    resumed_step: int | None = None
    last_step: int | None = None
    first_step_at: float | None = None
    signal: int | None = None  # a stop signal (Ctrl-C, SIGTERM, `ddp-launch stop`) the job got, even late


def describe_end(r: NodeRun, log: JobLog) -> str:
    err = first_error(log.tail(r.name))
    what = r.error or r.lost or (f"exited {r.code}" if r.code is not None else "ended")
    return f"{what}: {err}" if err and not r.error else what


def stopped_cleanly(runs: Sequence[NodeRun], log: JobLog, stop_signal: int | None) -> list[NodeRun]:
    """After a stop: the nodes that had finished (0), or exited 128 + signal after their ranks said
    they stopped (which they print only once the checkpoint is saved)."""
    if not stop_signal:
        return []
    sig = 128 + stop_signal
    return [r for r in runs if r.code == 0 or (r.code == sig and parse_stopped(log.tail(r.name)))]


def stop_outcome(r: NodeRun, log: JobLog, stop_signal: int | None) -> str:
    """One line: how a node ended after a stop (its ranks' stop lines say which step they saved)."""
    stopped = sorted(parse_stopped(log.tail(r.name)), key=lambda s: s.rank)
    steps = sorted({s.step for s in stopped})
    ranks = ",".join(str(s.rank) for s in stopped)
    if r.code == 128 + (stop_signal or 0) and steps:
        saved = ", checkpoint saved" if any(s.rank == 0 for s in stopped) else ""
        return f"exit {r.code}: rank {ranks} stopped after step {steps[-1]}{saved}"
    if r.code == 0:
        return "exit 0: had already finished"
    return f"{r.status()}: no clean stop"


def consequence(r: NodeRun, err: str | None, end: Ending) -> str | None:
    """FIRST ERROR of a node that failed only because the job was stopped (stall watchdog) or
    another node failed first: that reason, not the lost connection it saw."""
    root = end.cause
    if end.stalled:
        if r is root:  # its torchrun's SignalException is the watchdog's SIGTERM, not why it stalled
            own = err if err and not OUR_SIGNAL.search(err) else None
            return own or "stalled: no progress (the watchdog's stacks name it)"
        # whatever it printed once the watchdog stopped the job (torchrun's SignalException, a peer gone)
        return "stopped by the stall watchdog" if err or r.failed or r.signalled else None
    if root is None or r is root or r.error or r.lost or not r.failed:
        return err
    if r.signalled or (err and (PEER_FAILURE.search(err) or OUR_SIGNAL.search(err))):
        return f"stopped: node {root.plan.rank} failed ({root.name})"
    return err


def summarize(
    plan: JobPlan,
    log: JobLog,
    runs: Sequence[NodeRun],
    end: Ending,
    leftovers: dict[str, list[str]],
    elapsed: float,
) -> JobResult:
    """Print the table and the verdict, write summary.json; the result."""
    rows = []
    clean = stopped_cleanly(runs, log, end.stop_signal)
    for r in runs:
        err = r.error or (first_error(log.tail(r.name)) if r.failed or r.signalled else None)
        # a node that stopped as asked has no error to show
        err = None if r in clean else consequence(r, err, end)
        rows.append([r.name, r.plan.rank, r.status(), one_line(err or "", 100)])
    log.block(table(["HOST", "RANK", "STATUS", "FIRST ERROR"], rows))
    for r in runs:
        hidden = log.hidden.get(r.name, 0)
        if hidden and r.failed:
            log.note(
                f"{r.name}: {hidden} traceback line(s) kept off the console: "
                f"ddp-launch logs {plan.job_id} --node {r.name}"
            )
    all_clean = bool(end.stop_signal) and len(clean) == len(runs)
    if end.code == 0 and not leftovers:
        verdict = "succeeded"
    elif all_clean and not leftovers:
        steps = {str(s.step) for r in runs for s in parse_stopped(log.tail(r.name))}
        step = f" after step {', '.join(sorted(steps))}" if steps else ""
        verdict = f"stopped ({end.reason}){step}, checkpoint saved; the same command resumes from it"
    else:
        verdict = f"FAILED ({end.reason})"
    speed = next((t for r in runs if (t := parse_throughput(log.tail(r.name)))), None)
    if speed:  # issue 31: the wall-clock figure beside the compute-only one, so paused time shows
        mfu = ""
        if "mfu" in speed:
            mfu = f"; mfu {speed['wall_mfu']:.1f}% wall-clock, {speed['mfu']:.1f}% compute-only"
        log.note(
            f"throughput: {speed['wall_tokens_per_s']:.0f} tok/s wall-clock, "
            f"{speed['tokens_per_s']:.0f} tok/s compute-only ({speed['steps']:.0f} steps, rank 0){mfu}"
        )
    log.note(f"job {plan.job_id} {verdict} in {elapsed:.1f}s; logs: {log.dir}")
    first_failure = end.cause.name if end.cause else None
    log.write_json(
        "summary.json",
        {
            "job_id": plan.job_id,
            "exit_code": end.code,
            "reason": end.reason,
            "elapsed_s": round(elapsed, 3),
            "master": {"host": plan.master.node.name, "addr": plan.master_addr, "port": plan.master_port},
            "first_failure": first_failure,
            "throughput": speed,
            "leftover_processes": leftovers,
            "nodes": [
                {
                    "host": r.name,
                    "rank": r.plan.rank,
                    "status": r.status(),
                    "exit_code": r.code,
                    "pgid": r.pgid,
                    "first_error": row[3] or None,
                }
                for r, row in zip(runs, rows)
            ],
        },
    )
    code = exitcodes.NODE_FAILED if leftovers and end.code == 0 else end.code
    return JobResult(code, end.reason, all_clean, first_failure, leftovers, elapsed, lost(runs, end, log))


def lost(runs: Sequence[NodeRun], end: Ending, log: JobLog) -> tuple[Loss, ...]:
    """The nodes that ended the job by themselves: a failure's root cause, a stall's suspect, the nodes
    that could not be reached at the start; none after a success, a stop or --timeout."""
    now, mono = time.time(), time.monotonic()
    cause = end.cause
    if end.code not in (exitcodes.NODE_FAILED, exitcodes.STALLED):
        return ()
    if cause is None:  # the start: every node that could not be reached (nothing was started)
        return tuple(Loss(r.name, one_line(r.error, 200), now) for r in runs if r.error)
    at = now - (mono - cause.ended) if cause.ended is not None else now
    why = "stalled: the stall watchdog named it" if end.stalled else describe_end(cause, log)
    return (Loss(cause.name, one_line(why, 200), at, cause.code),)
