"""bench/gpu.sh cannot run on a GPU in CI; its --smoke mode runs the same code on CPU so it cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_gpu_sh_smoke_prints_every_ratio_line(repo_root):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        ["bash", "bench/gpu.sh", "--smoke"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    codes = re.findall(r"^(G\d) \S+ \S+ ratio=(\S+)", res.stdout, re.M)
    assert [c for c, _ in codes] == ["G1", "G3", "G2", "G4", "G5", "G6", "G7", "G8"]
    ratios = dict(codes)
    assert all(
        float(ratios[c]) > 0 for c in ("G2", "G3", "G4", "G5", "G8")
    )  # G6, G7 need CUDA memory stats: nan
    g2 = re.search(r"^G2 .* wall_s=(\S+) minimal_wall_s=(\S+) first_window_s=(\S+)$", res.stdout, re.M)
    assert g2 and all(float(v) > 0 for v in g2.groups()), res.stdout  # issue 31: wall time on both sides
    assert re.search(
        r"^G7 mem_set_to_none/mem_in_place peak_gib ratio=\S+ step_time_ratio=\S+$", res.stdout, re.M
    )
