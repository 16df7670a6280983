"""Prepared text on real clusters: ddp-launch on the local inventory and on testbed hosts (SSH, gloo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.test_launch_testbed import launch, make_inventory
from tests.integration.corpus import VAL_LOSS_BOUND, text_corpus
from tests.testbed import Testbed, free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LAUNCH = str(Path(sys.executable).parent / "ddp-launch")
FINAL = re.compile(
    r"^\[(\w+) r(\d)\] ddp-train: final rank=\d+ world=(\d+) step=(\d+) .*params_sha256=(\w+)", re.M
)


def prepared(root: Path) -> Path:
    corpus = text_corpus(root / "corpus.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "ddp_train", "prepare", str(corpus), "--out", str(root / "data")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return root / "data"


def train_args(data: Path, run_dir: Path) -> list[str]:
    sets = {
        "data.name": "tokens", "data.tokens.path": str(data), "model.gpt.vocab_size": "auto",
        "run.dir": str(run_dir), "eval.interval_steps": 20, "log.interval_steps": 20, "train.max_steps": 60,
    }  # fmt: skip
    out = ["--config", str(REPO / "ddp_train" / "configs" / "gpt-tiny.yaml")]
    for k, v in sets.items():
        out += ["--set", f"{k}={v}"]
    return out


def check_run(out: str, run_dir: Path, world: int) -> None:
    finals = FINAL.findall(out)
    assert len(finals) == world and {f[2:4] for f in finals} == {(str(world), "60")}, out
    assert len({f[4] for f in finals}) == 1, "ranks ended with different parameters"
    records = [json.loads(x) for x in (run_dir / "gpt-tiny" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [20, 40, 60] and val[-1]["val_loss"] < VAL_LOSS_BOUND, val


def test_local_inventory_trains_on_prepared_text(tmp_path: Path) -> None:
    data = prepared(tmp_path)
    args = [LAUNCH, "--hosts", str(REPO / "inventory" / "local"), "--master-port", str(free_port())]
    proc = subprocess.run(
        [*args, "--job-id", "pl-local", *train_args(data, tmp_path / "runs")],
        cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_run(proc.stdout, tmp_path / "runs", 2)


@pytest.mark.testbed
def test_testbed_hosts_train_on_prepared_text(testbed: Testbed, tmp_path: Path) -> None:
    data = prepared(tmp_path)  # the hosts share /tmp with this machine: every node reads the same path
    inv = make_inventory(testbed, tmp_path)
    code, out = launch(
        ["--hosts", str(inv), "--job-id", "pl-tb", *train_args(data, tmp_path / "runs")], tmp_path
    )
    assert code == 0, out
    check_run(out, tmp_path / "runs", 3)
