"""C10: submit -> first step with `ddp-launch --backend slurm` vs the SSH backend, same 3 testbed hosts.

Brings up 3 namespace hosts (prefix `c10`, 10.213.188.0/24), converges the slurm role on them with
molecule/slurm's prepare and converge playbooks (not timed: 4-8 min on 2 shared cores, so this bench runs
longer than the 5 minutes of the others), then alternates the two backends on the same trainer (default
MLP, 3 steps, 1 process per host) and times each from the command's start until rank 0 logs `step 1/`.
Ends with `C10 slurm/ssh first_step_s ratio=R ...`. The Slurm time adds sbatch, slurmctld's scheduling
(its main loop runs on submit), the batch script's start, its in-job node preflight (an srun step),
srun's step launch on every node and the launcher's polling (1 s) of the driver's log; the SSH backend's
adds its node preflight over SSH (docs/slurm.md, "Slurm (the launcher's backend)").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid

import yaml
from c5_launch_to_first_step import time_to_first_step, trainer_args
from common import BENCH_ENV, PYTHON, REPO, median, ratio_line
from testbed_hosts import testbed

WORKDIR = "/tmp/ddp-bench-c10"
PCI = "/tmp/ddp-c10-pci"


def converge(inventory: str) -> None:
    venv_bin = os.path.dirname(PYTHON)
    env = {
        **BENCH_ENV,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "MOLECULE_PROJECT_DIRECTORY": str(REPO),
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "ANSIBLE_NOCOLOR": "1",
    }
    argv = [
        os.path.join(venv_bin, "ansible-playbook"),
        "-i",
        inventory,
        "-i",
        "molecule/slurm/inventory",
        "-e",
        yaml.safe_dump({"molecule_pci_root": PCI}, default_flow_style=True).strip(),
        "molecule/slurm/prepare.yml",
        "molecule/slurm/converge.yml",
    ]
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    if res.returncode != 0:
        sys.exit(f"bench: slurm converge failed:\n{res.stdout[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    os.makedirs(WORKDIR, exist_ok=True)
    times: dict[str, list[float]] = {"slurm": [], "ssh": []}
    try:
        with testbed(3, prefix="c10", net="10.213.188") as tb:
            t0 = time.perf_counter()
            converge(str(tb.inventory))
            print(f"slurm converge: {time.perf_counter() - t0:.0f}s (not timed)", flush=True)
            inv = yaml.safe_load(tb.inventory.read_text())
            inv["all"]["vars"].update(ddp_venv=os.path.dirname(os.path.dirname(PYTHON)), ddp_workdir=WORKDIR)
            inv["all"]["children"]["slurm_controller"] = {"hosts": {"node0": None}}
            path = os.path.join(WORKDIR, "hosts.yml")
            with open(path, "w") as f:
                yaml.safe_dump(inv, f)
            launch = [
                os.path.join(os.path.dirname(PYTHON), "ddp-launch"),
                "--hosts",
                path,
                "--log-dir",
                f"{WORKDIR}/logs",
            ]
            for _ in range(a.repeats):
                for backend in ("slurm", "ssh"):
                    run = f"c10-{uuid.uuid4().hex[:8]}"
                    t = time_to_first_step([*launch, "--backend", backend, *trainer_args(run)])
                    times[backend].append(t)
                    print(f"{backend}: first step after {t:.2f}s", flush=True)
    finally:
        subprocess.run(["rm", "-rf", PCI], check=False)
    s, h = median(times["slurm"]), median(times["ssh"])
    print(ratio_line("C10", "slurm/ssh", "first_step_s", s / h, slurm=round(s, 2), ssh=round(h, 2), n=3))


if __name__ == "__main__":
    main()
