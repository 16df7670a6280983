"""C7: idempotent re-run of site.yml on 3 testbed hosts: the project's ansible.cfg vs stock defaults.

Brings up 3 namespace hosts, makes the wheelhouse (molecule/default/prepare.yml) and converges once
with site.yml. Then times re-runs that must report changed=0, alternating the project's ansible.cfg
(pipelining, ControlPersist, forks, fact cache, smart gathering) and stock settings (no ansible.cfg;
only roles_path and host-key checking set, which site.yml needs). Prints
`C7 stock/project_cfg rerun_s ratio=R` last (R = stock time / project time; target >= 1.25).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from common import REPO, changed_total, median, ratio_line, timed_playbook
from testbed_hosts import testbed

ANSIBLE_PLAYBOOK = str(Path(sys.executable).parent / "ansible-playbook")
SCENARIO_INV = REPO / "molecule" / "default" / "inventory"


def playbook(tb, cfg: str | None, playbook: str, tmp: Path) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update({"MOLECULE_PROJECT_DIRECTORY": str(REPO), "ANSIBLE_NOCOLOR": "1"})
    if cfg:
        env["ANSIBLE_CONFIG"] = cfg
        env["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(tmp / "facts")
    else:  # stock: an empty config file, plus what site.yml cannot run without
        empty = tmp / "stock.cfg"
        empty.write_text("[defaults]\n")
        env.update(
            {
                "ANSIBLE_CONFIG": str(empty),
                "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
                "ANSIBLE_HOST_KEY_CHECKING": "True",
            }
        )
    argv = [
        ANSIBLE_PLAYBOOK,
        "-i",
        str(tb.inventory),
        "-i",
        str(SCENARIO_INV),
        playbook,
        "-e",
        "molecule_wheelhouse=/tmp/ddp-wheelhouse-bench",
    ]
    return timed_playbook(playbook, argv, env, 1200)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    times: dict[str, list[float]] = {"project": [], "stock": []}
    with testbed(3, prefix="bench", net="10.213.80") as tb, tempfile.TemporaryDirectory(prefix="c7-") as tmp:
        tmpd = Path(tmp)
        project_cfg = str(REPO / "ansible.cfg")
        playbook(tb, project_cfg, str(REPO / "molecule" / "default" / "prepare.yml"), tmpd)
        first, _ = playbook(tb, project_cfg, "site.yml", tmpd)
        print(f"first converge: {first:.1f}s")
        for _ in range(a.repeats):
            for name, cfg in (("stock", None), ("project", project_cfg)):
                wall, out = playbook(tb, cfg, "site.yml", tmpd)
                changed = changed_total(out)
                if changed:
                    sys.exit(
                        f"bench: the re-run with {name} settings reported changed={changed}: not idempotent"
                    )
                times[name].append(wall)
    s, pr = median(times["stock"]), median(times["project"])
    print(
        f"re-run (changed=0): stock {[round(x, 1) for x in times['stock']]} s, "
        f"project {[round(x, 1) for x in times['project']]} s"
    )
    print(ratio_line("C7", "stock/project_cfg", "rerun_s", s / pr, stock_s=f"{s:.1f}", project_s=f"{pr:.1f}"))


if __name__ == "__main__":
    main()
