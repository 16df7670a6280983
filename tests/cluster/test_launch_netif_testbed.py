"""The training interface per node on hosts like a real cluster's (issue #12 part 1).

SSH and the hostnames are on a management network (eth0, 10.213.103.0/24); training is on
10.213.102.0/24 over interfaces named differently on every host (ens1f0, train0, enp65s0f1); every host
also has a decoy `aaa0` that sorts first and holds docker0's 172.17.0.1/16, leading nowhere. Told
nothing, gloo would connect over the hostnames' (management) addresses; with ddp_network_cidr the
launcher derives each node's interface, and the established connections (ss) show only training
addresses. A user's GLOO_SOCKET_IFNAME still wins, which ss shows too.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ansible.conftest import run, tool_env
from tests.cluster.test_launch_testbed import FINAL, Launcher, launch, make_inventory
from tests.conftest import REPO_ROOT, VENV_BIN, private_testbed
from tests.testbed import Testbed

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

PREFIX, NET, TRAIN_NET = "nicc", "10.213.103", "10.213.102"
TRAIN = ipaddress.ip_network(f"{TRAIN_NET}.0/24")
MGMT = ipaddress.ip_network(f"{NET}.0/24")
SS_LINE = re.compile(
    r"^\S+\s+\S+\s+\[?(?:::ffff:)?([\d.]+)\]?:(\d+)\s+\[?(?:::ffff:)?([\d.]+)\]?:(\d+)\s+users:\(\(\"([^\"]+)\""
)


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with private_testbed(PREFIX, NET, 3, train_net=TRAIN_NET) as bed:
        yield bed


def connections(tb: Testbed) -> list[tuple[str, str, int, str, int, str]]:
    """(host, local ip, port, peer ip, port, process) of every established TCP connection but SSH."""
    found = []
    for h in tb.hosts():
        out = tb.exec(h, "ss -Htnp state established").stdout
        for line in out.splitlines():
            m = SS_LINE.match(line.strip())
            assert m, f"unparsed ss line on {h.name}: {line!r}"
            local, lport, peer, pport, proc = m.groups()
            if proc != "sshd":
                found.append((h.name, local, int(lport), peer, int(pport), proc))
    return found


def run_and_sample(tb: Testbed, root: Path, job: str, extra: list[str]) -> tuple[str, list]:
    """A short training job; its connections sampled once every rank trains. Returns (output, sample)."""
    inv = make_inventory(tb, root)
    config = root / "train.yaml"
    config.write_text("train:\n  max_steps: 30\nrun:\n  dir: runs-nic\n")
    args = ["--hosts", str(inv), "--job-id", job, "--config", str(config), "--set", "debug.step_delay_s=0.2"]
    job_run = Launcher([*args, *extra], root)
    try:
        job_run.wait_for(r"INFO step 10/30", timeout=120)
        time.sleep(0.5)
        sample = connections(tb)
        code = job_run.wait(120)
    finally:
        job_run.stop()
    assert code == 0, job_run.text
    finals = [FINAL.match(ln) for ln in job_run.lines if FINAL.match(ln)]
    assert len(finals) == 3 and len({m.group(6) for m in finals}) == 1, job_run.text
    return job_run.text, sample


def gloo_pairs(sample: list) -> set[frozenset[str]]:
    """The node pairs the trainer processes (not the rendezvous store on the master port) connect."""
    return {frozenset((a, b)) for _, a, lport, b, pport, proc in sample
            if proc == "python" and 29500 not in (lport, pport)}  # fmt: skip


def test_differently_named_training_interfaces_carry_all_job_traffic(tb: Testbed, tmp_path: Path) -> None:
    hosts = tb.hosts()
    assert [h.train_dev for h in hosts] == ["ens1f0", "train0", "enp65s0f1"]
    inv = make_inventory(tb, tmp_path)
    code, out = launch(["doctor", "--hosts", str(inv)], tmp_path)
    assert code == 0, out
    for h in hosts:
        assert re.search(rf"^{h.name}\s.*\s{h.train_dev}\s+{h.train_ip}\s+ok$", out, re.M), out

    out, sample = run_and_sample(tb, tmp_path / "derived", "nic-derived", [])
    for h in hosts:
        assert (
            f"{h.name}: trains over {h.train_dev} {h.train_ip}/24: GLOO_SOCKET_IFNAME={h.train_dev} "
            f"NCCL_SOCKET_IFNAME=={h.train_dev} --local-addr {h.train_ip}"
        ) in out, out
    assert sample, "no connection of the job was seen"
    off = [s for s in sample if not {ipaddress.ip_address(s[1]), ipaddress.ip_address(s[3])} <= set(TRAIN)]
    assert off == [], f"job connections outside the training network: {off}"
    train_ips = {h.train_ip for h in hosts}
    assert gloo_pairs(sample) == {
        frozenset(p) for p in [(a, b) for a in train_ips for b in train_ips if a < b]
    }

    # a value the user sets wins (and is reported): gloo then runs over the management eth0
    out, sample = run_and_sample(tb, tmp_path / "user", "nic-user", ["--env", "GLOO_SOCKET_IFNAME=eth0"])
    assert f"{hosts[1].name}: trains over train0 {hosts[1].train_ip}/24: NCCL_SOCKET_IFNAME==train0" in out
    assert "GLOO_SOCKET_IFNAME=eth0 from ddp_env/--env wins over the derived train0" in out, out
    pairs = gloo_pairs(sample)
    assert pairs and all(ipaddress.ip_address(ip) in MGMT for p in pairs for ip in p), sample


def test_no_address_or_two_interfaces_in_the_cidr_fail_preflight_naming_them(
    tb: Testbed, tmp_path: Path
) -> None:
    node1, node2 = tb.hosts()[1:]
    inv = make_inventory(tb, tmp_path, host_vars={"node2": {"ddp_network_cidr": "10.213.99.0/24"}})
    tb.exec(node1, f"ip addr add {TRAIN_NET}.99/24 dev aaa0")
    try:
        code, out = launch(["doctor", "--hosts", str(inv)], tmp_path)
    finally:
        tb.exec(node1, f"ip addr del {TRAIN_NET}.99/24 dev aaa0")
    assert code == 3, out
    assert (
        f"FAIL node1: 2 interfaces have addresses in ddp_network_cidr {TRAIN_NET}.0/24: "
        f"train0 {node1.train_ip}/24, aaa0 {TRAIN_NET}.99/24; gloo/NCCL need one"
    ) in out, out
    assert re.search(
        r"^FAIL node2: no interface has an address in ddp_network_cidr 10.213.99.0/24 \(found: "
        rf".*eth0 {node2.ip}/24.*enp65s0f1 {node2.train_ip}/24.*aaa0 172.17.0.1/16", out, re.M
    ), out  # fmt: skip


def test_the_nccl_role_writes_each_nodes_interface_into_nccl_conf(tb: Testbed, tmp_path: Path) -> None:
    """Exact names per node, the admin's other lines kept, idempotent, check mode changes nothing."""
    hosts = tb.hosts()
    tb.exec(hosts[0], "printf '# admin\\nNCCL_DEBUG=WARN\\n' > /etc/nccl.conf")
    play = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "nccl_conf.yml")
    env = tool_env(VENV_BIN, tmp_path / "facts")

    def playbook(*args: str) -> tuple[int, str]:
        res = run(
            [str(VENV_BIN / "ansible-playbook"), "-i", str(tb.inventory), play, *args], env, timeout=300
        )
        return res.returncode, res.stdout + res.stderr

    code, out = playbook()
    assert code == 0, out[-3000:]
    for h in hosts:
        want = f"NCCL_SOCKET_IFNAME=={h.train_dev}\n"
        assert (
            tb.exec(h, "cat /etc/nccl.conf").stdout
            == ("# admin\nNCCL_DEBUG=WARN\n" if h is hosts[0] else "") + want
        )
    code, out = playbook()
    assert code == 0 and set(re.findall(r"changed=(\d+)", out)) == {"0"}, out[-3000:]

    # check mode changes nothing; two interfaces in the CIDR fail with one line naming them
    tb.exec(hosts[1], f"ip addr add {TRAIN_NET}.99/24 dev aaa0")
    try:
        code, out = playbook("--check", "-e", '{"nccl_conf": {"NCCL_IB_HCA": "=mlx5_0"}}')
    finally:
        tb.exec(hosts[1], f"ip addr del {TRAIN_NET}.99/24 dev aaa0")
    assert code == 2, out[-3000:]
    assert (
        f"node1: 2 interfaces have addresses in nccl_network_cidr {TRAIN_NET}.0/24 "
        f"(train0 {hosts[1].train_ip}/24, aaa0 {TRAIN_NET}.99/24); NCCL needs one."
    ) in out, out[-3000:]
    assert re.findall(r"(node\d) +: ok=\d+ +changed=(\d+) .*failed=(\d+)", out) == [
        ("node0", "1", "0"), ("node1", "0", "1"), ("node2", "1", "0"),
    ], out[-3000:]  # fmt: skip
    for h in hosts:
        assert "NCCL_IB_HCA" not in tb.exec(h, "cat /etc/nccl.conf").stdout
