"""tests/cpuprofile.py: CPU per test from a cpuacct group per pytest process, and its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpuprofile import CPUACCT, report


def test_report_sums_per_module_largest_cpu_first(tmp_path: Path) -> None:
    rows = [("tests/a.py::t1", 1.5, 3.0), ("tests/b.py::t", 10.0, 12.0), ("tests/a.py::t2", 0.5, 1.0)]
    path = tmp_path / "cpu.jsonl"
    path.write_text(
        "".join(json.dumps({"test": t, "cpu_s": c, "wall_s": w, "worker": "gw0"}) + "\n" for t, c, w in rows)
    )
    lines = report(path).splitlines()
    assert lines[0] == "3 tests, 12 s CPU, 16 s wall summed"
    assert lines[2].split() == ["10", "12", "1", "tests/b.py"] and lines[3].split() == [
        "2",
        "4",
        "2",
        "tests/a.py",
    ]


@pytest.mark.skipif(os.geteuid() != 0 or not CPUACCT.is_dir(), reason="needs root and cgroup-v1 cpuacct")
def test_a_tests_children_count_toward_it(tmp_path: Path) -> None:
    """A test whose child burns ~1 s of CPU records about that much; a sleeping one almost none."""
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "def test_burn():\n"
        "    subprocess.run([sys.executable, '-c', 'import time\\nt=time.process_time()\\n"
        "while time.process_time()-t<1: pass'], check=True)\n"
        "def test_sleep():\n"
        "    subprocess.run(['sleep', '1'], check=True)\n"
    )
    out = tmp_path / "cpu.jsonl"
    groups = {
        g.name for g in CPUACCT.iterdir() if g.name.startswith("ddp-cpuprofile-")
    }  # a profiled run's own
    env = {**os.environ, "DDP_CPU_PROFILE": str(out), "PYTHONPATH": str(Path(__file__).parents[2])}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "tests.cpuprofile",
        "-p",
        "no:cacheprovider",
        str(tmp_path),
    ]
    res = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    cpu = {
        json.loads(line)["test"].split("::")[1]: json.loads(line)["cpu_s"]
        for line in out.read_text().splitlines()
    }
    assert 0.9 <= cpu["test_burn"] < 3 and cpu["test_sleep"] < 0.5, cpu
    assert {g.name for g in CPUACCT.iterdir() if g.name.startswith("ddp-cpuprofile-")} <= groups  # removed
