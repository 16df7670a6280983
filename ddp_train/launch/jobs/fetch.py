"""`ddp-launch fetch JOB [best|last|metrics] [--to DIR]`: a packaged-trainer job's results from rank 0's node.

The run directory is where job.json's "metrics" (rank 0's host and its metrics.jsonl) says; `best` is
best.pt there, `last` the newest step-*.pt of checkpoint.dir (default <run dir>/checkpoints), `metrics`
metrics.jsonl. The node hashes the file (node/results.py); the copy lands in DIR (default: here) under a
temporary name and is renamed into place only when its sha256 matches.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_train.digest import file_sha256
from ddp_train.launch.errors import LaunchError, one_line
from ddp_train.launch.node import command, marked_json
from ddp_train.launch.node.results import MARK


def dirs(job_id: str, data: dict[str, Any]) -> tuple[str, str, str]:
    """(rank 0's host, run dir, checkpoint dir) on that node, from job.json and the recorded config."""
    from ddp_train.launch.jobs.recorded import parsed

    where = data.get("metrics")
    if not isinstance(where, dict) or not where.get("path") or not where.get("host"):
        raise LaunchError(
            f"job {job_id}: job.json names no results (field metrics): only the packaged trainer's are known"
        )
    run_dir = posixpath.dirname(where["path"])
    ckpt_dir = posixpath.join(run_dir, "checkpoints")
    try:
        from ddp_train.config import load_config

        _, opts = parsed(job_id, data)
        cfg = load_config(opts.config, list(opts.overrides))
        suffix = posixpath.join(cfg.run.dir, cfg.run.name)
        if cfg.checkpoint.dir:
            base = run_dir[: -len(suffix)] if run_dir.endswith(suffix) else ""
            c = str(cfg.checkpoint.dir)
            ckpt_dir = c if posixpath.isabs(c) or c.startswith("~") else posixpath.join(base or ".", c)
    except Exception:  # noqa: BLE001, S110 - a config that changed since: the default layout
        pass
    return where["host"], run_dir, ckpt_dir


def rank0_node(job_id: str, data: dict[str, Any], host: str) -> Any:
    from ddp_train.launch.jobs.recorded import inventory_nodes

    found = [n for n in inventory_nodes(job_id, data) if n.name == host]
    if not found:
        raise LaunchError(f"job {job_id}: rank 0's host {host} is no longer in the inventory")
    return found[0]


def fetch(job_id: str, data: dict[str, Any], what: str, to: str, connect_timeout: float = 10,
          hosts: list[str] | None = None, extra_vars: list[str] | None = None) -> str:  # fmt: skip
    """Copy the file; its local path. LaunchError (one line) if it cannot. Rank 0's node is found in the
    recorded command's inventory, or in `hosts` (a machine other than the one that launched the job)."""
    from ddp_train.launch.jobs.recorded import in_recorded_dir
    from ddp_train.launch.plan.inventory import inventory_host
    from ddp_train.launch.remote.remote import RemoteError, open_session

    out_dir = Path(to).expanduser().resolve()
    here = os.getcwd()
    recorded = isinstance(data.get("cwd"), str) and os.path.isdir(data["cwd"])
    if recorded or not hosts:
        in_recorded_dir(job_id, data)  # the recorded --hosts and --config are relative to it
    try:
        host, run_dir, ckpt_dir = dirs(job_id, data)
        node = None if hosts else rank0_node(job_id, data, host)
    finally:
        os.chdir(here)
    if node is None:  # rank 0's node in the inventory `hosts` names, relative to this directory
        node = inventory_host(host, hosts or [], extra_vars or [])
        if node is None:
            raise LaunchError(f"job {job_id}: rank 0's host {host} is not in {', '.join(hosts or [])}")
    try:
        session = open_session(node, connect_timeout)
        try:
            code, out = session.exec(command(node.venv, "results", what, run_dir, ckpt_dir), timeout=3600)
            found = marked_json(out, MARK) if code == 0 else None
            if not isinstance(found, dict):
                raise LaunchError(
                    f"{host}: {one_line(out.strip().splitlines()[-1] if out.strip() else f'exit {code}')}"
                )
            if "error" in found:
                raise LaunchError(f"job {job_id}: {what} on {host}: {found['error']}")
            out_dir.mkdir(parents=True, exist_ok=True)
            final = out_dir / posixpath.basename(found["path"])
            tmp = out_dir / f".{final.name}.{os.getpid()}.part"
            if node.local or node.ssh is None:
                shutil.copyfile(os.path.expanduser(found["path"]), tmp)
            else:
                try:
                    session.connection.get(found["path"], str(tmp))  # type: ignore[attr-defined]
                except Exception as e:  # paramiko/sftp raise IOError, SSHException...
                    tmp.unlink(missing_ok=True)
                    raise LaunchError(f"{host}: cannot copy {found['path']}: {one_line(str(e))}") from None
        finally:
            session.close()
    except RemoteError as e:
        raise LaunchError(str(e)) from None
    got = file_sha256(tmp)
    if got != found["sha256"]:
        tmp.unlink()
        raise LaunchError(
            f"{host}:{found['path']}: sha256 {got[:16]} after the copy, {found['sha256'][:16]} there"
        )
    os.replace(tmp, final)
    return f"{final} ({found['size']} bytes, sha256 {found['sha256'][:16]}, from {host}:{found['path']})"


def load(job_id: str, log_dir: str, command: bool = False, hosts: list[str] | None = None,
         extra_vars: list[str] | None = None, connect_timeout: float = 10) -> dict[str, Any]:  # fmt: skip
    """job.json of JOB under log_dir, else from its monitor on the cluster (this machine's record of the
    job, or the monitor host `hosts` names: clustermon.found_record); LaunchError (one line) for a bad id
    or a missing job. `command`: the recorded command is enough (restart), which this machine's record
    of a job monitored on the cluster keeps; without it, with `hosts`, job.json's command on the monitor
    host, to run from this directory on `hosts`' nodes (data "hosts": recorded.restart_argv)."""
    from ddp_train.launch.jobs import jobstate
    from ddp_train.launch.jobs.jobcmds import JOB_ID

    if not JOB_ID.match(job_id):
        raise LaunchError(f"job {job_id!r}: not a job id (letters, digits, '.', '_', '-')")
    data = jobstate.read_state(jobstate.state_path(log_dir, job_id))
    if data is None:
        from ddp_train.launch.jobs.clustermon import found_record

        record = found_record(job_id, hosts, extra_vars or []) or {}
        where = (record.get("monitor") or {}).get("name")
        if where and command and "argv" in record:
            kept = ("argv", "cwd", "master", "master_addr")
            return {"job_id": job_id, **{k: record[k] for k in kept if k in record}}
        if where and command and hosts:  # another machine: job.json's command, run from here, --hosts' nodes
            data = monitor_state(record, connect_timeout)
            kept = {k: data[k] for k in ("argv", "master", "master_addr") if k in data}
            return {"job_id": job_id, **kept, "cwd": os.getcwd(), "hosts": list(hosts)}
        if where and not command:  # its job.json is with its monitor on the cluster (--detach)
            data = monitor_state(record, connect_timeout)
            # the cwd there is the monitor's; the command's own is this machine's record's (none: --hosts)
            data["cwd"] = record.get("cwd")
            if "argv" in record:
                data["argv"] = record["argv"]
            return data
        if where:
            raise LaunchError(
                f"no job {job_id!r} in {log_dir}/: its monitor and job.json are on {where} "
                "(ddp_monitor_host) and this machine has no record of its command: restart it from the "
                "machine that launched it, or from a copy of its project directory here with `ddp-launch "
                "restart --hosts INVENTORY JOB`"
            )
        hint = "" if hosts else "; a job detached from another machine: add --hosts INVENTORY"
        raise LaunchError(f"no job {job_id!r} in {log_dir}/{hint}")
    return data


def monitor_state(record: dict[str, Any], connect_timeout: float = 10) -> dict[str, Any]:
    """job.json as the job's monitor host has it (`ddp-launch status JOB --json` run there: its lines
    from the first "{" on, whatever a login shell printed before)."""
    import json

    from ddp_train.launch.jobs.clustermon import proxy

    lines: list[str] = []
    code = proxy(record, ["status", record["job_id"], "--json"], connect_timeout, out=lines.append)
    name = record["monitor"]["name"]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("{")), None)
    try:
        data = json.loads("\n".join(lines[start:])) if code == 0 and start is not None else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        said = next((ln for ln in reversed(lines) if ln.strip()), f"exit {code}")
        raise LaunchError(
            f"no job {record['job_id']!r} here: its monitor and job.json are on {name} (ddp_monitor_host): "
            f"{one_line(said)}"
        )
    return data


def main(opts: Any, rerun: Callable[[list[str]], int]) -> int:
    """`fetch` or `restart` (`rerun`: the CLI's main, which runs the recorded command): exit 0, or 2 with
    one line."""
    import sys

    from ddp_train import exitcodes

    try:
        hosts, extra_vars = getattr(opts, "hosts", None), getattr(opts, "extra_vars", [])  # fetch has them
        data = load(opts.job, opts.log_dir, command=opts.command == "restart", hosts=hosts,
                    extra_vars=extra_vars, connect_timeout=getattr(opts, "connect_timeout", 10))  # fmt: skip
        if opts.command == "restart":
            from ddp_train.launch.jobs.recorded import restart

            return restart(opts.job, data, list(opts.extra), rerun)
        print(f"fetch: {fetch(opts.job, data, opts.what, opts.to, opts.connect_timeout, hosts, extra_vars)}")
        return exitcodes.OK
    except LaunchError as e:
        print(f"ddp-launch {opts.command}: error: {one_line(str(e), 1000)}", file=sys.stderr)
        return exitcodes.BAD_INPUT
