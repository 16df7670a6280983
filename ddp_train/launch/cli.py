"""`ddp-launch`: run the trainer with torchrun on every node of an Ansible inventory at once.

    ddp-launch [run] --hosts INVENTORY [--config F] [--set k=v ...] [options] [-- trainer args]
    ddp-launch [run] --hosts INVENTORY [--sync DIR] [options] train.py [script args]   (or -m pkg.mod)
    ddp-launch doctor --hosts INVENTORY [options]
    ddp-launch check-script [--sync DIR] [-m] SCRIPT                  (the script check alone)
    ddp-launch [run] --detach ...; ddp-launch jobs | status JOB | logs JOB [-f] [--node H] | attach JOB |
    stop JOB                                                          (job control: launch/jobs/jobcmds.py)
    ddp-launch stage SRC --to DEST --hosts INVENTORY                  (data on every node: remote/stage.py)
    ddp-launch fetch JOB [best|last|metrics] [--to DIR]; restart JOB  (launch/jobs/fetch.py, recorded.py)

The parser is launch/cliparse.py, the plan from its arguments launch/runargs.py, the launch itself
launch/pipeline.py. Exit codes: ddp_train/exitcodes.py (`ddp-launch --help` shows the table).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_train import exitcodes
from ddp_train.launch.cliparse import COMMANDS, MONITOR_ARGS, MONITOR_REQUEST
from ddp_train.launch.errors import LaunchError, one_line

if TYPE_CHECKING:  # the heavy modules load only when a command needs them
    from ddp_train.launch.pipeline import LaunchConfig
    from ddp_train.launch.plan.plan import JobPlan
    from ddp_train.launch.slurm.settings import SlurmSettings


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ddp-launch."""
    try:
        try:
            return _main(argv)
        finally:
            if sys.stdout is not None:  # None: started with fd 1 closed
                sys.stdout.flush()  # here, not at exit: a reader that left (`| head`) raises below
    except BrokenPipeError:
        return _stdout_closed()
    except OSError as e:
        # the launcher's own writes (logs/<job>/, job.json, the monitor's files): a disk that refuses
        # them is one line with the path and its free space, exit 2, not a traceback
        from ddp_train.storage import StorageError, disk_error

        cause = disk_error(e)
        if cause is None or not (_own_write(e) or _own_write(cause)):
            raise
        path = cause.filename if isinstance(cause.filename, str) else "logs"
        return _usage(str(StorageError("writing the job's logs and state", path, cause)))


def _stdout_closed() -> int:
    """Every command, when its stdout is a pipe whose reader left (`ddp-launch jobs | head`): quiet, and
    the status of a process killed by SIGPIPE, as a shell expects. Python ignores SIGPIPE, so the write
    raised; stdout goes to /dev/null so that nothing flushed at exit raises again, as CPython documents:
    https://docs.python.org/3/library/signal.html#note-on-sigpipe"""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):
        out = sys.stdout.fileno()
        if os.path.sameopenfile(out, sys.stderr.fileno()):  # `2>&1 | head`: the same closed pipe
            os.dup2(devnull, sys.stderr.fileno())
        os.dup2(devnull, out)
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _own_write(exc: BaseException) -> bool:
    """Whether `exc` came from one of the launcher's own writes (its job directory, job.json, the
    monitor's files), not from something else that reads or writes, such as an unreadable --config."""
    from ddp_train.launch.jobs import jobcmds, jobstate
    from ddp_train.launch.run import logs

    writes = [jobstate.private_dir, jobstate.open_private, jobstate.write_private, jobstate.write_state]
    writes += [logs._append, jobcmds.detach]
    writes += [f for f in vars(logs.JobLog).values() if hasattr(f, "__code__")]  # its files, summary.json
    own = {f.__code__ for f in writes}
    return any(frame.f_code in own for frame, _ in traceback.walk_tb(exc.__traceback__))


def _main(argv: Sequence[str] | None) -> int:
    from ddp_train.launch import runargs
    from ddp_train.launch.cliparse import build_parser

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [MONITOR_ARGS]:  # a detached monitor: its arguments come in a 0600 file, not argv
        from ddp_train.launch.jobs.jobcmds import read_monitor_args

        args = read_monitor_args(args[1])
    if args[:1] == [MONITOR_REQUEST]:  # a monitor on the cluster (--detach): the controller's prepared plan
        from ddp_train.launch.jobs.clustermon import run_monitor

        return run_monitor(args[1])
    shown = list(args)
    if args[:1] != ["run"] and (not args or args[0] not in COMMANDS):
        args = ["run", *args]
    if args[0] == "doctor" and "--" in args:  # nothing may follow it: doctor starts no trainer
        if args[args.index("--") + 1 :]:
            return _usage("doctor takes no trainer arguments after --")
        args = args[: args.index("--")]
    parser = build_parser()
    opts = parser.parse_args(args)
    if opts.command == "check-script":
        return _check_script_command(opts)
    if opts.command == "stage":
        from ddp_train.launch.remote.stage import main as stage_command

        return stage_command(opts)
    if opts.command in ("fetch", "restart"):
        from ddp_train.launch.jobs.fetch import main as results_command

        return results_command(opts, main)  # restart: the recorded command, through this main again
    if opts.command not in ("run", "doctor"):
        from ddp_train.launch.jobs.jobcmds import main as job_command

        return job_command(opts)
    doctor = opts.command == "doctor"
    trainer_args = runargs.split_rest(opts)
    if not doctor and opts.detach and not opts.dry_run and not opts.monitor:
        from ddp_train.launch.jobs.jobcmds import detach, without_detach
        from ddp_train.launch.plan.plan import check_job_id, new_job_id

        try:
            job_id = check_job_id(opts.job_id or new_job_id())
            code = None if opts.monitor_here else _detach_to_cluster(opts, trainer_args, job_id, shown)
            if code is not None:
                return code
        except LaunchError as e:
            return _usage(str(e))
        if opts.monitor_here and opts.backend != "slurm":
            from ddp_train.launch.jobs.clustermon import HERE_WARNING

            print(HERE_WARNING, file=sys.stderr, flush=True)
        return detach(without_detach(args[1:]), job_id, opts.log_dir)
    try:
        plan = runargs.build(opts, trainer_args, doctor)
        if doctor or not opts.dry_run:
            runargs.controller_limits(plan, opts)
        if doctor:
            return _doctor(plan, opts)
        slurm = runargs.slurm_settings(opts)  # None: the SSH backend
        if opts.dry_run:
            return _dry_run(plan) if slurm is None else _slurm_dry_run(plan, slurm)
        return _launch(plan, opts, shown, slurm)
    except LaunchError as e:
        return _usage(str(e))
    except KeyboardInterrupt:  # before the job started (once it runs, the job traps SIGINT itself)
        print("ddp-launch: interrupted; nothing was started", file=sys.stderr)
        return exitcodes.SIGINT


def _usage(message: str) -> int:
    print(f"ddp-launch: error: {one_line(message, 1000)}", file=sys.stderr)
    return exitcodes.BAD_INPUT


def _check_script_command(opts: argparse.Namespace) -> int:
    """`ddp-launch check-script`: the findings, one line each; exit 0 when none, 2 otherwise."""
    from ddp_train.launch.plan.scriptcheck import check_script, module_file

    root = Path(opts.sync or ".").expanduser()
    if opts.sync and not root.is_dir():
        return _usage(f"--sync {opts.sync}: not a directory")
    if opts.module:
        rel = module_file(opts.script, lambda f: (root / f).is_file(), init=False)
        if rel is None:
            mod = opts.script.replace(".", "/")
            return _usage(f"-m {opts.script}: no {mod}.py or {mod}/__main__.py under {root.resolve()}")
        path = root / rel
    else:
        path = Path(opts.script).expanduser()
        if not path.is_file():
            return _usage(f"{opts.script}: no such file")
    check = check_script(path, [root] if opts.sync or opts.module else [])
    for f in check.findings:
        print(f)
    if check.findings:
        print(check.summary(), file=sys.stderr)
        return exitcodes.BAD_INPUT
    print(f"script check: no findings in {', '.join(check.files)}", file=sys.stderr)
    return exitcodes.OK


def _dry_run(plan: JobPlan) -> int:
    from ddp_train.launch.plan.plan import command, shown_env
    from ddp_train.launch.preflight.netif import dry_run_line

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
    from ddp_train.launch.preflight import rdma
    from ddp_train.launch.preflight.preflight import run_preflight

    report = run_preflight(plan, connect_timeout=opts.connect_timeout, net_timeout=opts.net_timeout)
    for s in report.sessions().values():
        s.close()
    print(f"MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port} nodes={len(plan.nodes)}")
    print(report.render())
    from ddp_train.launch.preflight.gpuhealth import render as gpu_table

    if gpus := gpu_table(report.checks):  # GPU nodes only; their problems are in the lines above
        print(gpus)
    for line in rdma.doctor_lines(report.checks):  # each node's transport and why, what a launch would set
        print(f"rdma: {line}")
    if report.ok:
        print("preflight: all checks passed")
        return 0
    print(f"preflight: {len(report.failure_lines())} problem(s)")
    return exitcodes.PREFLIGHT


def _slurm_dry_run(plan: JobPlan, slurm: SlurmSettings) -> int:
    from ddp_train.launch.slurm.submit import shown_script

    nodes = slurm.nodes or len(plan.nodes)  # a login-only inventory: --nodes, its only "node" the login host
    print(f"# job {plan.job_id}: {nodes} nodes through Slurm: sbatch on {slurm.submit.name}")
    print(shown_script(plan, slurm))
    return 0


def _detach_to_cluster(opts: argparse.Namespace, trainer_args: list[str], job_id: str,
                       argv: Sequence[str]) -> int | None:  # fmt: skip
    """--detach with the monitor on the cluster (jobs/clustermon.py); None when the monitor host is this
    machine (a local inventory) or the job goes to Slurm, which the local detach serves."""
    from ddp_train.launch import runargs
    from ddp_train.launch.jobs import clustermon

    opts.job_id = job_id
    plan = runargs.build(opts, trainer_args, False)
    if runargs.slurm_settings(opts) is not None:  # a Slurm job outlives this machine: follow it from here
        return None
    monitor = clustermon.monitor_node(plan, opts)
    if monitor is None:
        return None
    runargs.controller_limits(plan, opts)
    return clustermon.detach_to_cluster(_config(plan, opts, argv), monitor)


def _launch(
    plan: JobPlan, opts: argparse.Namespace, argv: Sequence[str], slurm: SlurmSettings | None = None
) -> int:
    from ddp_train.launch.pipeline import launch
    from ddp_train.launch.slurm.submit import slurm_backend

    return launch(_config(plan, opts, argv), backend=slurm_backend(slurm) if slurm else None)


def _config(plan: JobPlan, opts: argparse.Namespace, argv: Sequence[str]) -> LaunchConfig:
    from ddp_train.launch.pipeline import LaunchConfig

    return LaunchConfig(
        plan,
        argv,
        log_dir=opts.log_dir,
        monitor=opts.monitor,
        connect_timeout=opts.connect_timeout,
        net_timeout=opts.net_timeout,
        skip_preflight=opts.skip_preflight,
        strict=opts.strict,
        sync_via=opts.sync_via,
        grace=opts.grace,
        timeout=opts.timeout,
        stall_timeout=opts.stall_timeout,
        overrides=tuple(opts.overrides),
    )


if __name__ == "__main__":
    sys.exit(main())
