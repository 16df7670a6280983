"""`--check` of the el9-sim scenario's converge on a fresh EL9 simulation host passes and changes
nothing. Own host: prefix el9k, 10.213.55."""

from __future__ import annotations

import pytest

import tests.conftest as root_conftest
from tests.ansible.conftest import REPO_ROOT, run, tool_env
from tests.ansible.el_sim import recaps

# The module's converge counts towards its first test's 600 s; under `pytest -n 4` it took longer.
pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_check_mode_on_a_fresh_host_passes_and_changes_nothing(venv_bin, tmp_path):
    with root_conftest.private_testbed("el9k", "10.213.55", 1, os="rocky9", gpus=8, nvswitch=True) as tb:
        state = (
            "rpm -qa | sort; dnf -q module list --enabled 2>&1; "
            "ls -la /etc/yum.repos.d /etc/sysctl.d /boot /opt; cat /etc/hosts; nft list ruleset; "
            "ls -R /var/lib/ddp-sim; cat /proc/sys/net/ipv4/ip_local_port_range; "
            "test -e /etc/modprobe.d && ls /etc/modprobe.d; true"
        )
        before = tb.ssh("node0", state).stdout
        env = tool_env(venv_bin, tmp_path / "facts")
        # The converge of the el9-sim scenario (site.yml without the allreduce), with its variables.
        argv = [str(venv_bin / "ansible-playbook"), "--check", "-i", str(tb.inventory)]
        argv += ["-i", "molecule/el9-sim/inventory/", "molecule/el9-sim/converge.yml"]
        env["MOLECULE_PROJECT_DIRECTORY"] = str(REPO_ROOT)
        res = run(argv, env, 900, merge=True)
        after = tb.ssh("node0", state).stdout
    assert res.returncode == 0, res.stdout[-4000:]
    assert recaps(res.stdout)["node0"] > 0, "check mode reports what would change"
    assert before == after
