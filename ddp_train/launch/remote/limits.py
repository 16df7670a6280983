"""The controller's open-file limit: raised to the hard limit at start, checked against the node count.

Each node holds a few descriptors in the controller for the whole run (its SSH socket, its log file,
the control connection of teardown); RHEL's default soft limit of 1024 would stop a launch at a few
hundred nodes with "Too many open files" in the middle of connecting (issue #19).
"""

from __future__ import annotations

import resource

from ddp_train.launch.errors import LaunchError

# Measured (bench/c8_controller_scale.py: fds at the end of preflight and of a launch, 8-64 nodes):
# a launch holds about 3 per node plus the interpreter's own; 4 per node and 64 more keep a margin.
FDS_PER_NODE = 4
FDS_BASE = 64


def fds_needed(nodes: int) -> int:
    return FDS_BASE + FDS_PER_NODE * nodes


def raise_nofile(nodes: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; LaunchError (one line) if `nodes` still do not fit.

    Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # keep the soft limit; the check below says whether it is enough
    elif hard == resource.RLIM_INFINITY and soft != hard:
        soft = _raise_unlimited(soft)
    need = fds_needed(nodes)
    if soft != resource.RLIM_INFINITY and need > soft:
        raise LaunchError(
            f"{nodes} nodes need about {need} open files in the controller but the limit is {soft} "
            f"(hard {'unlimited' if hard == resource.RLIM_INFINITY else hard}): raise it "
            f"(ulimit -n {need}, or nofile in /etc/security/limits.conf) or launch fewer nodes"
        )
    return soft


def _raise_unlimited(soft: int) -> int:
    """A hard limit of 'unlimited' still caps at the kernel's nr_open; take that."""
    try:
        with open("/proc/sys/fs/nr_open") as f:
            cap = int(f.read())
        resource.setrlimit(resource.RLIMIT_NOFILE, (cap, resource.RLIM_INFINITY))
        return cap
    except (OSError, ValueError):
        return soft
