"""A fresh start on request (`ddp-launch --fresh` = checkpoint.resume never) and the GPU-sized config."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import pytest

from ddp_train import batchplan
from ddp_train.checkpoint import Checkpointer, save, when
from ddp_train.config import PACKAGE_DIR, ConfigError, load_config
from ddp_train.launch.cli import main

REPO = Path(__file__).resolve().parents[2]
LOCAL_INV = str(REPO / "inventory" / "local")
GPT2 = PACKAGE_DIR / "configs" / "gpt2-124m.yaml"


def test_the_gpu_config_loads_and_is_sized_as_its_comment_says() -> None:
    cfg = load_config(str(GPT2))
    t, g = cfg.train, cfg.model.gpt
    assert (t.precision, t.compile, t.optimizer) == ("bf16", True, "adamw")
    assert (t.global_batch, t.batch_size, g.block_size) == (512, 64, 1024)
    assert t.global_batch * g.block_size == 524_288  # the comment's tokens a step
    # ... and its table is what the trainer makes of it for each number of ranks (batchplan.py)
    for ranks, batch, accum in ((8, 64, 1), (4, 64, 2), (16, 32, 1), (32, 16, 1)):
        s = batchplan.split(t.global_batch, ranks, t.batch_size)
        assert (s.per_rank, s.accum) == (batch, accum)
    with pytest.raises(batchplan.BatchError, match="over 24 ranks"):
        batchplan.split(t.global_batch, 24, t.batch_size)
    assert 0 < cfg.checkpoint.interval_steps < t.max_steps and cfg.checkpoint.keep_latest_k > 0
    assert cfg.eval.interval_steps >= 100  # each eval stops every rank: not the CPU default of 10
    # the README's cluster command: own tokens with the vocabulary from meta.json
    own = ["data.name=tokens", "data.tokens.path=data/mine", "model.gpt.vocab_size=auto"]
    assert load_config(str(GPT2), own).data.name == "tokens"


def test_readme_points_at_the_gpu_config() -> None:
    readme = (REPO / "README.md").read_text()
    assert "--config train.yaml" not in readme  # a file that does not exist
    assert "--config ddp_train/configs/gpt2-124m.yaml" in readme
    assert "batch_size x ranks x grad_accum_steps" in readme


def test_when_is_a_utc_stamp_and_an_age() -> None:
    assert when(0.0, now=3 * 3600 + 12 * 60 + 5) == "1970-01-01 00:00:00 UTC, 3h12m ago"
    assert when(100.0, now=165.0) == "1970-01-01 00:01:40 UTC, 1m05s ago"


def test_resume_never_refuses_naming_the_directory_and_the_newest_step(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    for step in (10, 20):
        save({"step": step}, d, step)
    old = time.time() - 2 * 3600
    os.utime(d / "step-00000020.pt", (old, old))
    never = Checkpointer(d, rank=0, local_rank=0, resume="never")
    with pytest.raises(ConfigError) as exc:
        never.newest_step()
    line = str(exc.value)
    assert "\n" not in line and line.startswith("config: checkpoint.resume: 'never' (--fresh) but ")
    assert f"{d} already holds 2 checkpoint(s), the newest of step 20 (step-00000020.pt, saved " in line
    assert ", 2h00m ago); use another run.name (or checkpoint.dir), delete that directory" in line
    assert Checkpointer(d, rank=0, local_rank=0).newest_step() == 20  # auto resumes as before
    assert Checkpointer(tmp_path / "none", rank=0, local_rank=0, resume="never").newest_step() is None


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(["--hosts", LOCAL_INV, *argv, "--dry-run"])
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_launcher_fresh_sets_resume_never_last(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _dry_run(["--set", "checkpoint.resume=auto", "--fresh"], capsys)
    assert code == 0, err
    commands = [shlex.split(ln) for ln in out.splitlines() if not ln.startswith("#")]
    assert len(commands) == 2
    for words in commands:
        assert words[-4:] == ["--set", "checkpoint.resume=auto", "--set", "checkpoint.resume=never"]
    code, out, _ = _dry_run([], capsys)
    assert code == 0 and "checkpoint.resume" not in out  # without --fresh: resume, as before


def test_launcher_fresh_is_for_the_packaged_trainer(tmp_path: Path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    code, _, err = _dry_run(["--fresh", str(script)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("ddp-launch: error: --config/--set/--fresh/`-- args` are for the packaged trainer")
