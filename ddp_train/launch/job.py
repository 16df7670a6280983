"""Run a planned job: start every node at once, stream logs, fail fast, tear down, verify, summarize.

One thread per node holds that node's run connection (and answers its SSH heartbeats). Through a second
connection the launcher then either
- stops the job (Ctrl-C, SIGTERM, --timeout): one signal to each node's torchrun agent only, which
  passes it once to its workers; every rank finishes its step, rank 0 saves, every node exits
  128 + signal. KILL only after a grace period sized from the measured save time, or at a second
  Ctrl-C; or
- tears it down (a node failed, exited, or went silent): TERM to every node's whole process group,
  KILL after a short grace, counted from the first unanswered heartbeat of a silent node;
and finally checks that no process carrying the job's DDP_JOB_ID is left on any node it can reach.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import shlex
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddp_train.launch.errors import one_line
from ddp_train.launch.fanout import parallel
from ddp_train.launch.lifeline import Heartbeat, node_env_line
from ddp_train.launch.logs import JobLog, first_error, table
from ddp_train.launch.plan import (
    PGID_MARKER,
    STOP_GRACE_MAX_S,
    JobPlan,
    NodePlan,
    command,
    env_line,
    shown_env,
)
from ddp_train.launch.progress import live_line, parse_step, parse_throughput
from ddp_train.launch.remote import LOST, RemoteError, Session, Stream, open_session

EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 124
# A node whose error only says a peer went away is a victim, not the cause.
PEER_FAILURE = re.compile(
    r"closed by peer|reset by peer|remote worker|Broken pipe|Connection refused|communicator was aborted|"
    r"Socket Timeout|timed out|TCPStore|rendezvous|ddp-train: stopped: ",
    re.IGNORECASE,
)
OUR_SIGNAL = re.compile(r"SignalException|got signal: 15")  # what torchrun says after our SIGTERM
ROOT_CAUSE_WINDOW_S = 2.0  # failures this close to the first one may be its cause reported a bit later
FAILURE_GRACE_S = 10.0  # teardown after a failure: TERM -> KILL (peers stuck in a collective never save)
STOP_GRACE_MIN_S = 30.0  # a stop waits at least torchrun's default shutdown timeout (30 s) before KILL
HEARTBEAT_LOST_S = 10.0  # an SSH heartbeat unanswered this long: the node is lost (silent partition)
# What the trainer prints (trainer.py): save and step times size a stop's grace; the stop line per rank.
SAVE_TIME = re.compile(r" INFO saved .+\.pt in (\d+(?:\.\d+)?)s")
STEP_TIME = re.compile(r" INFO step \d+/\d+ .* (\d+(?:\.\d+)?) s/step")
STOPPED = re.compile(r"ddp-train: stopped rank=(\d+) world=\d+ step=(\d+) signal=(\w+)")

# Signals one node's processes: scope "all": its process group, then any process of this job
# (DDP_JOB_ID in its environment) in this host's network namespace that left the group; scope "leader":
# only the group leader (the agent running torchrun, which passes the signal on to its workers once).
# SIG "-" only lists them. Only this user's processes (another user's may carry the same variable), and
# the group only when PGID > 1 is a session leader of this user whose environment has the job's id,
# as `setsid` made the agent: a PGID line printed by anything else (a .bashrc) never reaches kill.
SIGNAL_SCRIPT = r"""
sig=$1; pgid=$2; id=$3; scope=$4; uid=$(id -u)
mine() { [ "$(sed -n 's/^Uid:[[:space:]]*\([0-9]*\).*/\1/p' "/proc/$1/status" 2>/dev/null)" = "$uid" ]; }
leader() {
  case "$1" in ''|*[!0-9]*) return 1 ;; esac
  [ "$1" -gt 1 ] && mine "$1" && grep -qxzsF -- "DDP_JOB_ID=$id" "/proc/$1/environ" || return 1
  set -- "$1" $(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null)  # pid, then state ppid pgrp session ...
  [ "$4" = "$1" ] && [ "$5" = "$1" ]
}
if [ "$sig" != - ] && leader "$pgid"; then
  if [ "$scope" = leader ]; then kill -s "$sig" "$pgid" 2>/dev/null
  else kill -s "$sig" -- "-$pgid" 2>/dev/null; fi
fi
me=$(readlink /proc/self/ns/net)
for f in $(grep -lxzsF -- "DDP_JOB_ID=$id" /proc/[0-9]*/environ 2>/dev/null); do
  p=${f#/proc/}; p=${p%/environ}
  [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$me" ] || continue
  mine "$p" || continue
  if [ "$sig" != - ] && [ "$scope" != leader ]; then kill -s "$sig" "$p" 2>/dev/null; fi
  echo "JOBPROC $p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-160)"
done
exit 0
"""


def parse_pgid(line: str) -> int | None:
    """The PGID of a `DDP-LAUNCH-PGID N` line, when N is a process group teardown may signal (> 1: a
    `kill -- -1` would signal every process of the user; 0 would be the caller's own group)."""
    parts = line.split()
    if len(parts) == 2 and parts[0] == PGID_MARKER and parts[1].isdigit() and int(parts[1]) > 1:
        return int(parts[1])
    return None


@dataclasses.dataclass
class NodeRun:
    """The live state of one node's part of the job."""

    plan: NodePlan
    session: Session | None = None
    stream: Stream | None = None
    pgid: int | None = None
    started: bool = False
    env_sent: bool = False  # the environment line went first on stdin: heartbeats may follow
    code: int | None = None
    lost: str | None = None
    error: str | None = None  # could not connect/start
    signalled: str | None = None  # the signal the launcher sent, if any
    silent: str | None = None  # why the node counts as lost although its connection looked open
    silent_since: float | None = None  # monotonic time of its first unanswered heartbeat
    ended: float | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return self.plan.node.name

    @property
    def failed(self) -> bool:
        return self.error is not None or self.lost is not None or (self.code is not None and self.code != 0)

    def status(self) -> str:
        if self.error:
            return "not started"
        if self.lost:
            return "ssh lost" if self.lost.startswith(LOST) else "no exit status"
        if self.code is None:
            return "unknown (still running?)"
        base = (
            "ok"
            if self.code == 0
            else (f"killed by signal {-self.code}" if self.code < 0 else f"exit {self.code}")
        )
        return f"{base}, after {self.signalled}" if self.signalled and self.code != 0 else base


class Job:
    """One launch of a plan."""

    def __init__(
        self,
        plan: JobPlan,
        log: JobLog,
        control: dict[str, Session] | None = None,
        connect_timeout: float = 10,
        grace: float | None = None,
        timeout: float | None = None,
        on_state: Callable[[str], None] | None = None,
        trap: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
        watch: Any = None,
    ) -> None:
        self.plan = plan
        self.on_state = on_state or (lambda _state: None)  # job.json (launch/jobstate.py)
        self.trap = tuple(trap)  # a detached monitor leaves SIGHUP ignored
        self.watch = watch  # the stall watchdog (launch/watchdog.py), fed every line
        self.log = log
        self.control = dict(control or {})
        self.connect_timeout = connect_timeout
        self.grace = grace  # --grace; None: a stop's grace is derived from the measured save time
        self.failure_grace = FAILURE_GRACE_S if grace is None else min(grace, FAILURE_GRACE_S)
        self.timeout = timeout
        self.longest_save = 0.0  # seconds, from the trainer's "saved ... in N s" lines
        self.longest_step = 0.0
        self.stop_signal: int | None = None  # what a stop sent to the nodes
        self.runs = [NodeRun(p) for p in plan.nodes]
        self.events: queue.Queue[NodeRun] = queue.Queue()
        self.signal: int | None = None
        self.signal_count = 0
        self.reason = ""
        self.first: NodeRun | None = None
        self.stalled = False  # the stall watchdog stopped the job
        self.launched = False

    # ---- entry point ------------------------------------------------------------------------------

    def run(self) -> int:
        """Launch, wait, tear down on failure/signal, verify nothing is left; return the exit code."""
        t0 = time.monotonic()
        previous = (
            self._trap_signals()
        )  # kept through teardown and verification: Ctrl-C never cuts them short
        try:
            code = self._run()
            leftovers = self._verify() if self.launched else {}
            self._summary(code, leftovers, time.monotonic() - t0)
        finally:
            self._restore_signals(previous)
            for s in list(self.control.values()) + [r.session for r in self.runs if r.session]:
                s.close()
        return EXIT_FAILED if leftovers and code == EXIT_OK else code

    def _run(self) -> int:
        self.log.note(
            f"job {self.plan.job_id}: {len(self.runs)} nodes, master {self.plan.master.node.name} "
            f"{self.plan.master_addr}:{self.plan.master_port}, logs in {self.log.dir}"
        )
        parallel(self._connect, self.runs)
        broken = [r for r in self.runs if r.error]
        if broken or self.signal:
            for r in broken:
                self.log.note(f"{r.name}: {r.error}")
            self.reason = (
                "could not connect to every node; nothing was started" if broken else self._signal_reason()
            )
            return EXIT_FAILED if broken else 128 + (self.signal or 0)
        barrier = threading.Barrier(len(self.runs))
        threads = [
            threading.Thread(target=self._node_thread, args=(r, barrier), name=f"node-{r.name}", daemon=True)
            for r in self.runs
        ]
        for t in threads:
            t.start()
        self.launched = True
        heartbeat = Heartbeat(
            lambda: [r.stream.send for r in self.runs if r.env_sent and r.stream and not r.done.is_set()]
        )
        heartbeat.start()
        self.on_state("running")
        try:
            return self._supervise()
        finally:
            heartbeat.stop()

    def _supervise(self) -> int:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        finished = 0
        while finished < len(self.runs):
            try:
                r = self.events.get(timeout=0.2)
            except queue.Empty:
                r = None
            self._check_heartbeats()
            if self.watch is not None and self.first is None and not self.signal:
                stall = self.watch.check()
                if stall:
                    return self._stalled(stall)
            if self.signal:
                self.on_state("stopping")
                self.reason = self._signal_reason()
                self._stop(signal.SIGINT if self.signal == signal.SIGINT else signal.SIGTERM)
                return 128 + self.signal
            if r is not None:
                finished += 1
                if r.failed and self.first is None:
                    self.first = r
                    self._await_cause(r)
                    self.log.note(f"{r.plan.label} failed: {self._describe_end(r)}; stopping every node")
                    self._teardown()
                    cause = self._root_cause()
                    self.first = cause
                    self.reason = (
                        f"first failure: {cause.name} (rank {cause.plan.rank}) {self._describe_end(cause)}"
                    )
                    return EXIT_FAILED
                self.log.note(f"{r.plan.label} finished: {r.status()}", console=False)
            if deadline is not None and time.monotonic() > deadline:
                self.on_state("stopping")
                self.reason = f"--timeout {self.timeout:g}s reached"
                self._stop(signal.SIGTERM)
                return EXIT_TIMEOUT
        self.reason = "every node finished"
        return EXIT_OK

    def _stalled(self, stall: str) -> int:
        """The watchdog saw no progress: collect every rank's stack, name the odd ones, tear down."""
        self.on_state("stopping")
        self.log.note(f"{stall}; collecting the Python stack of every rank")
        started = [r for r in self.runs if r.started]
        found = self.watch.collect(
            [(r.plan, lambda cmd, r=r: self._control(r).exec(cmd, timeout=60)) for r in started]
        )
        self.log.note(found)
        self.reason = f"{stall}; {found}"
        self.stalled = True
        self.first = next((r for r in self.runs if self.watch.suspect_host == r.name), None)
        self._teardown()
        return self.watch.EXIT_CODE

    # ---- per node ---------------------------------------------------------------------------------

    def _connect(self, r: NodeRun) -> None:
        try:
            r.session = open_session(r.plan.node, self.connect_timeout)
            r.session.start_heartbeat()
        except RemoteError as e:
            r.error = str(e)
            r.done.set()

    def _node_thread(self, r: NodeRun, barrier: threading.Barrier) -> None:
        cmd = command(r.plan)
        try:
            barrier.wait()  # every node starts at the same moment
            assert r.session is not None
            if self.signal or self.first is not None:
                r.error = "not started: the job was already stopping"
                return
            r.stream = r.session.start(cmd, stdin=True)
            r.started = True
            # The environment never appears in a command line. Stdin then stays open: the lifeline
            # (launch/lifeline.py), whose EOF or silence makes the node stop itself.
            r.stream.send(node_env_line(env_line(r.plan), self.plan.job_id))
            r.env_sent = True  # not before: a heartbeat ahead of it would be read as the environment
            self.log.note(
                f"{r.plan.label}: started: {command(r.plan, masked=True)} (environment on stdin: "
                f"{shown_env(r.plan)})",
                console=False,
            )
            for line in r.stream.lines():
                if r.pgid is None and line.startswith(PGID_MARKER):
                    r.pgid = parse_pgid(line)  # None for a bad one: teardown then finds the job by id
                    continue
                self._measure(line)
                if self.watch is not None:
                    self.watch.feed(r.plan, line)
                self.log.line(r.name, r.plan.label, line)
                step = parse_step(line)
                if step is not None:
                    self.log.set_live(live_line(step))  # on a TTY: one line under the scrolling ones
            r.code, r.lost = r.stream.wait(timeout=30)
        except (RemoteError, threading.BrokenBarrierError) as e:
            r.error = one_line(str(e)) or type(e).__name__
        except Exception as e:  # a bug here must still end the job cleanly, never hang it
            r.error = f"launcher error: {type(e).__name__}: {one_line(str(e))}"
        finally:
            if r.silent:
                r.code, r.lost, r.error = None, f"{LOST}: {r.silent}", None
            r.ended = time.monotonic()
            r.done.set()
            self.events.put(r)

    def _measure(self, line: str) -> None:
        """Keep the longest checkpoint save and step the trainer reported (they size a stop's grace)."""
        for pattern, attr in ((SAVE_TIME, "longest_save"), (STEP_TIME, "longest_step")):
            m = pattern.search(line)
            if m:
                setattr(self, attr, max(getattr(self, attr), float(m.group(1))))

    def _check_heartbeats(self) -> None:
        """A node whose SSH heartbeat goes unanswered for HEARTBEAT_LOST_S is lost: drop its connection.

        Its thread then ends as "ssh connection lost" and the usual fail-fast path runs; teardown's grace
        counts from the first unanswered heartbeat, and nobody waits for that node again.
        """
        for r in self.runs:
            if not r.started or r.done.is_set() or r.silent or r.session is None:
                continue
            quiet = r.session.silent_for()
            if quiet > HEARTBEAT_LOST_S:
                r.silent = f"no reply to SSH heartbeats for {quiet:.0f}s"
                r.silent_since = time.monotonic() - quiet
                self.log.note(f"{r.plan.label}: {r.silent}; the node is lost", console=False)
                r.session.close()

    def _root_cause(self) -> NodeRun:
        """The node that failed first on its own; a node that only reports a lost peer is a victim."""
        first = self.first
        assert first is not None and first.ended is not None
        window = [
            r
            for r in self.runs
            if r.failed and r.ended is not None and r.ended <= first.ended + ROOT_CAUSE_WINDOW_S
        ]
        window.sort(key=lambda r: r.ended or 0.0)
        for r in window:
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

    def _describe_end(self, r: NodeRun) -> str:
        err = first_error(self.log.tail(r.name))
        what = r.error or r.lost or (f"exited {r.code}" if r.code is not None else "ended")
        return f"{what}: {err}" if err and not r.error else what

    # ---- teardown ---------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """After a failure: TERM every started node's process group, KILL what is left after the grace.

        A node already known lost (silent) is not contacted; the grace counts from its first unanswered
        heartbeat, since the other nodes' workers have been stuck in a collective with it since then.
        """
        live = [r for r in self.runs if (r.started or r.session is not None) and not r.silent]
        pending = [r for r in live if not r.done.is_set()]
        for r in pending:
            r.signalled = "SIGTERM from ddp-launch"
        start = min([time.monotonic()] + [r.silent_since for r in self.runs if r.silent_since is not None])
        parallel(lambda r: self._send(r, "TERM"), live)
        deadline = start + self.failure_grace
        while any(not r.done.is_set() for r in pending) and time.monotonic() < deadline:
            if self.signal_count > 1:
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
        self._kill(live)

    def _kill(self, live: list[NodeRun]) -> None:
        """KILL every process of the job on these nodes; unblock the threads of nodes that do not end."""
        parallel(lambda r: self._send(r, "KILL"), live)
        deadline = time.monotonic() + 5
        while any(not r.done.is_set() for r in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        for r in live:
            if not r.done.is_set() and r.stream is not None:
                r.stream.close()  # unblock its thread; the verification below reports what is left

    def _stop_grace(self) -> tuple[float, str]:
        """Seconds a stop waits before KILL, and how that number came about."""
        if self.grace is not None:
            return self.grace, "--grace"
        measured = 2 * (self.longest_save + self.longest_step) + 10
        grace = min(float(STOP_GRACE_MAX_S), max(STOP_GRACE_MIN_S, measured))
        return grace, (
            f"2 x (longest save {self.longest_save:.2f}s + step {self.longest_step:.2f}s) + 10s, "
            f"at least {STOP_GRACE_MIN_S:g}s"
        )

    def _stop(self, sig: int) -> None:
        """Ctrl-C, SIGTERM or --timeout: every rank finishes its step, rank 0 saves, every node exits.

        One signal goes to each node's torchrun agent only (the group leader), never to the workers as
        well: torchrun passes it on to its workers exactly once (ddp_train/agent.py), and a worker that
        got it twice would die mid-step (trainer.StopRequest: a second signal kills). The workers are
        not even in the group: torchrun starts each in its own session (torch 2.13,
        elastic/multiprocessing/subprocess_handler/subprocess_handler.py), hence the DDP_JOB_ID scan
        of SIGNAL_SCRIPT for failures.
        """
        self.stop_signal = sig
        name = signal.Signals(sig).name
        live = [r for r in self.runs if r.started and not r.done.is_set() and not r.silent]
        for r in live:
            r.signalled = f"{name} from ddp-launch"
        grace, how = self._stop_grace()
        self.log.note(
            f"{self.reason}: every node finishes its step and saves ({name} to torchrun); KILL after "
            f"{grace:.0f}s ({how}); press Ctrl-C again to kill now"
        )
        parallel(lambda r: self._send(r, name[3:], scope="leader"), live)
        seen = self.signal_count
        deadline = time.monotonic() + grace
        while any(not r.done.is_set() for r in live):
            self._check_heartbeats()
            if self.signal_count > seen:
                again = signal.Signals(self.signal or sig).name
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
            self._kill(live)
        for r in live:
            self.log.note(f"{r.plan.label}: {self._stop_outcome(r)}")

    def _stop_outcome(self, r: NodeRun) -> str:
        """One line: how a node ended after a stop (its ranks' stop lines say which step they saved)."""
        stopped = [m.groups() for m in map(STOPPED.search, self.log.tail(r.name)) if m]
        steps = sorted({int(step) for _, step, _ in stopped})
        ranks = ",".join(rank for rank, _, _ in sorted(stopped, key=lambda g: int(g[0])))
        if r.code == 128 + (self.stop_signal or 0) and steps:
            saved = ", checkpoint saved" if any(rank == "0" for rank, _, _ in stopped) else ""
            return f"exit {r.code}: rank {ranks} stopped after step {steps[-1]}{saved}"
        if r.code == 0:
            return "exit 0: had already finished"
        return f"{r.status()}: no clean stop"

    def _control(self, r: NodeRun) -> Session:
        """The node's second connection (not the one running the job), opened again if it dropped."""
        session = self.control.get(r.name)
        if session is None or not session.alive():
            session = self.control[r.name] = open_session(r.plan.node, self.connect_timeout)
        return session

    def _signal_cmd(self, sig: str, pgid: int | None, scope: str = "all") -> str:
        return shlex.join(
            ["sh", "-c", SIGNAL_SCRIPT, "ddp-launch", sig, str(pgid or ""), self.plan.job_id, scope]
        )

    def _send(self, r: NodeRun, sig: str, scope: str = "all") -> list[str]:
        """Signal the node's job processes (scope "leader": torchrun's agent only); what it still lists."""
        try:
            _, out = self._control(r).exec(self._signal_cmd(sig, r.pgid, scope), timeout=30)
        except RemoteError as e:
            self.log.note(f"{r.name}: cannot send {sig}: {e}")
            return [f"unknown: {e}"]
        return [ln[len("JOBPROC ") :] for ln in out.splitlines() if ln.startswith("JOBPROC ")]

    def _verify(self) -> dict[str, list[str]]:
        """Every node, after the end: is any process of this job left? Kill and report it."""
        targets = [r for r in self.runs if (r.started or r.session is not None) and not r.silent]

        def check(r: NodeRun) -> list[str]:
            left = self._send(r, "-")
            if left and not left[0].startswith("unknown"):
                self._send(r, "KILL")
                time.sleep(1)
                left = self._send(r, "-")
            return left

        results = parallel(check, targets)
        leftovers = {r.name: left for r, left in zip(targets, results) if left}
        for r in self.runs:
            if r.silent:  # trying would only wait for a connect timeout
                leftovers[r.name] = [f"unknown: not checked, the node is unreachable ({r.silent})"]
        if leftovers:
            for name, left in leftovers.items():
                self.log.note(f"{name}: processes of job {self.plan.job_id} remain: {'; '.join(left)}")
        if not leftovers:
            self.log.note(f"checked {len(targets)} nodes: no process of job {self.plan.job_id} remains")
        return leftovers

    # ---- signals ----------------------------------------------------------------------------------

    def _trap_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum: int, _frame: Any) -> None:
            # Only set flags here: the main loop polls them (no locks taken in a signal handler).
            self.signal = self.signal or signum
            self.signal_count += 1

        previous = {}
        for s in self.trap:
            previous[s] = signal.signal(s, handler)
        return previous

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    def _signal_reason(self) -> str:
        return f"received {signal.Signals(self.signal).name}" if self.signal else "interrupted"

    # ---- summary ----------------------------------------------------------------------------------

    def _stopped_cleanly(self) -> list[NodeRun]:
        """After a stop: the nodes that had finished (0), or exited 128 + signal after their ranks said
        they stopped (which they print only once the checkpoint is saved)."""
        if not self.stop_signal:
            return []
        sig = 128 + self.stop_signal
        return [
            r
            for r in self.runs
            if r.code == 0 or (r.code == sig and any(map(STOPPED.search, self.log.tail(r.name))))
        ]

    def stopped_cleanly(self) -> bool:
        """After a stop: every node ended as asked (its ranks saved), so the job can resume."""
        return bool(self.stop_signal) and len(self._stopped_cleanly()) == len(self.runs)

    def _consequence(self, r: NodeRun, err: str | None) -> str | None:
        """FIRST ERROR of a node that failed only because the job was stopped (stall watchdog) or
        another node failed first: that reason, not the lost connection it saw."""
        root = self.first
        if self.stalled:
            if r is root:
                return err or "stalled: no progress (the watchdog's stacks name it)"
            # whatever it printed once the watchdog stopped the job (torchrun's SignalException, a peer gone)
            return "stopped by the stall watchdog" if err or r.failed or r.signalled else None
        if root is None or r is root or r.error or r.lost or not r.failed:
            return err
        if r.signalled or (err and (PEER_FAILURE.search(err) or OUR_SIGNAL.search(err))):
            return f"stopped: node {root.plan.rank} failed ({root.name})"
        return err

    def _summary(self, code: int, leftovers: dict[str, list[str]], elapsed: float) -> None:
        rows = []
        clean = self._stopped_cleanly()
        for r in self.runs:
            err = r.error or (first_error(self.log.tail(r.name)) if r.failed or r.signalled else None)
            # a node that stopped as asked has no error to show
            err = None if r in clean else self._consequence(r, err)
            rows.append([r.name, r.plan.rank, r.status(), one_line(err or "", 100)])
        self.log.block(table(["HOST", "RANK", "STATUS", "FIRST ERROR"], rows))
        for r in self.runs:
            hidden = self.log.hidden.get(r.name, 0)
            if hidden and r.failed:
                self.log.note(
                    f"{r.name}: {hidden} traceback line(s) kept off the console: "
                    f"ddp-launch logs {self.plan.job_id} --node {r.name}"
                )
        if code == EXIT_OK and not leftovers:
            verdict = "succeeded"
        elif self.stop_signal and len(clean) == len(self.runs) and not leftovers:
            steps = {m.group(2) for r in self.runs for m in map(STOPPED.search, self.log.tail(r.name)) if m}
            step = f" after step {', '.join(sorted(steps))}" if steps else ""
            verdict = f"stopped ({self.reason}){step}, checkpoint saved; the same command resumes from it"
        else:
            verdict = f"FAILED ({self.reason})"
        speed = next((t for r in self.runs if (t := parse_throughput(self.log.tail(r.name)))), None)
        if speed:  # issue 31: the wall-clock figure beside the compute-only one, so paused time shows
            self.log.note(
                f"throughput: {speed['wall_tokens_per_s']:.0f} tok/s wall-clock, "
                f"{speed['tokens_per_s']:.0f} tok/s compute-only ({speed['steps']:.0f} steps, rank 0)"
            )
        self.log.note(f"job {self.plan.job_id} {verdict} in {elapsed:.1f}s; logs: {self.log.dir}")
        self.log.write_json(
            "summary.json",
            {
                "job_id": self.plan.job_id,
                "exit_code": code,
                "reason": self.reason,
                "elapsed_s": round(elapsed, 3),
                "master": {
                    "host": self.plan.master.node.name,
                    "addr": self.plan.master_addr,
                    "port": self.plan.master_port,
                },
                "first_failure": self.first.name if self.first else None,
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
                    for r, row in zip(self.runs, rows)
                ],
            },
        )
