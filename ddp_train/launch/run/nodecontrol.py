"""Remote control of a running job: the signal script, send/kill, the leftover-process scan.

Every command goes through the node's control connection (launch/remote/sessionpool.py), never the one that
runs the job. The shell snippets run on the nodes are files of this package (launch/node/*.sh), passed
to `sh -c` with their arguments.
"""

from __future__ import annotations

import importlib.resources
import shlex
import time
from collections.abc import Callable, Sequence

from ddp_train.launch.remote.fanout import parallel
from ddp_train.launch.remote.remote import RemoteError
from ddp_train.launch.remote.sessionpool import SessionPool
from ddp_train.launch.run.noderun import NodeRun


def node_script(name: str) -> str:
    """A shell snippet of launch/node/ (signal.sh, stack.sh), as text."""
    return (importlib.resources.files("ddp_train.launch") / "node" / name).read_text(encoding="utf-8")


SIGNAL_SCRIPT = node_script("signal.sh")
STACK_SCRIPT = node_script("stack.sh")


def signal_command(sig: str, pgid: int | None, job_id: str, scope: str = "all") -> str:
    return shlex.join(["sh", "-c", SIGNAL_SCRIPT, "ddp-launch", sig, str(pgid or ""), job_id, scope])


def stack_command(job_id: str, node_rank: int) -> str:
    return shlex.join(["sh", "-c", STACK_SCRIPT, "ddp-stacks", job_id, str(node_rank)])


class NodeControl:
    """Signals and scans one job's processes on its nodes."""

    def __init__(self, job_id: str, pool: SessionPool, note: Callable[[str], None]) -> None:
        self.job_id = job_id
        self.pool = pool
        self.note = note

    def exec(self, r: NodeRun, cmd: str, timeout: float = 60) -> tuple[int, str]:
        return self.pool.get(r.plan.node).exec(cmd, timeout=timeout)

    def send(self, r: NodeRun, sig: str, scope: str = "all") -> list[str]:
        """Signal the node's job processes (scope "leader": torchrun's agent only); what it still lists."""
        try:
            _, out = self.exec(r, signal_command(sig, r.pgid, self.job_id, scope), timeout=30)
        except RemoteError as e:
            self.note(f"{r.name}: cannot send {sig}: {e}")
            return [f"unknown: {e}"]
        return [ln[len("JOBPROC ") :] for ln in out.splitlines() if ln.startswith("JOBPROC ")]

    def send_all(self, runs: Sequence[NodeRun], sig: str, scope: str = "all") -> None:
        parallel(lambda r: self.send(r, sig, scope), list(runs))

    def kill(self, live: Sequence[NodeRun]) -> None:
        """KILL every process of the job on these nodes; unblock the threads of nodes that do not end."""
        self.send_all(live, "KILL")
        deadline = time.monotonic() + 5
        while any(not r.done.is_set() for r in live) and time.monotonic() < deadline:
            time.sleep(0.1)
        for r in live:
            if not r.done.is_set() and r.stream is not None:
                r.stream.close()  # unblock its thread; the verification reports what is left

    def leftovers(self, runs: Sequence[NodeRun]) -> dict[str, list[str]]:
        """Every node, after the end: is any process of this job left? Kill and report it."""
        targets = [r for r in runs if r.reached and not r.silent]

        def check(r: NodeRun) -> list[str]:
            left = self.send(r, "-")
            if left and not left[0].startswith("unknown"):
                self.send(r, "KILL")
                time.sleep(1)
                left = self.send(r, "-")
            return left

        results = parallel(check, targets)
        found = {r.name: left for r, left in zip(targets, results) if left}
        for r in runs:
            if r.silent:  # trying would only wait for a connect timeout
                found[r.name] = [f"unknown: not checked, the node is unreachable ({r.silent})"]
        for name, left in found.items():
            self.note(f"{name}: processes of job {self.job_id} remain: {'; '.join(left)}")
        if not found:
            self.note(f"checked {len(targets)} nodes: no process of job {self.job_id} remains")
        return found
