"""`ddp-launch`: run the trainer with torchrun on every node of an Ansible inventory at once.

    ddp-launch [run] --hosts INVENTORY [--config F] [--set k=v ...] [options] [-- trainer args]
    ddp-launch doctor --hosts INVENTORY [options]

Exit codes: 0 ok; 1 a node failed, could not start, or was lost; 2 bad input; 3 preflight failed;
124 --timeout; 128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM); after a stop every node saved.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_train.launch.errors import LaunchError, one_line

if TYPE_CHECKING:  # the heavy modules load only when a command needs them
    from ddp_train.launch.plan import JobPlan, NodePlan

DEFAULT_INVENTORY = "inventory/local"
EPILOG = """examples:
  ddp-launch --hosts inventory/local                       # two local nodes, no SSH
  ddp-launch doctor --hosts inventory/prod                 # preflight table, starts nothing
  ddp-launch --hosts inventory/prod --limit 'gpu[01:04]' --config train.yaml --set train.max_steps=500
  ddp-launch --hosts inventory/prod --dry-run -- --extra-trainer-arg

exit codes: 0 ok; 1 a node failed, could not start or was lost; 2 bad input; 3 preflight failed;
  124 --timeout; 130 Ctrl-C, 143 SIGTERM (128+N for signal N). A stop lets every rank finish its step
  and save a checkpoint (run the same command again to resume); a second Ctrl-C kills at once."""
EXIT_USAGE, EXIT_PREFLIGHT = 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's default prints usage too)
        self.exit(EXIT_USAGE, f"ddp-launch: error: {message} (see ddp-launch --help)\n")


def _parser(doctor: bool) -> argparse.ArgumentParser:
    p = _Parser(
        prog="ddp-launch doctor" if doctor else "ddp-launch",
        description=(
            "Check every node of the inventory (SSH, versions, ports, hostnames) and print a table."
            if doctor
            else "Start torchrun + the ddp_train trainer on every node of an Ansible inventory at once.\n"
            "Arguments after `--` go to the trainer. `ddp-launch doctor --help`: the checks alone."
        ),
        usage="ddp-launch doctor [options]" if doctor else "ddp-launch [run] [options] [-- trainer args]",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inv = p.add_argument_group("inventory (read with Ansible's own API)")
    inv.add_argument(
        "--hosts",
        "-i",
        action="append",
        metavar="INVENTORY",
        help=f"Ansible inventory: directory, YAML, INI or 'h1,h2,' (repeatable) [{DEFAULT_INVENTORY}]",
    )
    inv.add_argument(
        "--extra-vars",
        "-e",
        action="append",
        default=[],
        metavar="VARS",
        help="extra variables like ansible-playbook: key=value, JSON/YAML, or @file (repeatable)",
    )
    inv.add_argument("--group", help="node group [gpu_nodes if it has hosts, else all]")
    inv.add_argument("--limit", "-l", metavar="PATTERN", help="only these hosts (Ansible host pattern)")
    inv.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave these hosts out (Ansible host pattern, repeatable)",
    )
    job = p.add_argument_group("job")
    job.add_argument("--nproc-per-node", metavar="N", help="processes per node [ddp_nproc_per_node, else 1]")
    job.add_argument(
        "--master-port", type=int, metavar="PORT", help="MASTER_PORT [ddp_master_port, else 29500]"
    )
    job.add_argument("--env", action="append", default=[], metavar="K=V", help="extra env var for every node")
    job.add_argument(
        "--debug",
        action="store_true",
        help="NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET, TORCH_DISTRIBUTED_DEBUG=DETAIL",
    )
    net = p.add_argument_group("connections")
    net.add_argument(
        "--connect-timeout", type=float, default=10, metavar="S", help="SSH connect timeout [10]"
    )
    net.add_argument(
        "--net-timeout",
        type=float,
        default=3,
        metavar="S",
        help="preflight: timeout of each node-to-node TCP probe [3]",
    )
    if doctor:
        return p
    job.add_argument("--config", metavar="FILE", help="trainer config (YAML); copied to every remote node")
    job.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="K=V",
        help="trainer config override (repeatable)",
    )
    job.add_argument("--max-restarts", type=int, metavar="R", help="passed to torchrun")
    job.add_argument(
        "--rdzv",
        choices=("static", "c10d"),
        help="torchrun rendezvous [static; c10d when --max-restarts > 0 on several nodes, "
        "since a static rendezvous cannot restart one node's workers]",
    )
    job.add_argument("--job-id", help="job id (tags every process, names logs/<job>) [generated]")
    job.add_argument(
        "--log-dir", default="logs", metavar="DIR", help="logs go to DIR/<job>/<host>.log [logs]"
    )
    job.add_argument(
        "--grace",
        type=float,
        metavar="S",
        help="seconds a stop (Ctrl-C, SIGTERM, --timeout) waits for every rank to finish its step and save "
        "before KILL [derived from the measured save and step times, at least 30, at most 600]; a node "
        "failure waits min(S, 10)",
    )
    job.add_argument(
        "--timeout", type=float, metavar="S", help="stop the job after S seconds, as SIGTERM does (exit 124)"
    )
    job.add_argument("--skip-preflight", action="store_true", help="launch without the preflight checks")
    job.add_argument("--dry-run", action="store_true", help="print the exact command of every node and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ddp-launch."""
    args = list(sys.argv[1:] if argv is None else argv)
    trainer_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, trainer_args = args[:cut], args[cut + 1 :]
    doctor = bool(args) and args[0] == "doctor"
    if args and args[0] in ("doctor", "run"):
        args = args[1:]
    opts = _parser(doctor).parse_args(args)
    if doctor and trainer_args:
        return _usage("doctor takes no trainer arguments after --")
    try:
        plan = _plan(opts, trainer_args, doctor)
        if doctor:
            return _doctor(plan, opts)
        if opts.dry_run:
            return _dry_run(plan)
        return _launch(plan, opts)
    except LaunchError as e:
        return _usage(str(e))
    except KeyboardInterrupt:  # before the job started (once it runs, the job traps SIGINT itself)
        print("ddp-launch: interrupted; nothing was started", file=sys.stderr)
        return 130


def _usage(message: str) -> int:
    print(f"ddp-launch: error: {one_line(message, 1000)}", file=sys.stderr)
    return EXIT_USAGE


def _plan(opts: argparse.Namespace, trainer_args: list[str], doctor: bool) -> JobPlan:
    from ddp_train.launch.inventory import ENV_NAME, load_nodes
    from ddp_train.launch.plan import Options, build_plan

    env = {}
    for item in opts.env:
        key, sep, value = item.partition("=")
        if not sep or not ENV_NAME.match(key):
            raise LaunchError(f"--env {item!r}: expected NAME=VALUE")
        env[key] = value
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise LaunchError(f"--master-port {opts.master_port}: not a TCP port (1-65535)")
    if opts.nproc_per_node is not None and not (
        opts.nproc_per_node in ("gpu", "cpu", "auto")
        or (opts.nproc_per_node.isdigit() and int(opts.nproc_per_node) > 0)
    ):
        raise LaunchError(f"--nproc-per-node {opts.nproc_per_node!r}: a positive integer, gpu, cpu or auto")
    config = None
    if not doctor:
        if opts.max_restarts is not None and opts.max_restarts < 0:
            raise LaunchError(f"--max-restarts {opts.max_restarts}: must be >= 0")
        for flag, value in (("--grace", opts.grace), ("--timeout", opts.timeout)):
            if value is not None and value <= 0:
                raise LaunchError(f"{flag} {value:g}: must be > 0")
        config = _check_config(opts.config, opts.overrides)
    sources = opts.hosts or [DEFAULT_INVENTORY]
    nodes = load_nodes(
        sources, group=opts.group, limit=opts.limit, exclude=opts.exclude, extra_vars=opts.extra_vars
    )
    options = Options(
        job_id=None if doctor else opts.job_id,
        nproc_per_node=opts.nproc_per_node,
        master_port=opts.master_port,
        max_restarts=None if doctor else opts.max_restarts,
        config=config,
        overrides=() if doctor else tuple(opts.overrides),
        trainer_args=tuple(trainer_args),
        env=env,
        debug=opts.debug,
        rdzv=None if doctor else opts.rdzv,
        grace=None if doctor else opts.grace,
    )
    return build_plan(nodes, options)


def _check_config(path: str | None, overrides: Sequence[str]) -> str | None:
    """Refuse a bad trainer config here, before any node is touched (the trainer checks it again)."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise LaunchError(f"--config {path}: no such file")
        path = str(p.resolve())
    if path is None and not overrides:
        return None
    try:
        from ddp_train.config import ConfigError, load_config
    except ImportError:  # trainer package without a config module: the trainer itself will check
        return path
    try:
        load_config(path, list(overrides))
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    return path


def _dry_run(plan: JobPlan) -> int:
    from ddp_train.launch.plan import command, shown_env

    where = (f"MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port}" if plan.rdzv == "static"
             else f"c10d rendezvous at {plan.master_addr}:{plan.master_port}")  # fmt: skip
    print(f"# job {plan.job_id}: {len(plan.nodes)} nodes, {where}")
    for p in plan.nodes:
        print(f"# [{p.label}] {p.node.where}")
        print(f"# environment, sent on stdin: {shown_env(p)}")
        print(command(p, masked=True))
    return 0


def _doctor(plan: JobPlan, opts: argparse.Namespace) -> int:
    from ddp_train.launch.preflight import run_preflight

    report = run_preflight(plan, connect_timeout=opts.connect_timeout, net_timeout=opts.net_timeout)
    for s in report.sessions().values():
        s.close()
    print(f"MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port} nodes={len(plan.nodes)}")
    print(report.render())
    if report.ok:
        print("preflight: all checks passed")
        return 0
    print(f"preflight: {len(report.failure_lines())} problem(s)")
    return EXIT_PREFLIGHT


def _launch(plan: JobPlan, opts: argparse.Namespace) -> int:
    from ddp_train.launch.job import Job
    from ddp_train.launch.logs import JobLog
    from ddp_train.launch.plan import command
    from ddp_train.launch.preflight import parallel, run_preflight
    from ddp_train.launch.remote import RemoteError, open_session

    log = JobLog(Path(opts.log_dir), plan.job_id, secrets=plan.secrets())
    try:
        for p in plan.nodes:
            log.note(f"{p.label} ({p.node.where}): {command(p, masked=True)}", console=False)
        sessions = {}
        if not opts.skip_preflight:
            report = run_preflight(plan, connect_timeout=opts.connect_timeout, net_timeout=opts.net_timeout)
            sessions = report.sessions()
            for line in report.warning_lines():
                log.note(f"preflight warning: {line}")
            if not report.ok:
                log.block(report.render())
                log.note(
                    f"preflight failed on {len({c.name for c in report.checks if c.failures})} node(s); "
                    "nothing was started (fix the lines above, or --skip-preflight)"
                )
                for s in sessions.values():
                    s.close()
                return EXIT_PREFLIGHT
            log.note(f"preflight ok on {len(plan.nodes)} nodes")
        if plan.config:

            def ship(p: NodePlan) -> str | None:
                try:
                    s = sessions.get(p.node.name) or open_session(p.node, opts.connect_timeout)
                    sessions[p.node.name] = s
                    s.put(plan.config, p.config_path)
                except RemoteError as e:
                    return str(e)
                return None

            errors = [e for e in parallel(ship, list(plan.nodes)) if e]
            if errors:
                for e in errors:
                    log.note(f"cannot copy --config: {e}; nothing was started")
                for s in sessions.values():
                    s.close()
                return 1
            (log.dir / Path(plan.config).name).write_bytes(Path(plan.config).read_bytes())
        job = Job(
            plan,
            log,
            control=sessions,
            connect_timeout=opts.connect_timeout,
            grace=opts.grace,
            timeout=opts.timeout,
        )
        return job.run()
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
