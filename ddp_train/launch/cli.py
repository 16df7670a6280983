"""`ddp-launch`: run the trainer with torchrun on every node of an Ansible inventory at once.

    ddp-launch [run] --hosts INVENTORY [--config F] [--set k=v ...] [options] [-- trainer args]
    ddp-launch [run] --hosts INVENTORY [--sync DIR] [options] train.py [script args]   (or -m pkg.mod)
    ddp-launch doctor --hosts INVENTORY [options]
    ddp-launch check-script [--sync DIR] [-m] SCRIPT                  (the script check alone)
    ddp-launch [run] --detach ...; ddp-launch jobs | status JOB | logs JOB [-f] [--node H] | attach JOB |
    stop JOB                                                          (job control: launch/jobcmds.py)

Exit codes: 0 ok; 1 a node failed, could not start, or was lost; 2 bad input (with --strict: a script
check finding); 3 preflight failed (with --strict: a backend the nodes' GPUs contradict; or another job
runs on the same nodes and port); 4 the stall watchdog stopped the job; 124 --timeout;
128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM); after a stop every node saved.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_train.launch.errors import LaunchError, one_line

if TYPE_CHECKING:  # the heavy modules load only when a command needs them
    from ddp_train.launch.inventory import Node
    from ddp_train.launch.logs import JobLog
    from ddp_train.launch.plan import JobPlan, NodePlan
    from ddp_train.launch.scriptcheck import Finding, ScriptCheck
    from ddp_train.launch.sync import Manifest

DEFAULT_INVENTORY = "inventory/local"
EPILOG = """examples:
  ddp-launch --hosts inventory/local                       # two local nodes, no SSH
  ddp-launch doctor --hosts inventory/prod                 # preflight table, starts nothing
  ddp-launch --hosts inventory/prod --limit 'gpu[01:04]' --config train.yaml --set train.max_steps=500
  ddp-launch --hosts inventory/prod --dry-run -- --extra-trainer-arg
  ddp-launch --hosts inventory/prod --sync . train.py --epochs 3   # your own script, shipped to every node
  ddp-launch --hosts inventory/prod --sync . -m mypkg.train --lr 3e-4
  ddp-launch check-script train.py                         # the DDP mistakes in a script, nothing runs
  ddp-launch --hosts inventory/prod --detach               # returns once it runs; the monitor goes on
  ddp-launch jobs; ddp-launch status JOB; ddp-launch attach JOB; ddp-launch logs JOB -f --node gpu01
  ddp-launch stop JOB                                      # graceful: every rank saves

exit codes: 0 ok; 1 a node failed, could not start or was lost; 2 bad input; 3 preflight failed (or
  another job runs on the same nodes and port); 4 stalled (the stall watchdog stopped the job);
  124 --timeout; 130 Ctrl-C, 143 SIGTERM (128+N for signal N). A stop lets every rank finish its step
  and save a checkpoint (run the same command again to resume); a second Ctrl-C kills at once."""
EXIT_USAGE, EXIT_PREFLIGHT = 2, 3
JOB_COMMANDS = ("jobs", "status", "logs", "attach", "stop")  # launch/jobcmds.py
MONITOR_ARGS = "--monitor-args-file"  # what --detach starts: `cli --monitor-args-file FILE`


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's default prints usage too)
        self.exit(EXIT_USAGE, f"ddp-launch: error: {message} (see ddp-launch --help)\n")


def _parser(doctor: bool) -> argparse.ArgumentParser:
    p = _Parser(
        prog="ddp-launch doctor" if doctor else "ddp-launch",
        description=(
            "Check every node of the inventory (SSH, versions, ports, hostnames) and print a table."
            if doctor
            else "Start torchrun on every node of an Ansible inventory at once, running your script (as\n"
            "torchrun would: `train.py args` or `-m pkg.mod args`) or, without one, the ddp_train trainer\n"
            "(arguments after `--` go to it). `ddp-launch doctor --help`: the checks alone."
        ),
        usage="ddp-launch doctor [options]"
        if doctor
        else "ddp-launch [run] [options] [-- trainer args | [-m] script [script args]]",
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
    job.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="extra env var for every node (sent on stdin, never in a command line)",
    )
    job.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME",
        help="mark NAME secret: its value is masked wherever ddp-launch shows or records it; without "
        "--env/ddp_env NAME its value is this shell's $NAME (so it is in no command line here either). "
        "Names with TOKEN/KEY/SECRET/PASSWORD/PASSWD/CREDENTIAL/AUTH... and user:pass@ URLs are masked "
        "anyway",
    )
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
    net.add_argument(
        "--forks",
        type=int,
        metavar="N",
        help="at most N nodes connected, probed or stopped at once, as ansible-playbook --forks "
        "(the job's own channels are one per node) [ddp_forks, else ansible.cfg forks, else 5]",
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
    job.add_argument(
        "--detach",
        action="store_true",
        help="preflight, start the job, print its id and return; a background monitor (immune to SIGHUP "
        "and to the terminal closing) runs it: ddp-launch jobs/status/logs/attach/stop JOB",
    )
    job.add_argument("--monitor", action="store_true", help=argparse.SUPPRESS)  # what --detach starts
    job.add_argument(
        "--stall-timeout",
        type=float,
        metavar="S",
        help="no step for S seconds: dump every rank's stack to logs/<job>/stacks/, name the ranks whose "
        "stack differs, stop the job, exit 4 [10 x the longest gap between step lines + the longest "
        "save, at least 300; 0: off]",
    )
    job.add_argument(
        "--strict",
        action="store_true",
        help="refuse to launch when the script check finds a mistake: exit 2, or 3 for a backend the "
        "nodes' GPUs contradict (found by preflight) [ddp_script_check: strict|warn|off, else warn]",
    )
    job.add_argument("--dry-run", action="store_true", help="print the exact command of every node and exit")
    job.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="PATH",
        help="a file the run needs: preflight checks it exists on every node with the master's size/mtime "
        "(relative: to the run's directory; repeatable)",
    )
    user = p.add_argument_group("your own script (torchrun's meaning) and --sync")
    user.add_argument("-m", "--module", action="store_true", help="the script is a module: -m pkg.mod")
    user.add_argument(
        "--sync",
        metavar="DIR",
        help="ship DIR to every node (only what changed) and run from there, with it on PYTHONPATH "
        "[ddp_sync_dir]",
    )
    user.add_argument("--no-sync", action="store_true", help="ignore ddp_sync_dir")
    user.add_argument(
        "--sync-exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="gitignore-style pattern left out of --sync, besides .gitignore/.ddpignore (repeatable)",
    )
    user.add_argument(
        "--sync-max-size",
        default="1G",
        metavar="SIZE",
        help="refuse to sync more than this (500M, 2G, ...) [1G]",
    )
    user.add_argument(
        "--sync-via",
        choices=("auto", "rsync", "archive"),
        default="auto",
        help="auto: rsync over ssh when both ends have it, else a tar archive over the connection [auto]",
    )
    user.add_argument("script", nargs="?", help=argparse.SUPPRESS)
    user.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ddp-launch."""
    try:
        return _main(argv)
    except OSError as e:
        # the launcher's own writes (logs/<job>/, job.json, the monitor's files): a disk that refuses
        # them is one line with the path and its free space, exit 2, not a traceback
        from ddp_train.storage import StorageError, disk_error

        cause = disk_error(e)
        if cause is None or not (_own_write(e) or _own_write(cause)):
            raise
        path = cause.filename if isinstance(cause.filename, str) else "logs"
        return _usage(str(StorageError("writing the job's logs and state", path, cause)))


def _own_write(exc: BaseException) -> bool:
    """Whether `exc` came from one of the launcher's own writes (its job directory, job.json, the
    monitor's files), not from something else that reads or writes, such as an unreadable --config."""
    from ddp_train.launch import jobcmds, jobstate, logs

    writes = [jobstate.private_dir, jobstate.open_private, jobstate.write_private, jobstate.write_state]
    writes += [logs._append, jobcmds.detach]
    writes += [f for f in vars(logs.JobLog).values() if hasattr(f, "__code__")]  # its files, summary.json
    own = {f.__code__ for f in writes}
    return any(frame.f_code in own for frame, _ in traceback.walk_tb(exc.__traceback__))


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [MONITOR_ARGS]:  # a detached monitor: its arguments come in a 0600 file, not argv
        from ddp_train.launch.jobcmds import read_monitor_args

        args = read_monitor_args(args[1])
    shown = list(args)
    if args and args[0] == "check-script":
        return _check_script_command(args[1:])
    if args and args[0] in JOB_COMMANDS:
        from ddp_train.launch.jobcmds import main as job_command

        return job_command(args[0], args[1:])
    doctor = bool(args) and args[0] == "doctor"
    if args and args[0] in ("doctor", "run"):
        args = args[1:]
    trainer_args: list[str] = []
    tail: list[str] | None = None
    if "--" in args:
        cut = args.index("--")
        args, tail = args[:cut], args[cut + 1 :]
    opts = _parser(doctor).parse_args(args)
    opts.argv = shown
    if getattr(opts, "script", None) and tail is not None:  # after a script, `--` is the script's argument
        opts.script_args += ["--", *tail]
    elif tail is not None:
        trainer_args = tail
    if doctor and trainer_args:
        return _usage("doctor takes no trainer arguments after --")
    if not doctor and opts.detach and not opts.dry_run and not opts.monitor:
        from ddp_train.launch.jobcmds import detach, without_detach
        from ddp_train.launch.plan import check_job_id, new_job_id

        rest = without_detach(args) + ([] if tail is None else ["--", *tail])
        try:
            job_id = check_job_id(opts.job_id or new_job_id())
        except LaunchError as e:
            return _usage(str(e))
        return detach(rest, job_id, opts.log_dir)
    try:
        plan = _plan(opts, trainer_args, doctor)
        if doctor or not opts.dry_run:
            _controller_limits(plan, opts)
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


def _controller_limits(plan: JobPlan, opts: argparse.Namespace) -> None:
    """Open-file limit raised to the hard limit (LaunchError if the nodes still do not fit); --forks."""
    from ddp_train.launch.fanout import ansible_forks, set_forks
    from ddp_train.launch.limits import raise_nofile

    if opts.forks is not None and opts.forks < 1:
        raise LaunchError(f"--forks {opts.forks}: must be >= 1")
    raise_nofile(len(plan.nodes))
    from ddp_train.launch.plan import same

    forks = opts.forks or same([p.node for p in plan.nodes], "ddp_forks", lambda n: n.forks)
    set_forks(forks or ansible_forks())


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
    secret_env = set()
    for name in opts.secret_env:
        if not ENV_NAME.match(name):
            raise LaunchError(
                f"--secret-env {name.partition('=')[0]!r}: expected a variable NAME (no =VALUE: a value on "
                "this command line would be in ps; export it instead)"
            )
        secret_env.add(name)
        if name not in env and name in os.environ:
            env[name] = os.environ[name]
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise LaunchError(f"--master-port {opts.master_port}: not a TCP port (1-65535)")
    if opts.nproc_per_node is not None and not (
        opts.nproc_per_node in ("gpu", "cpu", "auto")
        or (opts.nproc_per_node.isdigit() and int(opts.nproc_per_node) > 0)
    ):
        raise LaunchError(f"--nproc-per-node {opts.nproc_per_node!r}: a positive integer, gpu, cpu or auto")
    config, required = None, []
    if not doctor:
        if opts.max_restarts is not None and opts.max_restarts < 0:
            raise LaunchError(f"--max-restarts {opts.max_restarts}: must be >= 0")
        for flag, value in (("--grace", opts.grace), ("--timeout", opts.timeout)):
            if value is not None and value <= 0:
                raise LaunchError(f"{flag} {value:g}: must be > 0")
        if opts.stall_timeout is not None and opts.stall_timeout < 0:
            raise LaunchError(f"--stall-timeout {opts.stall_timeout:g}: must be >= 0 (0: off)")
        if opts.module and not opts.script:
            raise LaunchError("-m/--module: name the module to run, as with torchrun (-m pkg.mod)")
        if opts.script and (opts.config or opts.overrides or trainer_args):
            raise LaunchError(
                "--config/--set/`-- args` are for the packaged trainer; your script takes its own "
                f"arguments after its name ({opts.script} ...)"
            )
        config, required = _check_config(opts.config, opts.overrides)
        required += opts.require
    sources = opts.hosts or [DEFAULT_INVENTORY]
    nodes = load_nodes(
        sources, group=opts.group, limit=opts.limit, exclude=opts.exclude, extra_vars=opts.extra_vars
    )
    manifest, script, script_local, check, mode = None, None, None, None, "warn"
    if not doctor:
        manifest = _scan(opts, nodes)
        script, script_local = _script(opts, manifest)
        if script:
            check, mode = _check_script(opts, nodes, manifest, script_local)
        if script and not opts.module and not manifest and script not in required:
            required.append(script)  # not shipped: it must already be the same on every node
    options = Options(
        job_id=None if doctor else opts.job_id,
        nproc_per_node=opts.nproc_per_node,
        master_port=opts.master_port,
        max_restarts=None if doctor else opts.max_restarts,
        config=config,
        overrides=() if doctor else tuple(opts.overrides),
        trainer_args=tuple(trainer_args),
        env=env,
        secret_env=frozenset(secret_env),
        debug=opts.debug,
        rdzv=None if doctor else opts.rdzv,
        grace=None if doctor else opts.grace,
        script=script,
        module=bool(not doctor and opts.module),
        script_args=tuple(opts.script_args) if script else (),
        sync=manifest,
        script_local=script_local,
        required=tuple(required),
        script_check=check,
        script_check_mode=mode,
    )
    return build_plan(nodes, options)


def _scan(opts: argparse.Namespace, nodes: Sequence[Node]) -> Manifest | None:
    """--sync (or ddp_sync_dir) scanned, excluded and size-checked here, before any node is touched."""
    from ddp_train.launch.plan import same
    from ddp_train.launch.sync import parse_size, scan

    directory = opts.sync or (None if opts.no_sync else same(nodes, "ddp_sync_dir", lambda n: n.sync_dir))
    if not directory:
        return None
    patterns = same(nodes, "ddp_sync_exclude", lambda n: n.sync_exclude)
    return scan(directory, [*patterns, *opts.sync_exclude], parse_size(opts.sync_max_size, "--sync-max-size"))


def _script(opts: argparse.Namespace, manifest: Manifest | None) -> tuple[str | None, str | None]:
    """(the script as torchrun gets it, its resolved path here when known). With --sync the script is
    a file of the synced directory, run by its path inside it."""
    if not opts.script:
        return None, None
    if opts.module:
        if manifest is None:
            return opts.script, None
        rel = opts.script.replace(".", "/")
        found = [f"{rel}.py", f"{rel}/__main__.py", f"{rel}/__init__.py"]
        hit = next((f for f in found if f in manifest.entries), None)
        return opts.script, str(Path(manifest.root, hit)) if hit else None
    given = Path(opts.script).expanduser()
    if manifest is None:
        return opts.script, str(given.resolve()) if given.is_file() else None
    root = Path(manifest.root)
    local = given.resolve() if given.exists() else (root / given).resolve()
    try:
        rel = local.relative_to(root).as_posix()
    except ValueError:
        raise LaunchError(f"{opts.script}: not inside the synced directory {root}") from None
    if rel not in manifest.entries:
        raise LaunchError(f"{opts.script}: not among the synced files of {root} (missing or excluded)")
    return rel, str(local)


def _check_script(
    opts: argparse.Namespace, nodes: Sequence[Node], manifest: Manifest | None, script_local: str | None
) -> tuple[ScriptCheck | None, str]:
    """The script check, before any node is touched: (its result, the mode). --strict refuses here."""
    from ddp_train.launch.plan import same
    from ddp_train.launch.scriptcheck import check_script

    mode = "strict" if opts.strict else same(nodes, "ddp_script_check", lambda n: n.script_check)
    if mode == "off":
        return None, mode
    if not script_local:
        print(f"ddp-launch: script check skipped: {opts.script} is no file on this machine", file=sys.stderr)
        return None, mode
    check = check_script(script_local, [manifest.root] if manifest else [])
    if check.findings and mode == "strict":
        for f in check.findings:
            print(f, file=sys.stderr)
        why = "--strict" if opts.strict else "ddp_script_check: strict"
        raise LaunchError(f"{_refusal(check.findings, why)}; nothing was started")
    return check, mode


def _refusal(findings: Sequence[Finding], why: str) -> str:
    codes = ", ".join(dict.fromkeys(f.code for f in findings))
    return (
        f"script check: {len(findings)} finding(s) above ({codes}) and {why} refuses to launch; fix them "
        "as each line says, or silence one with `# ddp-launch: ignore[<code>]` on its line"
    )


def _check_script_command(argv: Sequence[str]) -> int:
    """`ddp-launch check-script`: the findings, one line each; exit 0 when none, 2 otherwise."""
    from ddp_train.launch.scriptcheck import check_script

    p = _Parser(
        prog="ddp-launch check-script",
        description="Read a training script and the local modules it imports with Python's ast (nothing "
        "runs) and print each DDP mistake as `file:line: what is wrong; what to write instead`. Exit 0: "
        "none; 2: findings (or a bad argument). The backend check needs the nodes: it runs at launch.",
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module (pkg.mod), as torchrun -m")
    p.add_argument("--sync", metavar="DIR", help="the directory shipped with the script (its modules count)")
    p.add_argument("script", metavar="SCRIPT")
    opts = p.parse_args(list(argv))
    root = Path(opts.sync or ".").expanduser()
    if opts.sync and not root.is_dir():
        return _usage(f"--sync {opts.sync}: not a directory")
    if opts.module:
        rel = opts.script.replace(".", "/")
        path = next((root / f for f in (f"{rel}.py", f"{rel}/__main__.py") if (root / f).is_file()), None)
        if path is None:
            return _usage(f"-m {opts.script}: no {rel}.py or {rel}/__main__.py under {root.resolve()}")
    else:
        path = Path(opts.script).expanduser()
        if not path.is_file():
            return _usage(f"{opts.script}: no such file")
    check = check_script(path, [root] if opts.sync or opts.module else [])
    for f in check.findings:
        print(f)
    if check.findings:
        print(check.summary(), file=sys.stderr)
        return EXIT_USAGE
    print(f"script check: no findings in {', '.join(check.files)}", file=sys.stderr)
    return 0


def _check_config(path: str | None, overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """Refuse a bad trainer config here, before any node is touched (the trainer checks it again).

    Returns the config's path and the data files it reads, which preflight looks for on every node."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise LaunchError(f"--config {path}: no such file")
        path = str(p.resolve())
    if path is None and not overrides:
        return None, []
    try:
        from ddp_train.config import ConfigError, load_config
    except ImportError:  # trainer package without a config module: the trainer itself will check
        return path, []
    try:
        cfg = load_config(path, list(overrides))
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    data = [cfg.data.tokens.path] if cfg.data.name == "tokens" and cfg.data.tokens.path else []
    return path, data


def _dry_run(plan: JobPlan) -> int:
    from ddp_train.launch.netif import dry_run_line
    from ddp_train.launch.plan import command, shown_env

    where = (f"MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port}" if plan.rdzv == "static"
             else f"c10d rendezvous at {plan.master_addr}:{plan.master_port}")  # fmt: skip
    if plan.script_check and plan.script_check.findings:
        for f in plan.script_check.findings:
            print(f, file=sys.stderr)
        print(f"ddp-launch: {plan.script_check.summary()}", file=sys.stderr)
    print(f"# job {plan.job_id}: {len(plan.nodes)} nodes, {where}")
    if plan.sync:
        m = plan.sync
        print(f"# sync {m.root}: {len(m.entries)} files, {m.total_bytes} bytes, content {m.name}")
    for p in plan.nodes:
        print(f"# [{p.label}] {p.node.where}")
        print(f"# environment, sent on stdin: {shown_env(p)}")
        if network := dry_run_line(plan, p):
            print(network)
        print(command(p, masked=True))
    return 0


def _doctor(plan: JobPlan, opts: argparse.Namespace) -> int:
    from ddp_train.launch import rdma
    from ddp_train.launch.preflight import run_preflight

    report = run_preflight(plan, connect_timeout=opts.connect_timeout, net_timeout=opts.net_timeout)
    for s in report.sessions().values():
        s.close()
    print(f"MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port} nodes={len(plan.nodes)}")
    print(report.render())
    from ddp_train.launch.gpuhealth import render as gpu_table

    if gpus := gpu_table(report.checks):  # GPU nodes only; their problems are in the lines above
        print(gpus)
    for line in rdma.ib_hca_env(report.checks)[1]:  # what a launch would set: each node's active RDMA ports
        print(f"rdma: {line}")
    if report.ok:
        print("preflight: all checks passed")
        return 0
    print(f"preflight: {len(report.failure_lines())} problem(s)")
    return EXIT_PREFLIGHT


def _launch(plan: JobPlan, opts: argparse.Namespace) -> int:
    """Run the job in this process (foreground, or as the detached monitor), its state in job.json."""
    from ddp_train.launch import jobstate
    from ddp_train.launch.logs import JobLog
    from ddp_train.launch.plan import mask_argv

    if opts.monitor:  # the detached monitor: no terminal, so no SIGHUP; and it ignores one besides
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log = JobLog(Path(opts.log_dir), plan.job_id, secrets=plan.secrets())
    state = jobstate.state_path(opts.log_dir, plan.job_id)
    busy = jobstate.conflict(opts.log_dir, plan.job_id, [p.node.name for p in plan.nodes], plan.master_port)
    if busy:
        log.note(f"preflight failed: {busy}; nothing was started")
        log.close()
        return EXIT_PREFLIGHT
    argv = mask_argv(opts.argv, plan.secrets())  # job.json keeps no secret of the command line
    jobstate.write_state(state, jobstate.initial_state(plan, argv, detached=opts.monitor))
    code = 1
    try:
        code = _launch_job(plan, opts, log, state)
        return code
    finally:
        jobstate.update_state(state, state="finished", exit_code=code, ended=time.time())


def _launch_job(plan: JobPlan, opts: argparse.Namespace, log: JobLog, state: Path) -> int:
    from ddp_train.launch import jobstate, metricsview, netif, rdma
    from ddp_train.launch.fanout import parallel
    from ddp_train.launch.job import Job
    from ddp_train.launch.plan import command
    from ddp_train.launch.preflight import check_space, run_preflight
    from ddp_train.launch.remote import RemoteError, open_session
    from ddp_train.launch.watchdog import StallWatch

    try:
        for p in plan.nodes:
            log.note(f"{p.label} ({p.node.where}): {command(p, masked=True)}", console=False)
        if plan.script_check and plan.script_check.findings:
            for f in plan.script_check.findings:
                log.block(str(f))
            log.note(plan.script_check.summary())
        sessions: dict = {}
        if plan.sync and not _sync(plan, opts, log, sessions):
            for s in sessions.values():
                s.close()
            return 1
        if not opts.skip_preflight:
            report = run_preflight(
                plan, connect_timeout=opts.connect_timeout, net_timeout=opts.net_timeout, sessions=sessions
            )
            if not plan.script and (cfg := _trainer_config(plan, opts)) is not None:
                check_space(report.checks, cfg, opts.strict)  # rank 0's disk: two checkpoints + best.pt
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
            plan = netif.apply(plan, report.checks, log.note)  # each node's interface in ddp_network_cidr
            if not _check_backend(plan, report, log):
                for s in sessions.values():
                    s.close()
                return EXIT_PREFLIGHT
            plan, notes = rdma.with_ib_hca(plan, report.checks)  # NCCL_IB_HCA: each node's active ports
            for line in notes:
                log.note(f"rdma: {line}")
            # netif.apply re-ranks under c10d (torchrun orders nodes by --local-addr): status reads rank 0
            jobstate.update_state(state, nodes=jobstate.initial_state(plan, [], False)["nodes"])
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
            jobstate.write_private(log.dir / Path(plan.config).name, Path(plan.config).read_bytes())
        job = Job(
            plan,
            log,
            control=sessions,
            connect_timeout=opts.connect_timeout,
            grace=opts.grace,
            timeout=opts.timeout,
            on_state=lambda s: jobstate.update_state(state, state=s),
            trap=(signal.SIGINT, signal.SIGTERM) + (() if opts.monitor else (signal.SIGHUP,)),
            watch=StallWatch(plan.job_id, log.dir, opts.stall_timeout, lambda: job.longest_save),
        )
        fetcher = metricsview.start(plan, plan.config, opts.overrides, log.dir, opts.connect_timeout)
        code = job.run()
        jobstate.update_state(state, reason=job.reason, stopped_cleanly=job.stopped_cleanly())
        shown = metricsview.finish(fetcher, log.dir)
        if shown:
            log.note(shown)
        return code
    finally:
        log.close()


def _trainer_config(plan: JobPlan, opts: argparse.Namespace) -> Any:
    """The trainer's resolved config (--config and --set), or None when it cannot be read here."""
    try:
        from ddp_train.config import ConfigError, load_config

        return load_config(plan.config, list(opts.overrides or []))
    except (ImportError, ConfigError):
        return None


def _check_backend(plan: JobPlan, report: Any, log: JobLog) -> bool:
    """Finding 8, with preflight's GPU count of every node; False when --strict refuses to launch."""
    from ddp_train.launch.scriptcheck import backend_findings

    if plan.script_check is None or not plan.script_check.backends:
        return True
    gpus = {c.name: int(c.facts.get("gpus") or 0) for c in report.checks if c.facts}
    found = backend_findings(plan.script_check, gpus)
    for f in found:
        log.block(str(f))
    if found and plan.script_check_mode == "strict":
        log.note(_refusal(found, "--strict or ddp_script_check: strict") + "; nothing was started")
        return False
    return True


def _sync(plan: JobPlan, opts: argparse.Namespace, log: JobLog, sessions: dict) -> bool:
    """Ship --sync to every remote node in parallel; one line per node. False if any node failed."""
    from ddp_train.launch.fanout import parallel
    from ddp_train.launch.remote import RemoteError, open_session
    from ddp_train.launch.sync import SyncError, sync_node

    def one(p: NodePlan) -> tuple[Any, str | None]:
        if p.node.local or p.node.ssh is None:
            return None, None
        try:
            s = sessions[p.node.name] = open_session(p.node, opts.connect_timeout)
            return sync_node(s, p.node, plan.sync, opts.sync_via, opts.connect_timeout), None
        except (RemoteError, SyncError) as e:
            return None, str(e)

    results = parallel(one, list(plan.nodes))
    record = {}
    for p, (res, err) in zip(plan.nodes, results):
        if err:
            log.note(f"sync failed: {err}; nothing was started")
        elif res is None:
            log.note(f"sync: {p.node.name}: local node, runs in {p.sync_dir}")
        else:
            log.note(res.line(p.sync_dir or ""))
            record[p.node.name] = {"via": res.via, "files": res.files, "bytes": res.bytes, "dir": p.sync_dir}
    log.write_json("sync.json", {"source": plan.sync.root, "content": plan.sync.digest, "nodes": record})
    return not any(err for _, err in results)


if __name__ == "__main__":
    sys.exit(main())
