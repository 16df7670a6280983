"""`systemd-analyze verify` on every systemd unit the roles write, each drop-in together with the unit it
changes, and on the units of the packages the roles start (issue #45 item 6). No test starts a unit under
systemd (the testbeds run none): this catches what systemd itself would refuse or ignore when it loads
the files (unknown keys, bad values, an ExecStart= a drop-in adds without clearing the unit's, a command
that is not an absolute path or not there), not whether the daemons then run.

`systemd-analyze verify` exits 0 on most of what it reports ("Unknown key ..., ignoring"), so every line
it prints counts as a failure, except one kind: "Command X is not executable" for a program this Debian
machine does not have, where X is where the role installs it itself or where the package's own unit (a
fixture below) runs it. Debian's units here run the real programs (prometheus, prometheus-node-exporter,
slurmd, slurmctld, munged, firewalld, nft), so the Debian renderings are checked with their real paths.

Units of the packages (the ones the roles rely on):
- Debian's, from the installed packages (/lib/systemd/system): firewalld, nftables, munge, slurmd,
  slurmctld, prometheus, prometheus-node-exporter.
- tests/ansible/fixtures/units (real text, sources in its SOURCES.md): NVIDIA's nvidia-dcgm-exporter and
  nvidia-persistenced units.
- Not verified (no real text found): nvidia-fabricmanager (NVIDIA's tarball), EPEL's node_exporter,
  prometheus and slurm units, EL's own munge, firewalld and nftables units. The role's EL drop-ins for
  node_exporter and prometheus are verified over Debian's unit of the same program under EPEL's name.

And the PID files: slurm.conf's SlurmctldPidFile/SlurmdPidFile and the slurm role's own PID-file checks
(no-systemd path) against the PIDFile= of the units that start those daemons.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import REPO_ROOT

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
pytestmark = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")

PLAY = str(REPO_ROOT / "tests" / "ansible" / "playbooks" / "monitoring_units.yml")
FIXTURES = Path(__file__).parent / "fixtures" / "units"
SYSTEM = Path("/lib/systemd/system")
DEBIAN_UNITS = [
    "firewalld.service",
    "nftables.service",
    "munge.service",
    "slurmd.service",
    "slurmctld.service",
    "prometheus.service",
    "prometheus-node-exporter.service",
]

# Programs not on this machine, and why their path is right: where the role puts them itself, or where
# the package's unit runs them (its ExecStart, a fixture here, or the package's file list).
ABSENT_HERE = {
    "/usr/local/libexec/ddp-gpu-metrics": "the monitoring role copies it there (_monitoring_collector)",
    "/usr/local/bin/node_exporter": "the monitoring role unpacks the release tarball there",
    "/usr/bin/node_exporter": "EPEL's node-exporter (packages.fedoraproject.org file list, vars/RedHat.yml)",
    "/usr/bin/dcgm-exporter": "NVIDIA's unit runs it: fixtures/units/nvidia-dcgm-exporter.service",
    "/usr/bin/nvidia-persistenced": "NVIDIA's unit runs it: fixtures/units/nvidia-persistenced.service",
}
NOT_EXECUTABLE = re.compile(
    r"^[\w@.-]+\.service: Command (\S+) is not executable: No such file or directory$"
)


def verify(units: list[Path]) -> list[str]:
    """What `systemd-analyze verify` says about the units (drop-ins in <unit>.d/ beside each are read with
    it), less the "not executable" lines of ABSENT_HERE's programs where they are indeed absent here."""
    res = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", *map(str, units)],
        cwd=units[0].parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    left = []
    for line in lines:
        m = NOT_EXECUTABLE.match(line)
        if m and m.group(1) in ABSENT_HERE and not Path(m.group(1)).exists():
            continue
        left.append(line)
    if res.returncode != 0 and not lines:
        left.append(f"systemd-analyze verify exited {res.returncode} without saying why")
    return left


def exec_start(text: str) -> list[str]:
    """The ExecStart= values of a unit or drop-in, in order ("" for a reset)."""
    return [ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith("ExecStart=")]


def unit_value(path: Path, key: str) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1].strip()
    return None


def need_debian(*names: str) -> list[Path]:
    missing = [n for n in names if not (SYSTEM / n).is_file()]
    if missing:
        pytest.skip(f"Debian's units are not installed here: {', '.join(missing)}")
    return [SYSTEM / n for n in names]


@pytest.mark.parametrize("unit", DEBIAN_UNITS)
def test_the_debian_packages_units_the_roles_start_verify(unit):
    (path,) = need_debian(unit)
    assert verify([path]) == []


@pytest.mark.parametrize("unit", sorted(p.name for p in FIXTURES.glob("*.service")))
def test_nvidias_units_verify(unit):
    assert verify([FIXTURES / unit]) == []


# Each case: one host's OS vars and the role's choices; the packaged units its drop-ins change, as
# {unit name on that OS: the unit file that stands for it here}.
CASES = {
    "debian": (
        "Debian",
        {"monitoring_gpu_exporter": "nvidia_smi"},
        {
            "prometheus-node-exporter.service": SYSTEM / "prometheus-node-exporter.service",
            "prometheus.service": SYSTEM / "prometheus.service",
        },
    ),
    "el-package": (
        "RedHat",
        {"monitoring_gpu_exporter": "nvidia_smi", "monitoring_node_exporter_source": "package"},
        # EPEL's node_exporter.service is not here: Debian's unit of the same exporter stands in for it.
        {"node_exporter.service": SYSTEM / "prometheus-node-exporter.service"},
    ),
    "el-tarball-dcgm": (
        "RedHat",
        {"monitoring_gpu_exporter": "dcgm", "monitoring_node_exporter_source": "tarball"},
        {
            "prometheus.service": SYSTEM / "prometheus.service",  # EPEL's golang-github-prometheus: not here
            "nvidia-dcgm-exporter.service": FIXTURES / "nvidia-dcgm-exporter.service",
        },
    ),
}
# What each case must render (so a case that renders nothing cannot pass).
EXPECTED = {
    "debian": {
        "prometheus-node-exporter.service.d/ddp-train.conf",
        "prometheus.service.d/ddp-train.conf",
        "ddp-gpu-metrics.service",
    },
    "el-package": {"node_exporter.service.d/ddp-train.conf", "ddp-gpu-metrics.service"},
    "el-tarball-dcgm": {
        "ddp-node-exporter.service",
        "prometheus.service.d/ddp-train.conf",
        "nvidia-dcgm-exporter.service.d/ddp-train.conf",
    },
}


@pytest.fixture(scope="module")
def rendered(venv_bin, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The monitoring role's units and drop-ins for each case, rendered by the real ansible-core in one
    run: each case is a host with the role's defaults and the case's choices; debian and el-tarball-dcgm
    are each the Prometheus host of a monitoring group of their own."""
    from tests.ansible.conftest import run, tool_env

    tmp = tmp_path_factory.mktemp("monitoring-units")
    defaults = yaml.safe_load((REPO_ROOT / "roles" / "monitoring" / "defaults" / "main.yml").read_text())
    groups = {"debian": "mon_debian", "el-package": "mon_none", "el-tarball-dcgm": "mon_el"}
    hosts = {
        case: {
            **defaults,
            **choices,
            "os_vars": os_vars,
            "monitoring_group": groups[case],
            "cluster_hosts_address": "10.1.0.10",
            "gpu_facts_nvidia_gpus": 8,
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
        }
        for case, (os_vars, choices, _) in CASES.items()
    }
    inv = {
        "all": {
            "hosts": hosts,
            "children": {
                "gpu_nodes": {"hosts": {h: None for h in hosts}},
                "mon_debian": {"hosts": {"debian": None}},
                "mon_el": {"hosts": {"el-tarball-dcgm": None}},
            },
        }
    }
    (tmp / "hosts.yml").write_text(yaml.safe_dump(inv, sort_keys=False))
    argv = [str(venv_bin / "ansible-playbook"), "-i", str(tmp / "hosts.yml"), "-e", f"units_dir={tmp}", PLAY]
    res = run(argv, tool_env(venv_bin, tmp / "facts"), 300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return {case: json.loads((tmp / f"{case}.json").read_text()) for case in CASES}


def install(unit_dir: Path, files: dict[str, str], packaged: dict[str, Path]) -> list[Path]:
    """Lay the units out as in /etc/systemd/system (each packaged unit beside its drop-in directory);
    returns the unit files to verify."""
    for name, source in packaged.items():
        if not source.is_file():
            pytest.skip(f"{source} is not installed here")
        (unit_dir / name).write_text(source.read_text())
    for rel, text in files.items():
        (unit_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (unit_dir / rel).write_text(text)
    names = {rel.split(".service", 1)[0] + ".service" for rel in files}
    assert names <= set(packaged) | {rel for rel in files if rel.endswith(".service")}, names
    return [unit_dir / n for n in sorted(names)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_monitoring_roles_units_and_drop_ins_verify(rendered, tmp_path, case):
    files = rendered[case]
    assert set(files) == EXPECTED[case]
    units = install(tmp_path, files, CASES[case][2])
    assert verify(units) == []


@pytest.mark.parametrize("case", CASES)
def test_each_drop_in_clears_the_units_command_and_runs_the_packages_program(rendered, case):
    """systemd.unit(5)/systemd.service(5): a drop-in's ExecStart= is added to the unit's unless an empty
    ExecStart= clears the list first (two are refused for Type=simple); and the program must be the one the
    package's own unit runs, where this machine has that unit's real text."""
    for rel, text in rendered[case].items():
        if ".service.d/" not in rel:
            continue
        starts = exec_start(text)
        assert len(starts) == 2 and starts[0] == "", (rel, starts)
        unit = CASES[case][2][rel.split(".d/", 1)[0]]
        if case.startswith("el-") and unit.parent == SYSTEM:
            continue  # Debian's unit stands in for EPEL's: its program path is Debian's
        (packaged,) = exec_start(unit.read_text())
        assert starts[1].split()[0] == packaged.split()[0], (rel, starts[1], packaged)


def test_a_broken_unit_or_drop_in_fails_the_check(rendered, tmp_path):
    """The check itself: what systemd only warns about (exit 0) fails it, and so does a drop-in that does
    not clear the packaged ExecStart=."""
    files = dict(rendered["debian"])
    files["ddp-gpu-metrics.service"] = files["ddp-gpu-metrics.service"].replace("Restart=", "Restrat=")
    dropin = "prometheus.service.d/ddp-train.conf"
    files[dropin] = files[dropin].replace("ExecStart=\n", "", 1)
    said = verify(install(tmp_path, files, CASES["debian"][2]))
    assert any("Unknown key 'Restrat'" in line for line in said), said
    assert any("more than one ExecStart=" in line for line in said), said


def _slurm_conf_pidfiles() -> dict[str, str]:
    text = (REPO_ROOT / "roles" / "slurm" / "templates" / "slurm.conf.j2").read_text()
    found = dict(re.findall(r"^Slurm(ctld|d)PidFile=(\S+)$", text, re.M))
    return {"slurmctld": found["ctld"], "slurmd": found["d"]}


def test_slurm_conf_writes_the_pid_files_the_units_and_the_role_expect():
    """slurm.conf's SlurmctldPidFile/SlurmdPidFile are where Debian's units look (PIDFile=) and where the
    role looks without systemd (_slurm_daemons); munged's PID file is munge.service's."""
    units = dict(
        zip(
            ["slurmctld", "slurmd", "munge"],
            need_debian("slurmctld.service", "slurmd.service", "munge.service"),
        )
    )
    daemons = yaml.safe_load((REPO_ROOT / "roles" / "slurm" / "vars" / "main.yml").read_text())[
        "_slurm_daemons"
    ]
    role = {d["service"]: d["pidfile"] for d in daemons}
    conf = _slurm_conf_pidfiles()
    for service in ("slurmctld", "slurmd"):
        assert conf[service] == unit_value(units[service], "PIDFile") == role[service], service
    assert role["munge"] == unit_value(units["munge"], "PIDFile")
