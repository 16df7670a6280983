"""One node's part of a job: connect, start its command, stream its lines, and how it ended."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable

from ddp_train.launch.errors import one_line
from ddp_train.launch.plan.plan import PGID_MARKER, NodePlan, command
from ddp_train.launch.remote.remote import LOST, RemoteError, Session, Stream, open_session


def parse_pgid(line: str) -> int | None:
    """The PGID of a `DDP-LAUNCH-PGID N` line, when N is a process group teardown may signal (> 1: a
    `kill -- -1` would signal every process of the user; 0 would be the caller's own group)."""
    parts = line.split()
    if len(parts) == 2 and parts[0] == PGID_MARKER and parts[1].isdigit() and int(parts[1]) > 1:
        return int(parts[1])
    return None


class NodeState(enum.Enum):
    PENDING = "pending"  # not connected yet
    CONNECTED = "connected"
    RUNNING = "running"  # its command started
    EXITED = "exited"  # with an exit status (`code`)
    LOST = "lost"  # its connection dropped or went silent: no exit status (`detail` says why)
    ERROR = "error"  # could not connect or start, or the launcher failed on it (`detail`)


@dataclasses.dataclass
class NodeRun:
    """The live state of one node's part of the job."""

    plan: NodePlan
    state: NodeState = NodeState.PENDING
    detail: str = ""  # why, for LOST and ERROR
    code: int | None = None  # the exit status, for EXITED
    session: Session | None = None  # the connection running the job (this run opens and closes it)
    stream: Stream | None = None
    pgid: int | None = None
    started: bool = False  # its command was started (whatever happened since)
    env_sent: bool = False  # the environment line went first on stdin: lifeline beats may follow
    signalled: str | None = None  # the signal the launcher sent, if any
    silent: str | None = None  # why the node counts as lost although its connection looked open
    silent_since: float | None = None  # monotonic time of its first unanswered SSH liveness check
    ended: float | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return self.plan.node.name

    @property
    def error(self) -> str | None:
        return self.detail if self.state is NodeState.ERROR else None

    @property
    def lost(self) -> str | None:
        return self.detail if self.state is NodeState.LOST else None

    @property
    def failed(self) -> bool:
        return self.state in (NodeState.ERROR, NodeState.LOST) or (
            self.state is NodeState.EXITED and self.code != 0
        )

    @property
    def reached(self) -> bool:
        """Connected or started: its processes may need a signal."""
        return self.started or self.session is not None

    def fail(self, why: str) -> None:
        self.state, self.detail = NodeState.ERROR, why

    def exited(self, code: int) -> None:
        self.state, self.code = NodeState.EXITED, code

    def status(self) -> str:
        if self.state is NodeState.ERROR:
            return "not started"
        if self.state is NodeState.LOST:
            return "ssh lost" if self.detail.startswith(LOST) else "no exit status"
        if self.state is not NodeState.EXITED or self.code is None:
            return "unknown (still running?)"
        base = (
            "ok"
            if self.code == 0
            else (f"killed by signal {-self.code}" if self.code < 0 else f"exit {self.code}")
        )
        return f"{base}, after {self.signalled}" if self.signalled and self.code != 0 else base

    # ---- mechanism (one thread per node) ----------------------------------------------------------

    def connect(self, timeout: float) -> None:
        try:
            self.session = open_session(self.plan.node, timeout)
            self.session.start_heartbeat()  # the SSH liveness check (remote.py)
            self.state = NodeState.CONNECTED
        except RemoteError as e:
            self.fail(str(e))
            self.done.set()

    def run(
        self,
        barrier: threading.Barrier,
        stopping: Callable[[], bool],
        env: Callable[[], bytes],
        on_start: Callable[[], None],
        on_line: Callable[[str], None],
    ) -> None:
        """Start the command when every node is ready (unless the job is `stopping` by then), send its
        environment on stdin, feed each output line to `on_line`, record how it ended."""
        try:
            barrier.wait()  # every node starts at the same moment
            assert self.session is not None
            if stopping():
                self.fail("not started: the job was already stopping")
                return
            self.stream = self.session.start(command(self.plan), stdin=True)
            self.started, self.state = True, NodeState.RUNNING
            # The environment never appears in a command line. Stdin then stays open: the lifeline
            # (launch/run/lifeline.py), whose EOF or silence makes the node stop itself.
            self.stream.send(env())
            self.env_sent = True  # not before: a lifeline beat ahead of it would be read as the environment
            on_start()
            for line in self.stream.lines():
                if self.pgid is None and line.startswith(PGID_MARKER):
                    self.pgid = parse_pgid(line)  # None for a bad one: teardown then finds the job by id
                    continue
                on_line(line)
            code, lost = self.stream.wait(timeout=30)
            if lost is not None:
                self.state, self.detail, self.code = NodeState.LOST, lost, code
            elif code is not None:
                self.exited(code)
        except (RemoteError, threading.BrokenBarrierError) as e:
            self.fail(one_line(str(e)) or type(e).__name__)
        except Exception as e:  # a bug here must still end the job cleanly, never hang it
            self.fail(f"launcher error: {type(e).__name__}: {one_line(str(e))}")
        finally:
            if self.silent:
                self.state, self.detail, self.code = NodeState.LOST, f"{LOST}: {self.silent}", None
            self.ended = time.monotonic()
            self.done.set()

    def check_alive(self, silent_s: float) -> str | None:
        """SSH liveness: once the connection answered nothing for `silent_s`, the node is lost: its
        connection is dropped (its thread then ends as LOST) and the reason returned."""
        if not self.started or self.done.is_set() or self.silent or self.session is None:
            return None
        quiet = self.session.silent_for()
        if quiet <= silent_s:
            return None
        self.silent = f"no reply to SSH heartbeats for {quiet:.0f}s"
        self.silent_since = time.monotonic() - quiet
        self.session.close()
        return self.silent
