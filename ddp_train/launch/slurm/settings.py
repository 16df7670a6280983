"""What a Slurm job is submitted with: flags first, then the inventory's slurm_* variables.

The submit host is the first host of the inventory's `slurm_login` group, else of `slurm_controller`
(issue 28: sbatch runs there over the existing SSH code). An inventory of only those hosts (no
`gpu_nodes`: the cluster's admins run the nodes) takes the node count from --nodes / slurm_nodes and every
node's settings (ddp_venv, ddp_workdir, ...) from the submit host's variables (issue #48).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.plan.inventory import Node

BACKENDS = ("ssh", "slurm")
SUBMIT_GROUPS = ("slurm_login", "slurm_controller")
# sbatch(1) --time: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
# "days-hours:minutes" and "days-hours:minutes:seconds"
TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
SIGNAL_EARLY_S = 60  # sbatch(1) --signal: "the signal may be sent up to 60 seconds earlier than specified"
FLAGS = ("partition", "account", "qos", "time", "nodes", "gpus_per_node", "constraint")


@dataclasses.dataclass(frozen=True)
class SlurmSettings:
    submit: Node  # where sbatch/squeue/scancel run (over SSH, or locally)
    group: str = "slurm_controller"  # the submit host's group
    sources: tuple[str, ...] = ()  # the inventory (job.json keeps it for `ddp-launch status JOB`)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    nodes: int | None = None  # default: the inventory's node count
    gpus_per_node: int | None = None  # the flag or variable; 0: request none (a CPU job)
    nproc: str = "1"  # --nproc-per-node, else ddp_nproc_per_node: the GPU request's default
    exclusive: bool = False
    constraint: str | None = None
    signal_lead_s: int = 120  # --signal=B:USR1@lead: the driver stops the job this long before the limit
    requeue: bool = False
    max_requeues: int = 0
    login_only: bool = False  # no compute node in the inventory: the nodes are Slurm's alone
    shared_workdir: bool = True  # slurm_shared_workdir: false: ddp_workdir is each node's own disk

    def sbatch_options(self, job_id: str, nodes: int, restart: bool = False) -> list[str]:
        """`restart`: ddp_on_node_loss: restart, mapped onto Slurm's own mechanisms (docs/slurm.md):
        --no-kill keeps the allocation when a node fails (the driver starts the next attempt on the
        others), --requeue requeues the job when the batch host itself fails."""
        opts = [f"--job-name={job_id}", f"--nodes={self.nodes or nodes}", "--ntasks-per-node=1"]
        for name in ("partition", "account", "qos", "time", "constraint"):
            value = getattr(self, name)
            if value:
                opts.append(f"--{name}={value}")
        if gpus := self.gpus():
            opts.append(f"--gpus-per-node={gpus}")
        if self.exclusive:
            opts.append("--exclusive")
        opts.append(f"--signal=B:USR1@{self.signal_lead_s}")
        opts.append("--requeue" if self.requeue or restart else "--no-requeue")
        if self.requeue or restart:
            opts.append("--open-mode=append")
        if restart:
            opts.append("--no-kill")
        return opts

    def gpus(self) -> int | None:
        """GPUs per node the job requests: the flag or variable, else one per process when the process
        count is a number (issue #48: the slurm role sets ConstrainDevices, so a job that requests no GPU
        sees none). `gpu`/`auto` are resolved from the partition's Gres at submit (submit.preflight);
        `cpu` requests none."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node or None
        return int(self.nproc) if self.nproc.isdigit() else None

    def gpus_unresolved(self) -> bool:
        """The GPU request comes from the partition's Gres, read by the submit preflight alone."""
        return self.gpus_per_node is None and self.nproc in ("gpu", "auto")


def minutes(value: str) -> float | None:
    """A Slurm time (sbatch --time, a partition's MaxTime) in minutes; None for UNLIMITED/INFINITE."""
    if value.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = TIME.match(value.strip())
    if not m:
        raise ValueError(f"{value!r} is not a Slurm time ([days-]hours:minutes:seconds, or minutes)")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # days-hours[:minutes[:seconds]]
        return days * 1440 + (a or 0) * 60 + (b or 0) + (c or 0) / 60
    if c is not None:  # hours:minutes:seconds
        return (a or 0) * 60 + (b or 0) + c / 60
    if b is not None:  # minutes:seconds
        return (a or 0) + b / 60
    return float(a or 0)


def wanted(opts: argparse.Namespace, sources: Sequence[str], extra_vars: Sequence[str]) -> bool:
    """--backend slurm, or (without --backend) ddp_backend: slurm in the inventory."""
    if getattr(opts, "backend", None):
        return bool(opts.backend == "slurm")
    return _inventory(sources, extra_vars)[1].get("ddp_backend", "ssh") == "slurm"


def load(opts: argparse.Namespace, sources: Sequence[str], extra_vars: Sequence[str]) -> SlurmSettings:
    """The job's Slurm settings; LaunchError (one line naming the variable or flag) when one is bad."""
    from ddp_train.launch.plan.inventory import load_nodes

    groups, hostvars = _inventory(sources, extra_vars)
    backend = hostvars.get("ddp_backend", "ssh")
    if backend not in BACKENDS:
        raise LaunchError(f"ddp_backend {backend!r}: ssh or slurm")
    group = next((g for g in SUBMIT_GROUPS if groups.get(g)), None)
    if group is None:
        why = "ddp_backend: slurm" if backend == "slurm" and not opts.backend else "--backend slurm"
        raise LaunchError(
            f"{why} needs a slurm_controller (or slurm_login) group with one host in the inventory "
            f"{', '.join(sources)}: sbatch runs there"
        )
    submit = load_nodes(sources, group=group, extra_vars=extra_vars)[0]
    login_only = _login_only(groups, getattr(opts, "group", None))
    values: dict[str, Any] = {}
    for name in FLAGS:
        flag = getattr(opts, f"slurm_{name}", None)
        values[name] = flag if flag is not None else hostvars.get(f"slurm_{name}")
    if values["nodes"] is not None:
        values["nodes"] = _positive(values["nodes"], "--nodes / slurm_nodes")
    elif login_only:
        raise LaunchError(
            f"the inventory {', '.join(sources)} has no compute nodes, only the {group} host {submit.name}: "
            "give the job's node count with --nodes N (or slurm_nodes)"
        )
    if values["gpus_per_node"] is not None:  # 0: none, on a partition without GPUs
        values["gpus_per_node"] = _positive(
            values["gpus_per_node"], "--gpus-per-node / slurm_gpus_per_node", 0
        )
    nproc = getattr(opts, "nproc_per_node", None) or hostvars.get("ddp_nproc_per_node", 1)
    limit = None  # --time in minutes (None: not set, or UNLIMITED)
    if values["time"] is not None:
        values["time"] = str(values["time"])
        try:
            limit = minutes(values["time"])
        except ValueError as e:
            raise LaunchError(f"--time / slurm_time: {e}") from None
    exclusive = bool(getattr(opts, "slurm_exclusive", False) or hostvars.get("slurm_exclusive", False))
    lead = _positive(hostvars.get("slurm_signal_lead_s", 120), "slurm_signal_lead_s")
    if limit is not None and limit * 60 <= lead + SIGNAL_EARLY_S:
        raise LaunchError(
            f"--time {values['time']}: the time limit's USR1 comes slurm_signal_lead_s={lead} s before it, "
            f"and Slurm may send it up to {SIGNAL_EARLY_S} s earlier (sbatch(1) --signal): the job would "
            "stop as it starts; give a longer --time or a smaller slurm_signal_lead_s"
        )
    max_requeues = getattr(opts, "max_requeues", None)
    if max_requeues is None:
        max_requeues = hostvars.get("slurm_max_requeues", 0)
    max_requeues = int(max_requeues)
    requeue = bool(getattr(opts, "requeue", False) or hostvars.get("slurm_requeue", False) or max_requeues)
    shared = _bool(hostvars.get("slurm_shared_workdir", True), "slurm_shared_workdir")
    return SlurmSettings(
        submit=submit,
        group=group,
        sources=tuple(sources),
        nproc=str(nproc),
        exclusive=exclusive,
        signal_lead_s=lead,
        requeue=requeue,
        max_requeues=max(max_requeues, 1) if requeue else 0,
        login_only=login_only,
        shared_workdir=shared,
        **values,
    )


def _login_only(groups: dict[str, list[str]], group: str | None = None) -> bool:
    """The inventory's node group (--group, else gpu_nodes, else all: what the plan's nodes are) holds only
    submit hosts (slurm_login, slurm_controller): the compute nodes are not in the inventory."""
    from ddp_train.launch.plan.inventory import DEFAULT_GROUP

    name = group or (DEFAULT_GROUP if groups.get(DEFAULT_GROUP) else "all")
    submit = {h for g in SUBMIT_GROUPS for h in groups.get(g, [])}
    hosts = set(groups.get(name, []))
    return bool(hosts) and hosts <= submit


def _bool(value: Any, name: str) -> bool:
    """A boolean inventory variable (YAML's true/false, or a string of `-e name=false`)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise LaunchError(f"{name} {value!r}: true or false")


def _positive(value: Any, name: str, least: int = 1) -> int:
    try:
        n = int(str(value), 10)
    except ValueError:
        n = least - 1
    if isinstance(value, bool) or n < least:
        raise LaunchError(f"{name} {value!r}: {'a positive' if least else 'a non-negative'} integer")
    return n


def _inventory(
    sources: Sequence[str], extra_vars: Sequence[str]
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """(group -> hosts, the ddp_backend, ddp_nproc_per_node and slurm_* variables of the node group's
    first host)."""
    from ddp_train.launch.plan import inventory as inv
    from ddp_train.launch.plan import vault

    with inv._quiet_ansible():
        from ansible.inventory.manager import InventoryManager
        from ansible.vars.manager import VariableManager

        loader = vault.data_loader()
        manager = InventoryManager(loader=loader, sources=list(sources))
        groups = {name: [h.name for h in g.get_hosts()] for name, g in manager.groups.items()}
        group = inv.DEFAULT_GROUP if groups.get(inv.DEFAULT_GROUP) else "all"
        hosts = manager.get_hosts([group])
        if not hosts:
            return groups, {}
        v = inv._Vars(
            loader,
            VariableManager(loader=loader, inventory=manager),
            hosts[0],
            inv._load_extra_vars(loader, extra_vars),
            ", ".join(sources),
        )
        keys = [k for k in v.raw if k in ("ddp_backend", "ddp_nproc_per_node") or k.startswith("slurm_")]
        return groups, {k: v.get(k) for k in keys}
