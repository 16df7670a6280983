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

    @property
    def name(self) -> str:
        return self.plan.node.name

    def fail(self, message: str) -> None:
        self.failures.append(message)


@dataclasses.dataclass
class Report:
    """Preflight results; `sessions` are the open control connections, reused for teardown."""

    checks: list[NodeCheck]

    @property
    def ok(self) -> bool:
        return not any(c.failures for c in self.checks)

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
