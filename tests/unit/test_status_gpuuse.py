"""`ddp-launch status`'s GPU table (launch/jobs/gpuuse.py) from recorded nvidia-smi answers: the idle
GPU 2 of the 4-GPU recording, a starving node, a CPU-only node, and the inventory's threshold."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ddp_train.launch.errors import LaunchError
from ddp_train.launch.jobs import gpuuse

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"


def _answer(tmp_path: Path, recording: Path) -> str:
    """What the fake nvidia-smi prints for the query status runs on a node."""
    argv = ["python3", str(FIXTURES / "fake" / "nvidia-smi"), *gpuuse.QUERY.split()[1:]]
    res = subprocess.run(argv, env={"DDP_FAKE_GPU_DIR": str(recording), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)  # fmt: skip
    return res.stdout


def test_a_busy_node_with_one_idle_gpu(tmp_path: Path) -> None:
    gpus = gpuuse.parse(_answer(tmp_path, FIXTURES / "monitoring"))
    assert gpus is not None and [g.util for g in gpus] == [97, 95, 0, 96]
    assert gpuuse.row("node0", gpus, 20.0, live=True) == [
        "node0", "4", "72/0 %", "179.9/319 GiB", "GPU 2 0 %", "",
    ]  # fmt: skip


def test_a_starving_node_is_flagged_while_the_job_runs_only() -> None:
    gpus = gpuuse.parse("0, 5, 1000, 81559\n1, 12, 1000, 81559\n")
    assert gpuuse.row("node1", gpus, 20.0, live=True)[-1] == "STARVING (< 20 %)"
    assert gpuuse.row("node1", gpus, 20.0, live=False)[-1] == ""
    assert gpuuse.row("node1", gpus, 5.0, live=True)[-1] == ""  # ddp_gpu_idle_warn: 5


def test_cpu_only_and_unreachable_nodes() -> None:
    assert gpuuse.parse("No devices were found\n") is None
    assert gpuuse.row("node2", None, 20.0, live=True) == ["node2", "-", "-", "-", "-", ""]
    assert gpuuse.row("node3", None, 20.0, live=True, error="timed out")[1:5] == ["?"] * 4


def test_the_threshold_comes_from_the_inventory(tmp_path: Path) -> None:
    from ddp_train.launch.plan.inventory import load_nodes

    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  hosts:\n    n0: {ansible_connection: local, ddp_gpu_idle_warn: 35}\n")
    assert load_nodes([str(inv)])[0].gpu_idle_warn == 35.0
    inv.write_text("all:\n  hosts:\n    n0: {ansible_connection: local, ddp_gpu_idle_warn: 150}\n")
    with pytest.raises(LaunchError, match="ddp_gpu_idle_warn: must be a number of percent from 0 to 100"):
        load_nodes([str(inv)])


def test_the_status_of_a_live_local_job_has_the_gpu_table(tmp_path: Path, monkeypatch) -> None:
    """A local node whose PATH has the fake nvidia-smi: one query, one row."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_bytes((FIXTURES / "fake" / "nvidia-smi").read_bytes())
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("DDP_FAKE_GPU_DIR", str(FIXTURES / "monitoring"))
    (tmp_path / "hosts.yml").write_text("all:\n  hosts:\n    n0: {ansible_connection: local}\n")
    data = {"argv": ["--hosts", "hosts.yml"], "cwd": str(tmp_path), "nodes": [{"host": "n0", "rank": 0}]}
    out = gpuuse.lines(data, live=True)
    assert out[0].split() == ["HOST", "GPUS", "UTIL", "MEAN/MIN", "MEM", "USED", "LEAST", "BUSY", "NOTE"]
    assert out[1].split()[:3] == ["n0", "4", "72/0"], out


@pytest.mark.parametrize(
    ("argv", "files"),
    [
        (["-i", "a.yml", "--hosts", "b.yml", "train.py"], {}),  # -i and a repeated --hosts
        (["--hosts", "c.yml", "--group", "big", "train.py"], {}),
        (["--hosts", "d.yml", "-e", "@vars.yml", "train.py"], {"vars.yml": "ddp_gpu_idle_warn: 50\n"}),
        # no --hosts: the default inventory
        (["train.py"], {"inventory/local/hosts.yml": "all:\n  hosts:\n    n0: {}\n    n1: {}\n"}),
    ],
)
def test_status_reads_the_inventory_the_job_was_launched_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], files: dict[str, str]
) -> None:
    from ddp_train.launch.remote import remote

    local = "{ansible_connection: local}"
    inventories = {
        "a.yml": f"all:\n  hosts:\n    n0: {local}\n",
        "b.yml": f"all:\n  hosts:\n    n1: {local}\n",
        "c.yml": f"all:\n  children:\n    gpu_nodes:\n      hosts:\n        x: {local}\n"
        f"    big:\n      hosts:\n        n0: {local}\n        n1: {local}\n",
        "d.yml": f"all:\n  hosts:\n    n0: {local}\n    n1: {local}\n",
    }
    for name, text in inventories.items():
        (tmp_path / name).write_text(text)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    class Fake:
        def exec(self, command: str, timeout: float = 30) -> tuple[int, str]:
            return 0, "0, 30, 1000, 81559\n"

        def close(self) -> None:
            pass

    monkeypatch.setattr(remote, "open_session", lambda node: Fake())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # status runs from any directory
    data = {"job_id": "j", "argv": argv, "cwd": str(tmp_path),
            "nodes": [{"host": "n0", "rank": 0}, {"host": "n1", "rank": 1}]}  # fmt: skip
    out = gpuuse.lines(data, live=True)
    assert [ln.split()[0] for ln in out[1:]] == ["n0", "n1"], out
    starving = "STARVING" in out[1]  # 30 %: starving only below -e's ddp_gpu_idle_warn 50
    assert starving == ("-e" in argv), out
    assert Path.cwd() == elsewhere
