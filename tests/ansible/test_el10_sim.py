"""The roles' EL10 code paths on Rocky 10.1 simulation hosts (tests/testbed --os rocky10: real dnf and rpm
against local repositories laid out as NVIDIA's rhel10 one, no module streams, an OpenPGP v6 key in the
rpmdb; simulated GPUs and reboot).

`molecule test -s el10-sim` converges site.yml (without its GPU allreduce) on node0 (8 GPUs + NVSwitches)
and node1 (8 GPUs): the driver branch is locked with versionlock before the install
(branchlock-RedHat.yml), NVIDIA's key is imported beside the v6 key, the venv is made from EL10's
python3; then idempotence (changed=0) and the scenario's verify. Prefix el10s, net 10.213.66."""

from __future__ import annotations

import os
import re
import time

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import run, tool_env
from tests.ansible.el_sim import ANSI, recaps

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]


def _step(out: str, step: str) -> str:
    m = re.search(rf"\[el10-sim > {step}\] Executing(.*?)\[el10-sim > {step}\] Executed", out, re.S)
    assert m, f"molecule did not run {step}"
    return m.group(1)


def test_el10_sim_converges_idempotently_and_verifies(venv_bin):
    root_conftest.require_testbed()
    env = tool_env(venv_bin)
    start = time.monotonic()
    try:
        res = run([str(venv_bin / "molecule"), "test", "-s", "el10-sim"], env, 1500, merge=True)
        out = ANSI.sub("", res.stdout)
        print(f"molecule test -s el10-sim: rc={res.returncode} in {(time.monotonic() - start) / 60:.1f} min")
        assert res.returncode == 0, out[-6000:]
        converge, idempotence = recaps(_step(out, "converge")), recaps(_step(out, "idempotence"))
        assert sorted(converge) == ["node0", "node1"] and all(c > 0 for c in converge.values()), converge
        assert idempotence == {"node0": 0, "node1": 0}, idempotence
        assert "[el10-sim > verify] Executed: Successful" in out
        # The EL10 path ran, not the EL9 one: the branch lock, and no module stream.
        assert "TASK [nvidia_driver : Lock the driver branch]" in _step(out, "converge")
        assert "Read the enabled nvidia-driver stream" not in out
    finally:
        run([str(venv_bin / "molecule"), "destroy", "-s", "el10-sim"], env, 300)
    assert "el10s-node" not in os.popen("ip netns list").read(), "molecule destroy left namespaces behind"
