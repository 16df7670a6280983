"""InfiniBand / RoCE: port facts from sysfs, the cluster agreement check, NCCL_IB_HCA, and NCCL's log.

Ports are read from /sys/class/infiniband/<hca>/ports/<n>/{state,link_layer,rate} (kernel ABI:
Documentation/ABI/stable/sysfs-class-infiniband) under a root path, so tests use recorded trees. The
same reader (node/probe.py `rdma_ports`) runs inside preflight's probe on every node and here (`read_ports`).

    python -m ddp_train.launch.preflight.rdma facts [--root /]    # one JSON line: ports, active ones, rates
    python -m ddp_train.launch.preflight.rdma nccl-log < out.txt  # one JSON line: NCCL's transport, GPUDirect
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddp_train.launch.node.probe import rdma_ports

if TYPE_CHECKING:
    from ddp_train.launch.plan.inventory import Node
    from ddp_train.launch.plan.plan import JobPlan
    from ddp_train.launch.preflight.preflight_model import NodeCheck

ENV = "NCCL_IB_HCA"
DISABLE_ENV = "NCCL_IB_DISABLE"
RATE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")


@dataclasses.dataclass(frozen=True)
class Port:
    """One RDMA port: `state` is the sysfs word (ACTIVE, DOWN, INIT, ARMED), `rate_gbps` 0 when unknown."""

    hca: str
    port: str
    state: str
    link_layer: str
    rate_gbps: float
    netdev: str = ""  # a RoCE port's Ethernet interface (sysfs gid_attrs/ndevs/0)

    @property
    def name(self) -> str:
        return f"{self.hca}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def kind(self) -> str:
        """IB or RoCE (a port whose link layer is Ethernet)."""
        return "RoCE" if self.link_layer.lower() == "ethernet" else "IB"

    def describe(self) -> str:
        return f"{self.name} {self.kind} {self.state} {self.rate_gbps:g} Gb/s"


def ports_from_raw(raw: Iterable[Mapping[str, Any]]) -> list[Port]:
    """Ports from the reader's dicts: state "4: ACTIVE" -> ACTIVE, rate "200 Gb/sec (4X HDR)" -> 200.0."""
    out = []
    for e in raw:
        state = str(e.get("state") or "UNKNOWN").split(":")[-1].strip().upper()
        m = RATE.match(str(e.get("rate") or ""))
        layer = str(e.get("link_layer") or "InfiniBand")
        rate = float(m.group(1)) if m else 0.0
        out.append(
            Port(str(e.get("hca")), str(e.get("port")), state, layer, rate, str(e.get("netdev") or ""))
        )
    return out


def read_ports(root: str = "/") -> list[Port]:
    """The ports under `root`/sys/class/infiniband; [] when there is no HCA (or no such directory)."""
    return ports_from_raw(rdma_ports(root))


def ib_hca_value(ports: Sequence[Port]) -> str:
    """NCCL_IB_HCA for exactly the active ports: "=mlx5_0:1,mlx5_1:1" ("" when none is active).

    The leading "=" makes NCCL match the names exactly, not as prefixes (mlx5_1 would else also select
    mlx5_10..mlx5_17); "hca:port" selects one port (NCCL docs, Environment Variables, NCCL_IB_HCA:
    https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-hca)."""
    active = [p.name for p in ports if p.active]
    return "=" + ",".join(active) if active else ""


def summary(ports: Sequence[Port]) -> dict[str, Any]:
    """The JSON `facts` prints: every port, the active ones, and the fastest active port's rate."""
    active = [p for p in ports if p.active]
    return {
        "ports": [dataclasses.asdict(p) | {"name": p.name, "kind": p.kind} for p in ports],
        "active": [p.name for p in active],
        "not_active": [p.describe() for p in ports if not p.active],
        "link_gbps": max((p.rate_gbps for p in active), default=0.0),
        "nccl_ib_hca": ib_hca_value(ports),
    }


def _disabled(env: Mapping[str, str]) -> bool:
    return str(env.get(DISABLE_ENV, "0")).strip() not in ("", "0")


@dataclasses.dataclass(frozen=True)
class Transport:
    """What NCCL will use between this node and the others, and why (doctor's line, the launch's notes).

    `kind`: IB, RoCE, IB+RoCE (over `ports`), TCP (NCCL's socket transport on `iface`) or gloo (no GPU)."""

    kind: str
    why: str
    ports: tuple[Port, ...] = ()
    iface: str | None = None

    @property
    def rdma(self) -> bool:
        return bool(self.ports)

    def describe(self, name: str) -> str:
        if self.ports:
            over = ", ".join(p.name + (f" ({p.netdev})" if p.netdev else "") for p in self.ports)
            return f"{name}: {self.kind} over {over} ({self.why})"
        who, what = ("gloo", "gloo over TCP") if self.kind == "gloo" else ("NCCL", "TCP socket")
        on = f"on {self.iface}" if self.iface else f"on the interface {who} picks (set ddp_network_cidr)"
        return f"{name}: {what} {on} ({self.why})"


def transport(c: NodeCheck) -> Transport | None:
    """The transport of a probed node under its ddp_rdma (auto | on | off); None when it was not probed.

    NCCL_IB_DISABLE=1 makes NCCL use IP sockets instead of IB/RoCE (NCCL docs, Environment Variables,
    NCCL_IB_DISABLE: https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-ib-disable);
    otherwise NCCL's IB transport takes every port NCCL_IB_HCA names, RoCE ports included (NCCL_IB_HCA)."""
    if not c.facts or "rdma" not in c.facts:
        return None
    env, mode = c.plan.env, c.plan.node.rdma
    iface = c.facts.get("iface") or (env.get("NCCL_SOCKET_IFNAME") or "").lstrip("=") or None
    if not int(c.facts.get("gpus") or 0):
        return Transport("gloo", "no GPU: gloo, which never uses RDMA", iface=iface)
    if mode == "off":
        return Transport("TCP", f"ddp_rdma off: {DISABLE_ENV}=1", iface=iface)
    if _disabled(env):
        return Transport("TCP", f"{DISABLE_ENV}={env[DISABLE_ENV]} from ddp_env", iface=iface)
    ports = ports_from_raw(c.facts["rdma"])
    active = tuple(p for p in ports if p.active)
    if not active:
        return Transport("TCP", f"ddp_rdma {mode}: no ACTIVE RDMA port", iface=iface)
    kinds = sorted({p.kind for p in active})
    roce = [p for p in active if p.kind == "RoCE"]
    why = f"ddp_rdma {mode}: " + ("ACTIVE ports, link layer Ethernet" if roce else "ACTIVE ports")
    return Transport("+".join(kinds), why, ports=active)


def check_cluster(checks: Sequence[NodeCheck]) -> None:
    """Preflight: ddp_rdma on refuses a GPU node without an ACTIVE RDMA port; the GPU nodes must agree
    (all use RDMA, or none does: NCCL would mix IB and TCP between nodes), and the RDMA nodes must have
    the same link layers (an IB port cannot reach a RoCE one: one line on the first RDMA node names the
    nodes per link layer); ports that are not ACTIVE are named (a warning).

    GPU-less nodes run gloo, which never uses verbs, and are not compared."""
    found = [(c, t) for c in checks if (t := transport(c)) is not None and t.kind != "gloo"]
    have = sorted(c.name for c, t in found if t.rdma)
    layers: dict[str, list[str]] = {}
    for c, t in found:
        if t.rdma:
            layers.setdefault(t.kind, []).append(c.name)
    if len(layers) > 1:
        per = "; ".join(f"{kind} on {', '.join(sorted(names))}" for kind, names in sorted(layers.items()))
        next(c for c, t in found if t.rdma).fail(
            f"the RDMA nodes differ in link layer ({per}): an IB port cannot reach a RoCE one; give every "
            "node the same fabric, or set ddp_rdma: off (or --rdma off) for TCP"
        )
    for c, t in found:
        ports = ports_from_raw(c.facts["rdma"])
        down = [p.describe() for p in ports if not p.active]
        where = "; its ports: " + ", ".join(down) if down else " (no HCA in /sys/class/infiniband)"
        mode, env = c.plan.node.rdma, c.plan.env
        tcp_by_env = _disabled(env) and mode != "off"  # NCCL_IB_DISABLE in ddp_env: TCP on purpose
        if mode == "on" and not t.rdma:
            if tcp_by_env:
                c.fail(f"ddp_rdma is on but ddp_env sets {DISABLE_ENV}={env[DISABLE_ENV]}: drop one")
            else:
                c.fail(
                    f"ddp_rdma is on but no RDMA port is ACTIVE{where}: bring the ports up (ibstat) "
                    "or set ddp_rdma: off (TCP) or auto"
                )
        elif mode == "off" and DISABLE_ENV in env and not _disabled(env):
            c.fail(f"ddp_rdma is off but ddp_env sets {DISABLE_ENV}={env[DISABLE_ENV]}: drop one")
        elif not have or t.rdma or tcp_by_env:
            if down and mode != "off" and not tcp_by_env:
                c.warnings.append(f"RDMA ports not ACTIVE (NCCL skips them): {', '.join(down)}")
        elif mode == "auto":
            c.fail(
                f"no ACTIVE RDMA port{where}; but {', '.join(have)} have one: NCCL would mix IB and TCP "
                f"between nodes. Bring the ports up (ibstat) or set ddp_rdma: off (or --rdma off) for TCP"
            )
        else:
            c.fail(
                f"uses TCP sockets ({t.why}) but {', '.join(have)} use RDMA: NCCL would mix IB and TCP "
                "between nodes; set ddp_rdma the same on every node (or --rdma off)"
            )


def roce_notice(checks: Sequence[NodeCheck]) -> str | None:
    """One line when ddp_rdma auto chose RoCE somewhere: RoCE wants a lossless fabric, and how to say TCP."""
    nodes = [
        c.name
        for c in checks
        if c.plan.node.rdma == "auto" and (t := transport(c)) is not None and "RoCE" in t.kind
    ]
    if not nodes:
        return None
    return (
        f"RoCE chosen on {', '.join(nodes)} (ddp_rdma auto: an ACTIVE port with link layer Ethernet); "
        "RoCE needs a switch tuned for it (PFC or ECN), an untuned one drops and stalls it: "
        "ddp_rdma: off (or --rdma off) trains over TCP sockets, ddp_rdma: on keeps RoCE without this note"
    )


def ib_hca_env(checks: Sequence[NodeCheck]) -> tuple[dict[str, str], list[str]]:
    """Per node, the NCCL_IB_HCA the launcher sets (its active ports, exact match) and notes to log.

    A value the user set in ddp_env / --env wins and is reported. NCCL_IB_GID_INDEX is never set: since
    NCCL 2.21 its default (-1) selects the GID dynamically (NCCL docs, NCCL_IB_GID_INDEX; issue #12)."""
    values: dict[str, str] = {}
    notes: list[str] = []
    for c in checks:
        t = transport(c)
        if t is None or not t.rdma:
            continue
        value = ib_hca_value(t.ports)
        user = c.plan.env.get(ENV)
        if user is not None:
            notes.append(f"{c.name}: {ENV}={user} from ddp_env (the active ports are {value[1:]})")
        else:
            values[c.name] = value
            notes.append(f"{c.name}: {ENV}={value}")
    return values, notes


def transport_env(checks: Sequence[NodeCheck]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Per node, what the launcher adds for its transport (NCCL_IB_HCA; NCCL_IB_DISABLE=1 under ddp_rdma
    off), and the notes to log: one per node, then the RoCE notice. NCCL_SOCKET_IFNAME comes from netif
    (the interface in ddp_network_cidr), for TCP as for NCCL's bootstrap."""
    hca, notes = ib_hca_env(checks)
    values = {name: {ENV: v} for name, v in hca.items()}
    for c in checks:
        t = transport(c)
        if t is not None and c.plan.node.rdma == "off" and t.kind == "TCP" and DISABLE_ENV not in c.plan.env:
            values[c.name] = {DISABLE_ENV: "1"}
            notes.append(f"{c.name}: {DISABLE_ENV}=1 (ddp_rdma off)")
    if notice := roce_notice(checks):
        notes.append(notice)
    return values, notes


def with_mode_env(node: Node) -> Node:
    """The node with NCCL_IB_DISABLE=1 in its env under ddp_rdma off, from the plan on: --dry-run shows
    it and --skip-preflight keeps it (a value in ddp_env stays; preflight refuses one that is not 1)."""
    if node.rdma != "off" or DISABLE_ENV in node.env:
        return node
    return dataclasses.replace(node, env={**node.env, DISABLE_ENV: "1"})


def with_ib_hca(plan: JobPlan, checks: Sequence[NodeCheck]) -> tuple[JobPlan, list[str]]:
    """The job plan with each node's transport env added (`transport_env`), and the notes."""
    values, notes = transport_env(checks)
    if not values:
        return plan, notes
    nodes = tuple(
        dataclasses.replace(p, env={**p.env, **values[p.node.name]}) if p.node.name in values else p
        for p in plan.nodes
    )
    return dataclasses.replace(plan, nodes=nodes), notes


def doctor_lines(checks: Sequence[NodeCheck]) -> list[str]:
    """`ddp-launch doctor`: which transport each probed node will use and why, then what a launch sets."""
    lines = [t.describe(c.name) for c in checks if (t := transport(c)) is not None]
    return lines + transport_env(checks)[1]


# --- NCCL's INFO log ------------------------------------------------------------------------------
# Lines as NCCL 2.21-2.29 print them with NCCL_DEBUG=INFO (NVIDIA/nccl src/init.cc
# `INFO(NCCL_INIT, "Using network %s", ...)`; src/transport/net_ib*: "NET/IB : Using [0]mlx5_0:1/IB ...",
# "NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'", "... Disabled for HCA %d '%s' (no module)",
# "NET/IB : No device found."; src/transport/net.cc channel lines "via NET/IB/0/GDRDMA").
USING_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")
IB_DEVICES = re.compile(r"NCCL INFO NET/IB ?: Using (.*?)(?:;|$)")
IB_DEVICE = re.compile(r"\[\d+\]([^\s:/]+:\d+)/(IB|RoCE)")
GDR_ON = re.compile(r"GPU Direct RDMA (?:\(DMABUF\) )?Enabled for HCA", re.IGNORECASE)
GDR_OFF = re.compile(r"GPU Direct RDMA Disabled for HCA", re.IGNORECASE)
VIA_NET = re.compile(r"NCCL INFO Channel \S+ : .* via NET/(\w+)/\d+(/GDRDMA)?")
NCCL_VERSION = re.compile(r"NCCL INFO NCCL version (\S+)")
NO_IB = re.compile(r"NET/IB ?: No device found")


def parse_nccl_log(text: str) -> dict[str, Any]:
    """What NCCL chose: {"network": "IB"|"Socket"|<plugin>|None, "ib_devices": [...], "gdr": bool|None,
    "net_channels": n, "gdr_channels": n, "version": ..., "no_ib_device": bool}."""
    networks = USING_NETWORK.findall(text)
    devices: list[str] = []
    for m in IB_DEVICES.finditer(text):
        for dev, _ in IB_DEVICE.findall(m.group(1)):
            if dev not in devices:
                devices.append(dev)
    via = VIA_NET.findall(text)
    gdr_channels = sum(1 for _, g in via if g)
    gdr: bool | None = None
    if gdr_channels or GDR_ON.search(text):
        gdr = True
    elif GDR_OFF.search(text) or via:
        gdr = False
    version = NCCL_VERSION.search(text)
    return {
        "network": networks[-1] if networks else None,
        "ib_devices": devices,
        "gdr": gdr,
        "net_channels": len(via),
        "gdr_channels": gdr_channels,
        "version": version.group(1) if version else None,
        "no_ib_device": bool(NO_IB.search(text)),
    }


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ddp_train.launch.preflight.rdma", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    facts = sub.add_parser("facts", help="this node's RDMA ports from sysfs, as one JSON line")
    facts.add_argument("--root", default="/", help="where sysfs is mounted below [/]")
    sub.add_parser("nccl-log", help="read NCCL_DEBUG=INFO output on stdin; print what NCCL chose")
    args = p.parse_args(argv)
    if args.cmd == "facts":
        print(json.dumps(summary(read_ports(args.root))))
    else:
        print(json.dumps(parse_nccl_log(sys.stdin.read())))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
