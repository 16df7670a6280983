"""Job control: `ddp-launch --detach`, `jobs`, `status JOB`, `logs JOB`, `attach JOB`, `stop JOB`.

A detached job runs in a monitor process: `python -m ddp_train.launch.cli run --monitor ...`, the same
launch as a foreground run, in a new session (setsid: no controlling terminal, so closing the terminal
sends it no SIGHUP, and it ignores SIGHUP besides), stdin from /dev/null, stdout and stderr to
logs/<job>/console.log (what a foreground run prints). `--detach` shows that file until the job runs on
every node (or the monitor gives up: preflight failed, ...; at most 15 min) and returns. The job's state
is in logs/<job>/job.json (launch/jobs/jobstate.py); `stop` sends the monitor SIGTERM, the graceful stop of a
foreground Ctrl-C/SIGTERM (every rank finishes its step, rank 0 saves).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ddp_train import exitcodes
from ddp_train.launch.cliparse import MONITOR_ARGS
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.jobs import clustermon, jobstate
from ddp_train.launch.plan.plan import JOB_ID
from ddp_train.launch.run.logs import host_log_path, show_new, table
from ddp_train.launch.run.progress import duration, read_host_log

POLL_S = clustermon.POLL_S
PROXIED = os.environ.get(clustermon.PROXIED_ENV) == "1"  # run by clustermon.proxy: its records are not ours


def main(opts: argparse.Namespace) -> int:
    """Run the job command `opts.command` (its parser: cliparse.py)."""
    command = opts.command
    if command == "jobs":
        try:
            monitors = [] if PROXIED else _monitors(opts)  # the monitors on the cluster
        except LaunchError as e:
            print(f"ddp-launch: error: {e}", file=sys.stderr)
            return exitcodes.BAD_INPUT
        code = _jobs(Path(opts.log_dir))
        for where in monitors:
            print(f"\njobs of the monitor on {where['monitor']['name']} ({where['log_dir']}):", flush=True)
            code = clustermon.proxy(where, ["jobs"]) or code
        return code
    if not JOB_ID.match(opts.job):  # it names a directory under --log-dir: no path may come through
        print(f"ddp-launch: error: job {opts.job!r}: not a job id (letters, digits, '.', '_', '-')",
              file=sys.stderr)  # fmt: skip
        return exitcodes.BAD_INPUT
    data = jobstate.read_state(jobstate.state_path(opts.log_dir, opts.job))
    record: dict[str, Any] | None = None
    if data is None and not PROXIED:  # not under --log-dir: found by its job id, from any directory,
        try:  # or through --hosts
            record = clustermon.found_record(opts.job, opts.hosts, opts.extra_vars)
        except LaunchError as e:
            print(f"ddp-launch: error: {e}", file=sys.stderr)
            return exitcodes.BAD_INPUT
    if record:
        if record.get("monitor"):
            return clustermon.proxy(record, [command, opts.job, *_flags(opts)])
        opts.log_dir = record.get("log_dir") or opts.log_dir
        data = jobstate.read_state(jobstate.state_path(opts.log_dir, opts.job))
    if data is None:
        known = ", ".join(j["job_id"] for j in jobstate.list_jobs(opts.log_dir)[-5:]) or "none"
        hint = "" if opts.hosts or PROXIED else "; a job detached from another machine: add --hosts INVENTORY"
        print(f"ddp-launch: error: no job {opts.job!r} in {opts.log_dir}/ (recent: {known}){hint}",
              file=sys.stderr)  # fmt: skip
        return exitcodes.BAD_INPUT
    job_dir = Path(opts.log_dir) / opts.job
    if command == "status" and opts.json:  # the record as it is (argv's secrets are masked in it)
        print(json.dumps(data, indent=1, sort_keys=True))
        return exitcodes.OK
    if data.get("slurm"):  # submitted through Slurm: its state and, once nobody follows it, logs and stop
        from ddp_train.launch.slurm.jobctl import command as slurm_command

        if (code := slurm_command(opts, job_dir, data)) is not None:
            return code
    if command == "status":
        return _status(job_dir, data)
    if command == "logs":
        return _logs(job_dir, data, opts.follow, opts.node)
    if command == "attach":
        return _attach(job_dir, data)
    return _stop(job_dir, data, opts.no_wait)


def _monitors(opts: argparse.Namespace) -> list[dict[str, Any]]:
    """The monitor hosts whose jobs `jobs` lists too: this machine's records', and --hosts' own (a
    LaunchError when that inventory is bad)."""
    records = clustermon.remote_records()
    found = clustermon.found_record(None, opts.hosts, opts.extra_vars) if opts.hosts else None
    seen = {(r["monitor"].get("name"), r.get("log_dir")) for r in records}
    if found and (found["monitor"]["name"], found["log_dir"]) not in seen:
        records.append(found)
    return records


def _flags(opts: argparse.Namespace) -> list[str]:
    """The job command's own options, for the same command on the monitor host."""
    flags = ["--json"] if getattr(opts, "json", False) else []
    flags += ["-f"] if getattr(opts, "follow", False) else []
    flags += ["--node", opts.node] if getattr(opts, "node", None) else []
    return flags + (["--no-wait"] if getattr(opts, "no_wait", False) else [])


# ---- detach ---------------------------------------------------------------------------------------


def without_detach(args: list[str]) -> list[str]:
    """The launcher's arguments less its --detach (argparse also takes a prefix such as --deta): the
    first one only, so a --detach among the script's own arguments further on stays."""
    for i, a in enumerate(args):
        if len(a) > 4 and "--detach".startswith(a):
            return args[:i] + args[i + 1 :]
    return list(args)


MONITOR_ARGS_FILE = "monitor-args.json"  # the monitor's arguments (0600; it deletes the file once read)


def read_monitor_args(path: str) -> list[str]:
    """The arguments `detach` left for the monitor (and the file gone: it may hold secrets)."""
    try:
        with open(path, encoding="utf-8") as f:
            args = json.load(f)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SystemExit(f"ddp-launch: error: {path}: not a list of arguments")
    return args


def detach(run_args: list[str], job_id: str, log_dir: str) -> int:
    """Start the monitor in the background here, show its output until the job runs, return.

    The monitor's arguments (which may carry --env values) go in a 0600 file of the job's 0700 directory,
    not on its command line, where `ps` would show them for the whole job."""
    job_dir = jobstate.private_dir(Path(log_dir) / job_id)
    args_path = job_dir / MONITOR_ARGS_FILE
    monitor_args = ["run", "--monitor", "--job-id", job_id, *run_args]
    clustermon.save_record(job_id, None, log_dir)  # `status JOB` from any directory finds it
    jobstate.write_private(args_path, json.dumps(monitor_args).encode())
    argv = [sys.executable, "-m", "ddp_train.launch.cli", MONITOR_ARGS, str(args_path.resolve())]
    return clustermon.start_monitor(argv, job_id, job_dir, where="")


# ---- jobs / status --------------------------------------------------------------------------------


def _master_log(job_dir: Path, data: dict[str, Any]) -> Path | None:
    nodes = data.get("nodes") or []
    master = next((n for n in nodes if n.get("rank") == 0), None)
    return host_log_path(job_dir, master["host"]) if master else None


def _elapsed(data: dict[str, Any]) -> float | None:
    started = data.get("started")
    if not isinstance(started, (int, float)):
        return None
    return float(data.get("ended") or time.time()) - started


def _state_text(data: dict[str, Any]) -> str:
    state = jobstate.effective_state(data)
    if state == "finished":
        return f"finished (exit {data.get('exit_code')})"
    return state


def _jobs(log_dir: Path) -> int:
    rows = []
    for data in jobstate.list_jobs(log_dir):
        path = _master_log(Path(data["dir"]), data)
        step = read_host_log(path).last_step if path else None
        rows.append([
            data["job_id"],
            _state_text(data),
            len(data.get("nodes") or []),
            f"{step.step}/{step.total}" if step else "-",
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data.get("started") or 0)),
            duration(_elapsed(data)),
        ])  # fmt: skip
    if not rows:
        print(f"no jobs in {log_dir}/")
        return 0
    print(table(["JOB", "STATE", "NODES", "STEP", "STARTED", "ELAPSED"], rows))
    return 0


def _status(job_dir: Path, data: dict[str, Any]) -> int:
    state = _state_text(data)
    print(
        f"job {data['job_id']}: {state}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(data.get('started') or 0))}, elapsed "
        f"{duration(_elapsed(data))}, monitor pid {data.get('pid')}"
        f"{' (detached)' if data.get('detached') else ''}, master "
        f"{data.get('master_addr')}:{data.get('master_port')}"
    )
    if data.get("reason"):
        print(f"reason: {data['reason']}")
    for line in recovery_lines(data):
        print(line)
    if jobstate.effective_state(data) == "lost":
        print(
            "the monitor is gone (killed?); every node stops its job by itself within "
            "30s of losing it (ddp_train/agent.py lifeline) and saves a checkpoint"
        )
    rows = []
    now = time.time()
    for n in data.get("nodes") or []:
        log = read_host_log(host_log_path(job_dir, n["host"]))
        s = log.last_step
        rows.append([
            n["host"], n.get("rank"),
            f"{s.step}/{s.total}" if s else "-",
            f"{s.loss:.4f}" if s else "-",
            f"{s.tokens_per_s:.0f}" if s else "-",
            duration(log.eta_s()) if s and jobstate.effective_state(data) in jobstate.LIVE else "-",
            f"{duration(now - log.last_line_at)} ago" if log.last_line_at else "-",
        ])  # fmt: skip
    print(table(["HOST", "RANK", "STEP", "LOSS", "TOK/S", "ETA", "LAST OUTPUT"], rows))
    print("(step, loss, tok/s: rank 0's latest step line; every rank is at the same step under DDP)")
    if jobstate.effective_state(data) in jobstate.LIVE:  # GPU use now, one nvidia-smi per node (gpuuse.py)
        from ddp_train.launch.jobs import gpuuse

        print("\n".join(gpuuse.lines(data, live=True)))
    from ddp_train.launch.jobs.metricsview import refresh

    for line in refresh(job_dir, data):
        print(line)
    return 0


def recovery_lines(data: dict[str, Any]) -> list[str]:
    """A job run with ddp_on_node_loss: restart: its attempts, each lost node (when, why, the steps it
    cost, how long until training went on) and the world it runs on now."""
    from ddp_train.launch.run.nodeloss import lost_line

    attempts, lost = data.get("attempts") or [], data.get("lost") or []
    if len(attempts) < 2 and not lost:
        return []
    out = []
    for a in attempts:
        steps = "-" if a.get("last_step") is None else f"{a.get('resumed_step') or 0}-{a['last_step']}"
        out.append(
            f"attempt {a.get('n')}: {len(a.get('nodes') or [])} nodes ({', '.join(a.get('nodes') or [])}), "
            f"master {a.get('master')}, steps {steps}"
            + (f", exit {a['exit_code']}: {a.get('reason')}" if a.get("exit_code") is not None else "")
        )
    for x in lost:
        after = next((a for a in attempts if a.get("n") == (x.get("attempt") or 0) + 1), None)
        before = next((a for a in attempts if a.get("n") == x.get("attempt")), None)
        line = lost_line(x, "%Y-%m-%d %H:%M:%S")
        if after and before and after.get("resumed_step") is not None and before.get("last_step"):
            line += f"; steps lost: {max(0, before['last_step'] - after['resumed_step'])}"
        if after and after.get("first_step_at") and x.get("at"):
            line += f"; training went on {after['first_step_at'] - x['at']:.0f}s later"
        out.append(line)
    if lost:
        policy = data.get("policy") or {}
        out.append(
            f"{len(lost)} of ddp_max_node_losses {policy.get('max_losses')} used; now on "
            f"{len(data.get('nodes') or [])} node(s); a lost node is not re-added while the job runs "
            f"(ddp-launch restart {data.get('job_id')} after it ends uses every node the inventory selects)"
        )
    return out


# ---- logs / attach --------------------------------------------------------------------------------


def _log_file(job_dir: Path, node: str | None) -> Path:
    if node:
        return host_log_path(job_dir, node)
    console = job_dir / jobstate.CONSOLE_FILE
    return console if console.exists() else job_dir / "launcher.log"


def _follow(path: Path, job_dir: Path, offset: int) -> int:
    """Print path's new lines until the job is no longer live; the job's exit code (or 0)."""
    state_path = job_dir / jobstate.STATE_FILE
    while True:
        offset = show_new(path, offset, sys.stdout)
        data = jobstate.read_state(state_path) or {}
        state = jobstate.effective_state(data)
        if state not in jobstate.LIVE:
            time.sleep(POLL_S)
            show_new(path, offset, sys.stdout)
            if state == "lost":
                print("ddp-launch: the job's monitor is gone (killed?); the nodes stop by themselves")
                return exitcodes.NODE_FAILED
            return int(data.get("exit_code") or 0)
        time.sleep(POLL_S)


def _logs(job_dir: Path, data: dict[str, Any], follow: bool, node: str | None) -> int:
    if node and node not in {n.get("host") for n in data.get("nodes") or []}:
        hosts = ", ".join(str(n.get("host")) for n in data.get("nodes") or [])
        print(
            f"ddp-launch: error: --node {node}: not a node of job {data['job_id']} ({hosts})", file=sys.stderr
        )
        return exitcodes.BAD_INPUT
    path = _log_file(job_dir, node)
    if not follow:
        show_new(path, 0, sys.stdout)
        return 0
    try:
        return _follow(path, job_dir, 0)
    except KeyboardInterrupt:
        return 130


def _attach(job_dir: Path, data: dict[str, Any]) -> int:
    path = _log_file(job_dir, None)
    # Ctrl-C must detach even when started with SIGINT ignored (a non-interactive shell's `cmd &`).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    tail_from = _tail_offset(path, size, 20)
    print(f"ddp-launch: attached to job {data['job_id']} ({_state_text(data)}); Ctrl-C detaches, the job "
          f"keeps running (ddp-launch stop {data['job_id']} stops it)", flush=True)  # fmt: skip
    try:
        return _follow(path, job_dir, tail_from)
    except KeyboardInterrupt:
        print(f"\nddp-launch: detached from job {data['job_id']}; it keeps running", flush=True)
        return 0


def _tail_offset(path: Path, size: int, lines: int) -> int:
    """The offset of the last `lines` lines of path."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, size - 65536))
            chunk = f.read(size - f.tell())
    except OSError:
        return 0
    base = size - len(chunk)
    cut = len(chunk)
    for _ in range(lines + 1):
        cut = chunk.rfind(b"\n", 0, cut)
        if cut < 0:
            return base
    return base + cut + 1


# ---- stop -----------------------------------------------------------------------------------------


def _stop(job_dir: Path, data: dict[str, Any], no_wait: bool) -> int:
    state = jobstate.effective_state(data)
    job_id = data["job_id"]
    if state == "lost":
        print(f"ddp-launch: job {job_id}: its monitor (pid {data.get('pid')}) is gone; the nodes stop by "
              "themselves within 30s of losing it (lifeline), saving a checkpoint")  # fmt: skip
        return exitcodes.NODE_FAILED
    if state not in jobstate.LIVE:
        print(f"ddp-launch: job {job_id} is not running ({_state_text(data)})")
        return 0
    pid = int(data["pid"])
    path = _log_file(job_dir, None)
    offset = path.stat().st_size if path.exists() else 0
    os.kill(pid, signal.SIGTERM)
    print(f"ddp-launch: sent SIGTERM to job {job_id}'s monitor (pid {pid}): every rank finishes its step "
          "and saves", flush=True)  # fmt: skip
    if no_wait:
        return 0
    state_path = job_dir / jobstate.STATE_FILE
    if data.get("detached"):
        _follow(path, job_dir, offset)
    else:  # a foreground job: its own terminal shows the stop
        while jobstate.effective_state(jobstate.read_state(state_path) or {}) in jobstate.LIVE:
            time.sleep(POLL_S)
    final = jobstate.read_state(state_path) or {}
    if final.get("exit_code") == 0 or final.get("stopped_cleanly"):
        return 0
    print(f"ddp-launch: job {job_id} did not stop cleanly: {_state_text(final)}", file=sys.stderr)
    return exitcodes.NODE_FAILED
