"""Preflight: check every node in parallel before anything starts; one clear line per problem.

SSH with host key checking; the node's python, torch, torchrun and ddp_train; torch/CUDA/NCCL/Python
versions and GPU count equal across nodes; no hostname resolving to loopback; MASTER_PORT free on the
master and reachable from every node; and every node reachable from every other node on an
OS-chosen ephemeral port, which is what gloo and NCCL connect to after the rendezvous. A warning
when MASTER_PORT also answers the controller while it is no node (the port is open beyond the job).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import ipaddress
import json
import os
import posixpath
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Any

from ddp_train.digest import file_sha256
from ddp_train.launch.errors import LaunchError, one_line
from ddp_train.launch.node import command, env_line, marked_json
from ddp_train.launch.node.probe import PROBE_MARK
from ddp_train.launch.plan.plan import JobPlan, NodePlan, resolve
from ddp_train.launch.preflight import gpuhealth, netif, rdma
from ddp_train.launch.preflight.preflight_model import NodeCheck, Report
from ddp_train.launch.remote.fanout import parallel, rounds
from ddp_train.launch.remote.remote import RemoteError, Stream, open_session
from ddp_train.storage import size_text

COMPARED = ("python_minor", "torch", "cuda", "nccl", "gpus", "ddp_train")  # must be equal on every node


def run_preflight(
    plan: JobPlan, connect_timeout: float = 10, net_timeout: float = 3, sessions: dict | None = None
) -> Report:
    """Run every check on every node (in parallel) and return the report; starts nothing.

    `sessions`: connections already open (by --sync), reused instead of opening new ones."""
    checks = [NodeCheck(p, session=(sessions or {}).get(p.node.name)) for p in plan.nodes]
    parallel(lambda c: _probe(c, connect_timeout), checks)
    judge_probed(checks, hostnames=not plan.all_local)
    netif.check(plan, checks)
    plan = netif.with_master(plan, {c.plan.node.name: netif.chosen(c.facts) for c in checks})
    rdma.check_cluster(checks)
    _check_neighbour_table(checks)
    _check_files(plan, checks)
    _check_network(plan, checks, net_timeout)
    return Report(checks=checks)


def probe_env(p: NodePlan) -> dict[str, str]:
    """The job's env for a probe: no job id (probes must not look like job processes at teardown) and no
    secret (a probe needs none)."""
    return {k: v for k, v in p.env.items() if k != "DDP_JOB_ID" and not p.secret(k)}


def python_command(p: NodePlan, module: str, *args: str) -> str:
    """The node's python running node module `module` with `args`; its environment goes on stdin
    (`probe_stdin`), never on the command line."""
    return command(p.node.venv, module, *args, env=True)


def probe_stdin(p: NodePlan) -> bytes:
    """The first line a `python_command` reads from its stdin: its environment as JSON."""
    return env_line(probe_env(p))


def _probe(c: NodeCheck, connect_timeout: float) -> None:
    node = c.plan.node
    try:
        c.session = c.session or open_session(node, connect_timeout)
    except RemoteError as e:
        c.fail(f"ssh: {str(e).split(': ', 1)[-1]}")
        return
    try:
        gpu_args = gpuhealth.probe_args(node.gpu_health, node.gpu_health_dcgm)
        netif_args = netif.probe_argv(node.network_cidr)
        code, out = c.session.exec(
            python_command(c.plan, "probe", node.venv, node.workdir or "", *gpu_args, *netif_args),
            timeout=120,
            stdin=probe_stdin(c.plan),
        )
    except RemoteError as e:
        c.fail(f"probe failed: {str(e).split(': ', 1)[-1]}")
        return
    read_probe(c, code, out)


def read_probe(c: NodeCheck, code: int, out: str) -> None:
    """The probe's output (launch/node/probe.py) as c.facts, or c's failure saying what came instead."""
    node = c.plan.node
    python = f"{node.venv.rstrip('/')}/bin/python"
    try:
        found = marked_json(out, PROBE_MARK)
    except ValueError:
        c.fail(f"{python} printed an unreadable probe record")
        return
    if code == 127 or (found is None and "No such file" in out):
        c.fail(f"{python} not found (ddp_venv={node.venv}): run the pytorch role or set ddp_venv")
        return
    if not isinstance(found, dict):
        last = one_line(out.strip().splitlines()[-1]) if out.strip() else f"exit {code}, no output"
        c.fail(f"{python} failed: {last}")
        return
    c.facts = found
    c.facts["netif"] = netif.parse_probe(out)
    c.facts["python_minor"] = ".".join(str(c.facts.get("python", "")).split(".")[:2])
    c.facts["gpu_health"] = gpuhealth.parse_probe_output(out)
    if code != 0:
        c.warnings.append(f"probe exited {code}")


def judge_probed(checks: list[NodeCheck], hostnames: bool = True) -> None:
    """The checks that need only each node's probe facts: versions equal on every node, torch and the
    trainer importable, torchrun and setsid there, GPU counts and health; `hostnames`: the node's name
    must not resolve to a loopback address (skipped when every node is this machine). The Slurm
    driver's in-job preflight runs these too (launch/slurm/driver.py)."""
    _compare_versions(checks)
    _compare_patch_level(checks)
    for c in checks:
        _check_node_facts(c, hostnames)
        if c.facts:
            gpuhealth.check(c)


def _check_node_facts(c: NodeCheck, hostnames: bool) -> None:
    f, node = c.facts, c.plan.node
    if not f:
        return
    if "torch_error" in f:
        c.fail(f"cannot import torch with {f.get('executable')}: {one_line(f['torch_error'])}")
    if "ddp_train_error" in f:
        c.fail(
            f"cannot import the trainer (ddp_train) with {f.get('executable')}: "
            + one_line(f["ddp_train_error"])
        )
    if not f.get("torchrun"):
        c.fail(f"{node.venv}/bin/torchrun not found or not executable (ddp_venv={node.venv})")
    if not f.get("setsid"):
        c.fail("setsid not found (install util-linux); the launcher needs it to stop the job cleanly")
    if not f.get("workdir_ok"):
        c.fail(f"ddp_workdir {node.workdir} does not exist")
    if hostnames:
        _check_hostname(c)
    gpus, nproc = f.get("gpus") or 0, c.plan.nproc
    if gpus and nproc.isdigit() and int(nproc) > gpus:
        c.fail(f"{nproc} processes per node but only {gpus} GPUs")
    if nproc == "gpu" and not gpus:
        c.fail("--nproc-per-node gpu but torch sees no GPU")
    fingerprint = f.get("fingerprint")
    if isinstance(fingerprint, dict):
        for key in ("torch", "cuda", "nccl", "python", "ddp_train"):
            want, got = fingerprint.get(key), f.get(key)
            if want is not None and got is not None and str(want) != str(got):
                c.warnings.append(
                    f"{key} is {got} but the provisioning fingerprint says {want} (venv changed?)"
                )


def _check_neighbour_table(checks: list[NodeCheck]) -> None:
    """gloo connects every pair and NCCL bootstraps widely: each node keeps a neighbour entry per peer,
    and the kernel drops new ones past gc_thresh3 (defaults 128/512/1024). Warn below 4 x nodes."""
    need = 4 * len(checks)
    for c in checks:
        limit = c.facts.get("gc_thresh3")
        if isinstance(limit, int) and limit < need:
            c.warnings.append(
                f"net.ipv4.neigh.default.gc_thresh3 is {limit}, below 4 x {len(checks)} nodes = {need}: "
                "connections can fail with 'neighbor table overflow!' in the kernel log; raise it "
                "(role cluster_hosts sets it from the inventory's size)"
            )


def _check_files(plan: JobPlan, checks: list[NodeCheck]) -> None:
    """--sync's content digest on every remote node, and the run's files: present on every node with
    the master's size and mtime (files inside the synced copy are covered by its digest)."""
    if not plan.sync and not plan.required:
        return
    found: dict[str, dict] = {}

    def look(c: NodeCheck) -> None:
        verify = c.plan.sync_dir if plan.sync and not c.plan.node.local else ""
        required = json.dumps(list(plan.required))
        cmd = command(c.plan.node.venv, "files", c.plan.cwd or "", verify or "", required)
        try:
            code, out = c.session.exec(cmd, timeout=300)  # type: ignore[union-attr]
        except RemoteError as e:
            c.fail(f"file check failed: {str(e).split(': ', 1)[-1]}")
            return
        try:
            record = marked_json(out, "DDP-FILES ")
        except ValueError:
            record = None
        if not isinstance(record, dict):
            c.fail(f"file check failed: {one_line(out) or f'exit {code}'}")
            return
        found[c.name] = record
        if verify and plan.sync and found[c.name].get("sync") != plan.sync.digest:
            got = str(found[c.name].get("sync"))
            what = got if " " in got or got == "missing" else f"has content {got[:20]}, not {plan.sync.name}"
            c.fail(f"synced copy {verify} {what} (changed on the node? the next launch sends it again)")

    parallel(look, [c for c in checks if c.facts and c.session is not None])
    master = found.get(plan.master_name, {}).get("files", {})
    for c in checks:
        if c.name not in found:
            continue
        where = c.plan.cwd or "the login directory"
        problems = []
        for path, st in found[c.name]["files"].items():
            ref = master.get(path)
            if not isinstance(st, list):
                problems.append(f"{path} missing ({st}, looked in {where})")
            elif c.name != plan.master_name and isinstance(ref, list) and not _same_file(st, ref, plan, path):
                problems.append(
                    f"{path} differs from the master {plan.master_name}: size {st[0]} vs {ref[0]}, "
                    f"mtime {st[1]} vs {ref[1]}"
                )
        if problems:
            c.fail("files the run needs: " + "; ".join(problems))


def _same_file(st: list, ref: list, plan: JobPlan, path: str) -> bool:
    if plan.sync and posixpath.normpath(path) in plan.sync.entries:
        return True  # a file of the synced copy: its digest already proves the content equal
    return st[0] == ref[0] and abs(st[1] - ref[1]) <= 1  # some filesystems keep whole seconds only


def _check_hostname(c: NodeCheck) -> None:
    f, env = c.facts, c.plan.env
    pinned = "GLOO_SOCKET_IFNAME" in env and ("NCCL_SOCKET_IFNAME" in env or not f.get("gpus"))
    if "hostname_error" in f:
        msg = f"hostname {f.get('hostname')!r} does not resolve ({f['hostname_error']}); add it to /etc/hosts"
        (c.warnings.append if pinned else c.fail)(msg)
        return
    loop = [ip for ip in f.get("hostname_ips", []) if ipaddress.ip_address(ip.split("%")[0]).is_loopback]
    if loop:
        msg = (
            f"hostname {f.get('hostname')!r} resolves to {', '.join(loop)}: gloo/NCCL would advertise a "
            "loopback address to the other nodes; map it to the cluster IP in /etc/hosts (role cluster_hosts)"
        )
        (c.warnings.append if pinned else c.fail)(msg)


def _compare_versions(checks: list[NodeCheck]) -> None:
    """Every compared value must be equal on all nodes; the odd ones out are reported."""
    probed = [c for c in checks if c.facts and "torch_error" not in c.facts]
    for key in COMPARED:
        values = {c.name: c.facts.get(key) for c in probed}
        counts = collections.Counter(values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        # the most common value wins; on a tie, the master's (first node's) value
        reference = next(v for v in values.values() if counts[v] == top)
        holders = [n for n, v in values.items() if v == reference]
        for c in probed:
            if values[c.name] != reference:
                c.fail(f"{key} {values[c.name]} differs from {reference} on {', '.join(holders)}")


def _compare_patch_level(checks: list[NodeCheck]) -> None:
    """Python patch releases may differ (a warning): pickles and wheels are per minor version."""
    versions = {c.name: str(c.facts["python"]) for c in checks if c.facts.get("python")}
    if len(set(versions.values())) > 1:
        for c in checks:
            if c.name in versions:
                c.warnings.append(
                    f"python {versions[c.name]}; the nodes run {', '.join(sorted(set(versions.values())))}"
                )


def _check_network(plan: JobPlan, checks: list[NodeCheck], timeout: float) -> None:
    ready = [c for c in checks if c.facts and c.session is not None]
    master = next(c for c in checks if c.name == plan.master_name)
    if master not in ready:
        if master.failures:
            for c in ready:
                c.warnings.append("network checks skipped: the master failed its checks")
        return
    token = secrets.token_hex(8)
    # Listeners end on stdin EOF (finally below); their own life is the fallback if the controller dies.
    # Starting them and probing from them both go `forks` nodes at a time, each probe batch up to two
    # tries of `timeout`: the first listeners must outlive the last batch (hundreds of nodes, forks 5).
    life = str(int(timeout * 4 + 60 + rounds(len(ready)) * (3 * timeout + 10)))
    port = plan.master_port

    def start(c: NodeCheck) -> tuple[Stream | None, dict[str, Any]]:
        assert c.session is not None
        cmd = python_command(c.plan, "listener", str(port if c is master else 0), token, life)
        try:
            stream = c.session.start(cmd, stdin=True)
            stream.send(probe_stdin(c.plan))  # then stdin stays open: its EOF ends the listener
        except RemoteError as e:
            c.fail(f"cannot start the network probe: {e}")
            return None, {}
        info: dict[str, Any] = {}
        for line in stream.lines():
            word, _, rest = line.partition(" ")
            if word == "READY":
                break
            info[word] = rest
        return stream, info

    started = parallel(start, ready)
    try:
        listeners = {c.name: info for c, (_, info) in zip(ready, started)}
        minfo = listeners.get(master.name, {})
        if "MASTER-BUSY" in minfo:
            why = minfo["MASTER-BUSY"].split(" ", 1)[-1]
            master.fail(
                f"MASTER_PORT {port} is not free on the master ({why}); stop what listens there "
                "or choose another ddp_master_port / --master-port"
            )
        addresses = _addresses(plan, checks)
        targets = {}
        for c in ready:
            t = []
            if "MASTER" in minfo:
                t.append([f"{master.name}|MASTER_PORT|{plan.master_addr}|{port}", plan.master_addr, port])
            for peer in ready:
                eph = listeners.get(peer.name, {}).get("EPHEMERAL")
                ip = addresses.get(peer.name)
                if peer is not c and eph and ip:
                    t.append([f"{peer.name}|ephemeral|{ip}|{eph}", ip, int(eph)])
            targets[c.name] = t

        def connect(c: NodeCheck) -> None:
            if not targets[c.name]:
                return
            cmd = python_command(c.plan, "connector", json.dumps(targets[c.name]), token, str(timeout))
            try:
                code, out = c.session.exec(  # type: ignore[union-attr]
                    cmd, timeout=timeout + 60, stdin=probe_stdin(c.plan)
                )
            except RemoteError as e:
                c.fail(f"network probe failed: {str(e).split(': ', 1)[-1]}")
                return
            try:
                found = marked_json(out, "DDP-CONNECT ")
            except ValueError:
                found = None
            if not isinstance(found, dict):
                c.fail(f"network probe failed: {one_line(out) or f'exit {code}'}")
                return
            for key, result in found.items():
                if result != "ok":
                    c.fail_to_reach(key.split("|", 1)[0], _unreachable(key, result))

        parallel(connect, ready)
        outsider = _answers_outsider(plan, addresses, token, min(timeout, 2.0)) if "MASTER" in minfo else None
        if outsider:
            master.warnings.append(outsider)
    finally:
        # EOF ends every listener; wait for it so MASTER_PORT is free again before torchrun binds it
        streams = [s for s, _ in started if s is not None]
        for s in streams:
            s.close_stdin()
        for s in streams:
            s.wait(timeout=5)
            s.close()


def _answers_outsider(plan: JobPlan, addresses: dict[str, str], token: str, timeout: float) -> str | None:
    """A warning when MASTER_PORT answers this controller while it is no node of the job: the rendezvous
    (TCPStore) has no authentication, so a port that a non-member reaches lets it disturb the job. The
    controller is the one non-member address preflight can see; a firewall that keeps the port to the
    nodes makes this connect fail (issue #24)."""
    if any(p.node.local for p in plan.nodes):  # the controller is a node itself
        return None
    try:
        with socket.create_connection((plan.master_addr, plan.master_port), timeout=timeout) as s:
            s.settimeout(timeout)
            source = s.getsockname()[0]
            answered = s.makefile().readline().strip() == token
    except OSError:
        return None  # refused, filtered or unreachable from here: what a firewall should make it
    members = set(addresses.values()) | {plan.master_addr}
    for p in plan.nodes:
        with contextlib.suppress(LaunchError):
            members.add(resolve(p.node.address))
    if not answered or source in members:
        return None
    return (
        f"MASTER_PORT {plan.master_port} at {plan.master_addr} answers this controller ({source}), which is "
        "no node of the job: the rendezvous has no authentication, so any host that reaches it can abort "
        "or disturb the job; let only the nodes reach it (firewall_trusted_sources, see docs/security.md)"
    )


def _addresses(plan: JobPlan, checks: list[NodeCheck]) -> dict[str, str]:
    """The IP each node is reached at by its peers: its training address, else its inventory address."""
    out = {}
    for c in checks:
        if c.facts.get("iface_addr"):  # what gloo/NCCL will connect to (netif)
            out[c.name] = c.facts["iface_addr"]
            continue
        try:
            ip = resolve(c.plan.node.address)
        except LaunchError as e:
            c.fail(f"ansible_host: {e}")
            continue
        if ipaddress.ip_address(ip).is_loopback and not plan.all_local:
            c.fail(f"ansible_host {c.plan.node.address!r} is {ip}, which other nodes cannot reach")
            continue
        out[c.name] = ip
    return out


NEIGHBOUR_HINT = (
    "no answer to ARP/neighbour discovery: the kernel's neighbour table is full "
    "(net.ipv4.neigh.default.gc_thresh3, set by role cluster_hosts; 'neighbor table overflow!' in dmesg) "
    "or the host is down"
)


def _unreachable(key: str, result: str) -> str:
    peer, kind, ip, port = key.split("|")
    code, _, why = result.partition(" ")
    if code.startswith("E") and code.isupper():
        result = why  # the connector's "ERRNO-NAME strerror": the name picks the hint
    hint = ""
    if code in ("EHOSTUNREACH", "ENETUNREACH"):
        hint = f" ({NEIGHBOUR_HINT})" if code == "EHOSTUNREACH" else " (no route: check the node's routes)"
    elif result.startswith("timed out"):
        hint = " (packets dropped: a firewall on either side?)"
    elif code == "ECONNREFUSED" or "refused" in result.lower():
        hint = " (refused: a REJECT rule, or the address is not this node's?)"
    if kind == "MASTER_PORT":
        return (
            f"cannot reach the master {peer} at {ip}:{port} (MASTER_PORT): {result}{hint}; "
            "open MASTER_PORT to the cluster's addresses (role firewall)"
        )
    fix = f"allow the cluster's addresses in {peer}'s firewall (role firewall)"
    if code == "EHOSTUNREACH":
        fix = f"check that {peer} is up, and the neighbour table size on both nodes (role cluster_hosts)"
    return (
        f"cannot reach {peer} at {ip}:{port}, an OS-chosen ephemeral port as gloo/NCCL use: "
        f"{result}{hint}; {fix}"
    )


FILE_OVERHEAD = (
    64 * 1024
)  # per file beyond the tensors: zip records, config, RNG and data state (measured ~5-25 KiB)


def checkpoint_bytes(cfg: Any) -> tuple[int, int] | None:
    """(one checkpoint, best.pt) in bytes, estimated from the model's parameters: fp32 weights, plus
    AdamW's two moments (SGD's one momentum buffer) per weight in a checkpoint; best.pt holds the
    weights only (checkpoint.Checkpointer.save_best).
    None when the model cannot be built here (a plug-in that needs the nodes)."""
    weights = weight_bytes(cfg)
    if weights is None:
        return None
    moments = 2 if cfg.train.optimizer == "adamw" else (1 if cfg.train.momentum else 0)
    return weights * (1 + moments) + FILE_OVERHEAD, weights + FILE_OVERHEAD


def weight_bytes(cfg: Any) -> int | None:
    """The model's weights in bytes, from the model built on the meta device (no memory, no data).

    A built-in model's size follows from its own config section and models.py alone: remembered per
    user (`_size_cache`), so a launch does not import torch (~1.2 s of CPU) to learn again what an
    earlier launch learned. A plug-in is built every time. None when the model cannot be built here."""
    key, source = None, None
    if cfg.model.name in ("mlp", "gpt"):
        source = importlib.util.find_spec("ddp_train.models")  # found, not imported (that imports torch)
    if source is not None and source.origin:
        section = json.dumps(dataclasses.asdict(getattr(cfg.model, cfg.model.name)), sort_keys=True)
        key = f"{cfg.model.name} {section} {file_sha256(source.origin)}"
        cached = _size_cache().get(key)
        if isinstance(cached, int):
            return cached
    try:
        import torch

        from ddp_train.models import build_model

        with torch.device("meta"):
            model = build_model(cfg)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:  # noqa: BLE001 - an estimate only: the trainer reports what really fails
        return None
    if key is not None:
        _remember_size(key, int(weights))
    return int(weights)


SIZE_CACHE_ENTRIES = 64


def _size_cache_file() -> Path:
    """$XDG_CACHE_HOME/ddp-train/model-bytes.json (XDG Base Directory spec; default ~/.cache)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return cache / "ddp-train" / "model-bytes.json"


def _size_cache() -> dict[str, Any]:
    try:
        data = json.loads(_size_cache_file().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: the model is built instead
        return {}
    return data if isinstance(data, dict) else {}


def _remember_size(key: str, weights: int) -> None:
    """Adds one entry (the newest SIZE_CACHE_ENTRIES kept), written atomically, 0600 in a 0700 dir."""
    path = _size_cache_file()
    entries = {k: v for k, v in _size_cache().items() if k != key}
    entries[key] = weights
    entries = dict(list(entries.items())[-SIZE_CACHE_ENTRIES:])
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".model-bytes.")  # 0600
    except OSError:  # a read-only home: the next launch builds the model again
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def check_space(checks: list[NodeCheck], cfg: Any, strict: bool) -> None:
    """On rank 0's node, which writes them: room under checkpoint.dir for two checkpoints (the newest
    and the one being written) and under run.dir for best.pt (a whole checkpoint at worst: a hard link to
    one that rotation pruned). A warning naming the path and its free space; a failure with --strict."""
    sizes = checkpoint_bytes(cfg)
    c = next((c for c in checks if c.plan.rank == 0 and c.session is not None and c.facts), None)
    if sizes is None or c is None:
        return
    # best.pt is a hard link to its step's checkpoint where that step saved one (the last always does),
    # and outlives that checkpoint's rotation: a whole checkpoint at worst (checkpoint.Checkpointer)
    ckpt, best = sizes[0], sizes[0]
    run_dir = posixpath.join(cfg.run.dir, cfg.run.name)
    ckpt_dir = cfg.checkpoint.dir or posixpath.join(run_dir, "checkpoints")
    need, labels = {ckpt_dir: 2 * ckpt}, {ckpt_dir: "two checkpoints"}
    if cfg.eval.keep_best and cfg.eval.interval_steps:
        need[run_dir] = need.get(run_dir, 0) + best
        labels[run_dir] = "two checkpoints and best.pt" if run_dir == ckpt_dir else "best.pt"
    cmd = command(c.plan.node.venv, "space", c.plan.cwd or "", json.dumps(list(need)))
    try:
        _, out = c.session.exec(cmd, timeout=60)  # type: ignore[union-attr]
    except RemoteError as e:
        c.warnings.append(f"free space not checked: {one_line(str(e))}")
        return
    try:
        found = marked_json(out, "DDP-SPACE ")
    except ValueError:
        found = None
    if not isinstance(found, dict):
        c.warnings.append(f"free space not checked: {one_line(out) or 'no answer'}")
        return
    mounts: dict[str, list[Any]] = {}  # filesystem (nearest existing dir) -> [bytes needed, free, dirs]
    for d, n in need.items():
        st = found.get(d)
        if not isinstance(st, list):
            c.warnings.append(f"free space of {d} not checked: {st}")
            continue
        entry = mounts.setdefault(st[0], [0, st[1], []])
        entry[0] += n
        entry[2].append(d)
    best_text = f", {size_text(best)} best.pt" if len(labels) > 1 or run_dir == ckpt_dir else ""
    for where, (needed, free, dirs) in mounts.items():
        if free >= needed:
            continue
        what = " and ".join(labels[d] for d in dirs)
        msg = (
            f"{', '.join(dirs)} ({where}): {size_text(free)} free, less than {what} need "
            f"({size_text(needed)}: "
            f"{size_text(ckpt)} per checkpoint{best_text}, estimated from the model's parameters and "
            "optimizer state); a full disk stops the job at a save"
        )
        (c.fail if strict else c.warnings.append)(msg)
