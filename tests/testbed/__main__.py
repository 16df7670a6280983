"""CLI: python -m tests.testbed {up N [--os rocky9 ...] | down | status} [--prefix P] [--net A.B.C]."""

from __future__ import annotations

import argparse
import sys

from . import DEFAULT_NET, DEFAULT_PREFIX, DEFAULT_TRAIN_IFNAMES, OS_CHOICES, Testbed, TestbedError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.testbed", description=__doc__)
    p.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help="names this testbed (namespaces, bridge, state dir)"
    )
    p.add_argument("--net", default=DEFAULT_NET, help="the private /24 to use, as A.B.C")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create N hosts")
    up.add_argument("n", type=int)
    up.add_argument(
        "--loopback-hostname",
        action="store_true",
        help="map each hostname to 127.0.1.1 in its /etc/hosts, as Debian's installer does",
    )
    up.add_argument(
        "--os",
        choices=OS_CHOICES,
        default="debian",
        help="rocky9/rocky10: EL9/EL10 simulation hosts (real dnf/rpm against local repos, tests/testbed/el)",
    )
    up.add_argument("--gpus", type=int, default=8, help="simulated NVIDIA GPUs per EL sim host (0-8)")
    up.add_argument("--gpu-model", choices=("h100", "h200"), default="h100")
    up.add_argument("--nvswitch", action="store_true", help="EL sim hosts also get 4 simulated NVSwitches")
    up.add_argument(
        "--usr-local", action="store_true", help="debian hosts: an overlay over /usr/local too (for fakes)"
    )
    up.add_argument(
        "--firewalld", action="store_true", help="EL sim hosts run D-Bus and firewalld (el/firewalld.py)"
    )
    up.add_argument(
        "--train-net",
        metavar="A.B.C",
        help="a second /24 for training interfaces named per host, plus a decoy aaa0 (ddp_network_cidr)",
    )
    up.add_argument(
        "--train-ifnames",
        default=",".join(DEFAULT_TRAIN_IFNAMES),
        metavar="A,B,...",
        help=f"the training interface name of node0, node1, ... in turn [{','.join(DEFAULT_TRAIN_IFNAMES)}]",
    )
    sub.add_parser("down", help="kill the hosts' processes and delete their namespaces")
    sub.add_parser("status", help="list the hosts and their process counts")
    args = p.parse_args(argv)
    try:
        tb = Testbed(
            prefix=args.prefix,
            net=args.net,
            os=getattr(args, "os", "debian"),
            train_net=getattr(args, "train_net", None),
            train_ifnames=tuple(getattr(args, "train_ifnames", ",".join(DEFAULT_TRAIN_IFNAMES)).split(",")),
        )
        if args.cmd == "up":
            hosts = tb.up(
                args.n,
                loopback_hostname=args.loopback_hostname,
                gpus=args.gpus,
                nvswitch=args.nvswitch,
                gpu_model=args.gpu_model,
                usr_local=args.usr_local,
                firewalld=args.firewalld,
            )
            for h in hosts:
                train = f" training {h.train_dev} {h.train_ip}" if h.train_dev else ""
                print(f"{h.name} {h.ip} netns={h.netns}{train}")
            print(f"inventory: {tb.inventory}")
            print(f"ssh: ssh -F {tb.ssh_config} node0")
        elif args.cmd == "down":
            tb.down()
        else:
            for ns in tb.namespaces():
                print(f"{ns} pids={len(tb.pids(ns))}")
    except TestbedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
