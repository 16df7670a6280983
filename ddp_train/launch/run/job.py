"""Run a planned job: start every node at once, stream logs, fail fast, tear down, verify, summarize.

This is the policy; the mechanism is elsewhere: each node's run (launch/run/noderun.py: one thread per node
holds that node's run connection), the signals and the leftover scan (launch/run/nodecontrol.py, through
a second connection per node), the report (launch/run/report.py). The launcher either
- stops the job (Ctrl-C, SIGTERM, --timeout): one signal to each node's torchrun agent only, which
  passes it once to its workers; every rank finishes its step, rank 0 saves, every node exits
  128 + signal. KILL only after a grace period sized from the measured save time, or at a second
  Ctrl-C; or
- tears it down (a node failed, exited, or went silent): TERM to every node's whole process group,
  KILL after a short grace, counted from the first unanswered SSH liveness check of a silent node;
and finally checks that no process carrying the job's DDP_JOB_ID is left on any node it can reach.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddp_train import exitcodes
from ddp_train.launch.plan.plan import STOP_GRACE_MAX_S, JobPlan, command, env_line, shown_env
from ddp_train.launch.remote.fanout import parallel
from ddp_train.launch.remote.sessionpool import SessionPool
from ddp_train.launch.run.lifeline import Lifeline, node_env_line
from ddp_train.launch.run.logs import JobLog, first_error
from ddp_train.launch.run.nodecontrol import NodeControl
from ddp_train.launch.run.noderun import NodeRun
from ddp_train.launch.run.progress import live_line
from ddp_train.launch.run.report import (
    OUR_SIGNAL,
    PEER_FAILURE,
    Ending,
    JobResult,
    describe_end,
    stop_outcome,
    summarize,
)
from ddp_train.launch.run.sigtrap import SignalTrap
from ddp_train.launch.run.trainerlog import StepTimes

ROOT_CAUSE_WINDOW_S = 2.0  # failures this close to the first one may be its cause reported a bit later
FAILURE_GRACE_S = 10.0  # teardown after a failure: TERM -> KILL (peers stuck in a collective never save)
STOP_GRACE_MIN_S = 30.0  # a stop waits at least torchrun's default shutdown timeout (30 s) before KILL
SSH_SILENT_S = 10.0  # the SSH liveness check unanswered this long: the node is lost (silent partition)


class Job:
    """One launch of a plan. `pool` holds the control connections (its owner closes them); `times` is
    fed every output line (a stop's grace and the stall watchdog read it)."""

    def __init__(
        self,
        plan: JobPlan,
        log: JobLog,
        pool: SessionPool | None = None,
        grace: float | None = None,
        timeout: float | None = None,
        on_state: Callable[[str], None] | None = None,
        trap: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
        watch: Any = None,
        times: StepTimes | None = None,
    ) -> None:
        self.plan, self.log = plan, log
        self.own_pool = pool is None  # a pool it made, it closes
        self.pool = pool or SessionPool()
        self.control = NodeControl(plan.job_id, self.pool, log.note)
        self.on_state = on_state or (lambda _state: None)  # job.json (launch/jobs/jobstate.py)
        self.trap = SignalTrap(trap)  # a detached monitor leaves SIGHUP ignored
        self.watch = watch  # the stall watchdog (launch/run/watchdog.py), fed every step
        self.times = times or StepTimes()
        self.grace = grace  # --grace; None: a stop's grace is derived from the measured save time
        self.failure_grace = FAILURE_GRACE_S if grace is None else min(grace, FAILURE_GRACE_S)
        self.timeout = timeout
        self.runs = [NodeRun(p) for p in plan.nodes]
        self.events: queue.Queue[NodeRun] = queue.Queue()
        self.first_failed: NodeRun | None = None  # the first node to end failed: the job stops
        self.launched = False

    def run(self) -> JobResult:
        """Launch, wait, tear down on failure/signal, verify nothing is left; how it ended."""
        t0 = time.monotonic()
        try:
            with self.trap:  # kept through teardown and verification: Ctrl-C never cuts them short
                end = self._run()
                leftovers = self.control.leftovers(self.runs) if self.launched else {}
                result = summarize(self.plan, self.log, self.runs, end, leftovers, time.monotonic() - t0)
                # a stop that came during the teardown, the leftover scan or the summary: no restart
                return dataclasses.replace(result, signal=self.trap.first)
        finally:
            if self.own_pool:
                self.pool.close()
            for s in [r.session for r in self.runs if r.session]:  # the run connections: its own
                s.close()

    def _run(self) -> Ending:
        self.log.note(
            f"job {self.plan.job_id}: {len(self.runs)} nodes, master {self.plan.master.node.name} "
            f"{self.plan.master_addr}:{self.plan.master_port}, logs in {self.log.dir}"
        )
        parallel(lambda r: r.connect(self.pool.connect_timeout), self.runs)
        broken = [r for r in self.runs if r.error]
        if broken or self.trap.first:
            for r in broken:
                self.log.note(f"{r.name}: {r.error}")
            if broken:
                return Ending(exitcodes.NODE_FAILED, "could not connect to every node; nothing was started")
            return Ending(128 + (self.trap.first or 0), self.trap.reason())
        barrier = threading.Barrier(len(self.runs))
        for r in self.runs:
            threading.Thread(target=self._node, args=(r, barrier), name=f"node-{r.name}", daemon=True).start()
        self.launched = True
        lifeline = Lifeline(
            lambda: [r.stream.send for r in self.runs if r.env_sent and r.stream and not r.done.is_set()]
        )
        lifeline.start()
        self.on_state("running")
        try:
            return self._supervise()
        finally:
            lifeline.stop()

    def _node(self, r: NodeRun, barrier: threading.Barrier) -> None:
        def on_line(line: str) -> None:
            step = self.times.feed(line)
            if self.watch is not None and step is not None:
                self.watch.feed(step)
            self.log.line(r.name, r.plan.label, line)
            if step is not None:
                self.log.set_live(live_line(step))  # on a TTY: one line under the scrolling ones

        def on_start() -> None:
            shown = f"{command(r.plan, masked=True)} (environment on stdin: {shown_env(r.plan)})"
            self.log.note(f"{r.plan.label}: started: {shown}", console=False)

        def env() -> bytes:
            return node_env_line(env_line(r.plan), self.plan.job_id)

        try:
            r.run(barrier, lambda: bool(self.trap.first or self.first_failed), env, on_start, on_line)
        finally:
            self.events.put(r)

    def _supervise(self) -> Ending:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        finished = 0
        while finished < len(self.runs):
            try:
                r = self.events.get(timeout=0.2)
            except queue.Empty:
                r = None
            self._check_alive()
            if self.watch is not None and self.first_failed is None and not self.trap.first:
                stall = self.watch.check()
                if stall:
                    return self._stalled(stall)
            if self.trap.first:
                self.on_state("stopping")
                sig = signal.SIGINT if self.trap.first == signal.SIGINT else signal.SIGTERM
                return self._stop(sig, self.trap.reason(), 128 + self.trap.first)
            if r is not None:
                finished += 1
                if r.failed and self.first_failed is None:
                    self.first_failed = r
                    self._await_cause(r)
                    self.log.note(f"{r.plan.label} failed: {describe_end(r, self.log)}; stopping every node")
                    self._teardown()
                    cause = self._root_cause(r)
                    why = f"{cause.name} (rank {cause.plan.rank}) {describe_end(cause, self.log)}"
                    return Ending(exitcodes.NODE_FAILED, f"first failure: {why}", cause=cause)
                self.log.note(f"{r.plan.label} finished: {r.status()}", console=False)
            if deadline is not None and time.monotonic() > deadline:
                self.on_state("stopping")
                return self._stop(signal.SIGTERM, f"--timeout {self.timeout:g}s reached", exitcodes.TIMEOUT)
        return Ending(exitcodes.OK, "every node finished")

    def _stalled(self, stall: str) -> Ending:
        """The watchdog saw no progress: collect every rank's stack, name the odd ones, tear down."""
        self.on_state("stopping")
        self.log.note(f"{stall}; collecting the Python stack of every rank")
        started = [r for r in self.runs if r.started]
        found = self.watch.collect([(r.plan, lambda cmd, r=r: self.control.exec(r, cmd)) for r in started])
        self.log.note(found)
        suspect = next((r for r in self.runs if self.watch.suspect_host == r.name), None)
        self._teardown()
        return Ending(exitcodes.STALLED, f"{stall}; {found}", cause=suspect, stalled=True)

    def _check_alive(self) -> None:
        """A node whose SSH liveness check goes unanswered for SSH_SILENT_S is lost: its connection is
        dropped, its thread ends as "ssh connection lost" and the usual fail-fast path runs; teardown's
        grace counts from the first unanswered check, and nobody waits for that node again."""
        for r in self.runs:
            if why := r.check_alive(SSH_SILENT_S):
                self.log.note(f"{r.plan.label}: {why}; the node is lost", console=False)

    def _root_cause(self, first: NodeRun) -> NodeRun:
        """The node that failed first on its own; a node that only reports a lost peer is a victim."""
        assert first.ended is not None
        until = first.ended + ROOT_CAUSE_WINDOW_S
        window = [r for r in self.runs if r.failed and r.ended is not None and r.ended <= until]
        for r in sorted(window, key=lambda r: r.ended or 0.0):
            if r.lost or r.error:
                return r
            err = first_error(self.log.tail(r.name)) or ""
            if not PEER_FAILURE.search(err) and not OUR_SIGNAL.search(err):
                return r
        return first

    def _await_cause(self, r: NodeRun) -> None:
        """A first failure that only reports a lost peer: give the node that caused it up to
        ROOT_CAUSE_WINDOW_S to end by itself (with its own exit code and line) before the teardown's
        TERM reaches it."""
        if r.lost or r.error or not PEER_FAILURE.search(first_error(self.log.tail(r.name)) or ""):
            return
        deadline = time.monotonic() + ROOT_CAUSE_WINDOW_S
        others = [o for o in self.runs if o is not r and o.started]
        while time.monotonic() < deadline and not any(o.done.is_set() and o.failed for o in others):
            time.sleep(0.05)

    def _teardown(self) -> None:
        """After a failure: TERM every started node's process group, KILL what is left after the grace.

        A node already known lost (silent) is not contacted; the grace counts from its first unanswered
        liveness check, since the other nodes' workers have been stuck in a collective with it since then.
        """
        live = [r for r in self.runs if r.reached and not r.silent]
        pending = [r for r in live if not r.done.is_set()]
        for r in pending:
            r.signalled = "SIGTERM from ddp-launch"
        start = min([time.monotonic()] + [r.silent_since for r in self.runs if r.silent_since is not None])
        self.control.send_all(live, "TERM")
        deadline = start + self.failure_grace
        while any(not r.done.is_set() for r in pending) and time.monotonic() < deadline:
            if self.trap.count > 1:
                self.log.note("second signal: killing now")
                break
            time.sleep(0.1)
        stubborn = [r for r in live if not r.done.is_set()]
        if stubborn:
            self.log.note(
                f"still running {time.monotonic() - start:.0f}s after the failure: "
                f"{', '.join(r.name for r in stubborn)}; sending KILL"
            )
            for r in stubborn:
                r.signalled = "SIGKILL from ddp-launch"
        self.control.kill(live)

    def _stop_grace(self) -> tuple[float, str]:
        """Seconds a stop waits before KILL, and how that number came about."""
        if self.grace is not None:
            return self.grace, "--grace"
        save, step = self.times.longest_save, self.times.longest_step
        grace = min(float(STOP_GRACE_MAX_S), max(STOP_GRACE_MIN_S, 2 * (save + step) + 10))
        how = f"2 x (longest save {save:.2f}s + step {step:.2f}s) + 10s, at least {STOP_GRACE_MIN_S:g}s"
        return grace, how

    def _stop(self, sig: int, reason: str, code: int) -> Ending:
        """Ctrl-C, SIGTERM or --timeout: every rank finishes its step, rank 0 saves, every node exits.

        One signal goes to each node's torchrun agent only (the group leader), never to the workers as
        well: torchrun passes it on to its workers exactly once (ddp_train/agent.py), and a worker that
        got it twice would die mid-step (trainer.StopRequest: a second signal kills). The workers are
        not even in the group: torchrun starts each in its own session (torch 2.13,
        elastic/multiprocessing/subprocess_handler/subprocess_handler.py), hence the DDP_JOB_ID scan
        of node/signal.sh for failures.
        """
        name = signal.Signals(sig).name
        live = [r for r in self.runs if r.started and not r.done.is_set() and not r.silent]
        for r in live:
            r.signalled = f"{name} from ddp-launch"
        grace, how = self._stop_grace()
        self.log.note(
            f"{reason}: every node finishes its step and saves ({name} to torchrun); KILL after "
            f"{grace:.0f}s ({how}); press Ctrl-C again to kill now"
        )
        self.control.send_all(live, name[3:], scope="leader")
        seen, deadline = self.trap.count, time.monotonic() + grace
        while any(not r.done.is_set() for r in live):
            self._check_alive()
            if self.trap.count > seen:
                again = signal.Signals(self.trap.first or sig).name
                self.log.note(
                    f"{again} again during the grace period: sending KILL to every node now (a checkpoint "
                    "being written is lost; the previous one stays valid)"
                )
                break
            if time.monotonic() > deadline:
                stubborn = ", ".join(r.name for r in live if not r.done.is_set())
                self.log.note(f"still running {grace:.0f}s after {name} ({how}): {stubborn}; sending KILL")
                break
            time.sleep(0.1)
        for r in live:
            if not r.done.is_set():
                r.signalled = f"SIGKILL from ddp-launch after {name}"
        if any(not r.done.is_set() for r in live):
            self.control.kill(live)
        for r in live:
            self.log.note(f"{r.plan.label}: {stop_outcome(r, self.log, sig)}")
        return Ending(code, reason, stop_signal=sig)
