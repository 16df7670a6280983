"""`--fresh` (checkpoint.resume: never) refused before the job starts when a node already holds checkpoints.

The trainer refuses them as well (checkpoint.Checkpointer.newest), but only once the job runs, which then
fails (exit 1, FAILED); here the launch is bad input (exit 2): one line, and nothing is started.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from typing import Any

from ddp_train.launch.node import command, marked_json
from ddp_train.launch.node.checkpoints import MARK
from ddp_train.launch.plan.plan import JobPlan, NodePlan
from ddp_train.launch.remote.fanout import parallel
from ddp_train.launch.remote.remote import RemoteError, Session
from ddp_train.text import when


def checkpoint_dir(cfg: Any) -> str:
    """checkpoint.dir, else <run.dir>/<run.name>/checkpoints, as the trainer reads them on a node."""
    return str(cfg.checkpoint.dir or posixpath.join(cfg.run.dir, cfg.run.name, "checkpoints"))


def existing(plan: JobPlan, cfg: Any, session: Callable[[NodePlan], Session]) -> list[tuple[str, Any]]:
    """(host, what node/checkpoints.py found) for every node that answered; [] unless this launch is a
    --fresh run of the packaged trainer. A node that cannot be asked is left to the trainer's refusal."""
    if plan.script or cfg is None or cfg.checkpoint.resume != "never":
        return []
    directory = checkpoint_dir(cfg)

    def look(p: NodePlan) -> Any:
        try:
            _, out = session(p).exec(command(p.node.venv, "checkpoints", p.cwd or "", directory), timeout=60)
            return marked_json(out, MARK)
        except (RemoteError, ValueError):
            return None

    return [(p.node.name, f) for p, f in zip(plan.nodes, parallel(look, list(plan.nodes))) if f]


def refusal(found: Sequence[tuple[str, Any]], now: float | None = None) -> str | None:
    """The one line refusing a --fresh launch, naming the node and directory with the newest checkpoint;
    None when no node holds one."""
    held = [(h, f) for h, f in found if isinstance(f, dict) and f.get("count") and f.get("newest")]
    if not held:
        return None
    host, f = max(held, key=lambda hf: hf[1]["newest"][0])
    step, name, mtime = f["newest"]
    others = [h for h, _ in held if h != host]
    also = f" (checkpoints also on {', '.join(others)})" if others else ""
    return (
        f"--fresh (checkpoint.resume: never) but {host}:{f['dir']} already holds {f['count']} "
        f"checkpoint(s), the newest of step {step} ({name}, saved {when(mtime, now)}){also}; use another "
        f"run.name (or checkpoint.dir), delete {'those directories' if others else 'that directory'} to "
        "start over, or resume from it without --fresh; nothing was started"
    )
