"""GPU health on the namespace testbed: each host has a fake nvidia-smi (and dmesg) in /usr/local/bin
replaying recorded H100 x8 outputs; node1's GPU 3 has uncorrectable ECC errors. Doctor and the
launch's preflight fail with one line naming that GPU, and pass on the healthy node."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import private_testbed

pytestmark = [pytest.mark.testbed]

FIXTURES = Path(__file__).resolve().parents[1] / "unit" / "fixtures" / "gpu"
LAUNCH = str(Path(sys.executable).parent / "ddp-launch")
BAD = (
    "FAIL node1: GPU 3 (00000000:5D:00.0): 2 uncorrectable ECC error(s) since the driver loaded; "
    "fix: reset the GPU"
)


def launch(args: list[str], cwd: Path) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [LAUNCH, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )  # fmt: skip
    return res.returncode, res.stdout + res.stderr


@pytest.mark.slow
def test_doctor_and_preflight_name_the_bad_gpu_and_pass_the_healthy_node(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    shutil.copytree(FIXTURES / "h100x8", good)
    shutil.copytree(good, bad)
    csv = bad / "query-gpu.csv"
    rows = [r.split(", ") for r in csv.read_text().splitlines()]
    rows[4][rows[0].index("ecc.errors.uncorrected.volatile.total")] = "2"  # GPU 3
    csv.write_text("\n".join(", ".join(r) for r in rows) + "\n")
    fake = FIXTURES / "fake"
    with private_testbed("gph", "10.213.113", 2, usr_local=True) as tb:
        for host, rec in zip(tb.hosts(), (good, bad)):
            tb.exec(
                host,
                f"mkdir -p /etc/ddp-fake-gpu /usr/local/bin && "
                f"cp {shlex.quote(str(rec))}/* /etc/ddp-fake-gpu/ && "
                f"install -m 0755 {shlex.quote(str(fake / 'nvidia-smi'))} /usr/local/bin/nvidia-smi && "
                f"install -m 0755 {shlex.quote(str(fake / 'replay'))} /usr/local/bin/dmesg",
            )
        assert not Path("/usr/local/bin/nvidia-smi").exists()  # the fakes stay inside the hosts
        inv = yaml.safe_load(tb.inventory.read_text())
        inv["all"]["vars"].update(ddp_venv=sys.prefix, ddp_workdir=str(tmp_path))
        (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
        hosts = str(tmp_path / "hosts.yml")

        code, out = launch(["doctor", "--hosts", hosts], tmp_path)
        assert code == 3, out
        assert [ln for ln in out.splitlines() if ln.startswith("FAIL")] == [
            BAD + " (nvidia-smi -r -i 3) or reboot the node"
        ], out
        use = r"0/0 %\s+0\.0/637 GiB"  # idle: what runs on the GPUs already (the recordings: 1 MiB used each)
        row = r"\s+8\s+570\.172\.08\s+8/8\s+0/8\s+ok\s+0\s+" + use
        assert re.search(rf"^node0{row}\s+ok$", out, re.M), out
        assert re.search(rf"^node1{row}\s+FAIL \(1\)$", out, re.M), out

        code, out = launch(["doctor", "--hosts", hosts, "--limit", "node0"], tmp_path)
        assert code == 0 and "preflight: all checks passed" in out, out

        code, out = launch(["--hosts", hosts, "--job-id", "gph-pre"], tmp_path)
        assert code == 3 and BAD in out and "nothing was started" in out, out


def _recording(src: Path, dst: Path, util: list[int], used_mib: int) -> Path:
    """The H100 x8 recording with these GPU utilizations (%) and memory used per GPU (MiB)."""
    shutil.copytree(src, dst)
    csv = dst / "query-gpu.csv"
    rows = [r.split(", ") for r in csv.read_text().splitlines()]
    head = rows[0]
    for row, u in zip(rows[1:], util):
        row[head.index("utilization.gpu")] = str(u)
        row[head.index("memory.used")] = str(used_mib)
    csv.write_text("\n".join(", ".join(r) for r in rows) + "\n")
    return dst


@pytest.mark.slow
def test_status_shows_each_nodes_gpu_use_and_flags_the_idle_node(tmp_path: Path) -> None:
    """#29 on three testbed hosts, each with a fake nvidia-smi of its own: node0 busy, node1 busy but
    for one GPU, node2's eight GPUs idle. While the job runs, `ddp-launch status JOB` shows each node's
    GPU count, mean/min utilization, memory used, its least busy GPU, and flags node2 as starving."""
    from tests.cluster.test_launch_testbed import SLOW, Launcher

    recs = [
        _recording(FIXTURES / "h100x8", tmp_path / "rec0", [97, 95, 96, 98, 94, 97, 95, 96], 40960),
        _recording(FIXTURES / "h100x8", tmp_path / "rec1", [91, 92, 90, 93, 91, 35, 92, 90], 40960),
        _recording(FIXTURES / "h100x8", tmp_path / "rec2", [0] * 8, 1),
    ]
    fake = FIXTURES / "fake"
    with private_testbed("gph", "10.213.113", 3, usr_local=True) as tb:
        for host, rec in zip(tb.hosts(), recs):
            tb.exec(
                host,
                f"mkdir -p /etc/ddp-fake-gpu /usr/local/bin && "
                f"cp {shlex.quote(str(rec))}/* /etc/ddp-fake-gpu/ && "
                f"install -m 0755 {shlex.quote(str(fake / 'nvidia-smi'))} /usr/local/bin/nvidia-smi",
            )
        inv = yaml.safe_load(tb.inventory.read_text())
        inv["all"]["vars"].update(ddp_venv=sys.prefix, ddp_workdir=str(tmp_path))
        (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inv))
        job = ["--hosts", str(tmp_path / "hosts.yml"), "--job-id", "gph-use", "--set", "run.dir=runs"]
        run = Launcher([*job, *SLOW], tmp_path)
        try:
            run.wait_for(r"\[node0 r0\] .*step \d+/2000", timeout=180)
            code, out = launch(["status", "gph-use"], tmp_path)
        finally:
            run.stop()
    assert code == 0, out
    assert re.search(r"^HOST\s+GPUS\s+UTIL MEAN/MIN\s+MEM USED\s+LEAST BUSY\s+NOTE$", out, re.M), out
    assert re.search(r"^node0\s+8\s+96/94 %\s+320\.0/637 GiB\s+GPU 4 94 %\s+-$", out, re.M), out
    assert re.search(r"^node1\s+8\s+84/35 %\s+320\.0/637 GiB\s+GPU 5 35 %\s+-$", out, re.M), out
    assert re.search(r"^node2\s+8\s+0/0 %\s+0\.0/637 GiB\s+GPU 0 0 %\s+STARVING \(< 20 %\)$", out, re.M), out
