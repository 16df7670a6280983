"""ddp_train.allreduce, the smoke test verify.yml runs: the sum is checked and bandwidth reported per rank."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from ddp_train import allreduce
from tests.ansible.conftest import REPO_ROOT

LINE = re.compile(r"^ddp-allreduce (?P<fields>(\w+=\S+ ?)+)$")


def test_bus_bandwidth_follows_nccl_tests():
    assert allreduce.bus_bandwidth(1.0, 2) == pytest.approx(1.0)
    assert allreduce.bus_bandwidth(3.0, 4) == pytest.approx(4.5)
    assert allreduce.bus_bandwidth(2.0, 1) == 0.0


def test_auto_backend_is_gloo_without_cuda():
    assert allreduce.pick_backend("auto") == ("nccl" if allreduce.torch.cuda.is_available() else "gloo")
    assert allreduce.pick_backend("gloo") == "gloo"


@pytest.mark.parametrize(
    "argv", [["--size-mb", "0"], ["--iters", "0"], ["--warmup", "-1"], ["--timeout-s", "0"]]
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        allreduce.parse_args(argv)
    assert e.value.code == 2
    assert "must be" in capsys.readouterr().err


def test_outside_torchrun_it_says_so(monkeypatch, capsys):
    for var in allreduce.TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert allreduce.main([]) == 2
    assert "run it under torchrun" in capsys.readouterr().err


@pytest.mark.slow
def test_two_ranks_under_torchrun_print_one_line_each(venv_bin, tmp_path):
    """As verify.yml runs it: with --log-dir=/dev/null torchrun leaves no directory in the temp dir."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    argv = [str(venv_bin / "torchrun"), "--standalone", "--nproc-per-node=2", "--log-dir=/dev/null"]
    argv += ["-m", "ddp_train.allreduce"]
    argv += ["--size-mb=1", "--iters=3"]
    res = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    matches = [LINE.match(line) for line in res.stdout.splitlines()]
    rows = [dict(f.split("=", 1) for f in m["fields"].split()) for m in matches if m]
    assert sorted(r["rank"] for r in rows) == ["0", "1"], res.stdout + res.stderr[-2000:]
    for r in rows:
        assert r["ok"] == "1"
        assert r["backend"] == "gloo"
        assert r["world_size"] == "2"
        assert int(r["bytes"]) == 2**20
        algbw, busbw = float(r["algbw_GBps"]), float(r["busbw_GBps"])
        assert algbw > 0
        assert busbw == pytest.approx(allreduce.bus_bandwidth(algbw, 2), abs=0.002)
    assert [p.name for p in tmp_path.iterdir()] == []
