"""`molecule test -s default` on the namespace testbed: create, converge, idempotence (changed=0),
verify (real state and an allreduce across three hosts), destroy. Takes a few minutes (it installs
torch into three venvs); it uses the testbed prefix mol and net 10.213.53."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import run, tool_env

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _step(out: str, step: str) -> str:
    """The part of molecule's output for one step of the sequence."""
    m = re.search(rf"\[default > {step}\] Executing(.*?)\[default > {step}\] Executed", out, re.S)
    assert m, f"molecule did not run {step}"
    return m.group(1)


@pytest.mark.timeout(1800)
def test_molecule_default_scenario(venv_bin):
    root_conftest.require_testbed()
    start = time.monotonic()
    res = run([str(venv_bin / "molecule"), "test", "-s", "default"], tool_env(venv_bin), 1700, merge=True)
    minutes = (time.monotonic() - start) / 60
    out = ANSI.sub("", res.stdout)
    print(f"molecule test -s default: rc={res.returncode} in {minutes:.1f} min")

    assert res.returncode == 0, out[-6000:]
    converge = re.findall(r"(node\d)\s+: ok=\d+\s+changed=(\d+)", _step(out, "converge"))
    idempotence = re.findall(r"(node\d)\s+: ok=\d+\s+changed=(\d+)", _step(out, "idempotence"))
    assert sorted(n for n, _ in converge) == ["node0", "node1", "node2"]
    assert all(int(c) > 0 for _, c in converge)
    assert sorted(idempotence) == [("node0", "0"), ("node1", "0"), ("node2", "0")]
    verify = _step(out, "verify")
    assert len(re.findall(r"rank \d/3 gloo 16\.0 MiB: busbw [0-9.]+ GB/s", verify)) == 3
    outsider = r"TASK \[Connect from the outsider to MASTER_PORT and to the ephemeral range \(refused\)\]"
    assert re.search(outsider + r".*?ok: \[node0 -> localhost\] => \(item=29500\)", verify, re.S)
    exporter = r"TASK \[Connect from the outsider to the admin's exporter"
    assert re.search(exporter + r".*?ok: \[node0 -> localhost", verify, re.S)
    assert "default > destroy: Executed: Successful" in out
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "mol-node" not in netns, "molecule destroy left namespaces behind"
