"""C3: allreduce smoke test (ddp_train.allreduce, as playbooks/verify.yml runs it) vs iperf3.

3 testbed hosts. Allreduce bus bandwidth (nccl-tests definition, gloo here) is the minimum over ranks;
iperf3 measures TCP bandwidth node1 -> node0 between the same namespaces. Both are repeated and the
medians compared. Prints `C3 allreduce_busbw/iperf3_tcp bandwidth ratio=R` last (target R >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import re

from common import median, ratio_line
from testbed_hosts import run_on_all, testbed, torchrun_cmd


def allreduce_busbw(tb, size_mb: float, iters: int) -> float:
    hosts = tb.hosts()
    args = ["-m", "ddp_train.allreduce", f"--size-mb={size_mb}", f"--iters={iters}", "--backend=gloo"]
    outs = run_on_all(tb, [torchrun_cmd(hosts, r, args) for r in range(len(hosts))])
    values = [float(m) for out in outs for m in re.findall(r"busbw_GBps=([0-9.]+)", out)]
    if len(values) != len(hosts):
        raise SystemExit(f"bench: expected {len(hosts)} allreduce lines, got {values}: {outs}")
    return min(values)


def iperf3_gbytes(tb, seconds: int) -> float:
    server, client = tb.hosts()[:2]
    tb.ssh(server, "iperf3 -s -1 -D -p 5201 && sleep 0.3")
    res = tb.ssh(client, f"iperf3 -c {server.ip} -p 5201 -t {seconds} -J", timeout=seconds + 30)
    bits = json.loads(res.stdout)["end"]["sum_received"]["bits_per_second"]
    return bits / 8 / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mb", type=float, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    ar, tcp = [], []
    with testbed(3, prefix="bench", net="10.213.80") as tb:
        for _ in range(a.repeats):
            ar.append(allreduce_busbw(tb, a.size_mb, a.iters))
            tcp.append(iperf3_gbytes(tb, 3))
    b, t = median(ar), median(tcp)
    print(f"allreduce busbw GB/s {[round(x, 3) for x in ar]}; iperf3 TCP GB/s {[round(x, 3) for x in tcp]}")
    print(
        ratio_line(
            "C3",
            "allreduce_busbw/iperf3_tcp",
            "bandwidth",
            b / t,
            busbw_GBps=f"{b:.3f}",
            iperf3_GBps=f"{t:.3f}",
        )
    )


if __name__ == "__main__":
    main()
