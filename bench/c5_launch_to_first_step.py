"""C5: launch-to-first-step on N = 2 and 4 testbed hosts: ddp-launch vs pdsh vs a sequential ssh loop.

Time from starting the launch command until rank 0 logs `step 1/` (DDP has synchronised every node by
then). All three start the same trainer (default MLP, 3 steps, 1 process per host):
- ddp-launch: `ddp-launch --hosts <testbed inventory>` with its preflight ON (the product's default);
- pdsh: `pdsh -R ssh -f N -w hosts 'torchrun ... --node-rank <from hostname>'`;
- sequential: `for h in hosts; do ssh -f h 'torchrun ...'; done` (one connection after the other).
Methods alternate within each repeat; medians are compared. Prints one line per N, and last
`C5 ddp_launch/pdsh first_step_s ratio=R n=4 ...` (targets: <= 1.1 to pdsh, <= 1/N + 0.1 to sequential).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import time
import uuid

from common import BENCH_ENV, PYTHON, median, ratio_line
from testbed_hosts import testbed

WORKDIR = "/tmp/ddp-bench-c5"


def trainer_args(run: str) -> list[str]:
    sets = [
        "train.max_steps=3",
        "log.interval_steps=1",
        "checkpoint.interval_steps=0",
        "checkpoint.resume=never",
        f"run.name={run}",
        "log.progress=never",
    ]
    return [a for s in sets for a in ("--set", s)]


def node_command(n: int, master_ip: str, rank_expr: str, run: str, port: int) -> str:
    torchrun = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        f"--nnodes={n}",
        "--nproc-per-node=1",
        f"--master-addr={master_ip}",
        f"--master-port={port}",
        "-m",
        "ddp_train",
        *trainer_args(run),
    ]
    return (
        f"cd {WORKDIR} && OMP_NUM_THREADS=1 exec {shlex.join(torchrun[:3])} "
        f"--node-rank={rank_expr} {shlex.join(torchrun[3:])}"
    )


def time_to_first_step(argv: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or BENCH_ENV,
        start_new_session=True,
    )
    first, tail = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-30:]
        if first is None and " step 1/" in line:
            first = time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            break
    proc.wait(timeout=60)
    if first is None:
        raise SystemExit(f"bench: {shlex.join(argv[:4])}... never reached step 1:\n{''.join(tail)}")
    return first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sizes", default="2,4")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    os.makedirs(WORKDIR, exist_ok=True)
    results: dict[int, dict[str, list[float]]] = {}
    with testbed(max(sizes), prefix="bench", net="10.213.80") as tb:
        for n in sizes:
            hosts = tb.hosts()[:n]
            names = ",".join(h.name for h in hosts)
            rank_from_hostname = '"$(hostname | tr -dc 0-9)"'
            times: dict[str, list[float]] = {"ddp-launch": [], "pdsh": [], "sequential": []}
            for r in range(a.repeats):
                port = 29600 + r
                run = f"c5-{uuid.uuid4().hex[:8]}"
                launch = [
                    os.path.join(os.path.dirname(PYTHON), "ddp-launch"),
                    "--hosts",
                    str(tb.inventory),
                    "--limit",
                    names,
                    "-e",
                    f"ddp_venv={os.path.dirname(os.path.dirname(PYTHON))}",
                    "-e",
                    f"ddp_workdir={WORKDIR}",
                    "--master-port",
                    str(port),
                    "--log-dir",
                    f"{WORKDIR}/logs",
                    *trainer_args(run),
                ]
                times["ddp-launch"].append(time_to_first_step(launch))
                cmd = node_command(n, hosts[0].ip, rank_from_hostname, f"{run}-p", port)
                pdsh_env = {
                    **BENCH_ENV,
                    "PDSH_RCMD_TYPE": "ssh",
                    "PDSH_SSH_ARGS_APPEND": f"-F {tb.ssh_config}",
                }
                times["pdsh"].append(time_to_first_step(["pdsh", "-f", str(n), "-w", names, cmd], pdsh_env))
                cmd = node_command(n, hosts[0].ip, rank_from_hostname, f"{run}-s", port)
                loop = "; ".join(
                    shlex.join(["ssh", "-F", str(tb.ssh_config), "-f", h.name, cmd]) for h in hosts
                )
                times["sequential"].append(time_to_first_step(["bash", "-c", loop]))
            results[n] = times
            med = {k: median(v) for k, v in times.items()}
            print(
                f"N={n}: "
                + "  ".join(f"{k} {v:.2f}s {[round(x, 2) for x in times[k]]}" for k, v in med.items())
                + f"  ddp-launch/pdsh {med['ddp-launch'] / med['pdsh']:.3f}"
                f"  ddp-launch/seq {med['ddp-launch'] / med['sequential']:.3f} (target {1 / n + 0.1:.2f})"
            )
    n = max(sizes)
    med = {k: median(v) for k, v in results[n].items()}
    extra = {"n": n, "to_sequential": f"{med['ddp-launch'] / med['sequential']:.3f}"}
    for m in sizes[:-1]:
        mm = {k: median(v) for k, v in results[m].items()}
        extra[f"n{m}_to_pdsh"] = f"{mm['ddp-launch'] / mm['pdsh']:.3f}"
    print(ratio_line("C5", "ddp_launch/pdsh", "first_step_s", med["ddp-launch"] / med["pdsh"], **extra))


if __name__ == "__main__":
    main()
