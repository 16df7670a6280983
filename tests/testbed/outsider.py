"""An outsider: a namespace host on a testbed's bridge that is NOT in its inventory (issue #24).

It stands for another machine on the training network (a compromised workstation, another team's
server): the firewall must keep it off MASTER_PORT and the ephemeral range while the nodes reach them.
It has a network namespace only (no sshd, no overlays): commands run in it with `ip netns exec`.

    python -m tests.testbed.outsider --prefix mol --net 10.213.53 exec -- python3 probe.py connect ...

`exec` creates it when missing. It is named like a host the testbed never creates (`<prefix>-node200`,
veth `v<prefix>200`; hosts are node0..node199), so the testbed's `down` removes it with the hosts.
With --train-net it sits on the training bridge (bt-<prefix>), else on the SSH bridge (br-<prefix>).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from . import DEFAULT_NET, DEFAULT_PREFIX, FIRST_HOST_OCTET, Testbed, TestbedError, _run

INDEX = 200  # one past the last host `up` can create


def netns(tb: Testbed) -> str:
    return f"{tb.prefix}-node{INDEX}"


def address(tb: Testbed) -> str:
    return f"{tb.train_net or tb.net}.{FIRST_HOST_OCTET + INDEX}"


def ensure(tb: Testbed) -> str:
    """Create the outsider on the training (or SSH) bridge if it is not there; returns its netns."""
    ns = netns(tb)
    if ns in tb.namespaces():
        return ns
    bridge = tb.train_bridge if tb.train_net else tb.bridge
    if _run("ip", "link", "show", bridge, check=False).returncode != 0:
        raise TestbedError(f"bridge {bridge} not found: bring the testbed {tb.prefix} up first")
    veth = f"v{tb.prefix}{INDEX}"[:15]
    _run("ip", "netns", "add", ns)
    _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _run("ip", "link", "set", veth, "master", bridge, "up")
    _run("ip", "-n", ns, "addr", "add", f"{address(tb)}/24", "dev", "eth0")
    _run("ip", "-n", ns, "link", "set", "eth0", "up")
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    return ns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.testbed.outsider", description=__doc__)
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--net", default=DEFAULT_NET)
    p.add_argument("--train-net", default=None)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="create the outsider and print its address")
    ex = sub.add_parser("exec", help="run a command in the outsider (created when missing)")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        tb = Testbed(prefix=args.prefix, net=args.net, train_net=args.train_net)
        ns = ensure(tb)
    except TestbedError as e:
        print(f"outsider: {e}", file=sys.stderr)
        return 1
    if args.cmd == "up":
        print(f"{ns} {address(tb)}")
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("outsider: exec needs a command", file=sys.stderr)
        return 2
    return subprocess.run(["ip", "netns", "exec", ns, *command]).returncode


if __name__ == "__main__":
    sys.exit(main())
