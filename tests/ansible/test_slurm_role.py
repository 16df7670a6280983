"""The slurm role's configuration, rendered by the real ansible-core on localhost from an inventory
with the facts the role records on the nodes (`slurmd -C`, gpu_facts' count, the address in the
network), and the bad input that stops site.yml in its preflight play. The role on live hosts with
real Slurm is tested by molecule/slurm (test_molecule_slurm.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO_ROOT

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "slurm_conf.yml")
SLURMD_C = (
    "NodeName={} CPUs=96 Boards=1 SocketsPerBoard=2 CoresPerSocket=24 ThreadsPerCore=2 RealMemory=1000000"
)
NODES = {"gpu-0": ("g0", "10.1.0.10", 8), "gpu-1": ("g1", "10.1.0.11", 8), "cpu-2": ("c2", "10.1.0.12", 0)}


def _topology(gpu_cpus: list[str], sockets: int = 2, cores: int = 24, alternate: bool = False) -> list[str]:
    """What tasks/facts.yml reads on a node with 8 GPUs and 2 x 24 cores x 2 threads (96 CPUs): `gpu <slot>
    <minor> <local_cpulist>` and `cpu <id> <package> <core_id>`. The kernel numbers the first threads
    0-47 and their siblings 48-95; by socket (0-23 socket 0) or, as some BIOSes do, alternately (even CPUs
    socket 0). core_id as Xeons report it, with gaps (0-5, 8-13, 16-21, 24-29)."""
    core_ids = [c + 2 * (c // 6) for c in range(cores)]
    lines = [f"gpu 0000:{0x1B + 16 * i:02x}:00.0 {i} {cpus}" for i, cpus in enumerate(gpu_cpus)]
    for cpu in range(2 * sockets * cores):
        first = cpu % (sockets * cores)  # the core's first thread
        sock, core = (first % sockets, first // sockets) if alternate else divmod(first, cores)
        lines.append(f"cpu {cpu} {sock} {core_ids[core]}")
    return lines


# Recorded topologies of gpu-0 and gpu-1: four GPUs on each socket.
TOPOLOGY = {
    "gpu-0": _topology(["0-23,48-71"] * 4 + ["24-47,72-95"] * 4),
    "gpu-1": _topology(
        [",".join(map(str, range(0, 96, 2)))] * 4 + [",".join(map(str, range(1, 96, 2)))] * 4, alternate=True
    ),
}


def _inventory(
    tmp_path: Path, nvml: dict[str, bool] | None = None, controller: str = "ctl", topology: dict | None = None
) -> str:
    """gpu_nodes with the facts the role records; the controller is a host of its own (not a node)."""
    nvml = nvml or {}
    hosts = {
        name: {
            "__slurm_hostname": hostname,
            "__slurm_address": ip,
            "__slurm_gpus": gpus,
            "__slurm_slurmd_c": {"stdout_lines": [SLURMD_C.format(hostname), "UpTime=3-01:02:03"]},
            "__slurm_nvml_plugin": {"stat": {"exists": nvml.get(name, False)}},
        }
        for name, (hostname, ip, gpus) in NODES.items()
    }
    for name, lines in (topology or {}).items():
        hosts[name]["__slurm_gpu_topology"] = {"stdout_lines": lines}
    ctl = {controller: {"__slurm_hostname": "head", "__slurm_address": "10.1.0.2"}}
    inv = {
        "all": {
            "hosts": {"localhost": None},
            "children": {"gpu_nodes": {"hosts": hosts}, "slurm_controller": {"hosts": ctl}},
        }
    }
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return str(path)


def _render(
    playbook, tmp_path: Path, nvml: dict[str, bool] | None = None, topology: dict | None = None, **extra
) -> dict[str, str]:
    out = tmp_path / "conf.json"
    extra = {"ddp_network_cidr": "10.1.0.0/24", "conf_file": str(out), **extra}
    extra["ansible_python_interpreter"] = sys.executable
    res = playbook(
        "-i", _inventory(tmp_path, nvml, topology=topology), "-c", "local", "-e", json.dumps(extra), PLAY
    )
    assert res.returncode == 0, res.out[-2000:]
    return json.loads(out.read_text())


def _lines(conf: str) -> list[str]:
    return [line for line in conf.splitlines() if line and not line.startswith("#")]


@pytest.mark.slow
def test_slurm_conf_lists_every_node_as_its_slurmd_sees_it(playbook, tmp_path):
    conf = _lines(_render(playbook, tmp_path)["slurm.conf"])
    hw = "CPUs=96 Boards=1 SocketsPerBoard=2 CoresPerSocket=24 ThreadsPerCore=2 RealMemory=950000"
    assert [line for line in conf if line.startswith(("NodeName=", "PartitionName="))] == [
        f"NodeName=gpu-0 NodeHostname=g0 NodeAddr=10.1.0.10 {hw} Gres=gpu:8 State=UNKNOWN",
        f"NodeName=gpu-1 NodeHostname=g1 NodeAddr=10.1.0.11 {hw} Gres=gpu:8 State=UNKNOWN",
        f"NodeName=cpu-2 NodeHostname=c2 NodeAddr=10.1.0.12 {hw} State=UNKNOWN",
        "PartitionName=gpu Nodes=gpu-0,gpu-1,cpu-2 Default=YES MaxTime=INFINITE State=UP",
    ]
    for line in (
        "SlurmctldHost=head(10.1.0.2)",
        "SelectType=select/cons_tres",
        "GresTypes=gpu",
        "KillWait=120",
        "SrunPortRange=60001-63000",
        "ProctrackType=proctrack/cgroup",
        "TaskPlugin=task/cgroup,task/affinity",
        "JobAcctGatherType=jobacct_gather/cgroup",
        "JobCompType=jobcomp/filetxt",
        "ReturnToService=2",
    ):
        assert line in conf, line
    assert not [line for line in conf if line.startswith("AccountingStorage")]


@pytest.mark.slow
def test_the_testbed_choices_are_variables_and_slurmdbd_replaces_the_text_file(playbook, tmp_path):
    got = _render(
        playbook,
        tmp_path,
        slurm_proctrack_type="proctrack/linuxproc",
        slurm_task_plugin="task/none",
        slurm_cgroup_constrain=False,
        slurm_cgroup_plugin="cgroup/v1",
        slurm_accounting="slurmdbd",
        slurm_slurmdbd_host="db",
        slurm_partition_name="train",
        slurm_partition_max_time="2-00:00:00",
        slurm_extra_config={"AuthInfo": "cred_expire=10"},
    )
    conf = _lines(got["slurm.conf"])
    for line in (
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=db",
        "AuthInfo=cred_expire=10",
        "PartitionName=train Nodes=gpu-0,gpu-1,cpu-2 Default=YES MaxTime=2-00:00:00 State=UP",
    ):
        assert line in conf, line
    assert not [line for line in conf if line.startswith("JobComp")]
    assert _lines(got["cgroup.conf"]) == [
        "CgroupPlugin=cgroup/v1",
        "ConstrainCores=no",
        "ConstrainDevices=no",
        "ConstrainRAMSpace=no",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nvml", "autodetect"),
    [({}, False), ({"gpu-0": True, "gpu-1": True}, False), ({n: True for n in NODES}, True)],
)
def test_gres_conf_names_the_device_files_and_autodetects_only_with_nvml(
    playbook, tmp_path, nvml, autodetect
):
    """AutoDetect=nvml only where every node's build has gpu_nvml.so (Debian's and EPEL's have not)."""
    gres = _lines(_render(playbook, tmp_path, nvml)["gres.conf"])
    files = ["NodeName=gpu-0 Name=gpu File=/dev/nvidia[0-7]", "NodeName=gpu-1 Name=gpu File=/dev/nvidia[0-7]"]
    assert gres == (["AutoDetect=nvml"] if autodetect else []) + files


@pytest.mark.slow
def test_without_nvml_gres_conf_gives_each_gpu_the_cores_of_its_socket(playbook, tmp_path):
    """Issue #45 7b: EPEL's Slurm has no NVML, so the GPUs' CPU affinity comes from sysfs, as Slurm's logical
    core indexes: gpu-1's BIOS numbers the sockets' CPUs alternately (socket 0: CPUs 0, 2, ... 94), yet its
    first socket's cores are 0-23 as on gpu-0. Without the driver's minors (cpu-2, no GPU) no Cores=."""
    gres = _lines(_render(playbook, tmp_path, topology=TOPOLOGY)["gres.conf"])
    assert gres == [
        "NodeName=gpu-0 Name=gpu File=/dev/nvidia[0-3] Cores=0-23",
        "NodeName=gpu-0 Name=gpu File=/dev/nvidia[4-7] Cores=24-47",
        "NodeName=gpu-1 Name=gpu File=/dev/nvidia[0-3] Cores=0-23",
        "NodeName=gpu-1 Name=gpu File=/dev/nvidia[4-7] Cores=24-47",
    ]


@pytest.mark.slow
def test_gres_cores_per_gpu_and_none_where_the_driver_named_no_minor(playbook, tmp_path):
    """One core (two threads) per GPU, by device minor whatever the PCI order (gpu-0's first two slots hold
    minors 1 and 0); gpu-1's driver not loaded (no minor): its File= line without Cores=; with NVML,
    AutoDetect gives the affinity and no Cores= is written."""
    lines = _topology([f"{i},{i + 48}" for i in range(8)])
    lines[0], lines[1] = "gpu 0000:1b:00.0 1 0,48", "gpu 0000:2b:00.0 0 1,49"
    no_minor = [re.sub(r"^(gpu \S+) \d+ ", r"\1 - ", line) for line in TOPOLOGY["gpu-1"]]
    topology = {"gpu-0": lines, "gpu-1": no_minor}
    gres = _lines(_render(playbook, tmp_path, topology=topology)["gres.conf"])
    cores = [1, 0, *range(2, 8)]
    assert gres == [f"NodeName=gpu-0 Name=gpu File=/dev/nvidia{i} Cores={c}" for i, c in enumerate(cores)] + [
        "NodeName=gpu-1 Name=gpu File=/dev/nvidia[0-7]"
    ]
    gres = _lines(_render(playbook, tmp_path, {n: True for n in NODES}, topology=topology)["gres.conf"])
    files = ["NodeName=gpu-0 Name=gpu File=/dev/nvidia[0-7]", "NodeName=gpu-1 Name=gpu File=/dev/nvidia[0-7]"]
    assert gres == ["AutoDetect=nvml", *files]


@pytest.mark.slow
def test_a_munge_key_from_the_inventory_is_used_without_its_line_breaks(playbook, tmp_path):
    key = "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWZn\naGlqa2xtbm9wcXJzdHV2d3h5eg==\n"
    got = _render(playbook, tmp_path, slurm_munge_key=key)
    assert got["munge_key_b64"] == key.replace("\n", "")


@pytest.mark.parametrize(
    ("fact", "value", "why"),
    [
        ("__slurm_hostname", "g1\nSlurmUser=root", "not an RFC 1123 host name"),  # a line of its own
        ("__slurm_hostname", "g1 NodeAddr=6.6.6.6", "not an RFC 1123 host name"),
        ("__slurm_hostname", "G0", "another node reports it too"),
        ("__slurm_address", "10.1.0.0/24", "not one IPv4 address in 10.1.0.0/24"),
        ("__slurm_address", "6.6.6.6", "outside 10.1.0.0/24"),
    ],
)
def test_a_crafted_hostname_or_address_never_reaches_slurm_conf(playbook, tmp_path, fact, value, why):
    """What gpu-1 reports about itself (issue #44): refused in one line naming the node and the fact."""
    path = Path(_inventory(tmp_path))
    inv = yaml.safe_load(path.read_text())
    inv["all"]["children"]["gpu_nodes"]["hosts"]["gpu-1"][fact] = value
    path.write_text(yaml.safe_dump(inv))
    extra = {"ddp_network_cidr": "10.1.0.0/24", "conf_file": str(tmp_path / "conf.json")}
    extra["ansible_python_interpreter"] = sys.executable
    res = playbook("-i", str(path), "-c", "local", "-e", json.dumps(extra), PLAY)
    assert res.returncode != 0 and not (tmp_path / "conf.json").exists(), res.out[-2000:]
    msgs = re.findall(r'"msg": "(slurm: [^"]*)"', res.out)
    assert len(msgs) == 1 and "\\n" not in msgs[0], res.out[-2000:]
    label = fact.removeprefix("__slurm_")
    assert msgs[0].startswith("slurm: "), msgs[0]
    assert re.search(rf"gpu-1 reports {label} '[^']*' \({re.escape(why)}\)", msgs[0]), msgs[0]


def test_the_firewall_opens_the_srun_range_the_role_configures():
    slurm = yaml.safe_load((REPO_ROOT / "roles/slurm/defaults/main.yml").read_text())
    firewall = yaml.safe_load((REPO_ROOT / "roles/firewall/defaults/main.yml").read_text())
    assert f"default('{slurm['slurm_srun_port_range']}')" in firewall["firewall_slurm_srun_port_range"]


# Bad input: site.yml stops in its preflight play with one line naming the variable, before any change.
def _site_inventory(tmp_path: Path, controller: bool, **values) -> str:
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    nodes = {name: dict(local) for name in ("node0", "node1", "node2")}
    children = {"gpu_nodes": {"hosts": nodes}}
    if controller:
        children["slurm_controller"] = {"hosts": {"node0": None}}
    # No sudo here, and the run is as root already: the plays' `become` is overridden by the variable.
    inv = {
        "all": {"children": children, "vars": {"ddp_network_cidr": "10.1.0.0/24", "ansible_become": False}}
    }
    inv["all"]["vars"].update(values)
    path = tmp_path / "inventory" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("controller", "values", "message"),
    [
        (
            False,
            {"ddp_backend": "slurm"},
            "ddp_backend is slurm but the inventory has no slurm_controller group",
        ),
        (
            True,
            {"slurm_package_source": "rpmfusion"},
            "slurm_package_source must be one of epel, openhpc, local",
        ),
    ],
)
def test_bad_slurm_input_stops_site_yml_with_one_line(playbook, tmp_path, controller, values, message):
    res = playbook("-i", _site_inventory(tmp_path, controller, **values), "site.yml")
    assert res.returncode == 2, res.out[-3000:]
    fatal = re.findall(r"^fatal: .*$", res.out, re.M)
    assert len(fatal) == 1, res.out[-3000:]
    assert message in res.out and "[node0, node1, node2]" in res.out, res.out[-3000:]
    assert "PLAY [Map every node's hostname" not in res.out, "no play after preflight ran"


def _plays(out: str) -> list[tuple[str, list[str]]]:
    """`--list-hosts` output as (play name, sorted hosts) pairs."""
    plays = re.findall(
        r"play #\d+ \([^)]*\): (.+?)\tTAGS: \[\]\n\s+pattern: .*\n\s+hosts \(\d+\):\n((?:\s{6}\S+\n)*)", out
    )
    return [(name, sorted(hosts.split())) for name, hosts in plays]


def test_the_plays_take_the_slurm_group_names_from_the_role_variables(playbook, tmp_path):
    """slurm_controller_group, slurm_compute_group and slurm_login_group, not the default names written in."""
    children = {
        "gpu_nodes": {"hosts": {"node0": None}},
        "head": {"hosts": {"ctl": None}},
        "workers": {"hosts": {"w0": None, "w1": None}},
        "submit": {"hosts": {"login0": None}},
    }
    inv = tmp_path / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": children}}))
    names = {
        "slurm_controller_group": "head",
        "slurm_compute_group": "workers",
        "slurm_login_group": "submit",
    }
    base = str(REPO_ROOT / "playbooks" / "base.yml")
    slurm = str(REPO_ROOT / "playbooks" / "slurm.yml")
    res = playbook("-i", str(inv), "--list-hosts", "-e", json.dumps(names), slurm, base)
    assert res.returncode == 0, res.out[-2000:]
    assert _plays(res.out) == [
        ("Slurm controller, compute nodes and login hosts", ["ctl", "login0", "w0", "w1"]),
        ("Check Slurm from the controller", ["ctl"]),
        # the firewall runs on the controller and login hosts too (their Slurm ports)
        (
            "Map every node's hostname to its training-network IP, and open the training ports"
            " to the cluster",
            ["ctl", "login0", "node0"],
        ),
    ]
