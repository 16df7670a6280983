"""Run a planned job: start every node at once, stream logs, fail fast, tear down, verify, summarize.

One thread per node holds that node's run connection. The first node that exits non-zero (or whose SSH
connection drops), a signal to the launcher, or --timeout makes the launcher signal every node's
process group (TERM, then KILL after a grace period) through a second connection, then check that no
process carrying the job's DDP_JOB_ID is left on any node.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import shlex
import signal
import threading
import time
from typing import Any

from ddp_train.launch.errors import one_line
from ddp_train.launch.logs import JobLog, first_error, table
from ddp_train.launch.plan import PGID_MARKER, JobPlan, NodePlan, command
from ddp_train.launch.preflight import parallel
from ddp_train.launch.remote import LOST, RemoteError, Session, Stream, open_session

EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 124
# A node whose error only says a peer went away is a victim, not the cause.
PEER_FAILURE = re.compile(
    r"closed by peer|reset by peer|remote worker|Broken pipe|Connection refused|communicator was aborted|"
    r"Socket Timeout|timed out|TCPStore|rendezvous",
    re.IGNORECASE,
)
OUR_SIGNAL = re.compile(r"SignalException|got signal: 15")  # what torchrun says after our SIGTERM
ROOT_CAUSE_WINDOW_S = 2.0  # failures this close to the first one may be its cause reported a bit later

# Signals one node's processes: its process group, then any process of this job (DDP_JOB_ID in its
# environment) in this host's network namespace that left the group. SIG "-" only lists them.
SIGNAL_SCRIPT = r"""
sig=$1; pgid=$2; id=$3
if [ "$sig" != - ] && [ -n "$pgid" ]; then kill -s "$sig" -- "-$pgid" 2>/dev/null; fi
me=$(readlink /proc/self/ns/net)
for f in $(grep -lxzsF -- "DDP_JOB_ID=$id" /proc/[0-9]*/environ 2>/dev/null); do
  p=${f#/proc/}; p=${p%/environ}
  [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$me" ] || continue
  if [ "$sig" != - ]; then kill -s "$sig" "$p" 2>/dev/null; fi
  echo "JOBPROC $p $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-160)"
done
exit 0
"""


@dataclasses.dataclass
class NodeRun:
    """The live state of one node's part of the job."""

    plan: NodePlan
    session: Session | None = None
    stream: Stream | None = None
    pgid: int | None = None
    started: bool = False
    code: int | None = None
    lost: str | None = None
    error: str | None = None  # could not connect/start
    signalled: str | None = None  # the signal the launcher sent, if any
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
        grace: float = 10,
        timeout: float | None = None,
    ) -> None:
        self.plan = plan
        self.log = log
        self.control = dict(control or {})
        self.connect_timeout = connect_timeout
        self.grace = grace
        self.timeout = timeout
        self.runs = [NodeRun(p) for p in plan.nodes]
        self.events: queue.Queue[NodeRun] = queue.Queue()
        self.signal: int | None = None
        self.signal_count = 0
        self.reason = ""
        self.first: NodeRun | None = None
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
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        finished = 0
        while finished < len(self.runs):
            try:
                r = self.events.get(timeout=0.2)
            except queue.Empty:
                r = None
            if self.signal:
                self.reason = self._signal_reason()
                self.log.note(f"{self.reason}: stopping every node")
                self._teardown()
                return 128 + self.signal
            if r is not None:
                finished += 1
                if r.failed and self.first is None:
                    self.first = r
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
                self.reason = f"--timeout {self.timeout:g}s reached"
                self.log.note(f"{self.reason}: stopping every node")
                self._teardown()
                return EXIT_TIMEOUT
        self.reason = "every node finished"
        return EXIT_OK

    # ---- per node ---------------------------------------------------------------------------------

    def _connect(self, r: NodeRun) -> None:
        try:
            r.session = open_session(r.plan.node, self.connect_timeout)
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
            r.stream = r.session.start(cmd)
            r.started = True
            self.log.note(f"{r.plan.label}: started: {command(r.plan, masked=True)}", console=False)
            for line in r.stream.lines():
                if r.pgid is None and line.startswith(PGID_MARKER):
                    r.pgid = int(line.split()[1])
                    continue
                self.log.line(r.name, r.plan.label, line)
            r.code, r.lost = r.stream.wait(timeout=30)
        except (RemoteError, threading.BrokenBarrierError) as e:
            r.error = one_line(str(e)) or type(e).__name__
        except Exception as e:  # a bug here must still end the job cleanly, never hang it
            r.error = f"launcher error: {type(e).__name__}: {one_line(str(e))}"
        finally:
            r.ended = time.monotonic()
            r.done.set()
            self.events.put(r)

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

    def _describe_end(self, r: NodeRun) -> str:
        err = first_error(self.log.tail(r.name))
        what = r.error or r.lost or (f"exited {r.code}" if r.code is not None else "ended")
        return f"{what}: {err}" if err and not r.error else what

    # ---- teardown ---------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """TERM every started node's process group, wait `grace`, then KILL what is left."""
        live = [r for r in self.runs if r.started or r.session is not None]
        pending = [r for r in live if not r.done.is_set()]
        for r in pending:
            r.signalled = "SIGTERM from ddp-launch"
        parallel(lambda r: self._send(r, "TERM"), live)
        deadline = time.monotonic() + self.grace
        while any(not r.done.is_set() for r in pending) and time.monotonic() < deadline:
            if self.signal_count > 1:
                self.log.note("second signal: killing now")
                break
            time.sleep(0.1)
        stubborn = [r for r in live if not r.done.is_set()]
        if stubborn:
            self.log.note(
                f"still running after {self.grace:g}s: {', '.join(r.name for r in stubborn)}; sending KILL"
            )
            for r in stubborn:
                r.signalled = "SIGKILL from ddp-launch"
        parallel(lambda r: self._send(r, "KILL"), live)
        deadline = time.monotonic() + 5
        while any(not r.done.is_set() for r in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        for r in live:
            if not r.done.is_set() and r.stream is not None:
                r.stream.close()  # unblock its thread; the verification below reports what is left

    def _control(self, r: NodeRun) -> Session:
        """The node's second connection (not the one running the job), opened again if it dropped."""
        session = self.control.get(r.name)
        if session is None or not session.alive():
            session = self.control[r.name] = open_session(r.plan.node, self.connect_timeout)
        return session

    def _signal_cmd(self, sig: str, pgid: int | None) -> str:
        return shlex.join(["sh", "-c", SIGNAL_SCRIPT, "ddp-launch", sig, str(pgid or ""), self.plan.job_id])

    def _send(self, r: NodeRun, sig: str) -> list[str]:
        """Signal the node's job processes; returns what the node still listed."""
        try:
            _, out = self._control(r).exec(self._signal_cmd(sig, r.pgid), timeout=30)
        except RemoteError as e:
            self.log.note(f"{r.name}: cannot send {sig}: {e}")
            return [f"unknown: {e}"]
        return [ln[len("JOBPROC ") :] for ln in out.splitlines() if ln.startswith("JOBPROC ")]

    def _verify(self) -> dict[str, list[str]]:
        """Every node, after the end: is any process of this job left? Kill and report it."""
        targets = [r for r in self.runs if r.started or r.session is not None]

        def check(r: NodeRun) -> list[str]:
            left = self._send(r, "-")
            if left and not left[0].startswith("unknown"):
                self._send(r, "KILL")
                time.sleep(1)
                left = self._send(r, "-")
            return left

        results = parallel(check, targets)
        leftovers = {r.name: left for r, left in zip(targets, results) if left}
        if leftovers:
            for name, left in leftovers.items():
                self.log.note(f"{name}: processes of job {self.plan.job_id} remain: {'; '.join(left)}")
        else:
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
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[s] = signal.signal(s, handler)
        return previous

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    def _signal_reason(self) -> str:
        return f"received {signal.Signals(self.signal).name}" if self.signal else "interrupted"

    # ---- summary ----------------------------------------------------------------------------------

    def _summary(self, code: int, leftovers: dict[str, list[str]], elapsed: float) -> None:
        rows = []
        for r in self.runs:
            err = r.error or (first_error(self.log.tail(r.name)) if r.failed or r.signalled else None)
            rows.append([r.name, r.plan.rank, r.status(), one_line(err or "", 100)])
        self.log.block(table(["HOST", "RANK", "STATUS", "FIRST ERROR"], rows))
        verdict = "succeeded" if code == EXIT_OK and not leftovers else f"FAILED ({self.reason})"
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
