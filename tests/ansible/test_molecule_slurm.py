"""`molecule test -s slurm` on the namespace testbed: the slurm role with Debian 12's real Slurm 22.05
and munge on three hosts (node0 also the controller): create, --check before anything is configured
(the controller without a munge key yet), converge (ending with the allreduce smoke test submitted
through `ddp-launch --backend slurm`), idempotence (changed=0), verify
(`sinfo` shows every node idle with its simulated GPUs, `srun -N3 hostname`, one GPU per node through
`--gres`, one munge key), destroy. Uses the testbed prefix slm and net 10.213.170."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import tests.conftest as root_conftest
from tests.ansible.conftest import ANSI, REPO_ROOT, molecule_step, molecule_test, run, tool_env

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

RECAP = re.compile(r"(node\d)\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0")


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
    out = molecule_test("slurm", venv_bin)
    check = molecule_step(out, "slurm", "check")
    assert sorted(n for n, _ in RECAP.findall(check)) == ["node0", "node1", "node2"], check[-3000:]
    assert "check mode: node0 has no munge key yet" in check, check[-3000:]
    converge = RECAP.findall(molecule_step(out, "slurm", "converge"))
    assert sorted(n for n, _ in converge) == ["node0", "node1", "node2"]
    assert all(int(c) > 0 for _, c in converge)
    assert sorted(RECAP.findall(molecule_step(out, "slurm", "idempotence"))) == [
        ("node0", "0"),
        ("node1", "0"),
        ("node2", "0"),
    ]
    # slurm.yml's last check: the allreduce submitted through `ddp-launch --backend slurm`, all 3 ranks
    text = " ".join(molecule_step(out, "slurm", "converge").replace("\u2502", " ").split())
    assert re.search(r"node0 rank 0/3 gloo: busbw [0-9.]+ GB/s; node1 rank 1/3 gloo: busbw [0-9.]+ GB/s; "
                     r"node2 rank 2/3 gloo: busbw [0-9.]+ GB/s", text), text[-3000:]  # fmt: skip
    verify = molecule_step(out, "slurm", "verify")
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


ROLE_PLAY = """
- name: The slurm role alone
  hosts: localhost
  gather_facts: true
  roles:
    - role: slurm
"""
# A private mount namespace in which this machine looks fresh: no munge key, no slurmd, no sinfo.
HIDE = (
    "mount -t tmpfs none /etc/munge && mount --bind /dev/null /usr/sbin/slurmd"
    ' && mount --bind /dev/null /usr/bin/sinfo && exec "$@"'
)


@pytest.mark.timeout(600)
def test_check_mode_on_a_fresh_controller_and_node_fails_nowhere(venv_bin, tmp_path):
    """--check before Slurm is installed: the controller has no munge key to read and `slurmd -C` cannot
    run; the role says what it cannot know and fails nowhere. This machine, as controller and node, with
    those hidden (check mode changes nothing)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a private mount namespace)")
    if any(not Path(p).exists() for p in ("/etc/munge", "/usr/sbin/slurmd", "/usr/bin/sinfo")):
        pytest.skip("Slurm is not installed here: bash .ci/setup --with-testbed")
    inv = {
        "all": {
            "vars": {"ddp_network_cidr": "127.0.0.0/8", "slurm_service_manage": False},
            "children": {
                "slurm_controller": {"hosts": {"localhost": None}},
                "gpu_nodes": {"hosts": {"localhost": None}},
            },
        }
    }
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
    (tmp_path / "play.yml").write_text(ROLE_PLAY)
    env = tool_env(venv_bin, tmp_path / "facts", ANSIBLE_ROLES_PATH=str(REPO_ROOT / "roles"))
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", HIDE, "sh"]
    argv += [str(venv_bin / "ansible-playbook"), "--check", "-c", "local", "-i", str(tmp_path / "hosts.yml")]
    argv += ["-e", f"ansible_python_interpreter={venv_bin / 'python'}", str(tmp_path / "play.yml")]
    res = run(argv, env, 500, merge=True)
    out = ANSI.sub("", res.stdout)
    assert res.returncode == 0, out[-4000:]
    assert "check mode: localhost has no munge key yet" in out, out[-4000:]
    assert "check mode: slurmd is not installed yet on localhost" in out, out[-4000:]
    assert re.search(r"TASK \[slurm : Write the Slurm configuration\][ *]*\n(skipping: .*\n)+", out), out[
        -4000:
    ]
