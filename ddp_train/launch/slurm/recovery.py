"""The job's recovery inside Slurm: its attempts across allocations (a requeue starts the batch script
again, on the same shared workdir) and the rule whether one more attempt is allowed after a node loss."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ATTEMPTS_FILE = "attempts.json"  # beside driver.log: what the job's allocations had, across requeues


class Attempts:
    """The job's attempts across its allocations: the step attempts so far, the lost nodes (never used
    again, counted against ddp_max_node_losses), the time-limit requeues the driver made (--max-requeues
    counts only those), and the batch host of a driver that has not ended: one that never does was lost
    with its host."""

    def __init__(self, path: Path, restarts: int) -> None:
        self.path = path
        data: dict[str, Any] = {}
        if restarts:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
        self.attempt = int(data.get("attempt") or 0)
        self.lost: list[dict[str, str]] = list(data.get("lost") or [])
        self.usr1 = int(data.get("usr1") or 0)
        self.started: str | None = data.get("started")

    def start(self, batch_host: str) -> None:
        self.started = batch_host
        self._save()

    def next(self) -> int:
        self.attempt += 1
        self._save()
        return self.attempt

    def lose(self, host: str, why: str) -> None:
        self.lost.append({"host": host, "why": why})
        self._save()

    def end(self, usr1: bool = False) -> None:
        self.started, self.usr1 = None, self.usr1 + int(usr1)
        self._save()

    @property
    def lost_hosts(self) -> list[str]:
        return [x["host"] for x in self.lost]

    def _save(self) -> None:
        data = {"attempt": self.attempt, "lost": self.lost, "usr1": self.usr1, "started": self.started}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)


def limit_reached(losses: int, remaining: int, policy: Mapping[str, Any]) -> str:
    """Why a restart after `losses` lost nodes, with `remaining` left, is not allowed ('' if it is): the
    rule of launch/run/nodeloss.py, inside one Slurm allocation."""
    if losses > int(policy.get("max_losses", 0)):
        return f"{losses} node(s) lost, more than ddp_max_node_losses {policy.get('max_losses')}"
    if remaining < int(policy.get("min_nodes", 1)):
        return f"{remaining} node(s) would remain, fewer than ddp_min_nodes {policy.get('min_nodes')}"
    return ""
