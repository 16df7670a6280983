"""The preflight model: what preflight learned about each node (NodeCheck) and the whole report.

Its own module so that the checks in gpuhealth, netif and rdma can type what they judge."""

from __future__ import annotations

import dataclasses
from typing import Any

from ddp_train.launch.plan.plan import NodePlan
from ddp_train.launch.remote.remote import Session
from ddp_train.launch.run.logs import table


@dataclasses.dataclass
class NodeCheck:
    """What preflight learned about one node."""

    plan: NodePlan
    session: Session | None = None
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    unreached: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (peer, its failure)

    @property
    def name(self) -> str:
        return self.plan.node.name

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def fail_to_reach(self, peer: str, message: str) -> None:
        """A failure of this node's network probe to reach `peer`: the fault may be the peer's."""
        self.failures.append(message)
        self.unreached.append((peer, message))


@dataclasses.dataclass
class Report:
    """Preflight results; `sessions` are the open control connections, reused for teardown."""

    checks: list[NodeCheck]

    @property
    def ok(self) -> bool:
        return not any(c.failures for c in self.checks)

    def at_fault(self) -> dict[str, str]:
        """The nodes that failed for a cause of their own, each with its first failure (an unattended
        restart leaves them out: launch/run/nodeloss.py). A node that more than half of the others cannot
        reach is at fault, not they; a node that cannot reach a peer the others reach is at fault too."""
        others = len(self.checks) - 1
        counts: dict[str, int] = {}
        for c in self.checks:
            for peer in {p for p, _ in c.unreached}:
                counts[peer] = counts.get(peer, 0) + 1
        unreachable = {p for p, n in counts.items() if n * 2 > others}
        out: dict[str, str] = {}
        for c in self.checks:
            reach = {m for _, m in c.unreached}
            own = [m for m in c.failures if m not in reach]
            alone = [m for p, m in c.unreached if p not in unreachable]
            if own or alone:
                out[c.name] = (own or alone)[0]
            elif c.name in unreachable:
                out[c.name] = (
                    f"{counts[c.name]} of the other {others} node(s) cannot reach it on the training network"
                )
        return out

    def failure_lines(self) -> list[str]:
        return [f"{c.name}: {m}" for c in self.checks for m in c.failures]

    def warning_lines(self) -> list[str]:
        return [f"{c.name}: {m}" for c in self.checks for m in c.warnings]

    def sessions(self) -> dict[str, Session]:
        return {c.name: c.session for c in self.checks if c.session is not None}

    def render(self) -> str:
        """The doctor table, then one line per failure and warning."""
        rows = []
        for c in self.checks:
            f = c.facts
            status = "ok" if not c.failures else f"FAIL ({len(c.failures)})"
            rows.append(
                [
                    c.name,
                    c.plan.rank,
                    c.plan.node.where,
                    f.get("python"),
                    f.get("torch"),
                    f.get("cuda"),
                    f.get("nccl"),
                    f.get("gpus"),
                    f.get("ddp_train"),
                    f.get("iface"),
                    f.get("iface_addr"),
                    status,
                ]
            )
        head = [
            "HOST",
            "RANK",
            "CONNECT",
            "PYTHON",
            "TORCH",
            "CUDA",
            "NCCL",
            "GPUS",
            "DDP_TRAIN",
            "IFACE",
            "ADDRESS",
            "PREFLIGHT",
        ]
        lines = [table(head, rows)]
        lines += [f"FAIL {m}" for m in self.failure_lines()]
        lines += [f"warn {m}" for m in self.warning_lines()]
        return "\n".join(lines)
