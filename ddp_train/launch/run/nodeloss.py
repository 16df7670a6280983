"""Whether a lost node restarts the job on the others (`ddp_on_node_loss: restart`), decided from how an
attempt ended. Pure: the pipeline (launch/pipeline.py) asks, logs the lines and relaunches.

A node is lost when it alone ended the attempt: its SSH connection was lost (crash, power, partition:
SSH heartbeats, launch/run/job.py), its agent exited non-zero on its own, the stall watchdog named it, or
it could not be reached when an attempt started; or when it failed the preflight of a restart
(`decide_preflight`). A node whose ranks exited 2 (bad input: config, data, checkpoint) or 3 (ranks
differ) failed for the job's sake, not the node's: every node would fail alike, so nothing restarts.
A stop (Ctrl-C, SIGTERM, `ddp-launch stop`), --timeout and success never restart.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Sequence

from ddp_train import exitcodes
from ddp_train.launch.plan.plan import Recovery
from ddp_train.launch.run.report import JobResult, Loss


@dataclasses.dataclass(frozen=True)
class Decision:
    restart: bool
    exclude: tuple[str, ...] = ()  # the nodes the next attempt leaves out
    lines: tuple[str, ...] = ()  # what the log says, one line each


def decide(
    result: JobResult, policy: Recovery, lost_before: Sequence[dict], nodes: Sequence[str], attempt: int
) -> Decision:
    """Restart without result.lost, or the lines saying why the job ends here (none for ending as usual)."""
    if (
        policy.mode != "restart"
        or not result.lost
        or result.code not in (exitcodes.NODE_FAILED, exitcodes.STALLED)
    ):
        return Decision(False)
    if result.signal:
        return Decision(False, lines=(f"not restarting: stopped by {signal.Signals(result.signal).name}",))
    own = [x for x in result.lost if x.job_error]
    if own:
        x = own[0]
        return Decision(False, lines=(
            f"not restarting: {x.host}'s ranks ended with exit {x.code} ({x.reason}), which every node "
            "would repeat (ddp_on_node_loss restarts after a lost node, not after a bad config or data)",
        ))  # fmt: skip
    new = [x for x in result.lost if x.host in nodes]
    if (limit := _limit(new, policy, lost_before, nodes, attempt)) is not None:
        return limit
    staying = [h for h, procs in result.leftovers.items() if procs and h in nodes and h not in
               {x.host for x in new}]  # fmt: skip
    if staying:
        every = [*(lost_line(d) for d in lost_before), *(lost_line(x.record(attempt)) for x in new)]
        why = f"processes of the job remain on {', '.join(staying)} (listed above)"
        return Decision(False, lines=(*every, f"not restarting: {why}; a new attempt would run beside them"))
    return _restart(new, policy, lost_before, nodes, attempt)


def decide_preflight(
    failed: Sequence[Loss], policy: Recovery, lost_before: Sequence[dict], nodes: Sequence[str], attempt: int
) -> Decision:
    """The nodes that failed the restart's preflight (attempt + 1's) are lost too ("a failed health check
    at restart", issue 43): the attempt starts without them, or the lines saying why the job ends."""
    new = [x for x in failed if x.host in nodes]
    if not new:
        return Decision(False)
    limit = _limit(new, policy, lost_before, nodes, attempt)
    return limit if limit is not None else _restart(new, policy, lost_before, nodes, attempt)


def _limit(
    new: Sequence[Loss], policy: Recovery, lost_before: Sequence[dict], nodes: Sequence[str], attempt: int
) -> Decision | None:
    """The end of the job when `new` losses use up ddp_max_node_losses or leave fewer than ddp_min_nodes."""
    every = [*(lost_line(d) for d in lost_before), *(lost_line(x.record(attempt)) for x in new)]
    count, left = len(lost_before) + len(new), len(nodes) - len(new)
    if count > policy.max_losses:
        why = f"giving up: {count} node(s) lost, more than ddp_max_node_losses {policy.max_losses}"
        return Decision(False, lines=(*every, why))
    if left < policy.min_nodes:
        why = f"giving up: {left} node(s) left, fewer than ddp_min_nodes {policy.min_nodes}"
        return Decision(False, lines=(*every, why))
    return None


def _restart(
    new: Sequence[Loss], policy: Recovery, lost_before: Sequence[dict], nodes: Sequence[str], attempt: int
) -> Decision:
    count, left = len(lost_before) + len(new), len(nodes) - len(new)
    names = ", ".join(x.host for x in new)
    return Decision(True, exclude=tuple(x.host for x in new), lines=(
        f"{names} lost ({'; '.join(x.reason for x in new)}); excluded; restarting on {left} node(s) as "
        f"attempt {attempt + 1} of the job ({count} of ddp_max_node_losses {policy.max_losses} used)",
    ))  # fmt: skip


def lost_line(d: dict, when: str = "%H:%M:%S") -> str:
    """A lost node as the log (and, with the date, `status`) says it: an entry of job.json's "lost"."""
    at = time.strftime(when, time.localtime(d.get("at") or 0))
    return f"lost {d.get('host')} at {at} (attempt {d.get('attempt')}): {d.get('reason')}"
