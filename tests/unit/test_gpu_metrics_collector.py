"""The monitoring role's GPU collector (roles/monitoring/files/ddp_gpu_metrics.py) against the fake
nvidia-smi replaying a recorded 4-GPU node (GPU 2 idle, GPU 3 with Xids and a pending row remap)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "roles" / "monitoring" / "files" / "ddp_gpu_metrics.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"
UUID = "GPU-3c1f0a52-7d3e-4b1c-9a55-1a2b3c4d5e0"


def _load():
    loader = importlib.machinery.SourceFileLoader("ddp_gpu_metrics", str(SCRIPT))
    spec = importlib.util.spec_from_loader("ddp_gpu_metrics", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """nvidia-smi and dmesg fakes on PATH, replaying a copy of the recording (so a test can edit it)."""
    rec = tmp_path / "rec"
    shutil.copytree(FIXTURES / "monitoring", rec)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FIXTURES / "fake" / "nvidia-smi", bin_dir / "nvidia-smi")
    shutil.copy(FIXTURES / "fake" / "replay", bin_dir / "dmesg")
    monkeypatch.setenv("DDP_FAKE_GPU_DIR", str(rec))
    return rec, bin_dir


def _series(text: str) -> dict[str, float]:
    return {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if not ln.startswith("#")
    }


def test_every_field_of_every_gpu_and_the_idle_one(fakes):
    _, bin_dir = fakes
    text = _load().collect(str(bin_dir / "nvidia-smi"), str(bin_dir / "dmesg"))
    s = _series(text)
    gpu = lambda i: f'gpu="{i}",uuid="{UUID}{i}"'  # noqa: E731
    assert s[f"ddp_gpu_utilization_percent{{{gpu(2)}}}"] == 0
    assert s[f"ddp_gpu_utilization_percent{{{gpu(0)}}}"] == 97
    assert s[f"ddp_gpu_memory_used_bytes{{{gpu(2)}}}"] == 512 * 2**20
    assert s[f"ddp_gpu_memory_total_bytes{{{gpu(0)}}}"] == 81559 * 2**20
    assert s[f"ddp_gpu_power_watts{{{gpu(1)}}}"] == pytest.approx(598.12)
    assert s[f"ddp_gpu_temperature_celsius{{{gpu(3)}}}"] == 60
    assert s[f"ddp_gpu_sm_clock_hertz{{{gpu(0)}}}"] == 1980e6
    assert s[f"ddp_gpu_ecc_corrected_errors{{{gpu(1)}}}"] == 3
    assert s[f"ddp_gpu_remapped_rows_correctable{{{gpu(1)}}}"] == 2
    assert s[f"ddp_gpu_remapped_rows_pending{{{gpu(3)}}}"] == 1
    assert s[f"ddp_gpu_xid_errors{{{gpu(3)}}}"] == 2 and s[f"ddp_gpu_xid_errors{{{gpu(0)}}}"] == 0
    assert not [k for k in s if k.startswith("ddp_gpu_retired_pages")]  # [N/A] on H100: left out
    assert s["ddp_gpu_collector_up"] == 1
    # node_exporter rejects a file whose metric families repeat or lack a TYPE line
    types = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")]
    assert len(types) == len(set(types)) == len({k.split("{")[0] for k in s})


def test_a_driver_without_the_newer_fields_still_gives_the_core_ones(fakes):
    rec, bin_dir = fakes
    lines = (rec / "query-gpu.csv").read_text().splitlines()
    cut = [", ".join(c.strip() for c in ln.split(",")[:10]) for ln in lines]  # up to clocks.sm
    (rec / "query-gpu.csv").write_text("\n".join(cut) + "\n")
    s = _series(_load().collect(str(bin_dir / "nvidia-smi"), str(bin_dir / "dmesg")))
    assert s[f'ddp_gpu_sm_clock_hertz{{gpu="2",uuid="{UUID}2"}}'] == 345e6
    assert not [k for k in s if k.startswith("ddp_gpu_ecc")]
    assert s["ddp_gpu_collector_up"] == 1


def test_a_failing_nvidia_smi_says_so_and_keeps_no_gpu_series(fakes):
    rec, bin_dir = fakes
    shutil.copy(FIXTURES / "logs" / "nvidia-smi-no-driver.txt", rec / "fail.txt")
    s = _series(_load().collect(str(bin_dir / "nvidia-smi"), str(bin_dir / "dmesg")))
    assert s["ddp_gpu_collector_up"] == 0
    assert [k for k in s if k.startswith("ddp_gpu_") and "collector" not in k] == []


def test_the_script_writes_its_file_atomically_and_leaves_no_temporary(fakes, tmp_path):
    _, bin_dir = fakes
    out = tmp_path / "textfile" / "ddp_gpu.prom"
    out.parent.mkdir()
    out.write_text("old\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--interval", "0"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "ddp_gpu_utilization_percent" in out.read_text()
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in out.parent.iterdir()) == ["ddp_gpu.prom"]
