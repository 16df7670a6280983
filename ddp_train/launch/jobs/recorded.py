"""A job's recorded command (job.json "argv", secrets masked, and "cwd"): read back for `restart` and
`fetch`, with the inventory re-read as it is now.

`ddp-launch restart JOB [OPTIONS]` runs that command again from the recorded directory, as a new job (on
a machine without that record, `restart --hosts INVENTORY JOB` takes the command from job.json on the
monitor host, and runs it from this directory with that inventory instead of the recorded one): its
--job-id and --fresh are dropped (a restart continues from the newest checkpoint, and says so on its
first line; a detached job detaches again), OPTIONS (e.g. `--exclude node0`) go after the recorded
options, before the script or `--`. The packaged trainer gets `--set train.global_batch=auto` (unless the
command sets it): the checkpoint's global batch, on fewer nodes too, or one line saying why it cannot be.
A value job.json masks (`--env NAME=***`) is taken from this shell's $NAME (as `--secret-env NAME`);
without it the restart is refused with one line naming it. So is a master the inventory pins to a node
the restart leaves out (`check_master`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
from collections.abc import Callable
from typing import Any

from ddp_train.launch.errors import LaunchError

DROPPED = {"--job-id": 1, "--fresh": 0, "--monitor": 0}  # option -> how many values follow it


def parsed(job_id: str, data: dict[str, Any]) -> tuple[list[str], argparse.Namespace]:
    """(["run", options...], rest) and its parse; LaunchError (one line) if job.json has no usable command."""
    from ddp_train.launch.cliparse import COMMANDS, build_parser

    argv = data.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchError(f"job {job_id}: job.json records no command (field argv)")
    args = list(argv) if argv[0] == "run" or argv[0] not in COMMANDS else None
    if args is None:
        raise LaunchError(f"job {job_id}: job.json's argv is a {argv[0]!r} command, not a launch")
    if args[0] != "run":
        args = ["run", *args]
    try:
        opts = build_parser().parse_args(args)
    except SystemExit:
        raise LaunchError(f"job {job_id}: job.json's argv no longer parses: {shlex.join(argv)}") from None
    return args, opts


def in_recorded_dir(job_id: str, data: dict[str, Any]) -> None:
    """chdir to the job's recorded working directory: its paths (--hosts, --config) are relative to it."""
    cwd = data.get("cwd")
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise LaunchError(f"job {job_id}: job.json field cwd: {cwd!r} is not a directory here")
    os.chdir(cwd)


def inventory_nodes(job_id: str, data: dict[str, Any]) -> list[Any]:
    """The inventory's nodes as the recorded command selects them (--hosts/-i, --group, -e; the default
    inventory without --hosts), re-read now from the recorded directory. LaunchError (one line)."""
    from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY, load_nodes

    _, opts = parsed(job_id, data)
    here = os.getcwd()
    in_recorded_dir(job_id, data)
    try:
        return load_nodes(opts.hosts or [DEFAULT_INVENTORY], group=opts.group, extra_vars=opts.extra_vars)
    finally:
        os.chdir(here)


def unmask(job_id: str, options: list[str]) -> list[str]:
    """Masked `--env NAME=***` -> `--secret-env NAME` (its value from this shell); LaunchError otherwise."""
    from ddp_train.launch.plan.plan import MASK

    out: list[str] = []
    i = 0
    while i < len(options):
        a = options[i]
        pair = (
            options[i + 1]
            if a == "--env" and i + 1 < len(options)
            else (a[6:] if a.startswith("--env=") else None)
        )
        if pair is not None and MASK in pair:
            name = pair.split("=", 1)[0]
            if name not in os.environ:
                raise LaunchError(
                    f"job {job_id}: --env {name} is masked in job.json; export {name} in this shell and "
                    "restart again"
                )
            out += ["--secret-env", name]
            i += 2 if a == "--env" else 1
            continue
        if MASK in a:
            raise LaunchError(
                f"job {job_id}: job.json masks a secret in {a!r}; run that command again by hand"
            )
        out.append(a)
        i += 1
    return out


def restart_argv(job_id: str, data: dict[str, Any], extra: list[str]) -> list[str]:
    """The command to run again (see the module doc)."""
    args, opts = parsed(job_id, data)
    rest = list(opts.rest)
    options = args[1 : len(args) - len(rest)]
    given = data.get("hosts")  # restart --hosts INVENTORY JOB on another machine: that inventory
    dropped = {**DROPPED, "--hosts": 1, "-i": 1} if given else DROPPED
    kept: list[str] = []
    i = 0
    while i < len(options):
        a = options[i]
        name = a.split("=", 1)[0]
        if name in dropped:
            i += 1 + (dropped[name] if "=" not in a else 0)
            continue
        if given and a.startswith("-i") and not a.startswith("--"):  # -iINVENTORY
            i += 1
            continue
        kept.append(a)
        i += 1
    kept += [a for h in given or [] for a in ("--hosts", h)]
    if "--monitor" in options:  # a detached job's monitor recorded it: detached again
        kept.append("--detach")
    from ddp_train.launch.plan.plan import global_batch_kept
    from ddp_train.launch.runargs import split_rest

    split_rest(opts)  # opts.script: None for the packaged trainer
    if opts.script is None:  # on fewer nodes too: the checkpoint's global batch (batchplan.py)
        kept += [a for o in global_batch_kept(opts.overrides) for a in ("--set", o)]
    return ["run", *unmask(job_id, kept), *extra, *rest]


def check_master(job_id: str, data: dict[str, Any], argv: list[str]) -> None:
    """LaunchError (one line: the variable, where it is set, what to do) when the inventory pins the master
    to a node this restart leaves out (--exclude, --limit, or gone from the inventory): ddp_master naming
    it, or ddp_master_addr still the address of the job's master. Unpinned, the first remaining node is
    the master, at its address in ddp_network_cidr (README, "Recover"). Anything else wrong is the
    launch's to report."""
    from ddp_train.launch.cliparse import build_parser
    from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY, load_nodes

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a bad option: the launch says so, once
            opts = build_parser().parse_args(argv)
        nodes = load_nodes(opts.hosts or [DEFAULT_INVENTORY], group=opts.group, limit=opts.limit,
                           exclude=opts.exclude, extra_vars=opts.extra_vars)  # fmt: skip
    except (LaunchError, SystemExit):
        return
    names = [n.name for n in nodes]
    master, addr = nodes[0].master, nodes[0].master_addr  # the same on every node, or the launch says so
    if master and master not in names:
        raise LaunchError(
            f"{nodes[0].origin('ddp_master')}: ddp_master: {master} is not among this restart's nodes "
            f"({', '.join(names)}); delete ddp_master there (the first remaining node becomes the master, "
            "at its address in ddp_network_cidr) or set it to one of them, then restart again"
        )
    old = data.get("master") or next(
        (n.get("host") for n in data.get("nodes") or [] if isinstance(n, dict) and n.get("rank") == 0), None
    )
    if addr and old and old not in names and _same_address(addr, data.get("master_addr")):
        new = master or names[0]
        raise LaunchError(
            f"{nodes[0].origin('ddp_master_addr')}: ddp_master_addr: {addr} is the address of {old}, the "
            f"master of job {job_id}, which this restart leaves out; delete ddp_master_addr there "
            f"(MASTER_ADDR then moves to {new}'s address in ddp_network_cidr) or set it to {new}'s training "
            "address, then restart again"
        )


def _same_address(pinned: str, recorded: Any) -> bool:
    """Whether ddp_master_addr (an IP or a name) is the address job.json recorded (the IP it resolved to)."""
    from ddp_train.launch.plan.plan import resolve

    if pinned == recorded:
        return True
    try:
        return resolve(pinned) == recorded
    except LaunchError:
        return False


def restart(job_id: str, data: dict[str, Any], extra: list[str], rerun: Callable[[list[str]], int]) -> int:
    """The recorded command run again with `rerun`: the CLI's own main (cli.py passes it), so it parses,
    plans and launches exactly as that command typed anew would."""
    in_recorded_dir(job_id, data)
    argv = restart_argv(job_id, data, extra)
    check_master(job_id, data, argv)
    print(
        f"ddp-launch: restart of job {job_id} in {os.getcwd()}: ddp-launch {shlex.join(argv[1:])}",
        file=sys.stderr,
    )
    return rerun(argv)
