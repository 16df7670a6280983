"""The run's and doctor's parsed arguments -> a JobPlan, every input refused here before a node is touched."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_train.launch.errors import LaunchError

if TYPE_CHECKING:  # the heavy modules load only when a command needs them
    from ddp_train.launch.plan.inventory import Node
    from ddp_train.launch.plan.plan import JobPlan
    from ddp_train.launch.plan.scriptcheck import ScriptCheck
    from ddp_train.launch.remote.sync import Manifest
    from ddp_train.launch.slurm.settings import SlurmSettings


def split_rest(opts: argparse.Namespace) -> list[str]:
    """What followed the options (`rest`): `-- trainer args` (returned) or `script [script args]`
    (set as opts.script, opts.script_args)."""
    rest = list(getattr(opts, "rest", []))  # doctor has none
    opts.script, opts.script_args = None, []
    if rest[:1] == ["--"]:
        return rest[1:]
    if rest:
        opts.script, opts.script_args = rest[0], rest[1:]
    return []


def controller_limits(plan: JobPlan, opts: argparse.Namespace) -> None:
    """Open-file limit raised to the hard limit (LaunchError if the nodes still do not fit); --forks."""
    from ddp_train.launch.remote.fanout import ansible_forks, set_forks
    from ddp_train.launch.remote.limits import raise_nofile

    if opts.forks is not None and opts.forks < 1:
        raise LaunchError(f"--forks {opts.forks}: must be >= 1")
    raise_nofile(len(plan.nodes))
    from ddp_train.launch.plan.plan import same

    forks = opts.forks or same([p.node for p in plan.nodes], "ddp_forks", lambda n: n.forks)
    set_forks(forks or ansible_forks())


def build(opts: argparse.Namespace, trainer_args: list[str], doctor: bool) -> JobPlan:
    from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY, ENV_NAME, load_nodes
    from ddp_train.launch.plan.plan import FRESH, Options, build_plan

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
    nproc = _check_nproc(opts.nproc_per_node)
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
        if opts.script and (opts.config or opts.overrides or trainer_args or opts.fresh):
            raise LaunchError(
                "--config/--set/--fresh/`-- args` are for the packaged trainer; your script takes its own "
                f"arguments after its name ({opts.script} ...)"
            )
        if opts.fresh and FRESH not in opts.overrides:
            opts.overrides.append(FRESH)  # last, so it wins over a --set checkpoint.resume before it
        config, required = _check_config(opts.config, opts.overrides)
        required += opts.require
    sources = opts.hosts or [DEFAULT_INVENTORY]
    nodes = load_nodes(
        sources, group=opts.group, limit=opts.limit, exclude=opts.exclude, extra_vars=opts.extra_vars
    )
    from ddp_train.launch.preflight.rdma import with_mode_env

    if opts.rdma:
        nodes = [dataclasses.replace(n, rdma=opts.rdma) for n in nodes]  # --rdma wins over ddp_rdma
    nodes = [with_mode_env(n) for n in nodes]
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
        nproc_per_node=nproc,
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
        on_node_loss=getattr(opts, "on_node_loss", None),  # doctor has none
        max_node_losses=getattr(opts, "max_node_losses", None),
        min_nodes=getattr(opts, "min_nodes", None),
    )
    return build_plan(nodes, options)


def _scan(opts: argparse.Namespace, nodes: Sequence[Node]) -> Manifest | None:
    """--sync (or ddp_sync_dir) scanned, excluded and size-checked here, before any node is touched."""
    from ddp_train.launch.plan.plan import same
    from ddp_train.launch.remote.sync import parse_size, scan

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
        from ddp_train.launch.plan.scriptcheck import module_file

        hit = module_file(opts.script, manifest.entries.__contains__)
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
    from ddp_train.launch.pipeline import refusal
    from ddp_train.launch.plan.plan import same
    from ddp_train.launch.plan.scriptcheck import check_script

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
        raise LaunchError(f"{refusal(check.findings, why)}; nothing was started")
    return check, mode


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


def _check_nproc(value: str | None) -> str | None:
    """--nproc-per-node as torchrun gets it: a positive integer, gpu, cpu or auto (the same rule as the
    inventory's ddp_nproc_per_node, inventory.nproc_value)."""
    from ddp_train.launch.plan.inventory import nproc_value

    if value is None:
        return None
    n = nproc_value(value)
    if n is None:
        raise LaunchError(f"--nproc-per-node {value!r}: a positive integer, gpu, cpu or auto")
    return n


def slurm_settings(opts: argparse.Namespace) -> SlurmSettings | None:
    """The job's Slurm settings (--backend slurm, or ddp_backend: slurm); None for the SSH backend."""
    from ddp_train.launch.plan.inventory import DEFAULT_INVENTORY
    from ddp_train.launch.slurm import settings

    sources = opts.hosts or [DEFAULT_INVENTORY]
    if not settings.wanted(opts, sources, opts.extra_vars):
        return None
    return settings.load(opts, sources, opts.extra_vars)
