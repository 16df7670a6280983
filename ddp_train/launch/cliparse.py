"""`ddp-launch`'s command line: argparse subcommands over a parent parser that run and doctor share.

`run` is implied when the first argument is not a command (cli.py). The whole grammar is here, the job
commands' included: this module imports none of the features it parses for (cli.py wires each command
to its module), so a feature that re-reads a recorded command line (jobs/recorded.py) can import it.
"""

from __future__ import annotations

import argparse
from typing import Any

from ddp_train import exitcodes
from ddp_train.cliargs import Parser
from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY

COMMANDS = ("run", "doctor", "check-script", "jobs", "status", "logs", "attach", "stop")
COMMANDS += ("stage", "fetch", "restart")
MONITOR_ARGS = "--monitor-args-file"  # what --detach starts: `cli --monitor-args-file FILE`
MONITOR_REQUEST = "--monitor-request-file"  # what --detach starts on the cluster (jobs/clustermon.py)
FETCH_WHAT = ("best", "last", "metrics")  # `fetch JOB WHAT` (jobs/fetch.py)
JOB_COMMANDS = {  # launch/jobs/jobcmds.py
    "jobs": "List the jobs under the log directory: id, state, nodes, step, started, elapsed.",
    "status": "One job: its state and, per node, the latest step, loss, tokens/s, ETA and last output.",
    "logs": "Print a job's output (every node, as the launcher showed it) or one node's log.",
    "attach": "Follow a job's output live; Ctrl-C detaches (the job keeps running).",
    "stop": "Stop a job gracefully: every rank finishes its step, rank 0 saves a checkpoint.",
}
EPILOG = (
    """examples:
  ddp-launch --hosts inventory/local                       # two local nodes, no SSH
  ddp-launch doctor --hosts inventory/prod                 # preflight table, starts nothing
  ddp-launch --hosts inventory/prod --limit 'gpu[01:04]' --config ddp_train/configs/gpt2-124m.yaml
  ddp-launch --hosts inventory/local --fresh               # a new run: refuse existing checkpoints
  ddp-launch --hosts inventory/prod --dry-run -- --extra-trainer-arg
  ddp-launch --hosts inventory/prod --sync . train.py --epochs 3   # your own script, shipped to every node
  ddp-launch --hosts inventory/prod --sync . -m mypkg.train --lr 3e-4
  ddp-launch stage ./data/tokens --to data/tokens --hosts inventory/prod   # data on every node
  ddp-launch check-script train.py                         # the DDP mistakes in a script, nothing runs
  ddp-launch --hosts inventory/prod --detach               # returns once it runs; the monitor goes on
  ddp-launch jobs; ddp-launch status JOB; ddp-launch attach JOB; ddp-launch logs JOB -f --node gpu01
  ddp-launch stop JOB                                      # graceful: every rank saves
  ddp-launch fetch JOB best --to results/                  # best.pt from rank 0's node (last, metrics)
  ddp-launch restart JOB --exclude gpu03                   # the recorded command again, resuming

"""
    + exitcodes.LAUNCH_TABLE
)


def build_parser() -> Parser:
    """ddp-launch's parser: run, doctor, check-script, the job commands, stage, fetch and restart."""
    top = Parser(prog="ddp-launch", label="ddp-launch", hint="ddp-launch --help")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    shared = {"parents": [_common()], "label": "ddp-launch", "hint": "ddp-launch --help", "epilog": EPILOG,
              "formatter_class": argparse.RawDescriptionHelpFormatter}  # fmt: skip
    sub.add_parser(
        "doctor",
        prog="ddp-launch doctor",
        usage="ddp-launch doctor [options]",
        description="Check every node of the inventory (SSH, versions, ports, hostnames) and print a table.",
        **shared,
    )
    run = sub.add_parser(
        "run",
        prog="ddp-launch",
        usage="ddp-launch [run] [options] [-- trainer args | [-m] script [script args]]",
        description="Start torchrun on every node of an Ansible inventory at once, running your script (as\n"
        "torchrun would: `train.py args` or `-m pkg.mod args`) or, without one, the ddp_train trainer\n"
        "(arguments after `--` go to it). `ddp-launch doctor --help`: the checks alone.",
        **shared,
    )
    _run_options(run, next(g for g in run._action_groups if g.title == "job"))  # the parent's group
    _slurm_options(run)
    check = sub.add_parser(
        "check-script",
        prog="ddp-launch check-script",
        label="ddp-launch",
        hint="ddp-launch --help",
        description="Read a training script and the local modules it imports with Python's ast (nothing "
        "runs) and print each DDP mistake as `file:line: what is wrong; what to write instead`. Exit 0: "
        "none; 2: findings (or a bad argument). The backend check needs the nodes: it runs at launch.",
    )
    check.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module (pkg.mod), as torchrun -m"
    )
    check.add_argument(
        "--sync", metavar="DIR", help="the directory shipped with the script (its modules count)"
    )
    check.add_argument("script", metavar="SCRIPT")
    _job_parsers(sub)
    _stage_parser(sub)
    _fetch_parsers(sub)
    return top


def _common() -> argparse.ArgumentParser:
    """The options of run and doctor: the inventory, the job's processes, the connections."""
    common = argparse.ArgumentParser(add_help=False)
    inv = common.add_argument_group("inventory (read with Ansible's own API)")
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
    job = common.add_argument_group("job")
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
    job.add_argument(
        "--rdma",
        choices=("auto", "on", "off"),
        help="NCCL between nodes: auto: InfiniBand or RoCE where a node has an ACTIVE RDMA port, else TCP; "
        "on: refuse nodes without one; off: TCP sockets on the training interface (NCCL_IB_DISABLE=1) "
        "[ddp_rdma, else auto]",
    )
    net = common.add_argument_group("connections")
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
    return common


def _run_options(run: argparse.ArgumentParser, job: argparse._ArgumentGroup) -> None:
    job.add_argument("--config", metavar="FILE", help="trainer config (YAML); copied to every remote node")
    job.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="K=V",
        help="trainer config override (repeatable)",
    )
    job.add_argument(
        "--fresh",
        action="store_true",
        help="this must be a new run: the trainer refuses (exit 2) when the run's checkpoint directory "
        "already holds checkpoints (--set checkpoint.resume=never) [resume from the newest, and say so]",
    )
    job.add_argument("--max-restarts", type=int, metavar="R", help="passed to torchrun")
    job.add_argument(
        "--on-node-loss",
        choices=("stop", "restart"),
        help="a node lost (crashed, unreachable, its agent failed, named by the stall watchdog): stop the "
        "job, or restart it on the other nodes from the newest checkpoint with the same global batch "
        "[ddp_on_node_loss, else stop]",
    )
    job.add_argument(
        "--max-node-losses",
        type=int,
        metavar="N",
        help="with restart: give up once more than N nodes are lost in all [ddp_max_node_losses, else 2]",
    )
    job.add_argument(
        "--min-nodes",
        type=int,
        metavar="N",
        help="with restart: give up rather than go on with fewer than N nodes [ddp_min_nodes, else the "
        "job's nodes minus the losses allowed, at least 1]",
    )
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
        help="preflight, start the job, print its id and return; a monitor on the cluster (ddp_monitor_host, "
        "else the master node; under systemd-run or setsid) runs it, so the job outlives this machine: "
        "ddp-launch jobs/status/logs/attach/stop JOB from any directory",
    )
    job.add_argument(
        "--monitor-here",
        action="store_true",
        help="with --detach: keep the monitor on this machine, whose sleep or lost network then stops the "
        "job [the monitor runs on the cluster: ddp_monitor_host, else the master node]",
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
    user = run.add_argument_group("your own script (torchrun's meaning) and --sync")
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
    # everything after the options: `-- trainer args` or `script [script args]` (launch/runargs.py)
    user.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _slurm_options(run: argparse.ArgumentParser) -> None:
    """--backend slurm and the sbatch options (launch/slurm/settings.py; each falls back to slurm_<name>)."""
    g = run.add_argument_group("Slurm (--backend slurm, or ddp_backend: slurm in the inventory)")
    g.add_argument("--backend", choices=("ssh", "slurm"), help="where the job runs [ddp_backend, else ssh]")
    for flag, meta, what in (
        ("partition", "NAME", "the partition [slurm_partition, else the default partition]"),
        ("account", "NAME", "the account to charge [slurm_account]"),
        ("qos", "NAME", "the quality of service [slurm_qos]"),
        ("time", "TIME", "the time limit, as sbatch --time [slurm_time, else the partition's default]"),
        ("constraint", "LIST", "node features, as sbatch --constraint [slurm_constraint]"),
    ):
        g.add_argument(f"--{flag}", dest=f"slurm_{flag}", metavar=meta, help=what)
    g.add_argument("--nodes", dest="slurm_nodes", type=int, metavar="N", help="nodes [the inventory's]")
    g.add_argument(
        "--gpus-per-node",
        dest="slurm_gpus_per_node",
        type=int,
        metavar="N",
        help="GPUs per node to request (0: none) [slurm_gpus_per_node, else one per process]",
    )
    g.add_argument("--exclusive", dest="slurm_exclusive", action="store_true", help="whole nodes only")
    g.add_argument(
        "--requeue",
        action="store_true",
        help="near the time limit (--signal=B:USR1) every rank saves, then the job is requeued and "
        "resumes from the newest checkpoint (which must be on shared storage) [slurm_requeue]",
    )
    g.add_argument(
        "--max-requeues", type=int, metavar="N", help="requeues at most [slurm_max_requeues, else 1]"
    )


def _job_parsers(sub: Any) -> None:
    """The job commands (launch/jobs/jobcmds.py) as subcommands (`sub`: add_subparsers())."""
    for command, description in JOB_COMMANDS.items():
        p = sub.add_parser(command, prog=f"ddp-launch {command}", description=description)
        p.add_argument("--log-dir", default="logs", metavar="DIR", help="where the jobs' logs are [logs]")
        _monitor_lookup(p)
        if command != "jobs":
            p.add_argument("job", metavar="JOB", help="job id (as `ddp-launch jobs` lists it)")
        if command == "status":
            p.add_argument("--json", action="store_true", help="print the job's record (job.json) as it is")
        if command == "logs":
            p.add_argument(
                "-f", "--follow", action="store_true", help="keep printing new lines until the job ends"
            )
            p.add_argument("--node", metavar="HOST", help="that node's log only")
        if command == "stop":
            p.add_argument("--no-wait", action="store_true", help="return once the monitor got the signal")


def _monitor_lookup(p: Any) -> None:
    """A job not known here (no logs/<job>, no record of this machine): asked of the monitor host that the
    inventory names (ddp_monitor_host, else the master node), over SSH (launch/jobs/clustermon.py)."""
    p.add_argument(
        "--hosts",
        "-i",
        action="append",
        metavar="INVENTORY",
        help="a job this machine has no record of: ask the monitor host this inventory names",
    )
    p.add_argument(
        "--extra-vars", "-e", action="append", default=[], metavar="VARS", help="as ansible-playbook -e"
    )


def _stage_parser(sub: Any) -> None:
    """`stage` (launch/remote/stage.py): its own options plus the inventory and connection options run
    and doctor have."""
    p = sub.add_parser(
        "stage",
        prog="ddp-launch stage",
        usage="ddp-launch stage SRC --to DEST --hosts INVENTORY [options]",
        label="ddp-launch stage",
        hint="ddp-launch stage --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Copy a file or directory to DEST on every node: sha256 per file, files already there "
        "with the same hash are\nskipped, an interrupted copy continues where it stopped. The controller "
        "sends each byte once, to one\nnode; the nodes pass it on to each other over the training network "
        "(ddp_network_cidr).\nA relative DEST is taken against ddp_workdir, as a relative data.tokens.path "
        "is; absolute or ~ paths as given.\nText already on a node: run `ddp-train prepare` (or `python -m "
        'ddp_train.prepare`) there instead\n(README, "Your data"; docs/data.md).',
    )
    p.add_argument("src", metavar="SRC", help="a local file or directory")
    p.add_argument("--to", dest="dest", required=True, metavar="DEST", help="the directory on every node")
    p.add_argument(
        "--hosts", "-i", action="append", metavar="INVENTORY", help="Ansible inventory (repeatable)"
    )
    p.add_argument(
        "--extra-vars", "-e", action="append", default=[], metavar="VARS", help="as ansible-playbook -e"
    )
    p.add_argument("--group", help="node group [gpu_nodes if it has hosts, else all]")
    p.add_argument("--limit", "-l", metavar="PATTERN", help="only these hosts (Ansible host pattern)")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN", help="leave these hosts out")
    p.add_argument("--connect-timeout", type=float, default=10, metavar="S", help="SSH connect timeout [10]")
    p.add_argument(
        "--forks", type=int, metavar="N", help="nodes inspected at once [ddp_forks, else ansible's]"
    )


def _fetch_parsers(sub: Any) -> None:
    """`fetch` and `restart` (launch/jobs/fetch.py, jobs/recorded.py) as subcommands."""
    p = sub.add_parser(
        "fetch",
        prog="ddp-launch fetch",
        description="Copy a packaged-trainer job's best.pt (best), newest checkpoint (last) or metrics.jsonl "
        "(metrics) from rank 0's node, where the run wrote them, hash-checked.",
    )
    p.add_argument("--log-dir", default="logs", metavar="DIR", help="where the jobs' logs are [logs]")
    p.add_argument("job", metavar="JOB", help="job id (as `ddp-launch jobs` lists it)")
    p.add_argument(
        "what", nargs="?", default="best", choices=FETCH_WHAT, help="best (default), last or metrics"
    )
    p.add_argument("--to", default=".", metavar="DIR", help="where the copy goes [.]")
    p.add_argument("--connect-timeout", type=float, default=10, metavar="S", help="SSH connect timeout [10]")
    _monitor_lookup(p)
    r = sub.add_parser(
        "restart",
        prog="ddp-launch restart",
        usage="ddp-launch restart [--log-dir DIR] [--hosts INVENTORY] JOB [launch options]",
        description="Run a job's recorded command again (job.json), from its directory, as a new job that "
        "resumes from the newest checkpoint: its --job-id and --fresh are dropped, the inventory is read "
        "again, a masked --env NAME comes from this shell's $NAME. Launch options given here (e.g. "
        "--exclude node0) are added after the recorded ones. On a machine without the job's record, --hosts "
        "INVENTORY (before JOB) takes the command from job.json on the monitor host that inventory names and "
        "runs it from this directory with that inventory.",
    )
    r.add_argument("--log-dir", default="logs", metavar="DIR", help="where the jobs' logs are [logs]")
    _monitor_lookup(r)
    r.add_argument("job", metavar="JOB", help="job id (as `ddp-launch jobs` lists it)")
    r.add_argument("extra", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
