"""`--detach` with the job's monitor on the cluster (issue 30): the job outlives the controller.

The controller prepares the job as a foreground run does (sync, preflight, each node's interface, the
config copied), then sends the prepared plan to the monitor host (ddp_monitor_host, else the master
node) on the stdin of one SSH command, `python -m ddp_train.launch.jobs.clustermon start JOB DIR`. That
command writes it to a 0600 file of the job's 0700 directory there (secrets: never on a command line),
starts the monitor (`ddp_train.launch.cli --monitor-request-file FILE`: the launch without its
preparation) under a supervisor that outlives the SSH session, and shows its output until the job runs
on every node, as a local --detach does. The supervisor: a transient systemd service (systemd-run)
where systemd is PID 1, since logind may kill what a session leaves behind (KillUserProcesses=, see
logind.conf(5)); elsewhere setsid. The monitor reaches the nodes with the cluster-internal key and known
hosts (ddp_cluster_key, ddp_cluster_known_hosts: roles/cluster_monitor), never the controller's.

The controller keeps a record per job in $XDG_STATE_HOME/ddp-train/jobs/<job>.json (found by job id,
from any directory); `jobs/status/logs/attach/stop JOB` run the same command on the monitor host over
SSH when the job is not under --log-dir.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_train import __version__, exitcodes
from ddp_train.launch.cliparse import MONITOR_REQUEST  # cli: the monitor's launch request (a 0600 pickle)
from ddp_train.launch.errors import LaunchError
from ddp_train.launch.jobs import jobstate
from ddp_train.launch.run.logs import show_new

if TYPE_CHECKING:
    import argparse

    from ddp_train.launch.pipeline import LaunchConfig
    from ddp_train.launch.plan.inventory import Node
    from ddp_train.launch.plan.plan import JobPlan

REQUEST_FILE = "monitor-request.pkl"
PROXIED_ENV = "DDP_LAUNCH_PROXIED"  # set on the job commands clustermon.proxy runs on the monitor host
UNIT_PREFIX = "ddp-job-"  # systemd-run's unit: ddp-job-<job>.service
POLL_S = 0.3  # how often whoever follows a monitor (detach, logs -f, attach, stop) looks again
DETACH_WAIT_S = 900.0  # --detach stops showing the start after this; the monitor goes on
OPTIONS = ("connect_timeout", "net_timeout", "grace", "timeout", "stall_timeout", "overrides", "strict",
           "skip_preflight")  # fmt: skip
HERE_WARNING = (
    "ddp-launch: warning: --monitor-here: the job's monitor runs on this machine; if it sleeps, loses its "
    "network or shuts down, every node stops the job within 30 s (lifeline). Without --monitor-here the "
    "monitor runs on the cluster (ddp_monitor_host, else the master node)"
)


# ---- the controller -------------------------------------------------------------------------------


def monitor_node(plan: JobPlan, opts: argparse.Namespace) -> Node | None:
    """The host that runs the detached job's monitor: ddp_monitor_host (a node of the job, or any host
    of the inventory, such as a login node), else the master node. None when it is this machine."""
    from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY

    master = plan.master.node
    name = master.monitor_host or master.name
    node = next((p.node for p in plan.nodes if p.node.name == name), None)
    if node is None:
        node = _host(name, opts.hosts or [DEFAULT_INVENTORY], opts.extra_vars)
    return None if node.local or node.ssh is None else node


def _host(name: str, hosts: list[str], extra_vars: list[str]) -> Node:
    from ddp_train.launch.plan.inventory import inventory_host

    node = inventory_host(name, hosts, extra_vars)
    if node is None:
        raise LaunchError(f"ddp_monitor_host {name!r}: no such host in the inventory")
    return node


def inventory_monitor(hosts: list[str], extra_vars: list[str]) -> tuple[Node | None, str]:
    """The monitor host of the jobs this inventory launches and its directory, picked as detach picks them
    at launch (monitor_node, detach_to_cluster): ddp_monitor_host, else the master node (ddp_master,
    else the first node of the node group), and the master's ddp_monitor_dir. None: this machine. For the
    job commands on a machine with the inventory and no record of the job (a second laptop)."""
    from ddp_train.launch.plan.inventory import load_nodes

    nodes = load_nodes(hosts, extra_vars=extra_vars)
    if not nodes:
        raise LaunchError(f"inventory {', '.join(hosts)}: no nodes")
    master = next((n for n in nodes if n.name == nodes[0].master), nodes[0])
    name = master.monitor_host or master.name
    node = next((n for n in nodes if n.name == name), None) or _host(name, hosts, extra_vars)
    return (None if node.local or node.ssh is None else node), master.monitor_dir


def cluster_plan(plan: JobPlan) -> JobPlan:
    """The plan as the monitor host uses it: every node reached with the cluster-internal key and known
    hosts (~ expanded there), directly (the controller's password, proxy or jump host stay here)."""
    master = plan.master.node
    keys = (master.cluster_key,) if master.cluster_key else ()
    known = (master.cluster_known_hosts,) if master.cluster_known_hosts else ()
    nodes = []
    for p in plan.nodes:
        ssh = p.node.ssh
        if ssh is not None:
            ssh = dataclasses.replace(ssh, key_files=keys, known_hosts_files=known, password=None,
                                      proxy_command=None, proxy_jump=None)  # fmt: skip
        nodes.append(dataclasses.replace(p, node=dataclasses.replace(p.node, ssh=ssh)))
    return dataclasses.replace(plan, nodes=tuple(nodes), config=None, sync=None, script_check=None)


def detach_to_cluster(cfg: LaunchConfig, monitor: Node) -> int:
    """Prepare the job here, start its monitor on `monitor`, show its output until the job runs."""
    from ddp_train.launch.pipeline import Refused, SshBackend
    from ddp_train.launch.plan.plan import mask_argv
    from ddp_train.launch.remote.remote import RemoteError
    from ddp_train.launch.run.logs import JobLog

    plan = cfg.plan
    log = JobLog(Path(cfg.log_dir), plan.job_id, secrets=plan.secrets())
    monitor_dir = plan.master.node.monitor_dir
    try:
        with SshBackend(cfg, log) as nodes:
            try:
                plan = nodes.prepare(plan, lambda _: None)
            except Refused as e:
                return e.code
            request = {
                "version": __version__,
                "plan": cluster_plan(plan),
                "argv": list(cfg.argv),
                "options": {k: getattr(cfg, k) for k in OPTIONS},
                "config": (Path(plan.config).name, Path(plan.config).read_bytes()) if plan.config else None,
            }
            save_record(plan.job_id, monitor, monitor_dir, mask_argv(list(cfg.argv), plan.secrets()),
                        master=(plan.master_name, plan.master_addr))  # fmt: skip
            log.note(f"starting the job's monitor on {monitor.name} ({monitor.where}), in {monitor_dir}")
            try:
                code = _start_remote(nodes.pool.get(monitor), monitor, monitor_dir, plan.job_id,
                                     pickle.dumps(request))  # fmt: skip
            except RemoteError as e:
                log.note(f"cannot start the monitor on {monitor.name}: {e}")
                return exitcodes.NODE_FAILED
    finally:
        log.close()
    if code == 0:
        print(f"  (from any directory of this machine: the job's record is {record_path(plan.job_id)})",
              flush=True)  # fmt: skip
    return code


def _start_remote(session: Any, monitor: Node, monitor_dir: str, job_id: str, request: bytes) -> int:
    python = f"{monitor.venv}/bin/python"
    command = (f"cd && umask 077 && exec {shlex.quote(python)} -m ddp_train.launch.jobs.clustermon start "
               f"{shlex.quote(job_id)} {shlex.quote(monitor_dir)}")  # fmt: skip
    stream = session.start(command, stdin=True)
    try:
        stream.send(request)
    finally:
        stream.close_stdin()
    for line in stream.lines():
        print(line, flush=True)
    code, lost = stream.wait(timeout=30)
    stream.close()
    if code is None:
        print(f"ddp-launch: the monitor host {monitor.name}: {lost}", file=sys.stderr)
        return exitcodes.NODE_FAILED
    if code == 127:
        print(f"ddp-launch: {monitor.name}: no {python} (ddp_venv: roles/pytorch)", file=sys.stderr)
    return code


# ---- the records: which host runs a job's monitor, found by job id --------------------------------


def records_dir() -> Path:
    """$XDG_STATE_HOME/ddp-train/jobs (XDG Base Directory spec: state data, default ~/.local/state)."""
    return Path(os.environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / "ddp-train" / "jobs"


def record_path(job_id: str) -> Path:
    return records_dir() / f"{job_id}.json"


def save_record(
    job_id: str,
    monitor: Node | None,
    log_dir: str,
    argv: list[str] | None = None,
    master: tuple[str, str] | None = None,
) -> None:
    """monitor None: the monitor runs here, its state under log_dir (made absolute). `argv` (secrets
    masked), this directory and the master (node, address) are kept for `restart`, whose job.json is
    then on the monitor host."""
    data: dict[str, Any] = {"job_id": job_id, "saved": time.time()}
    if argv is not None:
        data.update(argv=argv, cwd=os.getcwd())
    if master is not None:
        data.update(master=master[0], master_addr=master[1])
    if monitor is None:
        data["log_dir"] = str(Path(log_dir).resolve())
    else:
        assert monitor.ssh is not None
        ssh = {k: v for k, v in dataclasses.asdict(monitor.ssh).items() if k != "password"}
        data.update(log_dir=log_dir, monitor={"name": monitor.name, "venv": monitor.venv, "ssh": ssh})
    jobstate.write_state(record_path(job_id), data)


def load_record(job_id: str) -> dict[str, Any] | None:
    return jobstate.read_state(record_path(job_id))


def remote_records() -> list[dict[str, Any]]:
    """One record per monitor host and directory (of the jobs whose monitor is on the cluster)."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(records_dir().glob("*.json")):
        data = jobstate.read_state(path)
        if data and isinstance(data.get("monitor"), dict):
            seen.setdefault((data["monitor"].get("name"), data.get("log_dir")), data)
    return list(seen.values())


def home_path(path: str) -> str:
    """`path` for a remote shell, quoted, with a leading ~ as the remote user's $HOME (ddp_monitor_dir may
    say ~/jobs: remote_start expands it there, so must whoever asks for the same directory)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def found_record(job_id: str | None, hosts: list[str] | None, extra_vars: list[str]) -> dict[str, Any] | None:
    """Where a job's monitor is: this machine's record of it, else (with `hosts`) the monitor host that
    inventory names and its ddp_monitor_dir. None: neither (or the inventory's monitor is this machine)."""
    record = load_record(job_id) if job_id else None
    if record or not hosts:
        return record
    node, log_dir = inventory_monitor(hosts, extra_vars)
    if node is None:
        return None
    return {"job_id": job_id, "log_dir": log_dir, "node": node, "monitor": {"name": node.name}}


def _record_node(record: dict[str, Any]) -> Node:
    from ddp_train.launch.plan.inventory import Node, SshTarget

    m = record["monitor"]
    ssh = dict(m["ssh"])
    for key in ("key_files", "known_hosts_files"):
        ssh[key] = tuple(ssh.get(key) or ())
    return Node(name=m["name"], address=ssh["host"], local=False, ssh=SshTarget(**ssh), venv=m["venv"],
                workdir=None, nproc="1", master_port=0, env={})  # fmt: skip


def proxy(record: dict[str, Any], args: list[str], connect_timeout: float = 10,
          out: Callable[[str], None] | None = None) -> int:  # fmt: skip
    """Run `ddp-launch ARGS --log-dir DIR` on the job's monitor host; its output here (each line to `out`,
    else printed; this function's own error lines too), its exit code. The record: a saved one
    (load_record) or found_record's."""
    from ddp_train.launch.remote.remote import RemoteError, open_session

    def error(text: str) -> None:
        if out is None:
            print(f"ddp-launch: error: {text}", file=sys.stderr)
        else:
            out(text)

    try:
        node = record["node"] if "node" in record else _record_node(record)
    except (KeyError, TypeError):  # written by another version, or by hand
        error(f"{record_path(record.get('job_id') or '?')}: not a record of a job's monitor host (fields "
              "monitor.name, .venv, .ssh)")  # fmt: skip
        return exitcodes.BAD_INPUT
    python = f"{node.venv}/bin/python"
    command = (f"cd && {PROXIED_ENV}=1 exec {shlex.quote(python)} -m ddp_train.launch.cli "
               f"{shlex.join(args)} --log-dir {home_path(record['log_dir'])}")  # fmt: skip
    what = f"the monitor host of job {record['job_id']}" if record.get("job_id") else "the monitor host"
    try:
        session = open_session(node, connect_timeout)
    except RemoteError as e:
        error(f"{what} ({node.name}): {e}")
        return exitcodes.NODE_FAILED
    try:
        stream = session.start(command)
        try:
            for line in stream.lines():
                if out is None:
                    print(line, flush=True)
                else:
                    out(line)
        except KeyboardInterrupt:
            if args[0] == "attach":
                print(f"\nddp-launch: detached from job {record['job_id']}; it keeps running", flush=True)
                return 0
            return exitcodes.SIGINT
        code, lost = stream.wait(timeout=10)
    except RemoteError as e:
        error(str(e))
        return exitcodes.NODE_FAILED
    finally:
        session.close()
    if code is None:
        error(f"{node.name}: {lost}")
        return exitcodes.NODE_FAILED
    return code


# ---- the monitor host -----------------------------------------------------------------------------


def systemd_booted() -> bool:
    """sd_booted(3): systemd is PID 1 exactly when /run/systemd/system/ exists
    (https://man7.org/linux/man-pages/man3/sd_booted.3.html)."""
    return os.path.isdir("/run/systemd/system")


def supervisor() -> str:
    """systemd (a system service: root's) where systemd runs, else setsid. A user's own service manager
    would stop with the user's last session unless lingering; setsid's process stays in the session's
    scope, which logind ends only with KillUserProcesses=yes (default no on most distributions, and root
    is excluded by KillExcludeUsers=root: logind.conf(5))."""
    return "systemd" if systemd_booted() and os.geteuid() == 0 else "setsid"


class Unit:
    """The monitor as a transient systemd service (not this process's child): what detach polls."""

    def __init__(self, name: str, state_path: Path) -> None:
        self.name, self.state_path = name, state_path
        self.pid: int | str = name

    def poll(self) -> int | None:
        data = jobstate.read_state(self.state_path) or {}
        if isinstance(data.get("pid"), int):
            self.pid = data["pid"]
        if data.get("state") == "finished":
            return int(data.get("exit_code") or 0)
        if subprocess.run(["systemctl", "is-active", "--quiet", self.name], check=False).returncode == 0:
            return None
        data = jobstate.read_state(self.state_path) or {}  # it may have written its end as it exited
        if data.get("state") == "finished":
            return int(data.get("exit_code") or 0)
        return exitcodes.NODE_FAILED  # the unit is gone: whatever its state file still says

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout)
            time.sleep(0.3)
        return code

    def terminate(self) -> None:
        subprocess.run(["systemctl", "kill", "--signal=SIGTERM", self.name], check=False)


def systemd_argv(job_id: str, console: Path, argv: list[str]) -> list[str]:
    """systemd-run(1): a transient service with the monitor's output appended to console.log."""
    return [
        "systemd-run", f"--unit={UNIT_PREFIX}{job_id}", "--collect", "--quiet",
        f"--working-directory={Path.home()}", "--setenv=PYTHONUNBUFFERED=1",
        f"--property=StandardOutput=append:{console}", f"--property=StandardError=append:{console}",
        "--", *argv,
    ]  # fmt: skip


def start_monitor(argv: list[str], job_id: str, job_dir: Path, where: str, supervisor: str = "setsid") -> int:
    """Start the monitor `argv` (setsid, or a systemd unit), its output to console.log, show
    that until the job runs on every node (or the monitor gives up); its exit code then, else 0."""
    console_path = job_dir / jobstate.CONSOLE_FILE
    state_path = job_dir / jobstate.STATE_FILE
    if state_path.exists():
        state_path.unlink()  # a previous run of this job id: its state is not this one's
    proc: Any
    with open(jobstate.open_private(console_path), "ab") as console:
        start = console.seek(0, os.SEEK_END)
        if supervisor == "systemd":
            unit = subprocess.run(
                systemd_argv(job_id, console_path, argv), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False,
            )  # fmt: skip
            if unit.returncode != 0:
                print(f"ddp-launch: error: systemd-run: {unit.stdout.strip()}", file=sys.stderr)
                return exitcodes.NODE_FAILED
            proc = Unit(f"{UNIT_PREFIX}{job_id}", state_path)
        else:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # setsid: no controlling terminal, no SIGHUP when it closes
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                close_fds=True,
            )
    shown = start
    deadline = time.monotonic() + DETACH_WAIT_S
    try:
        while True:
            shown = show_new(console_path, shown, sys.stdout)
            code = proc.poll()
            data = jobstate.read_state(state_path) or {}
            if data.get("state") in ("running", "stopping", "finished") or code is not None:
                break
            if time.monotonic() > deadline:
                print(
                    f"ddp-launch: job {job_id} is still {data.get('state') or 'starting'} after "
                    f"{DETACH_WAIT_S:.0f} s; it goes on detached (ddp-launch status {job_id}); its output: "
                    f"{console_path}",
                    flush=True,
                )
                return 0
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        proc.terminate()
        print(f"\nddp-launch: interrupted; stopping job {job_id} (monitor pid {proc.pid})", file=sys.stderr)
        return 130
    if code is None and data.get("state") == "finished":  # it wrote its end; its process is exiting
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = int(data.get("exit_code") or 1)
    if code is not None:  # the monitor ended before the job ran (preflight failed, bad input ...)
        time.sleep(POLL_S)
        show_new(console_path, shown, sys.stdout)
        return code
    print(
        f"ddp-launch: job {job_id} runs detached on {len(data.get('nodes') or [])} nodes (monitor pid "
        f"{data.get('pid') or proc.pid}{' ' + where if where else ''}); its output: {console_path}\n"
        f"  ddp-launch status {job_id}    ddp-launch attach {job_id}    ddp-launch logs {job_id} -f\n"
        f"  ddp-launch stop {job_id}      (from any directory of this machine)",
        flush=True,
    )
    return 0


def remote_start(job_id: str, log_dir: str) -> int:
    """On the monitor host: the request from stdin into a 0600 file, the monitor started under its
    supervisor, its output shown until the job runs on every node."""
    from ddp_train.launch.plan.plan import check_job_id

    check_job_id(job_id)
    request = sys.stdin.buffer.read()
    job_dir = jobstate.private_dir(Path(log_dir).expanduser().resolve() / job_id)
    path = job_dir / REQUEST_FILE
    jobstate.write_private(path, request)
    # this host's own record too: here (a phone's SSH session), `ddp-launch status JOB` finds the job
    # from any directory, with nothing but the venv; not over the controller's (a home both share)
    if not (load_record(job_id) or {}).get("monitor"):
        save_record(job_id, None, str(job_dir.parent))
    argv = [sys.executable, "-m", "ddp_train.launch.cli", MONITOR_REQUEST, str(path)]
    how = supervisor()
    return start_monitor(argv, job_id, job_dir, where=f"on {os.uname().nodename} under {how}", supervisor=how)


def run_monitor(path: str) -> int:
    """The monitor: the controller's prepared plan launched here (cli --monitor-request-file FILE)."""
    from ddp_train.launch.pipeline import LaunchConfig, launch

    try:
        with open(path, "rb") as f:
            # written by this user's controller, 0600 in a 0700 directory: who can write it runs as this user
            request = pickle.load(f)  # noqa: S301
    finally:
        os.unlink(path)
    if request.get("version") != __version__:
        print(f"ddp-launch: warning: the controller runs ddp_train {request.get('version')}, this host "
              f"{__version__}", flush=True)  # fmt: skip
    plan: JobPlan = request["plan"]
    nodes = []
    for p in plan.nodes:  # the cluster-internal key and known hosts, as this host's user sees them
        ssh = p.node.ssh
        if ssh is not None:
            ssh = dataclasses.replace(ssh, key_files=_expanded(ssh.key_files),
                                      known_hosts_files=_expanded(ssh.known_hosts_files))  # fmt: skip
        nodes.append(dataclasses.replace(p, node=dataclasses.replace(p.node, ssh=ssh)))
    plan = dataclasses.replace(plan, nodes=tuple(nodes))
    job_dir = Path(path).parent
    if request.get("config"):
        name, data = request["config"]
        jobstate.write_private(job_dir / name, data)
        plan = dataclasses.replace(plan, config=str(job_dir / name))
    cfg = LaunchConfig(plan, request["argv"], log_dir=str(job_dir.parent), monitor=True, prepared=True,
                       **request["options"])  # fmt: skip
    return launch(cfg)


def _expanded(paths: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(os.path.expanduser(p) for p in paths)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "start":
        try:
            return remote_start(argv[1], argv[2])
        except LaunchError as e:
            print(f"ddp-launch: error: {e}", file=sys.stderr)
            return exitcodes.BAD_INPUT
    print("usage: python -m ddp_train.launch.jobs.clustermon start JOB DIR", file=sys.stderr)
    return exitcodes.BAD_INPUT


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(sys.argv[1:]))
