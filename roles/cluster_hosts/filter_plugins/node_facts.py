"""What a node reports about itself (its hostname and FQDN facts, its training address: whatever root on
that node made them) before a role writes it into another node's files: /etc/hosts, the firewall's
sources, slurm.conf, Prometheus' targets. One rule for every role (tasks/check_nodes.yml uses it)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError

# RFC 1123 2.1 and RFC 952: labels of letters, digits and inner hyphens, 1-63 characters, 253 in all.
LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"(?=.{{1,253}}\Z){LABEL}(?:\.{LABEL})*\Z")
# The loopback names a fresh node reports (localhost, localhost.localdomain), in any case: never written
# into a hosts file (the loopback lines keep them) and never a collision between nodes.
LOOPBACK_NAME = re.compile(r"localhost(?:\.|\Z)", re.IGNORECASE)


def is_loopback_name(name: str) -> bool:
    return bool(LOOPBACK_NAME.match(name))


def without_loopback_names(names: Sequence[Any]) -> list[Any]:
    """The names to write for a node: its loopback names (any case) left out."""
    return [n for n in names if not (isinstance(n, str) and is_loopback_name(n))]


def shown(value: Any) -> str:
    """A reported value quoted for a one-line message: outside printable ASCII as '?', at most 80."""
    text = re.sub(r"[^ -~]", "?", value if isinstance(value, str) else repr(value))
    return "'" + (text if len(text) <= 80 else text[:77] + "...") + "'"


def _lookup(hostvars: Mapping[str, Any], host: str, path: str) -> Any:
    """hostvars[host] along a dotted path (ansible_facts.hostname); None where any part is missing."""
    if host not in hostvars:
        return None
    value: Any = hostvars[host]
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _name_problem(name: Any, host: str, named: set[str], reported: set[str]) -> str | None:
    if not isinstance(name, str) or not HOST_NAME.match(name):
        return "not an RFC 1123 host name"
    key = name.lower()
    if is_loopback_name(name) or key == host.lower():
        return None
    if key in named:
        return "a name of another inventory host"
    if key in reported:
        return "another node reports it too"
    return None


def _address_problem(value: Any, network: ipaddress.IPv4Network, others: set[str]) -> str | None:
    try:
        address = ipaddress.IPv4Address(value) if isinstance(value, str) else None
    except ValueError:
        address = None
    if address is None or str(address) != value:
        return f"not one IPv4 address in {network}"
    if address not in network:
        return f"outside {network}"
    if value in others:
        return "another node reports it too"
    return None


def node_fact_problems(
    hosts: Sequence[str],
    hostvars: Mapping[str, Any],
    cidr: str,
    names: Mapping[str, str] | None = None,
    addresses: Mapping[str, str] | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """One line per node whose reports are bad: "node1 reports hostname 'x' (why), address 'y' (why)".

    names and addresses map the label shown to the variable holding the value, a dotted path into the
    host's variables (hostname: ansible_facts.hostname). A missing value is left to the roles' checks."""
    try:
        network = ipaddress.IPv4Network(str(cidr), strict=False)
    except ValueError as e:
        raise AnsibleFilterError(f"node_fact_problems: '{cidr}' is not an IPv4 network: {e}") from e
    names = dict(names or {})
    aliases = aliases or {}
    hosts = list(dict.fromkeys(hosts))
    reports = {h: {label: _lookup(hostvars, h, path) for label, path in names.items()} for h in hosts}
    ips = {h: {label: _lookup(hostvars, h, path) for label, path in (addresses or {}).items()} for h in hosts}
    problems = []
    for host in hosts:
        others = [h for h in hosts if h != host]
        named = {n.lower() for h in others for n in [h, *aliases.get(h, [])]}
        reported = {v.lower() for h in others for v in reports[h].values() if isinstance(v, str) and v}
        bad = []
        for label, value in reports[host].items():
            why = None if value in (None, "") else _name_problem(value, host, named, reported)
            if why:
                bad.append(f"{label} {shown(value)} ({why})")
        taken = {a for h in others for a in ips[h].values() if isinstance(a, str)}
        for label, value in ips[host].items():
            why = None if value in (None, "") else _address_problem(value, network, taken)
            if why:
                bad.append(f"{label} {shown(value)} ({why})")
        if bad:
            problems.append(f"{host} reports " + ", ".join(bad))
    return problems


class FilterModule:
    """ddp_node_fact_problems, ddp_without_loopback_names."""

    def filters(self) -> dict[str, Any]:
        return {
            "ddp_node_fact_problems": node_fact_problems,
            "ddp_without_loopback_names": without_loopback_names,
        }
