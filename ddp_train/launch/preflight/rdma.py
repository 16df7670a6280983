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
        out.append(Port(str(e.get("hca")), str(e.get("port")), state, layer, float(m.group(1)) if m else 0.0))
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


def check_cluster(checks: Sequence[NodeCheck]) -> None:
    """Preflight: the GPU nodes must agree (all have an ACTIVE RDMA port, or none has); ports that are
    not ACTIVE are named (a warning, a failure on a node left without any active port).

    GPU-less nodes run gloo, which never uses verbs, and are not compared; neither are
    nodes whose ddp_env sets NCCL_IB_DISABLE=1 (TCP on purpose)."""
    with_ports = {}
    for c in checks:
        if not c.facts or "rdma" not in c.facts or not int(c.facts.get("gpus") or 0):
            continue
        if _disabled(c.plan.env):
            continue
        with_ports[c.name] = (c, ports_from_raw(c.facts["rdma"]))
    have = sorted(n for n, (_, ports) in with_ports.items() if any(p.active for p in ports))
    lack = sorted(n for n in with_ports if n not in have)
    for name, (c, ports) in with_ports.items():
        down = [p.describe() for p in ports if not p.active]
        if have and name in lack:
            found = "; its ports: " + ", ".join(down) if down else " (no HCA in /sys/class/infiniband)"
            c.fail(
                f"no ACTIVE RDMA port{found}; but {', '.join(have)} have one: NCCL would mix IB and TCP "
                f"between nodes. Bring the ports up (ibstat) or set {DISABLE_ENV}: '1' in ddp_env for TCP"
            )
        elif down:
            c.warnings.append(f"RDMA ports not ACTIVE (NCCL skips them): {', '.join(down)}")


def ib_hca_env(checks: Sequence[NodeCheck]) -> tuple[dict[str, str], list[str]]:
    """Per node, the NCCL_IB_HCA the launcher sets (its active ports, exact match) and notes to log.

    A value the user set in ddp_env / --env wins and is reported. NCCL_IB_GID_INDEX is never set: since
    NCCL 2.21 its default (-1) selects the GID dynamically (NCCL docs, NCCL_IB_GID_INDEX; issue #12)."""
    values: dict[str, str] = {}
    notes: list[str] = []
    for c in checks:
        if not c.facts or not int(c.facts.get("gpus") or 0) or _disabled(c.plan.env):
            continue
        value = ib_hca_value(ports_from_raw(c.facts.get("rdma") or []))
        if not value:
            continue
        user = c.plan.env.get(ENV)
        if user is not None:
            notes.append(f"{c.name}: {ENV}={user} from ddp_env (the active ports are {value[1:]})")
        else:
            values[c.name] = value
            notes.append(f"{c.name}: {ENV}={value}")
    return values, notes


def with_ib_hca(plan: JobPlan, checks: Sequence[NodeCheck]) -> tuple[JobPlan, list[str]]:
    """The job plan with NCCL_IB_HCA added to the env of each node that has active ports, and the notes."""
    values, notes = ib_hca_env(checks)
    if not values:
        return plan, notes
    nodes = tuple(
        dataclasses.replace(p, env={**p.env, ENV: values[p.node.name]}) if p.node.name in values else p
        for p in plan.nodes
    )
    return dataclasses.replace(plan, nodes=nodes), notes


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
