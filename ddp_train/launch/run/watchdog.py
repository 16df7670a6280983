"""The stall watchdog: no step for --stall-timeout seconds -> every rank's stack, the odd ranks named.

The launcher already reads every node's lines; rank 0's step lines (launch/run/trainerlog.py) are the job's
progress, since DDP keeps every rank at the same step. The watchdog arms at the first step line. Its
timeout is --stall-timeout, else STALL_FACTOR x the longest gap seen between two step lines plus the
longest checkpoint save, at least STALL_FLOOR_S (a save or an evaluation must not look like a stall).

On a stall it asks every node, through its control connection, for the stack of each rank
(launch/node/stack.sh): SIGUSR1 to every worker of the job that handles it (the trainer registers a
faulthandler dump, all threads, into $DDP_STACK_DIR/r<rank>.txt: ddp_train/stackdump.py) and `py-spy
dump` where py-spy is installed (native frames too). The stacks land in
logs/<job>/stacks/<host>-r<rank>.txt (<host> made a plain file name as for host logs). The main thread's
frames (function names, innermost first) are compared: the ranks outside the largest group of identical
stacks are named; with no single largest group, the ranks not waiting in a collective are. The job is
then torn down and ddp-launch exits exitcodes.STALLED (4).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddp_train.launch.jobs.jobstate import private_dir, write_private
from ddp_train.launch.run.logs import safe_name
from ddp_train.launch.run.nodecontrol import stack_command
from ddp_train.launch.run.progress import duration
from ddp_train.launch.run.trainerlog import Step, StepTimes

STALL_FLOOR_S = 300.0
STALL_FACTOR = 10.0
# Frames of a rank that waits for its peers (torch.distributed, DDP's reducer in backward, our all-reduce).
WAITING = re.compile(r"all_reduce|allreduce|all_gather|broadcast|barrier|\bwait\b|backward|_engine_run")
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


class StallWatch:
    def __init__(self, job_id: str, log_dir: Path, timeout: float | None, times: StepTimes) -> None:
        self.job_id = job_id
        self.dir = Path(log_dir) / "stacks"
        self.explicit = timeout
        self.times = times  # the longest save, as the job measured it
        self.last_step: int | None = None
        self.last_at: float | None = None
        self.finishing = False  # the last step is done: the final save, check and exit follow
        self.longest_gap = 0.0
        self.suspect_host: str | None = None

    def timeout(self) -> float:
        if self.explicit:
            # After the last step no step line comes: the final save, the ranks' parameter check and the
            # loader workers' shutdown take longer than a short --stall-timeout on a loaded machine (a
            # finished run ended with exit 4); from then on the floor applies too.
            return max(self.explicit, STALL_FLOOR_S) if self.finishing else self.explicit
        return max(STALL_FLOOR_S, STALL_FACTOR * self.longest_gap + self.times.longest_save)

    def feed(self, step: Step) -> None:
        """A step line of any rank (launch/run/trainerlog.py)."""
        now = time.monotonic()
        if self.last_step is None or step.step > self.last_step:
            if self.last_at is not None:
                self.longest_gap = max(self.longest_gap, now - self.last_at)
            self.last_step, self.last_at = step.step, now
        self.finishing = step.total > 0 and step.step >= step.total

    def check(self) -> str | None:
        if self.explicit == 0 or self.last_at is None:
            return None
        quiet, limit = time.monotonic() - self.last_at, self.timeout()
        if quiet <= limit:
            return None
        how = "--stall-timeout" if self.explicit else "derived from the step time"
        return (
            f"stall: no rank advanced past step {self.last_step} for {duration(quiet)} "
            f"(limit {limit:.0f}s, {how})"
        )

    def collect(self, nodes: Sequence[tuple[Any, Callable[[str], tuple[int, str]]]]) -> str:
        """Fetch, save and compare every rank's stack; one line naming the odd ranks."""
        from ddp_train.launch.remote.fanout import parallel

        def one(item: tuple[Any, Callable[[str], tuple[int, str]]]) -> str:
            plan, run = item
            try:
                return run(stack_command(self.job_id, plan.rank))[1]
            except Exception as e:  # noqa: BLE001 - one unreachable node must not stop the others
                return f"ERROR {e}"

        outputs = parallel(one, list(nodes))
        private_dir(self.dir)
        stacks: dict[tuple[str, int], str] = {}
        for (plan, _), out in zip(nodes, outputs):
            for rank, text in split_dumps(out).items():
                stacks[(plan.node.name, rank)] = text
                # the inventory name as a plain file name, as host logs are (`../x` stays inside)
                write_private(self.dir / f"{safe_name(plan.node.name)}-r{rank}.txt", text.encode())
        if not stacks:
            return f"no stack could be collected (see {self.dir})"
        odd = odd_ranks({k: main_frames(v) for k, v in stacks.items()})
        if not odd:
            return f"every rank shows the same stack (in {self.dir})"
        self.suspect_host = odd[0][0]
        named = "; ".join(f"rank {rank} on {host} ({innermost(stacks[(host, rank)])})" for host, rank in odd)
        return f"stack differs from the majority: {named}; stacks in {self.dir}"


def split_dumps(output: str) -> dict[int, str]:
    """node/stack.sh's output -> {rank: its faulthandler dump (+ py-spy's)}."""
    dumps: dict[int, str] = {}
    current: tuple[int, str] | None = None
    for line in output.splitlines():
        m = re.match(r"^==> (py-spy-)?r(\d+)\.txt$", line)
        if m:
            current = (int(m.group(2)), "py-spy" if m.group(1) else "faulthandler")
            dumps.setdefault(current[0], "")
            dumps[current[0]] += f"--- {current[1]} ---\n"
            continue
        if current is not None:
            dumps[current[0]] += line + "\n"
    return dumps


def main_frames(dump: str) -> tuple[str, ...]:
    """The main thread's functions, innermost first, from a faulthandler dump (line numbers left out)."""
    threads: list[list[str]] = []
    section = ""
    for line in dump.splitlines():
        if line.startswith("--- "):
            section = line
            continue
        if section != "--- faulthandler ---":
            continue
        if THREAD.match(line):
            threads.append([])
            continue
        m = FRAME.match(line)
        if m and threads:
            threads[-1].append(f"{m.group(3)} ({Path(m.group(1)).name})")
    # the main thread runs a module's top level somewhere below it (`python -m` adds runpy's frames
    # outside it); the others start in threading's _bootstrap, and the thread faulthandler lists first
    # is whichever caught the signal (e.g. the checkpoint replica's receiver waiting in accept)
    main = [t for t in threads if any(f.startswith("<module> ") for f in t)]
    return tuple((main or threads or [[]])[0])


def odd_ranks(signatures: dict[tuple[str, int], tuple[str, ...]]) -> list[tuple[str, int]]:
    """The ranks whose stack differs from the majority; on a tie, those not waiting in a collective."""
    counts = Counter(signatures.values())
    if len(counts) < 2:
        return []
    ranked = counts.most_common()
    if ranked[0][1] > ranked[1][1]:
        odd = [k for k, sig in signatures.items() if sig != ranked[0][0]]
    else:
        odd = [k for k, sig in signatures.items() if not any(WAITING.search(f) for f in sig)]
    return sorted(odd, key=lambda k: (k[1], k[0]))


def innermost(dump: str) -> str:
    """The innermost frame of the main thread, as `func (file:line)`."""
    for line in dump.splitlines():
        m = FRAME.match(line)
        if m:
            frames = main_frames(dump)
            if frames:
                return f"innermost frame {frames[0]}"
            return f"innermost frame {m.group(3)} ({Path(m.group(1)).name}:{m.group(2)})"
    return "no stack"
