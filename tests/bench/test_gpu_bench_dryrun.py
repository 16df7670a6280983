"""bench/gpu.sh cannot run on a GPU in CI: its --smoke mode runs the same code on CPU, here in a Python that
can import only what the lent GPU machine's image has (tests/gpuimage/sitecustomize.py) plus the wheels
bench/gpu_wheels.sh fetches, installed by gpu.sh itself as on the machine, so the next import that would
break it there breaks here first (issue #46)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def image_env(repo_root, **extra) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(repo_root / "tests" / "gpuimage"),
        **extra,
    }


def test_the_image_simulation_refuses_what_the_image_lacks(repo_root):
    """The dry run below means something only if the simulated image really lacks the trainer's extras."""
    for name in ("jsonschema", "rpds", "fabric", "ansible"):
        res = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=image_env(repo_root), capture_output=True, text=True
        )
        assert res.returncode != 0 and f"No module named {name!r}" in res.stderr, (name, res.stderr)
    res = subprocess.run(
        [sys.executable, "-c", "import torch, yaml, numpy"], env=image_env(repo_root), capture_output=True
    )
    assert res.returncode == 0, res.stderr


def test_gpu_sh_runs_every_part_in_the_image_with_the_carried_wheels(repo_root, tmp_path):
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if not list((repo_root / "bench" / "wheels" / tag).glob("*.whl")):
        ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
        got = subprocess.run(
            ["bash", "bench/gpu_wheels.sh", ver], cwd=repo_root, capture_output=True, text=True, timeout=300
        )
        assert got.returncode == 0, got.stderr[-2000:]
    out = tmp_path / "out"
    env = image_env(repo_root, OMP_NUM_THREADS="1", OUT=str(out))
    res = subprocess.run(
        ["bash", "bench/gpu.sh", "--smoke"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    codes = re.findall(r"^(G\d) \S+ \S+ ratio=(\S+)", res.stdout, re.M)
    # the parts' order: the most important numbers first, so a call cut short keeps them
    assert [c for c, _ in codes] == ["G1", "G2", "G9", "G3", "G4", "G5", "G6", "G7", "G8"]
    ratios = dict(codes)
    assert all(float(ratios[c]) > 0 for c in ("G2", "G3", "G4", "G5", "G8", "G9"))  # G6, G7: CUDA memory, nan
    g2 = re.search(r"^G2 .* wall_s=(\S+) minimal_wall_s=(\S+) first_window_s=(\S+)$", res.stdout, re.M)
    assert g2 and all(float(v) > 0 for v in g2.groups()), res.stdout  # issue 31: wall time on both sides
    assert re.search(
        r"^G7 mem_set_to_none/mem_in_place peak_gib ratio=\S+ step_time_ratio=\S+$", res.stdout, re.M
    )
    assert re.search(r"^G9 ckpt_async/no_ckpt wall_s ratio=\S+ sync_ratio=\S+ per_250=\S+", res.stdout, re.M)
    # every line also went to $OUT as it came, for the device tool to bring back
    kept = (out / "gpu-bench.txt").read_text()
    assert re.findall(r"^(G\d) \S+ \S+ ratio=", kept, re.M) == [c for c, _ in codes]


def test_gpu_sh_refuses_a_part_it_does_not_have(repo_root):
    res = subprocess.run(
        ["bash", "bench/gpu.sh", "--part", "4"], cwd=repo_root, capture_output=True, text=True
    )
    assert res.returncode == 2 and res.stderr.strip() == "gpu.sh: --part is 1, 2 or 3, not '4'"
