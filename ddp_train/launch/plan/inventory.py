"""Read the nodes of a job from an Ansible inventory with Ansible's own inventory and variable API.

`ansible_host`, `ansible_user`, `ansible_port`, `ansible_ssh_private_key_file`, group_vars/host_vars and
`{{ templates }}` mean exactly what they mean to ansible-playbook; the `ddp_*` variables are the ones
the roles use (one source of truth).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddp_train.launch.errors import LaunchError, one_line
from ddp_train.launch.plan import vault
from ddp_train.text import short

DEFAULT_INVENTORY = "inventory/local"  # without --hosts (ddp-launch and its job commands)
DEFAULT_GROUP = "gpu_nodes"
PINNED = ("ddp_master", "ddp_master_addr")  # the master, pinned: `restart` names where to edit them
DEFAULT_MASTER_PORT = 29500
DEFAULT_REMOTE_VENV = "/opt/ddp-train/venv"  # the pytorch role's default ddp_venv
NPROC_WORDS = ("gpu", "cpu", "auto")
MODES = ("strict", "warn", "off")  # ddp_script_check, ddp_gpu_health
RDMA_MODES = ("auto", "on", "off")  # ddp_rdma
NODE_LOSS_MODES = ("stop", "restart")  # ddp_on_node_loss
SSH_CONNECTIONS = (
    "ssh",
    "smart",
    "paramiko",
    "paramiko_ssh",
    "ansible.builtin.ssh",
    "ansible.builtin.paramiko_ssh",
)
LOCAL_CONNECTIONS = ("local", "ansible.builtin.local")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


@dataclasses.dataclass(frozen=True)
class SshTarget:
    """How to reach a node over SSH, as ansible-playbook would."""

    host: str
    port: int = 22
    user: str | None = None
    key_files: tuple[str, ...] = ()
    password: str | None = dataclasses.field(default=None, repr=False)
    known_hosts_files: tuple[str, ...] = ()
    host_key_alias: str | None = None
    proxy_command: str | None = None
    proxy_jump: str | None = None

    def describe(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Node:
    """One inventory host that runs a torchrun agent."""

    name: str
    address: str  # ansible_host (or the inventory name), as written
    local: bool  # ansible_connection: local -> run without SSH
    ssh: SshTarget | None
    venv: str
    workdir: str | None
    nproc: str
    master_port: int
    env: Mapping[str, str]
    secret_env: tuple[str, ...] = ()  # ddp_secret_env: names whose values are masked wherever shown
    master: str | None = None  # ddp_master
    master_addr: str | None = None  # ddp_master_addr
    network_cidr: str | None = None
    sync_dir: str | None = None  # ddp_sync_dir: the default of --sync
    sync_exclude: tuple[str, ...] = ()  # ddp_sync_exclude: gitignore-style patterns
    script_check: str = "warn"  # ddp_script_check: strict | warn | off
    gpu_health: str = "strict"  # ddp_gpu_health: strict | warn | off (launch/preflight/gpuhealth.py)
    gpu_health_dcgm: bool = False  # ddp_gpu_health_dcgm: also run `dcgmi diag -r 1`
    forks: int | None = None  # ddp_forks: the default of --forks
    rdma: str = "auto"  # ddp_rdma: auto | on | off (launch/preflight/rdma.py; --rdma wins)
    gpu_idle_warn: float = 20.0  # ddp_gpu_idle_warn: `status` flags a node below it (mean GPU %) as starving
    # a lost node: stop the job, or restart it on the others (plan.Recovery, launch/run/nodeloss.py)
    on_node_loss: str = "stop"  # ddp_on_node_loss: stop | restart
    max_node_losses: int = 2  # ddp_max_node_losses: nodes a job may lose in all before it gives up
    min_nodes: int | None = None  # ddp_min_nodes: fewest nodes to go on with [the job's minus max losses]
    # --detach's monitor on the cluster (launch/jobs/clustermon.py): its host, its state directory there,
    # the cluster-internal key and known_hosts it reaches the nodes with (roles/cluster_monitor)
    monitor_host: str | None = None  # ddp_monitor_host [the master node]
    monitor_dir: str = ".ddp-train/jobs"  # ddp_monitor_dir (relative: to the monitor user's home)
    cluster_key: str = "~/.ssh/ddp_cluster_ed25519"  # ddp_cluster_key, on the monitor host
    cluster_known_hosts: str = "/etc/ssh/ssh_known_hosts"  # ddp_cluster_known_hosts (and ~/.ssh/known_hosts)
    # where the variables in PINNED are set (file:line), for the lines that ask to edit them
    origins: tuple[tuple[str, str], ...] = ()

    @property
    def where(self) -> str:
        return "local" if self.local or self.ssh is None else self.ssh.describe()

    def origin(self, key: str) -> str:
        """Where inventory variable `key` is set (`file:line`), as far as it is known."""
        return dict(self.origins).get(key, "the inventory")


# ---- loading ------------------------------------------------------------------------------------


def load_nodes(
    sources: Sequence[str],
    group: str | None = None,
    limit: str | None = None,
    exclude: Sequence[str] = (),
    extra_vars: Sequence[str] = (),
) -> list[Node]:
    """Parse the inventory sources and return the selected nodes in declared order."""
    for src in sources:
        if "," not in src and not Path(src).exists():
            raise LaunchError(f"inventory {src}: no such file or directory")
    with _quiet_ansible() as notes:
        from ansible import constants
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.vars.manager import VariableManager

        loader = vault.data_loader()
        where = ", ".join(sources)
        # A source no plugin parses is an error here, not a warning and an empty inventory. Set on
        # Ansible's constants for this parse only (InventoryManager reads it while parsing), never in
        # os.environ: that leaked into every process this one started (a later `molecule syntax`).
        strict = constants.INVENTORY_ANY_UNPARSED_IS_FAILED
        constants.INVENTORY_ANY_UNPARSED_IS_FAILED = True
        try:
            inventory = InventoryManager(loader=loader, sources=list(sources))
        except AnsibleError as e:
            raise LaunchError(_parse_failure(where, notes, e)) from None
        finally:
            constants.INVENTORY_ANY_UNPARSED_IS_FAILED = strict
        extra = _load_extra_vars(loader, extra_vars)
        variables = VariableManager(loader=loader, inventory=inventory)
        hosts = _select_hosts(inventory, where, group, limit, exclude, notes)
        try:
            return [_node(loader, variables, h, extra, where) for h in hosts]
        except AnsibleError as e:  # group_vars/host_vars are read here: a vault without its password
            raise LaunchError(vault.failure(where, e)) from None


def inventory_host(name: str, sources: Sequence[str], extra_vars: Sequence[str] = ()) -> Node | None:
    """The inventory's host `name` among all its hosts (group all: a login or monitor host too, not only
    the node group); None when it has none of that name. Relative sources: to this directory."""
    return next((n for n in load_nodes(sources, group="all", extra_vars=extra_vars) if n.name == name), None)


@contextlib.contextmanager
def _quiet_ansible() -> Iterator[list[str]]:
    """Collect Ansible's warnings instead of printing them; they are reported only if useful."""
    from ansible.utils.display import Display

    display = Display()
    notes: list[str] = []
    saved = {
        name: getattr(display, name) for name in ("warning", "error_as_warning", "deprecated", "display")
    }

    def error_as_warning(msg: str, exception: BaseException | None = None, *a: Any, **k: Any) -> None:
        if exception is None:
            notes.append(msg)
            return
        origin = getattr(exception, "obj", None)
        line = getattr(origin, "line_num", None)
        detail = one_line(getattr(exception, "message", None) or str(exception))
        plugin = re.search(r"'([\w.]+)' plugin", msg)
        # "<plugin>\t<line>\t<message>", read back by _parse_failure
        notes.append(f"{plugin.group(1) if plugin else msg}\t{line or ''}\t{detail}")

    display.warning = lambda msg, *a, **k: notes.append(str(msg))
    display.error_as_warning = error_as_warning
    display.deprecated = lambda *a, **k: None
    display.display = lambda *a, **k: None
    try:
        yield notes
    finally:
        for name, fn in saved.items():
            setattr(display, name, fn)


def _parse_failure(where: str, notes: list[str], err: Exception) -> str:
    """The failing file, line and the complaint of the plugin that matches its format."""
    text = str(getattr(err, "message", None) or err)
    source = text.rsplit("inventory source ", 1)[-1].strip() if "inventory source " in text else where
    failures = [n.split("\t", 2) for n in notes if n.count("\t") >= 2]
    yamlish = source.endswith((".yml", ".yaml", ".json"))
    # 'auto' reads a YAML file first (syntax errors with their line), but "no root 'plugin' key" only says
    # the file is no plugin config: then the yaml plugin's complaint is the one about the inventory
    failures = [f for f in failures if not (f[0] == "auto" and "no root 'plugin' key" in f[2])] or failures
    for plugin in ("auto", "yaml", "ini") if yamlish else ("ini", "yaml", "auto"):
        for name, line, detail in failures:
            if name == plugin:
                line = line or next((ln for n, ln, d in failures if d == detail and ln), "")
                return f"{source}{':' + line if line else ''}: {detail}"
    return f"inventory {source}: {one_line(notes[-1] if notes else text)}"


def _load_extra_vars(loader: Any, items: Sequence[str]) -> dict[str, Any]:
    """`-e` like ansible-playbook: key=value pairs, a JSON/YAML mapping, or @file."""
    from ansible.errors import AnsibleError
    from ansible.parsing.splitter import parse_kv
    from ansible.template import trust_as_template

    merged: dict[str, Any] = {}
    for item in items:
        try:
            if item.startswith("@"):
                data = loader.load_from_file(item[1:], trusted_as_template=True)
            elif item[:1] in ("{", "["):
                data = loader.load(trust_as_template(item))
            else:
                data = {k: trust_as_template(v) for k, v in parse_kv(item).items()}
        except AnsibleError as e:
            raise LaunchError(f"--extra-vars {item!r}: {one_line(str(e))}") from None
        if not isinstance(data, Mapping):
            raise LaunchError(f"--extra-vars {item!r}: must be key=value, a mapping, or @file")
        merged.update(data)
    return merged


def _select_hosts(
    inventory: Any, where: str, group: str | None, limit: str | None, exclude: Sequence[str], notes: list[str]
) -> list[Any]:
    from ansible.inventory.manager import split_host_pattern

    groups = inventory.groups
    if group is None:
        group = DEFAULT_GROUP if DEFAULT_GROUP in groups and groups[DEFAULT_GROUP].get_hosts() else "all"
    elif group not in groups:
        raise LaunchError(f"inventory {where}: no group {group!r} (groups: {', '.join(sorted(groups))})")
    pattern = [group] + [f"!{p}" for e in exclude for p in split_host_pattern(e)]
    if limit:
        inventory.subset(limit)
    hosts = inventory.get_hosts(pattern)
    if not hosts:
        why = f" matching --limit {limit!r}" if limit else ""
        why += f" after --exclude {', '.join(exclude)}" if exclude else ""
        hint = f" ({one_line('; '.join(notes))})" if notes else ""
        raise LaunchError(f"inventory {where}: no hosts in group {group!r}{why}{hint}")
    return hosts


# ---- one host's variables -----------------------------------------------------------------------


class _Vars:
    """A host's variables, templated on access, with the file and line of each for error messages."""

    def __init__(self, loader: Any, variables: Any, host: Any, extra: Mapping[str, Any], where: str) -> None:
        from ansible.template import Templar
        from ansible.utils.vars import combine_vars

        self.host = host.name
        self.where = where
        self.raw = combine_vars(variables.get_vars(host=host), extra)
        self.templar = Templar(loader=loader, variables=self.raw)

    def origin(self, key: str) -> str:
        try:
            from ansible._internal._datatag._tags import Origin

            tag = Origin.get_tag(self.raw.get(key))
        except ImportError:  # ansible-core < 2.19 has no origin tags
            tag = None
        if tag is not None and getattr(tag, "path", None):
            return f"{tag.path}:{tag.line_num}" if getattr(tag, "line_num", None) else str(tag.path)
        return f"inventory {self.where}"

    def error(self, key: str, message: str) -> LaunchError:
        return LaunchError(f"{self.origin(key)}: host {self.host}: {key}: {message}")

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of `keys` that is set, templated and converted to plain Python types."""
        from ansible.errors import AnsibleError

        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                try:
                    return _plain(self.templar.template(self.raw[key]))
                except AnsibleError as e:
                    raise self.error(key, one_line(getattr(e, "message", None) or str(e))) from None
        return default

    def text(self, *keys: str, default: str | None = None) -> str | None:
        value = self.get(*keys)
        if value is None:
            return default
        if isinstance(value, (dict, list)) or value == "":
            raise self.error(self._first(keys), f"expected a non-empty string, got {short(value)}")
        text = str(value)
        if "\x00" in text or "\n" in text:
            raise self.error(self._first(keys), "must not contain newlines or NUL bytes")
        return text

    def port(self, *keys: str, default: int) -> int:
        value = self.get(*keys)
        if value is None:
            return default
        try:
            port = int(str(value), 10)
        except ValueError:
            port = -1
        if isinstance(value, bool) or not 1 <= port <= 65535:
            raise self.error(self._first(keys), f"{short(value)} is not a TCP port (1-65535)")
        return port

    def _first(self, keys: Sequence[str]) -> str:
        return next((k for k in keys if self.raw.get(k) is not None), keys[0])


def _plain(value: Any) -> Any:
    """Strip Ansible's tagged types so the rest of the launcher sees plain dict/list/str/int."""
    if value is None or isinstance(value, bool):
        return value if value is None else bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _node(loader: Any, variables: Any, host: Any, extra: Mapping[str, Any], where: str) -> Node:
    if CONTROL_CHARS.search(host.name):  # Ansible's fact cache raises on NUL; logs need one-line labels
        raise LaunchError(f"inventory {where}: host {host.name!r}: control characters in a host name")
    v = _Vars(loader, variables, host, extra, where)
    connection = v.text("ansible_connection", default="ssh")
    if connection in LOCAL_CONNECTIONS:
        local = True
    elif connection in SSH_CONNECTIONS:
        local = False
    else:
        raise v.error(
            "ansible_connection", f"{connection!r} is not supported by ddp-launch (use ssh or local)"
        )

    address = v.text("ansible_host", "ansible_ssh_host", default=None) or (
        "127.0.0.1" if local else host.name
    )
    ssh = None if local else _ssh_target(v, address)
    venv = v.text("ddp_venv", default=sys.prefix if local else DEFAULT_REMOTE_VENV)
    workdir = v.text("ddp_workdir", default=os.getcwd() if local else None)
    return Node(
        name=host.name,
        address=address,
        local=local,
        ssh=ssh,
        venv=str(venv),
        workdir=workdir,
        nproc=_nproc(v),
        master_port=v.port("ddp_master_port", default=DEFAULT_MASTER_PORT),
        env=_env(v),
        secret_env=_secret_env(v),
        master=v.text("ddp_master"),
        master_addr=v.text("ddp_master_addr"),
        network_cidr=v.text("ddp_network_cidr"),
        sync_dir=v.text("ddp_sync_dir"),
        sync_exclude=_patterns(v, "ddp_sync_exclude"),
        script_check=_mode(v, "ddp_script_check", "warn"),
        gpu_health=_mode(v, "ddp_gpu_health", "strict"),
        gpu_health_dcgm=_flag(v, "ddp_gpu_health_dcgm"),
        forks=_forks(v),
        rdma=_rdma(v),
        gpu_idle_warn=_percent(v, "ddp_gpu_idle_warn", 20.0),
        on_node_loss=_mode(v, "ddp_on_node_loss", "stop", NODE_LOSS_MODES),
        max_node_losses=_count(v, "ddp_max_node_losses", 2, least=0),
        min_nodes=_count(v, "ddp_min_nodes", None, least=1),
        monitor_host=v.text("ddp_monitor_host"),
        monitor_dir=v.text("ddp_monitor_dir", default=".ddp-train/jobs") or ".ddp-train/jobs",
        cluster_key=v.text("ddp_cluster_key", default="~/.ssh/ddp_cluster_ed25519") or "",
        cluster_known_hosts=v.text("ddp_cluster_known_hosts", default="/etc/ssh/ssh_known_hosts") or "",
        origins=tuple((k, v.origin(k)) for k in PINNED if v.raw.get(k) is not None),
    )


def _rdma(v: _Vars) -> str:
    value = v.get("ddp_rdma", default="auto")
    if isinstance(value, bool):  # YAML 1.1 reads an unquoted on/off as true/false
        return "on" if value else "off"
    if not isinstance(value, str) or value not in RDMA_MODES:
        raise v.error("ddp_rdma", f"{short(value)} is not one of {', '.join(RDMA_MODES)}")
    return value


def _percent(v: _Vars, key: str, default: float) -> float:
    value = v.get(key, default=default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise v.error(key, f"must be a number of percent from 0 to 100, got {value!r}")
    return float(value)


def _forks(v: _Vars) -> int | None:
    value = v.get("ddp_forks")
    if value is None:
        return None
    if isinstance(value, bool) or not str(value).isdigit() or int(str(value)) < 1:
        raise v.error("ddp_forks", f"{short(value)} is not a positive integer")
    return int(str(value))


def _mode(v: _Vars, key: str, default: str, modes: Sequence[str] = MODES) -> str:
    value = v.get(key, default=default)
    if value is False and "off" in modes:  # YAML 1.1 reads an unquoted `off` as false
        return "off"
    if not isinstance(value, str) or value not in modes:
        raise v.error(key, f"{short(value)} is not one of {', '.join(modes)}")
    return value


def _count(v: _Vars, key: str, default: int | None, least: int) -> int | None:
    value = v.get(key, default=default)
    if value is None:
        return None
    if isinstance(value, bool) or not str(value).isdigit() or int(str(value)) < least:
        raise v.error(key, f"{short(value)} is not a whole number of at least {least}")
    return int(str(value))


def _flag(v: _Vars, key: str) -> bool:
    value = v.get(key, default=False)
    if not isinstance(value, bool):
        raise v.error(key, f"expected true or false, got {short(value)}")
    return value


def _patterns(v: _Vars, key: str) -> tuple[str, ...]:
    value = v.get(key, default=[])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) and x and "\n" not in x for x in value):
        raise v.error(key, f"expected a list of patterns (strings), got {short(value)}")
    return tuple(value)


def nproc_value(value: object) -> str | None:
    """torchrun's --nproc-per-node from an inventory value or a command line: gpu, cpu, auto or a
    positive count (as text, without sign or leading zeros); None when `value` is none of these."""
    if isinstance(value, str) and value in NPROC_WORDS:
        return value
    if isinstance(value, bool) or not str(value).isdigit():  # no sign, space or '_' (int() takes them)
        return None
    n = int(str(value), 10)
    return str(n) if n >= 1 else None


def _nproc(v: _Vars) -> str:
    value = v.get("ddp_nproc_per_node", default=1)
    n = nproc_value(value)
    if n is None:
        raise v.error(
            "ddp_nproc_per_node", f"{short(value)} is not a positive integer or one of {NPROC_WORDS}"
        )
    return n


def _secret_env(v: _Vars) -> tuple[str, ...]:
    value = v.get("ddp_secret_env", default=[])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) and ENV_NAME.match(x) for x in value):
        raise v.error("ddp_secret_env", f"expected a list of environment variable names, got {short(value)}")
    return tuple(value)


def _env(v: _Vars) -> dict[str, str]:
    value = v.get("ddp_env", default={})
    if not isinstance(value, dict):
        raise v.error("ddp_env", f"expected a mapping of environment variables, got {short(value)}")
    env: dict[str, str] = {}
    for key, val in value.items():
        if not ENV_NAME.match(key):
            raise v.error("ddp_env", f"{key!r} is not a valid environment variable name")
        if isinstance(val, (dict, list)) or val is None:
            raise v.error("ddp_env", f"{key}: expected a string or number, got {short(val)}")
        text = str(val).lower() if isinstance(val, bool) else str(val)
        if "\x00" in text:
            raise v.error("ddp_env", f"{key}: value must not contain NUL bytes")
        env[key] = text
    return env


def _ssh_target(v: _Vars, address: str) -> SshTarget:
    opts = parse_ssh_args(
        " ".join(filter(None, [v.text("ansible_ssh_common_args"), v.text("ansible_ssh_extra_args")]))
    )
    default_port = int(opts["port"][0]) if opts.get("port", [""])[0].isdigit() else 22
    keys = v.get("ansible_ssh_private_key_file", "ansible_private_key_file")
    key_files = [str(keys)] if keys else []
    key_files += opts.get("identityfile", [])
    known = [
        f
        for value in opts.get("userknownhostsfile", []) + opts.get("globalknownhostsfile", [])
        for f in value.split()
    ]
    extra_known = v.get("ddp_known_hosts_file")
    if extra_known:
        known += [str(x) for x in extra_known] if isinstance(extra_known, list) else [str(extra_known)]
    return SshTarget(
        host=address,
        port=v.port("ansible_port", "ansible_ssh_port", default=default_port),
        user=v.text("ansible_user", "ansible_ssh_user", default=(opts.get("user") or [None])[0]),
        key_files=tuple(os.path.expanduser(k) for k in key_files),
        password=v.text("ansible_password", "ansible_ssh_pass", "ansible_ssh_password"),
        known_hosts_files=tuple(os.path.expanduser(k) for k in known if k.lower() != "/dev/null"),
        host_key_alias=(opts.get("hostkeyalias") or [None])[0],
        proxy_command=(opts.get("proxycommand") or [None])[0],
        proxy_jump=(opts.get("proxyjump") or [None])[0],
    )


_SSH_FLAG_OPTION = {"-J": "proxyjump", "-i": "identityfile", "-p": "port", "-l": "user"}


def parse_ssh_args(text: str) -> dict[str, list[str]]:
    """The `-o Key=Value` (and -J/-i/-p/-l) options of an OpenSSH argument string, keys lowercased."""
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise LaunchError(f"ansible_ssh_common_args/extra_args {text!r}: {e}") from None
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        arg, value = args[i], None
        if arg in ("-o", *_SSH_FLAG_OPTION) and i + 1 < len(args):
            value, i = args[i + 1], i + 2
        elif arg[:2] in ("-o", *_SSH_FLAG_OPTION) and len(arg) > 2:
            value, i = arg[2:], i + 1
        else:
            i += 1
            continue
        if arg[:2] == "-o":
            key, sep, val = value.partition("=")
            if not sep:
                key, _, val = value.partition(" ")
            opts.setdefault(key.strip().lower(), []).append(val.strip())
        else:
            opts.setdefault(_SSH_FLAG_OPTION[arg[:2]], []).append(value)
    return opts
