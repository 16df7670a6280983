"""What the batch script's driver and the launcher (submit.py) agree on: where the driver keeps the job's
output, the lines the launcher acts on, the stop line the driver sends every node, and the submit shell's
umask in the batch script's environment."""

from __future__ import annotations

import re

STOP = b"stop\n"  # the driver's only line to the nodes after the job: each node's task stops its torchrun
SUBMIT_UMASK = "DDP_SUBMIT_UMASK"  # the submit shell's umask, in the batch script's environment (submit.py)
DRIVER_LOG = "driver.log"  # the driver's own lines (and srun's), beside the nodes' r<N>-<host>.log
# Without shared storage (slurm_shared_workdir: false) the launcher reads the driver's files through
# `srun --overlap` into the running job (jobctl.read_logs), which writes to read-offset.<reader> how much
# of driver.log that reader has: the driver's last line waits for the launcher's own (LAUNCHER), since
# nothing can read the files once the job ended; `ddp-launch logs -f` reads as logs-<pid>.
READ_ACK = "read-offset"
LAUNCHER = "launcher"
# Every read through srun is a job step, and Slurm ends a job's steps at MaxStepCount (40000 by default):
# the reads come every READ_FAST_S while driver.log grows, backing off to READ_SLOW_S while it does not.
READ_FAST_S, READ_SLOW_S = 3.0, 30.0


def ack_name(reader: str) -> str:
    """The file in the driver's log directory holding how much of driver.log `reader` has."""
    return f"{READ_ACK}.{reader}"


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


def batch_dir(workdir: str | None, shared: bool) -> str | None:
    """The batch script's --chdir: ddp_workdir, or /tmp when ddp_workdir is each node's own disk (it may
    not exist yet there: the driver creates it; Slurm would otherwise run the script in /tmp anyway)."""
    return workdir if shared else "/tmp"
