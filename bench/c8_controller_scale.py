"""C8: the controller's cost as the cluster grows: `ddp-launch doctor` on N = 8, 16, 32, 64 testbed hosts.

For each N (the first N hosts of one testbed, --limit), the doctor's wall time, CPU (user+sys of the
ddp-launch process), CPU per node, peak RSS, and peak open fds and threads (sampled from /proc every
20 ms); then launch -> first step (rank 0 logs `step 1/`) at --launch-n hosts, with the launcher's
peak fds and threads while the job runs. Fits each figure as a + b x N (least squares) and projects
to 256 and 1024 nodes. Last line: `C8 doctor_cpu_per_node/target ... ratio=R` where R is the CPU
per node at the largest N over the 0.03 s target (<= 1 met).

The testbed's hosts share this machine's cores with the controller (and, on the CI-class machine,
with other jobs), so wall times grow with N for reasons a real cluster does not have; the controller's
own CPU, fds and threads are what this bench is for.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import threading
import time
import uuid

from c5_launch_to_first_step import trainer_args
from common import BENCH_ENV, PYTHON, median, ratio_line
from testbed_hosts import testbed

TARGET_CPU_PER_NODE = 0.03  # issue #19
LAUNCHER = os.path.join(os.path.dirname(PYTHON), "ddp-launch")
VENV = os.path.dirname(os.path.dirname(PYTHON))
WORKDIR = "/tmp/ddp-bench-c8"


class Sampler:
    """Peak open fds, threads and RSS (VmHWM) of a process, read from /proc while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.fds, self.threads, self.rss_kib = pid, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("Threads:"):
                            self.threads = max(self.threads, int(line.split()[1]))
                        elif line.startswith("VmHWM:"):
                            self.rss_kib = max(self.rss_kib, int(line.split()[1]))
            except (OSError, ValueError):
                pass
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def doctor(inventory: str, names: list[str]) -> dict:
    argv = [LAUNCHER, "doctor", "--hosts", inventory, "--limit", ",".join(names)]
    argv += ["-e", f"ddp_venv={VENV}", "-e", f"ddp_workdir={WORKDIR}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=BENCH_ENV)
    sampler = Sampler(proc.pid)
    out, _ = proc.communicate(timeout=600)
    wall = time.perf_counter() - t0
    sampler.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench: doctor on {len(names)} hosts failed ({proc.returncode}):\n{out[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "n": len(names),
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_node_s": cpu / len(names),
        "rss_MiB": sampler.rss_kib / 1024,  # VmHWM: the kernel's peak, last read <= 20 ms before exit
        "fds": sampler.fds,
        "threads": sampler.threads,
    }


def launch(inventory: str, names: list[str]) -> dict:
    run = f"c8-{uuid.uuid4().hex[:8]}"
    argv = [LAUNCHER, "--hosts", inventory, "--limit", ",".join(names), "-e", f"ddp_venv={VENV}"]
    argv += ["-e", f"ddp_workdir={WORKDIR}", "--master-port", "29650", "--log-dir", f"{WORKDIR}/logs"]
    argv += trainer_args(run)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=BENCH_ENV,
        start_new_session=True,
    )
    sampler = Sampler(proc.pid)
    first, tail = None, []
    assert proc.stdout is not None
    for line in proc.stdout:  # to the end: the fds and threads of the whole job are sampled
        tail = (tail + [line])[-40:]
        if first is None and " step 1/" in line:
            first = time.perf_counter() - t0
    proc.wait(timeout=120)
    sampler.stop()
    if first is None or proc.returncode != 0:
        raise SystemExit(f"bench: launch on {len(names)} hosts failed ({proc.returncode}):\n{''.join(tail)}")
    return {
        "n": len(names),
        "first_step_s": first,
        "fds": sampler.fds,
        "threads": sampler.threads,
        "rss_MiB": sampler.rss_kib / 1024,
    }


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b x N."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="8,16,32,64")
    p.add_argument("--repeats", type=int, default=1, help="doctor runs per size (medians)")
    p.add_argument("--launch-n", type=int, default=16, help="hosts for launch -> first step (0: skip)")
    p.add_argument("--prefix", default="sclc")
    p.add_argument("--net", default="10.213.118")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    os.makedirs(WORKDIR, exist_ok=True)
    rows = []
    with testbed(max(sizes + [a.launch_n]), prefix=a.prefix, net=a.net) as tb:
        inv = str(tb.inventory)
        names = [h.name for h in tb.hosts()]
        doctor(inv, names[: max(sizes)])  # warms each node's cached torch facts
        for n in sizes:
            runs = [doctor(inv, names[:n]) for _ in range(a.repeats)]
            row = {k: median([r[k] for r in runs]) for k in runs[0]}
            rows.append(row)
            print(
                f"doctor n={n}: wall {row['wall_s']:.1f} s, cpu {row['cpu_s']:.2f} s "
                f"({row['cpu_per_node_s'] * 1000:.1f} ms/node), rss {row['rss_MiB']:.0f} MiB, "
                f"fds {row['fds']:.0f}, threads {row['threads']:.0f}",
                flush=True,
            )
        started = launch(inv, names[: a.launch_n]) if a.launch_n else None
    if started:
        print(
            f"launch n={started['n']}: first step after {started['first_step_s']:.1f} s; launcher peak "
            f"fds {started['fds']}, threads {started['threads']}, rss {started['rss_MiB']:.0f} MiB",
            flush=True,
        )
    for key, unit in (("cpu_s", "s"), ("fds", ""), ("threads", ""), ("rss_MiB", "MiB"), ("wall_s", "s")):
        a0, b = fit([(r["n"], r[key]) for r in rows])
        proj = ", ".join(f"N={n}: {a0 + b * n:.1f}{unit}" for n in (256, 1024))
        print(f"fit {key} = {a0:.3f} + {b:.4f} x N  ->  {proj}")
    last = rows[-1]
    extra = {
        "n": last["n"],
        "cpu_s": f"{last['cpu_s']:.2f}",
        "slope_ms_per_node": f"{fit([(r['n'], r['cpu_s']) for r in rows])[1] * 1000:.1f}",
        "rss_MiB": f"{last['rss_MiB']:.0f}",
        "fds": last["fds"],
        "threads": last["threads"],
        "wall_s": f"{last['wall_s']:.1f}",
        "load": f"{os.getloadavg()[0]:.1f}",
    }
    if started:
        extra.update(launch_n=started["n"], first_step_s=f"{started['first_step_s']:.1f}")
    print(
        ratio_line(
            "C8", "doctor_cpu_per_node/target", "cpu_s", last["cpu_per_node_s"] / TARGET_CPU_PER_NODE, **extra
        )
    )


if __name__ == "__main__":
    main()
