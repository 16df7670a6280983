"""C9: site.yml converge and idempotent re-run at N = 2, 4, 8 testbed hosts, with the repo's ansible.cfg.

For each N: bring up N namespace hosts, make the wheelhouse the hosts install from (molecule/default's
prepare.yml: torch's CPU wheel and the trainer's dependencies, the hosts having no internet), converge
with site.yml (preflight, hosts file, firewall, neighbour sysctl, GPU roles in their no-GPU mode, the
venv from the pytorch role's cluster wheelhouse, the allreduce across all N), then re-run it and assert
changed=0. Prints each wall time and, last, `C9 site_n8/site_n2 converge_s ratio=R ...`: the time at the
largest N over the time at N=2 in the same run (1.0 = the N hosts cost no more than 2; the hosts share
this machine's cores, real nodes do not).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from common import REPO, changed_total, ratio_line, timed_playbook
from testbed_hosts import testbed

ANSIBLE_PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
SCENARIO_INV = REPO / "molecule" / "default" / "inventory"
WHEELHOUSE = "/tmp/ddp-wheelhouse-c9"


def playbook(tb, playbook: str, facts: Path) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        {
            "MOLECULE_PROJECT_DIRECTORY": str(REPO),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts),  # testbeds reuse host names
        }
    )
    argv = [ANSIBLE_PLAYBOOK, "-i", str(tb.inventory), "-i", str(SCENARIO_INV), playbook]
    argv += ["-e", f"molecule_wheelhouse={WHEELHOUSE}"]
    return timed_playbook(playbook, argv, env, 1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", default="2,4,8", help="host counts, the first is the baseline (default 2,4,8)")
    p.add_argument("--prefix", default="bench", help="testbed prefix (default bench)")
    p.add_argument("--net", default="10.213.80", help="testbed /24 (default 10.213.80)")
    a = p.parse_args()
    sizes = [int(n) for n in a.sizes.split(",")]
    rows: dict[int, tuple[float, float]] = {}
    for n in sizes:
        with testbed(n, prefix=a.prefix, net=a.net) as tb, tempfile.TemporaryDirectory(prefix="c9-") as tmp:
            facts = Path(tmp) / "facts"
            playbook(tb, str(REPO / "molecule" / "default" / "prepare.yml"), facts)
            converge, _ = playbook(tb, "site.yml", facts)
            rerun, out = playbook(tb, "site.yml", facts)
            if changed_total(out):
                sys.exit(f"bench: the re-run at N={n} reported changed={changed_total(out)}: not idempotent")
            rows[n] = (converge, rerun)
            print(f"N={n}: converge {converge:.1f} s, re-run (changed=0) {rerun:.1f} s", flush=True)
    print("| N | converge s | re-run s | converge per node s |")
    print("|---|---|---|---|")
    for n, (c, r) in rows.items():
        print(f"| {n} | {c:.1f} | {r:.1f} | {c / n:.1f} |")
    lo, hi = sizes[0], sizes[-1]
    print(
        ratio_line(
            "C9",
            f"site_n{hi}/site_n{lo}",
            "converge_s",
            rows[hi][0] / rows[lo][0],
            rerun_ratio=f"{rows[hi][1] / rows[lo][1]:.3f}",
            **{f"converge_n{n}": f"{c:.1f}" for n, (c, _) in rows.items()},
            **{f"rerun_n{n}": f"{r:.1f}" for n, (_, r) in rows.items()},
        )
    )


if __name__ == "__main__":
    main()
