"""`molecule test -s slurm` on the namespace testbed: the slurm role with Debian 12's real Slurm 22.05
and munge on three hosts (node0 also the controller): create, --check before anything is configured
(the controller without a munge key yet), converge, idempotence (changed=0), verify
(`sinfo` shows every node idle with its simulated GPUs, `srun -N3 hostname`, one GPU per node through
`--gres`, one munge key), destroy. Uses the testbed prefix slm and net 10.213.170."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import run, tool_env

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
RECAP = re.compile(r"(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0")


def _step(out: str, step: str) -> str:
    m = re.search(rf"\[slurm > {step}\] Executing(.*?)\[slurm > {step}\] Executed", out, re.S)
    assert m, f"molecule did not run {step}"
    return m.group(1)


@pytest.mark.timeout(1800)
def test_molecule_slurm_scenario(venv_bin):
    root_conftest.require_testbed()
    missing = [
        b
        for b in ("slurmctld", "slurmd", "srun", "munged")
        if shutil.which(b, path="/usr/sbin:/usr/bin") is None
    ]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)}): bash .ci/setup --with-testbed")
    start = time.monotonic()
    res = run([str(venv_bin / "molecule"), "test", "-s", "slurm"], tool_env(venv_bin), 1700, merge=True)
    minutes = (time.monotonic() - start) / 60
    out = ANSI.sub("", res.stdout)
    print(f"molecule test -s slurm: rc={res.returncode} in {minutes:.1f} min")

    assert res.returncode == 0, out[-6000:]
    check = _step(out, "check")
    assert sorted(n for n, _ in RECAP.findall(check)) == ["node0", "node1", "node2"], check[-3000:]
    assert "check mode: node0 has no munge key yet" in check, check[-3000:]
    converge = RECAP.findall(_step(out, "converge"))
    assert sorted(n for n, _ in converge) == ["node0", "node1", "node2"]
    assert all(int(c) > 0 for _, c in converge)
    assert sorted(RECAP.findall(_step(out, "idempotence"))) == [
        ("node0", "0"),
        ("node1", "0"),
        ("node2", "0"),
    ]
    verify = _step(out, "verify")
    for task in (
        "Check every node's state and GPU count",
        "Check that every node ran it",
        "Check that each node's task got one GPU",
    ):
        assert re.search(rf"TASK \[{re.escape(task)}\].*?ok: \[node0\]", verify, re.S), task
    assert re.search(r"node0\s+: ok=8\s+changed=0\s+unreachable=0\s+failed=0", verify)
    assert "slurm > destroy: Executed: Successful" in out
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "slm-node" not in netns, "molecule destroy left namespaces behind"
