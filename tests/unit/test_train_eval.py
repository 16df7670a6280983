"""Validation in the trainer: per-rank slices, val loss on prepared data, best.pt, resume, vocab checks."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_train import checkpoint
from ddp_train.__main__ import main as ddp_train_main
from ddp_train.config import load_config
from ddp_train.data import SyntheticClassification, TokenSequences
from ddp_train.evaluate import BestValLoss, Evaluator
from ddp_train.prepare import prepare
from ddp_train.trainer import run
from tests.integration.corpus import VAL_LOSS_BOUND, text_corpus

FINAL_SHA = re.compile(r"params_sha256=([0-9a-f]{16})")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    prepare([str(text_corpus(root / "corpus.txt"))], root / "data", workers=1)
    return root / "data"


def train(tmp_path: Path, *overrides: str) -> int:
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", *overrides])
    return run(cfg)


def records(tmp_path: Path, name: str = "default") -> list[dict]:
    path = tmp_path / "runs" / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


class MeanOfInputs(nn.Module):
    """loss = mean of x: the evaluator's weighting can be checked by hand. Dropout shows eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.drop(x).mean()


def test_evaluator_slices_are_disjoint_fixed_and_leave_rng_and_mode_alone():
    ds = TokenSequences(torch.arange(30, dtype=torch.float32).view(10, 3))  # 10 items, x = 2 values
    slices = [Evaluator(ds, 2, 2, r, 3, torch.device("cpu")).batches for r in range(3)]
    flat = [sorted(i for b in s for i in b) for s in slices]
    assert flat == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]  # rank r: r, r + world, ... disjoint
    model = MeanOfInputs().train()
    ev = Evaluator(ds, 2, 2, 0, 3, torch.device("cpu"))
    before = torch.get_rng_state()
    loss = ev.evaluate(model)
    assert torch.equal(before, torch.get_rng_state())  # no dropout mask drawn: eval mode, no RNG
    assert model.training
    expected = sum(float(ds[i][0].mean()) for i in (0, 3, 6, 9)) / 4
    assert loss == pytest.approx(expected)
    assert ev.evaluate(model) == loss  # the same slice every time


def test_the_best_val_loss_keeps_only_a_finite_lower_loss_and_round_trips():
    best = BestValLoss()
    assert best.state_dict() == {"val_loss": None, "step": None}
    assert not best.update(math.nan, 1) and best.step is None  # a NaN never becomes the best
    assert best.update(2.5, 2) and best.update(2.0, 4)
    assert not best.update(2.0, 6) and not best.update(math.inf, 8)  # equal is not better
    assert best.state_dict() == {"val_loss": 2.0, "step": 4}
    again = BestValLoss(best.state_dict())
    assert (again.val_loss, again.step) == (2.0, 4) and not again.update(3.0, 10)
    assert BestValLoss(None).state_dict() == {"val_loss": None, "step": None}  # a checkpoint's "best": None


def test_synthetic_val_split_is_new_samples_of_the_same_task():
    train = SyntheticClassification(64, 8, 4, seed=1)
    val = train.held_out(32, seed=2)
    assert not any(torch.equal(v, t) for v in val.x for t in train.x)
    assert torch.equal(val.y, train.label(val.x))  # the same teacher labels them
    again = SyntheticClassification(64, 8, 4, seed=1)
    assert torch.equal(again.x, train.x) and torch.equal(again.y, train.y)


@pytest.mark.slow
def test_default_demo_logs_train_and_val_curves(tmp_path, capsys):
    assert train(tmp_path) == 0
    recs = records(tmp_path)
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [10, 20, 30, 40]
    assert val[-1]["val_loss"] < val[0]["val_loss"] < math.log(8) + 0.2
    assert "val_ppl" not in val[0]  # classification: no perplexity
    err = capsys.readouterr().err
    assert re.search(r"step 40/40 loss \S+ val_loss \S+ lr", err), err


@pytest.mark.slow
def test_gpt_on_prepared_bytes_reaches_the_val_bound(tmp_path, prepared, capsys):
    code = train(
        tmp_path,
        "model.name=gpt",
        "model.gpt.vocab_size=auto",
        "data.name=tokens",
        f"data.tokens.path={prepared}",
        "train.max_steps=60",
        "train.batch_size=16",
        "train.lr=0.003",
        "eval.interval_steps=20",
        "log.interval_steps=20",
    )
    assert code == 0, capsys.readouterr().err
    val = [r for r in records(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in val] == [20, 40, 60]
    assert val[0]["val_loss"] < math.log(256)
    assert val[-1]["val_loss"] < VAL_LOSS_BOUND
    assert val[-1]["val_ppl"] == pytest.approx(math.exp(val[-1]["val_loss"]), rel=1e-4)
    saved = torch.load(tmp_path / "runs" / "default" / "best.pt", weights_only=True)
    assert saved["config"]["model"]["gpt"]["vocab_size"] == 256  # 'auto' took meta.json's


def test_vocab_smaller_than_the_data_is_refused_before_the_first_step(tmp_path, prepared, capsys):
    code = train(
        tmp_path,
        "model.name=gpt",
        "model.gpt.vocab_size=100",
        "data.name=tokens",
        f"data.tokens.path={prepared}",
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        f"ddp-train: error: {prepared}/meta.json: vocab_size: 256 (tokenizer byte) does not fit "
        "model.gpt.vocab_size 100 of the config; set it to 'auto' or >= 256"
    )
    assert not (tmp_path / "runs" / "default" / "metrics.jsonl").exists()  # not a single step


def test_a_padded_vocab_trains_with_a_warning(tmp_path, prepared, capsys):
    sets = ["model.name=gpt", "data.name=tokens", f"data.tokens.path={prepared}", "train.max_steps=2"]
    assert train(tmp_path, *sets, "model.gpt.vocab_size=320") == 0
    assert "model.gpt.vocab_size 320 > " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.gpt.vocab_size=auto"], "'auto' needs data.name 'tokens'"),
        (["model.gpt.vocab_size=big"], "model.gpt.vocab_size"),
    ],
)
def test_vocab_auto_needs_prepared_data(tmp_path, capsys, overrides, expected):
    args = [f"run.dir={tmp_path}", "model.name=gpt", *overrides]
    assert ddp_train_main([x for a in args for x in ("--set", a)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and expected in err, err


def test_vocab_auto_with_a_raw_bin_names_the_field(tmp_path, capsys):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(bytes(range(200)))
    code = train(
        tmp_path, "model.name=gpt", "model.gpt.vocab_size=auto", "data.name=tokens", f"data.tokens.path={raw}"
    )
    err = capsys.readouterr().err
    assert code == 2 and "model.gpt.vocab_size: 'auto' needs data.tokens.path to be a prepared" in err


# An MLP that overfits 64 samples: its val loss falls, then rises, so the best step is not the last.
OVERFIT = (
    "data.synthetic.num_samples=64",
    "data.synthetic.val_samples=256",
    "train.batch_size=32",
    "model.mlp.hidden_dim=256",
    "train.lr=0.01",
    "train.min_lr=0.01",
    "train.decay_steps=50",
    "eval.interval_steps=5",
    "eval.batches=8",
    "checkpoint.interval_steps=5",
    "checkpoint.keep_latest_k=1",
    "log.interval_steps=5",
)


def _best(recs: list[dict]) -> tuple[int, float]:
    val = [(r["val_loss"], r["step"]) for r in recs if "val_loss" in r]
    loss, step = min(val)
    return step, loss


@pytest.mark.slow
def test_best_checkpoint_survives_rotation_and_resume_restores_the_best(tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, *OVERFIT, "train.max_steps=50") == 0
    out_straight = capsys.readouterr().out
    recs = records(straight)
    best_step, best_loss = _best(recs)
    assert 5 <= best_step <= 30 and recs[-1]["val_loss"] > best_loss + 0.05, "no overfitting to test with"
    ckpts = straight / "runs" / "default" / "checkpoints"
    assert [p.name for p in ckpts.iterdir()] == ["step-00000050.pt"]  # rotation ran (keep_latest_k=1)
    best_pt = straight / "runs" / "default" / "best.pt"
    best = torch.load(best_pt, weights_only=True)
    # evaluated at a checkpoint step: best.pt was a hard link to that step's checkpoint (no second
    # write), and outlived its rotation as the one name left of that file
    assert best["format"] == checkpoint.FORMAT and best_pt.stat().st_nlink == 1
    assert best["step"] == best_step and best["best"]["step"] == best_step
    assert best["best"]["val_loss"] == pytest.approx(best_loss, abs=1e-6)
    assert recs[-1]["best_val_loss"] == pytest.approx(best_loss, abs=1e-6)

    # stop after the best step, resume: the resumed run must not forget it (its later evals are worse)
    stop_at = best_step + 10
    assert train(split, *OVERFIT, f"train.max_steps={stop_at}") == 0
    assert train(split, *OVERFIT, "train.max_steps=50") == 0
    out = capsys.readouterr().out
    again = torch.load(split / "runs" / "default" / "best.pt", weights_only=True)
    assert again["step"] == best_step and again["best"]["val_loss"] == pytest.approx(best_loss, abs=1e-6)
    assert records(split)[-1]["best_val_loss"] == pytest.approx(best_loss, abs=1e-6)
    # evaluating never moved a random stream or the data order: the resume stays bit-exact
    assert FINAL_SHA.findall(out)[-1] == FINAL_SHA.findall(out_straight)[-1]
