"""What the batch script's driver and the launcher (submit.py) agree on: where the driver keeps the job's
output, the lines the launcher acts on, the stop line the driver sends every node, and the submit shell's
umask in the batch script's environment."""

from __future__ import annotations

import re

STOP = b"stop\n"  # the driver's only line to the nodes after the job: each node's task stops its torchrun
SUBMIT_UMASK = "DDP_SUBMIT_UMASK"  # the submit shell's umask, in the batch script's environment (submit.py)
DRIVER_LOG = "driver.log"  # the driver's own lines (and srun's), beside the nodes' r<N>-<host>.log
# The driver's lines the launcher acts on (submit.py): its last one, the requeue (the ranks' stops before
# it were the earlier attempt's) and the one naming nodes that went away without an exit status.
DONE = re.compile(r"^ddp-slurm: job \d+: done, exit (\d+)$")
REQUEUED = re.compile(r"^ddp-slurm: job \d+: requeued \(")
GONE = re.compile(r"^ddp-slurm: job \d+: (.* did not end with the other nodes .*)$")
# ddp_on_node_loss: restart, a node lost inside the allocation: the next attempt as a new step on the others
ATTEMPT = re.compile(r"^ddp-slurm: job \d+: attempt (\d+) on ")


def log_dir(workdir: str | None, slurm_job: str) -> str:
    """Where the driver keeps each node's output (relative: to the job's working directory)."""
    base = f"{workdir.rstrip('/')}/" if workdir else ""
    return f"{base}.ddp-launch/slurm-{slurm_job}"
