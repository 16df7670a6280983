"""`ddp-train prepare` then the trainer under real torchrun (2 ranks, gloo) on the prepared directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.corpus import VAL_LOSS_BOUND, text_corpus
from tests.integration.trainrun import describe, parse_finals, read_jsonl, run_torchrun, sets

GPT_TINY = str(Path(__file__).resolve().parents[2] / "ddp_train" / "configs" / "gpt-tiny.yaml")


@pytest.mark.slow
def test_prepare_then_torchrun_reaches_the_val_bound(tmp_path: Path) -> None:
    corpus = text_corpus(tmp_path / "corpus.txt")
    prep = subprocess.run(
        [sys.executable, "-m", "ddp_train", "prepare", str(corpus), "--out", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    assert "train" in prep.stdout and (tmp_path / "data" / "meta.json").is_file()
    args = [
        "--config", GPT_TINY,
        *sets(data__name="tokens", data__tokens__path=str(tmp_path / "data"), model__gpt__vocab_size="auto"),
        *sets(run__dir="runs", eval__interval_steps=20, log__interval_steps=20, train__max_steps=60),
    ]  # fmt: skip
    proc = run_torchrun(args, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert len(parse_finals(proc.stdout).shas) == 1
    records = read_jsonl(tmp_path / "runs" / "gpt-tiny" / "metrics.jsonl")
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [20, 40, 60], records
    assert val[-1]["val_loss"] < VAL_LOSS_BOUND, val
    assert "val_loss" in proc.stderr and "best val_loss" in proc.stderr
    assert (tmp_path / "runs" / "gpt-tiny" / "best.pt").is_file()
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["vocab_size"] == 256
