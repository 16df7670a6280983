"""Bench helpers for the namespace testbed: bring hosts up for a bench, run commands on all at once."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
from collections.abc import Iterator

from common import BENCH_ENV, PYTHON, REPO

sys.path.insert(0, str(REPO))
from tests.testbed import Host, Testbed  # noqa: E402


@contextlib.contextmanager
def testbed(n: int, prefix: str, net: str) -> Iterator[Testbed]:
    """n namespace hosts for the duration of the block, always torn down."""
    tb = Testbed(prefix=prefix, net=net)
    try:
        tb.up(n)
        yield tb
    finally:
        tb.down()


def torchrun_cmd(hosts: list[Host], rank: int, module_args: list[str], port: int = 29500) -> str:
    """The shell command that starts node `rank`'s torchrun (static rendezvous on hosts[0])."""
    argv = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(hosts)}",
        "--nproc-per-node=1",
        f"--node-rank={rank}",
        f"--master-addr={hosts[0].ip}",
        f"--master-port={port}",
        *module_args,
    ]
    return f"cd {shlex.quote(str(REPO))} && OMP_NUM_THREADS=1 exec {shlex.join(argv)}"


def run_on_all(tb: Testbed, commands: list[str], timeout: float = 240) -> list[str]:
    """Run commands[i] on host i over ssh, all at once; their outputs (exits on any failure)."""
    procs = [
        subprocess.Popen(
            tb.ssh_argv(h, c), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=BENCH_ENV
        )
        for h, c in zip(tb.hosts(), commands)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for h, p, out in zip(tb.hosts(), procs, outs):
        if p.returncode != 0:
            sys.exit(f"bench: command on {h.name} failed ({p.returncode}): {out[-1500:]}")
    return outs
