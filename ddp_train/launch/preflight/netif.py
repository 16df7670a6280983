"""Each node's training interface: the one interface and address the kernel has inside ddp_network_cidr.

gloo and NCCL pick an interface by themselves when told nothing (gloo: the address the hostname
resolves to; NCCL: the first interface that is not lo or docker*), which is the most common multi-node
hang: docker0, virbr0 or the management NIC is chosen, and the names differ between nodes (NVIDIA/nccl
#286, NVIDIA/nccl-tests #219, vllm-project/vllm #7074, horovod/horovod #310, huggingface/accelerate #412).
So preflight asks each node's kernel (`ip -j addr`, `ip -j route get`, in the same SSH round trip as
its other probe) which interface holds an address in ddp_network_cidr, and the launcher sets per node

    GLOO_SOCKET_IFNAME=<dev>    NCCL_SOCKET_IFNAME==<dev>    torchrun --local-addr <address>

(NCCL: a leading "=" means that exact name, not a prefix: NCCL_SOCKET_IFNAME in
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html). A value set in ddp_env/--env wins
and is reported. No address in the CIDR, or two interfaces in it, fails preflight with one line. Without
ddp_network_cidr (or when every node is this machine) nothing is derived: gloo/NCCL choose as before.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddp_train.launch.node import marked_json
from ddp_train.launch.node.probe import NETIF_MARK as MARK
from ddp_train.launch.plan.inventory import Node
from ddp_train.launch.plan.plan import JobPlan, NodePlan

if TYPE_CHECKING:
    from ddp_train.launch.preflight.preflight_model import NodeCheck

ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class NetifError(ValueError):
    """A node's interfaces do not give one training interface (the message is the preflight line)."""


@dataclasses.dataclass(frozen=True)
class Address:
    dev: str
    address: str
    prefixlen: int
    up: bool = True
    secondary: bool = False

    def __str__(self) -> str:
        return f"{self.dev} {self.address}/{self.prefixlen}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The interface and address a node trains over."""

    dev: str
    address: str
    prefixlen: int


def network(cidr: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(cidr, strict=False)
    except ValueError as e:
        raise NetifError(f"ddp_network_cidr {cidr!r}: {e}") from None


def probe_argv(cidr: str | None) -> list[str]:
    """The probe's --netif arguments (node/probe.py): none without a CIDR (it then prints nothing)."""
    if not cidr:
        return []
    try:
        net = network(cidr)
    except NetifError:
        return ["--netif", cidr, "[]"]  # the node reports its addresses; the choice names the bad CIDR
    # `ip route get` to an address in the CIDR that is not the node's: any will do (no packet is sent)
    targets = [net[-2], net[1], net[2]] if net.num_addresses >= 4 else list(net)
    return ["--netif", cidr, json.dumps([str(t) for t in targets])]


def parse_probe(output: str) -> dict[str, Any] | None:
    """The last DDP-NETIF line of a probe's output, or None."""
    try:
        found = marked_json(output, MARK)
    except ValueError:
        return {"error": "unreadable interface probe output"}
    if found is None:
        return None
    return found if isinstance(found, dict) else {"error": "unreadable interface probe output"}


def addresses(ip_addr: Sequence[Mapping[str, Any]]) -> list[Address]:
    """Every address of `ip -j addr show` output (IPv4 and IPv6), in the kernel's order."""
    out = []
    for link in ip_addr:
        dev = str(link.get("ifname", "?"))
        up = "UP" in (link.get("flags") or [])
        for a in link.get("addr_info") or []:
            if a.get("family") not in ("inet", "inet6") or "local" not in a:
                continue
            prefixlen, secondary = int(a.get("prefixlen", 0)), bool(a.get("secondary"))
            out.append(Address(dev, str(a["local"]), prefixlen, up, secondary))
    return out


def route_dev(ip_route: Sequence[Mapping[str, Any]]) -> tuple[str | None, str | None]:
    """(dev, prefsrc) of `ip -j route get` output."""
    if not ip_route:
        return None, None
    r = ip_route[0]
    return r.get("dev"), r.get("prefsrc")


def choose(cidr: str, probe: Mapping[str, Any]) -> Choice:
    """The one interface (and its address) inside `cidr`; NetifError naming what the node has otherwise."""
    net = network(cidr)
    if "addr" not in probe:
        raise NetifError(f"cannot list the interfaces: {probe.get('error', 'no ip -j addr output')}")
    found = addresses(probe["addr"])
    inside = [a for a in found if a.address.split("%")[0] in _Within(net)]
    devs = list(dict.fromkeys(a.dev for a in inside))
    if not devs:
        others = [str(a) for a in found if a.dev != "lo" and _shown(a.address, net)]
        raise NetifError(
            f"no interface has an address in ddp_network_cidr {cidr} (found: {', '.join(others) or 'none'}); "
            "give the node an address in the training network or fix ddp_network_cidr"
        )
    if len(devs) > 1:
        raise NetifError(
            f"{len(devs)} interfaces have addresses in ddp_network_cidr {cidr}: "
            f"{', '.join(str(a) for a in inside)}; gloo/NCCL need one: remove one address or narrow the CIDR"
        )
    dev = devs[0]
    mine = [a for a in inside if a.dev == dev]
    rdev, prefsrc = route_dev(probe.get("route") or [])
    if probe.get("route_to") and rdev and rdev != dev:
        raise NetifError(
            f"{dev} has {', '.join(a.address for a in mine)} in ddp_network_cidr {cidr}, but the kernel "
            f"routes {probe['route_to']} (in it) through {rdev}: check `ip route` on the node"
        )
    pick = next((a for a in mine if a.address == prefsrc), None) or next(
        (a for a in mine if not a.secondary), mine[0]
    )
    if not pick.up:
        raise NetifError(f"interface {pick} (in ddp_network_cidr {cidr}) is down")
    return Choice(dev=dev, address=pick.address, prefixlen=pick.prefixlen)


def _shown(address: str, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    """Worth naming when no address is in `net`: the same family, not link-local."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip.version == net.version and not ip.is_link_local


class _Within:
    """`text in _Within(net)`: an address string inside net (another family or garbage: False)."""

    def __init__(self, net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> None:
        self.net = net

    def __contains__(self, text: object) -> bool:
        try:
            return ipaddress.ip_address(str(text)) in self.net
        except ValueError:
            return False


def derived_env(choice: Choice) -> dict[str, str]:
    """What the launcher sets for a node training over `choice` (NCCL "=": exact name, not a prefix)."""
    return {"GLOO_SOCKET_IFNAME": choice.dev, "NCCL_SOCKET_IFNAME": f"={choice.dev}"}


def settings(choice: Choice, env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """(env to add, one note per user value that wins over the derived one)."""
    add, kept = {}, []
    for key, value in derived_env(choice).items():
        if key in env:
            if env[key] != value:
                kept.append(f"{key}={env[key]} from ddp_env/--env wins over the derived {value}")
        else:
            add[key] = value
    return add, kept


def with_local_addr(argv: Iterable[str], address: str) -> tuple[str, ...]:
    """torchrun's argv with --local-addr set to `address` (replaced, or added after --nproc-per-node)."""
    out = list(argv)
    if "--local-addr" in out:
        out[out.index("--local-addr") + 1] = address
        return tuple(out)
    at = out.index("--nproc-per-node") + 2
    return tuple(out[:at] + ["--local-addr", address] + out[at:])


def describe(name: str, choice: Choice, env: Mapping[str, str]) -> str:
    """One line for the log and doctor: what the node trains over and what the launcher sets."""
    add, kept = settings(choice, env)
    shown = [f"{k}={v}" for k, v in add.items()] + [f"--local-addr {choice.address}"]
    line = f"{name}: trains over {choice.dev} {choice.address}/{choice.prefixlen}: {' '.join(shown)}"
    return line + "".join(f"; {k}" for k in kept)


def wanted(plan: JobPlan, node: Node) -> bool:
    """Derive this node's interface? Only with ddp_network_cidr, and not when every node is this machine."""
    return bool(node.network_cidr) and not plan.all_local


def check(plan: JobPlan, checks: Sequence[NodeCheck]) -> None:
    """Preflight: choose each probed node's interface (facts iface/iface_addr) or fail it with one line.

    `checks` are preflight's NodeChecks (plan, facts, fail, warnings)."""
    probed = [c for c in checks if c.facts]
    if not plan.all_local and not any(c.plan.node.network_cidr for c in checks) and probed:
        probed[0].warnings.append(
            "ddp_network_cidr is not set: gloo/NCCL choose each node's interface themselves (set it to the "
            "training network to have the interface derived per node)"
        )
    for c in probed:
        node = c.plan.node
        if not wanted(plan, node):
            continue
        try:
            found = c.facts.get("netif") or {"error": "the probe did not run"}
            choice = choose(str(node.network_cidr), found)
        except NetifError as e:
            c.fail(str(e))
            continue
        c.facts["iface"], c.facts["iface_addr"] = choice.dev, choice.address
        c.facts["iface_prefixlen"] = choice.prefixlen
        _, kept = settings(choice, c.plan.env)
        c.warnings.extend(kept)


def chosen(facts: Mapping[str, Any]) -> Choice | None:
    if "iface" not in facts:
        return None
    return Choice(facts["iface"], facts["iface_addr"], int(facts.get("iface_prefixlen", 0)))


def apply(plan: JobPlan, checks: Sequence[NodeCheck], note: Callable[[str], Any] | None = None) -> JobPlan:
    """The plan with each node's derived settings (after preflight passed); `note` gets one line per node.

    c10d: torchrun ranks the nodes by their --local-addr as text, so the nodes are ordered again."""
    found = {c.plan.node.name: chosen(c.facts) for c in checks}
    before, plan = plan.master_addr, with_master(plan, found)
    if note and plan.master_addr != before:
        note(f"MASTER_ADDR {plan.master_addr}: {plan.master_name}'s address in ddp_network_cidr")
    nodes = []
    for p in plan.nodes:
        choice = found.get(p.node.name)
        if choice is None:
            nodes.append(p)
            continue
        add, _ = settings(choice, p.env)
        argv = with_local_addr(p.argv, choice.address)
        nodes.append(dataclasses.replace(p, env={**p.env, **add}, argv=argv))
        if note:
            note(describe(p.node.name, choice, p.env))
    if plan.rdzv == "c10d" and all(found.get(p.node.name) for p in plan.nodes):
        nodes.sort(key=lambda p: p.argv[p.argv.index("--local-addr") + 1])
        nodes = [dataclasses.replace(p, rank=i) for i, p in enumerate(nodes)]
    return dataclasses.replace(plan, nodes=tuple(nodes))


def with_master(plan: JobPlan, found: Mapping[str, Choice | None]) -> JobPlan:
    """Without ddp_master_addr (plan.master_derived): MASTER_ADDR is the master's address in
    ddp_network_cidr, as its preflight found it (`found`: node name -> choice), in every node's
    --master-addr / --rdzv-endpoint; the plan unchanged otherwise."""
    choice = found.get(plan.master_name)
    if not plan.master_derived or choice is None or choice.address == plan.master_addr:
        return plan
    addr = choice.address
    endpoint = f"[{addr}]:{plan.master_port}" if ":" in addr else f"{addr}:{plan.master_port}"
    nodes = []
    for p in plan.nodes:
        argv = list(p.argv)
        for flag, value in (("--master-addr", addr), ("--rdzv-endpoint", endpoint)):
            if flag in argv:
                argv[argv.index(flag) + 1] = value
        nodes.append(dataclasses.replace(p, argv=tuple(argv)))
    return dataclasses.replace(plan, nodes=tuple(nodes), master_addr=addr)


def master_unchecked(plan: JobPlan) -> str | None:
    """--skip-preflight: nothing finds the master's address in ddp_network_cidr, so an inventory address
    outside it is refused as before (the one line), with ddp_master_addr as the way out."""
    cidr = plan.master.node.network_cidr
    if (
        not plan.master_derived
        or not cidr
        or plan.master_addr in _Within(ipaddress.ip_network(cidr, strict=False))
    ):
        return None
    return (
        f"master {plan.master_name}: ansible_host {plan.master_addr} is outside ddp_network_cidr {cidr} and "
        "--skip-preflight leaves the master's training address unknown; run preflight or set ddp_master_addr"
    )


def dry_run_line(plan: JobPlan, p: NodePlan) -> str | None:
    """--dry-run starts nothing and asks no node: what preflight will derive, and what the user set."""
    if not wanted(plan, p.node):
        return None
    user = [f"{k}={p.env[k]} (ddp_env/--env, wins)" for k in ENV_KEYS if k in p.env]
    derived = [f"{k}={'=' if k.startswith('NCCL') else ''}<dev>" for k in ENV_KEYS if k not in p.env]
    return (
        f"# network: <dev> <address> = this node's interface in ddp_network_cidr {p.node.network_cidr}, "
        f"found by preflight at launch (`ddp-launch doctor` shows it): "
        + " ".join([*derived, "--local-addr <address>", *user])
    )
