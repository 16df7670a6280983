"""The job plan: which node is master, each node's rank, env and the exact torchrun command it runs.

Every remote command is built only from shlex-quoted parts, so inventory values and trainer arguments
reach the trainer verbatim and are never interpreted by a shell. The environment (ddp_env, --env)
is not in the command at all: it goes to the node's agent as one JSON line on stdin (`env_line`), so
no value, secret or not, is readable in `ps` or /proc/PID/cmdline there.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import posixpath
import re
import secrets
import shlex
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.plan.inventory import NODE_LOSS_MODES, Node
from ddp_train.launch.plan.scriptcheck import ScriptCheck
from ddp_train.launch.remote.sync import Manifest, remote_dir

PGID_MARKER = "DDP-LAUNCH-PGID"
# A value is secret when its name looks like one, when it holds a URL with a password (user:pass@host) or
# a connection string's key, or when the inventory (ddp_secret_env) or the command line (--secret-env)
# marks it so.
# TOKEN but not TOKENS/TOKENIZER: `data.tokens.path` (the trainer's token files) and
# TOKENIZERS_PARALLELISM are no secrets, and masking them hid the data path and broke `restart`
SECRET_NAME = re.compile(
    r"TOKEN(?!S|IZ)|KEY|SECRET|PASSWORD|PASSWD|PASSPHRASE|PWD|CREDENTIAL|AUTH|COOKIE|PRIVATE|SIGNATURE",
    re.IGNORECASE,
)
# Short names only as a whole word part (DB_PASS, dbPass, GITHUB_PAT, AWS_CREDS, DB_PW): as substrings they
# are in PATH, PASSES, BYPASS, PATIENCE, CREDIT. PASS_THROUGH (a flag, like PASSTHROUGH) is no password.
SECRET_WORDS = frozenset({"PASS", "PW", "PAT", "CRED", "CREDS"})
WORD_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s:]*:[^/@\s]+@")
# The secret fields of connection strings (Azure storage and Service Bus, ADO.NET, ODBC) and of Azure SAS
# and S3 presigned URLs: the value is a secret whatever its name.
VALUE_SECRET = re.compile(
    r"(?:^|[;\s])(?:AccountKey|SharedAccessKey|SharedAccessSignature|Password|Pwd)\s*="
    r"|[?&](?:sig|X-Amz-Signature)=",
    re.IGNORECASE,
)
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MASK = "***"
DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
CONFIG_DIR = ".ddp-launch"  # per-job copies of --config on remote nodes, under the workdir
# The longest grace a stop (Ctrl-C, SIGTERM, --timeout) may get: torchrun's own wait before it kills the
# workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), so that the launcher, not torchrun, decides when to KILL.
STOP_GRACE_MAX_S = 600
ARGV_ENV = ("DDP_JOB_ID",)  # on the command line: how teardown finds the job's processes; no secret
FRESH = "checkpoint.resume=never"  # what --fresh means to the packaged trainer (checkpoint.py refuses)
# A resume on another node set keeps the checkpoint's global batch (ddp_train/batchplan.py): `restart` and
# an unattended restart after a lost node add it for the packaged trainer unless the command sets one.
KEEP_GLOBAL_BATCH = "train.global_batch=auto"


def global_batch_kept(overrides: Sequence[str]) -> list[str]:
    """The --set a resume on another node set adds for the packaged trainer: KEEP_GLOBAL_BATCH, or
    nothing when the command sets train.global_batch itself."""
    return [] if any(o.startswith("train.global_batch=") for o in overrides) else [KEEP_GLOBAL_BATCH]


@dataclasses.dataclass(frozen=True)
class Recovery:
    """What happens when a node is lost (launch/run/nodeloss.py): `stop` the job, as always, or `restart`
    it on the other nodes, at most `max_losses` times in all and never on fewer than `min_nodes`.
    ddp_on_node_loss, ddp_max_node_losses, ddp_min_nodes; --on-node-loss, --max-node-losses, --min-nodes."""

    mode: str = "stop"
    max_losses: int = 2
    min_nodes: int = 1


@dataclasses.dataclass(frozen=True)
class Options:
    """What the command line adds to the inventory."""

    job_id: str | None = None
    nproc_per_node: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None
    config: str | None = None  # local path; shipped to remote nodes
    overrides: Sequence[str] = ()
    trainer_args: Sequence[str] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    secret_env: frozenset[str] = frozenset()  # --secret-env names: their values are masked wherever shown
    debug: bool = False
    rdzv: str | None = None  # static | c10d; None: c10d when restarts are allowed on several nodes
    grace: float | None = None  # --grace: seconds a stop waits before KILL (None: derived, capped)
    script: str | None = None  # the user's script (or module with `module`) instead of -m ddp_train
    module: bool = False
    script_args: Sequence[str] = ()
    sync: Manifest | None = None  # --sync: the scanned directory every node runs from
    script_local: str | None = None  # the script's resolved path on this machine, when known
    required: Sequence[str] = ()  # files the run needs on every node (relative: to the run's directory)
    script_check: ScriptCheck | None = None  # what the script check found (None: not checked)
    script_check_mode: str = "warn"  # strict: findings refuse the launch
    on_node_loss: str | None = None  # --on-node-loss (None: ddp_on_node_loss)
    max_node_losses: int | None = None  # --max-node-losses (None: ddp_max_node_losses)
    min_nodes: int | None = None  # --min-nodes (None: ddp_min_nodes, else nodes - max losses, at least 1)
    attempt: int = 1  # an unattended restart's attempt: c10d's --rdzv-id differs per attempt


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """One node's part of the job."""

    node: Node
    rank: int  # the node rank torchrun will use
    env: Mapping[str, str]
    argv: tuple[str, ...]  # torchrun and its arguments
    config_path: str | None  # where --config lives on this node
    sync_dir: str | None = None  # the node's copy of --sync: the run starts there
    secret_names: frozenset[str] = frozenset()  # marked secret (ddp_secret_env, --secret-env)

    def secret(self, key: str) -> bool:
        return is_secret(key, self.env.get(key, ""), self.secret_names)

    @property
    def label(self) -> str:
        return f"{self.node.name} r{self.rank}"

    @property
    def cwd(self) -> str | None:
        """The directory torchrun starts in: the synced copy, else ddp_workdir (None: the login dir)."""
        return self.sync_dir or self.node.workdir

    @property
    def nproc(self) -> str:
        """torchrun's --nproc-per-node on this node: gpu, cpu, auto or a count."""
        if "--nproc-per-node" in self.argv:
            return self.argv[self.argv.index("--nproc-per-node") + 1]
        return self.node.nproc


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The whole job: every node's plan, master address and port."""

    job_id: str
    nodes: tuple[NodePlan, ...]  # in node-rank order
    master_addr: str  # static: MASTER_ADDR; c10d: the rendezvous endpoint's host
    master_port: int
    config: str | None
    master_name: str
    rdzv: str = "static"
    script: str | None = None  # as passed to torchrun (relative to the run's directory), or a module
    module: bool = False
    script_local: str | None = None  # the script on this machine (hook for checks before launch)
    sync: Manifest | None = None  # the synced directory; each node's copy is NodePlan.sync_dir
    required: tuple[str, ...] = ()  # checked on every node by preflight
    script_check: ScriptCheck | None = None  # the script check's result (the backend is checked later)
    script_check_mode: str = "warn"
    # no ddp_master_addr: preflight replaces master_addr by the master's address in ddp_network_cidr
    master_derived: bool = False
    recovery: Recovery = Recovery()
    options: Options | None = None  # what it was built from: `replan` builds the next attempt from them

    @property
    def master(self) -> NodePlan:
        return next(p for p in self.nodes if p.node.name == self.master_name)

    @property
    def all_local(self) -> bool:
        return all(p.node.local for p in self.nodes)

    def secrets(self) -> list[str]:
        """Values that must never be printed: env values whose name looks like a secret."""
        found = {v for p in self.nodes for k, v in p.env.items() if v and p.secret(k)}
        for p in self.nodes:
            for arg in p.argv:
                key, sep, value = arg.partition("=")
                if sep and value and is_secret(key, value):
                    found.add(value)
        return sorted(found, key=len, reverse=True)


def is_secret(name: str, value: str = "", marked: frozenset[str] | set[str] = frozenset()) -> bool:
    """A variable whose value must never be shown: marked, named like a secret, or a value holding a
    password or key (a URL with user:pass@, a connection string's AccountKey=, a SAS URL's sig=)."""
    return (
        name in marked
        or bool(SECRET_NAME.search(name))
        or _secret_word(name)
        or bool(URL_PASSWORD.search(value) or VALUE_SECRET.search(value))
    )


def _secret_word(name: str) -> bool:
    """A short secret word as a whole part of the name: DB_PASS, dbPass, GITHUB_PAT (not PATH, PASSES)."""
    parts = [p.upper() for p in WORD_PART.findall(name)]
    return any(
        p in SECRET_WORDS and not (p == "PASS" and parts[i + 1 : i + 2] == ["THROUGH"])
        for i, p in enumerate(parts)
    )


def check_job_id(job_id: str, flag: str = "--job-id") -> str:
    """The job id, if it is a plain name (it names logs/<job>/ and tags processes); LaunchError otherwise."""
    if not JOB_ID.match(job_id):
        raise LaunchError(f"{flag} {job_id!r}: use letters, digits, '.', '_' or '-' (max 64)")
    return job_id


def new_job_id() -> str:
    """A job id unique enough to tag processes: ddp-YYYYmmdd-HHMMSS-<6 hex>."""
    return time.strftime("ddp-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def build_plan(nodes: Sequence[Node], options: Options) -> JobPlan:
    """Order the nodes (master first), pick MASTER_ADDR/PORT and build each node's command."""
    if not nodes:
        raise LaunchError("no nodes selected")
    job_id = check_job_id(options.job_id or new_job_id())
    master_name = same(nodes, "ddp_master", lambda n: n.master)
    ordered = list(nodes)
    if master_name is not None:
        names = [n.name for n in nodes]
        if master_name not in names:
            raise LaunchError(
                f"ddp_master {master_name!r} is not one of the selected nodes ({', '.join(names)})"
            )
        ordered.sort(key=lambda n: n.name != master_name)  # stable: the others keep their order
    names = [n.name for n in ordered]
    if len(set(names)) != len(names):
        raise LaunchError(f"a host is listed twice: {', '.join(names)}")
    master = ordered[0]
    port = options.master_port or same(nodes, "ddp_master_port", lambda n: n.master_port)
    explicit = same(nodes, "ddp_master_addr", lambda n: n.master_addr)
    all_local = all(n.local for n in ordered)
    derived = not explicit and bool(master.network_cidr) and not all_local
    addr = master_address(master, explicit, all_local=all_local, derived=derived)
    rdzv = options.rdzv or ("c10d" if (options.max_restarts or 0) > 0 and len(ordered) > 1 else "static")
    if rdzv not in ("static", "c10d"):
        raise LaunchError(f"--rdzv {rdzv!r}: static or c10d")
    if rdzv == "static":
        rdzv_args = [["--master-addr", addr, "--master-port", str(port)]] * len(ordered)
    else:
        # an attempt's own rendezvous: an agent of the attempt before it can never join this one
        rdzv_id = job_id if options.attempt == 1 else f"{job_id}.a{options.attempt}"
        ordered, rdzv_args = _c10d_order(ordered, addr, port, rdzv_id, all_local)
    plans = tuple(
        _node_plan(node, rank, len(ordered), rdzv_args[rank], job_id, options, rdzv == "static")
        for rank, node in enumerate(ordered)
    )
    return JobPlan(job_id=job_id, nodes=plans, master_addr=addr, master_port=port, config=options.config,
                   master_name=master.name, rdzv=rdzv, script=options.script, module=options.module,
                   script_local=options.script_local, sync=options.sync,
                   required=tuple(options.required), script_check=options.script_check,
                   script_check_mode=options.script_check_mode, master_derived=derived,
                   recovery=recovery(ordered, options),
                   options=dataclasses.replace(options, job_id=job_id, script_check=None))  # fmt: skip


def recovery(nodes: Sequence[Node], options: Options) -> Recovery:
    """The job's node-loss policy: the command line's, else the inventory's (one value on every node)."""
    mode = options.on_node_loss or same(nodes, "ddp_on_node_loss", lambda n: n.on_node_loss)
    if mode not in NODE_LOSS_MODES:
        raise LaunchError(f"--on-node-loss {mode!r}: {' or '.join(NODE_LOSS_MODES)}")
    losses = options.max_node_losses
    if losses is None:
        losses = same(nodes, "ddp_max_node_losses", lambda n: n.max_node_losses)
    if losses < 0:
        raise LaunchError(f"--max-node-losses {losses}: 0 or more")
    least = options.min_nodes
    if least is None:
        least = same(nodes, "ddp_min_nodes", lambda n: n.min_nodes)
    if least is None or mode == "stop":  # stop: never used (a --limit below it refuses nothing)
        least = max(1, len(nodes) - losses) if least is None else least
    elif not 1 <= least <= len(nodes):
        raise LaunchError(f"ddp_min_nodes (or --min-nodes) {least}: from 1 to the job's {len(nodes)} node(s)")
    return Recovery(mode, losses, least)


def replan(plan: JobPlan, lost: Sequence[str], config: str | None) -> JobPlan:
    """The next attempt of `plan` without the `lost` nodes (an unattended restart, nodeloss.py): the same
    job id, nodes, options and policy; the first remaining node in rank order is the master unless
    ddp_master names another; --fresh dropped (the next attempt resumes) and, for the packaged trainer,
    the checkpoint's global batch kept. Already synced (sync=None: the nodes keep their copy). LaunchError
    when the inventory pins the master to a lost node."""
    assert plan.options is not None
    remaining = [p.node for p in plan.nodes if p.node.name not in lost]
    if plan.master_name in lost and not plan.master_derived:
        pinned = remaining[0].master_addr if remaining else None
        if pinned and (pinned == plan.master_addr or _resolves_to(pinned, plan.master_addr)):
            raise LaunchError(
                f"ddp_master_addr {pinned} is the address of {plan.master_name}, the lost master; delete "
                "it (MASTER_ADDR then moves to the next node's address in ddp_network_cidr) so that a "
                "restart can move it"
            )
    old = plan.options
    overrides = [o for o in old.overrides if o != FRESH]
    if not old.script:
        overrides += global_batch_kept(overrides)
    options = dataclasses.replace(
        old, overrides=tuple(overrides), config=config, attempt=old.attempt + 1,
        on_node_loss=plan.recovery.mode, max_node_losses=plan.recovery.max_losses,
        min_nodes=plan.recovery.min_nodes,
    )  # fmt: skip
    new = build_plan(remaining, options)
    return dataclasses.replace(new, sync=None, recovery=plan.recovery)


def _resolves_to(name: str, addr: str) -> bool:
    try:
        return resolve(name) == addr
    except LaunchError:
        return False


def _c10d_order(
    nodes: list[Node], addr: str, port: int, rdzv_id: str, all_local: bool
) -> tuple[list[Node], list[list[str]]]:
    """c10d rendezvous: torchrun numbers the nodes by sorting their --local-addr as text.

    Each node advertises its own IP (never a hostname that may not resolve); nodes that all run on
    this machine get distinct loopback addresses so their order, and so their ranks, are known.
    """
    local_addrs = {}
    for i, node in enumerate(nodes):
        ip = f"127.0.0.{i + 1}" if all_local else resolve(node.address)
        if not all_local and ipaddress.ip_address(ip).is_loopback:
            raise LaunchError(
                f"{node.name}: ansible_host {node.address!r} is {ip}, which other nodes cannot reach"
            )
        local_addrs[node.name] = ip
    if len(set(local_addrs.values())) != len(nodes):
        raise LaunchError(f"two nodes share an address ({local_addrs}); c10d rendezvous needs one per node")
    ordered = sorted(nodes, key=lambda n: local_addrs[n.name])
    endpoint = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    common = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    return ordered, [[*common, "--local-addr", local_addrs[n.name]] for n in ordered]


def same(nodes: Sequence[Node], var: str, get: Callable[[Node], Any]) -> Any:
    """A job-level variable: it must have one value on every node."""
    values = {n.name: get(n) for n in nodes}
    distinct = set(values.values())
    if len(distinct) > 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        raise LaunchError(f"{var} must be the same on every node of a job, got {shown}")
    return next(iter(distinct))


def resolve(address: str) -> str:
    """An IP address for `address` (an IP literal is returned as is); LaunchError if it does not resolve."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise LaunchError(f"cannot resolve {address!r} on this machine: {e}") from None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # IPv4 first, as gloo/NCCL prefer
    return str(infos[0][4][0])


def master_address(master: Node, explicit: str | None, all_local: bool, derived: bool = False) -> str:
    """MASTER_ADDR: ddp_master_addr, else the master's inventory address resolved to an IP here.

    `derived`: preflight will replace it by the master's address in ddp_network_cidr (netif.with_master),
    so an inventory address outside the CIDR (the management network) is no error yet."""
    source = "ddp_master_addr" if explicit else "ansible_host"
    try:
        addr = resolve(explicit or master.address)
    except LaunchError as e:
        raise LaunchError(f"master {master.name}: {source}: {e}; set it to the node's IP") from None
    if ipaddress.ip_address(addr).is_loopback and not all_local:
        raise LaunchError(
            f"master {master.name}: {source} {explicit or master.address!r} is {addr}, a loopback address "
            "the other nodes cannot reach; set it (or ddp_master_addr) to the master's cluster IP"
        )
    cidr = master.network_cidr
    if cidr and not all_local and not derived:
        # The roles open MASTER_PORT to the training network only: an SSH-network address would hang.
        try:
            inside = ipaddress.ip_address(addr) in ipaddress.ip_network(cidr, strict=False)
        except ValueError as e:
            raise LaunchError(f"master {master.name}: ddp_network_cidr {cidr!r}: {e}") from None
        if not inside:
            raise LaunchError(
                f"master {master.name}: {source} {addr} is outside ddp_network_cidr {cidr} (the training "
                "network the firewall opens); set ddp_master_addr to the master's IP in that network"
            )
    return addr


def _node_plan(
    node: Node, rank: int, nnodes: int, rdzv_args: list[str], job_id: str, options: Options, static: bool
) -> NodePlan:
    shutdown = STOP_GRACE_MAX_S if options.grace is None else max(1, math.ceil(options.grace))
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown)}
    if not static:
        # torch shares the c10d rendezvous store with the workers by default, and a restarted round then
        # reads the previous round's peer addresses (gloo: "Connection refused"); a fresh store per round
        # is what makes --max-restarts work across nodes.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.update(node.env)
    env.update(options.env)
    sync_dir = remote_dir(node, options.sync) if options.sync else None
    if sync_dir:
        # relative (no ddp_workdir): the run starts in the copy, so "." is the copy
        entry = sync_dir if sync_dir.startswith("/") else "."
        env["PYTHONPATH"] = f"{entry}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else entry
    if options.debug:
        env.update(DEBUG_ENV)
    env["DDP_JOB_ID"] = job_id
    marked = frozenset(node.secret_env) | frozenset(options.secret_env)
    argv = [
        f"{node.venv.rstrip('/')}/bin/torchrun",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        options.nproc_per_node or node.nproc,
        *(["--node-rank", str(rank)] if static else []),
        *rdzv_args,
    ]
    if options.max_restarts is not None:
        argv += ["--max-restarts", str(options.max_restarts)]
    if options.script:
        argv += [*(["-m"] if options.module else []), options.script, *options.script_args]
        return NodePlan(node=node, rank=rank, env=env, argv=tuple(argv), config_path=None, sync_dir=sync_dir,
                        secret_names=marked)  # fmt: skip
    argv += ["-m", "ddp_train"]
    config_path = None
    if options.config:
        config_path = options.config if node.local else remote_config_path(node, job_id, options.config)
        shown = config_path
        if sync_dir and not config_path.startswith("/"):  # both under the login dir; the run is in sync_dir
            shown = posixpath.relpath(config_path, sync_dir)
        argv += ["--config", shown]
    for item in options.overrides:
        argv += ["--set", item]
    argv += list(options.trainer_args)
    return NodePlan(
        node=node, rank=rank, env=env, argv=tuple(argv), config_path=config_path, sync_dir=sync_dir,
        secret_names=marked,
    )  # fmt: skip


def remote_config_path(node: Node, job_id: str, local_path: str) -> str:
    """Where a remote node gets its copy of --config (relative paths are under the login directory)."""
    name = local_path.rstrip("/").rsplit("/", 1)[-1]
    base = f"{node.workdir.rstrip('/')}/" if node.workdir else ""
    return f"{base}{CONFIG_DIR}/{job_id}/{name}"


def command(plan: NodePlan, masked: bool = False) -> str:
    """The shell command a node runs: cd to its run directory; setsid the agent, which prints its PGID first.

    `setsid -w` puts the agent (ddp_train.agent, which runs torchrun in its own process) and every
    worker in one new process group (PGID = the pid of the inner `sh`, which prints it and then execs
    the agent), so teardown can signal torchrun alone (a stop) or the whole tree (a failure); it waits
    and passes the exit status back. Only DDP_JOB_ID is on the command line (processes inside the group
    carry it, so signalling them never kills setsid itself); the rest of the environment is `env_line`,
    written to the command's stdin.
    """
    env = [f"{k}={v}" for k, v in plan.env.items() if k in ARGV_ENV]
    argv = [_mask_override(a) for a in plan.argv] if masked else list(plan.argv)
    python = f"{plan.node.venv.rstrip('/')}/bin/python"
    inner = f'echo "{PGID_MARKER} $$"; exec "$@"'
    agent = [python, "-m", "ddp_train.agent", *argv]
    run = shlex.join(["exec", "setsid", "-w", "env", *env, "sh", "-c", inner, "ddp-launch", *agent])
    workdir = plan.cwd
    return f"cd -- {shlex.quote(workdir)} && {run}" if workdir else run


def env_line(plan: NodePlan) -> bytes:
    """The environment the node's agent reads from stdin: one JSON line (never on a command line)."""
    env = {k: v for k, v in plan.env.items() if k not in ARGV_ENV}
    return (json.dumps(env, ensure_ascii=True) + "\n").encode()


def shown_env(plan: NodePlan) -> str:
    """The stdin environment for display (--dry-run, logs): the JSON line with secret values masked."""
    env = {k: MASK if plan.secret(k) else v for k, v in plan.env.items() if k not in ARGV_ENV}
    return json.dumps(env, ensure_ascii=True)


def _mask_override(arg: str) -> str:
    key, sep, value = arg.partition("=")
    return f"{key}={MASK}" if sep and is_secret(key, value) else arg


def mask_argv(argv: Sequence[str], secret_values: Sequence[str]) -> list[str]:
    """A command line as it may be recorded (job.json): NAME=VALUE words of secret NAMEs and every known
    secret value masked (--env HF_TOKEN=..., -e ansible_password=..., -e '{"ddp_env": ...}')."""
    return [mask_text(_mask_override(a), secret_values) for a in argv]


def mask_text(text: str, secret_values: Sequence[str]) -> str:
    """Replace every secret value in `text` by ***."""
    for value in secret_values:
        if len(value) >= 3:
            text = text.replace(value, MASK)
    return text
