"""The configuration users train with (#42), for the fault tests: the gpt-tiny model, wider (a few MB of
weights, ~5 MB checkpoints with AdamW's moments), on token files made by `ddp-train prepare`, a loader
worker per rank (`num_workers: 1`, as gpt-tiny.yaml says; forked on CPU), checkpoint replicas on (the
default). The demo config (default.yaml: synthetic data, no workers, 21k parameters) never saw a loader
worker die of a stop.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.conftest import REPO_ROOT

CONFIG = REPO_ROOT / "ddp_train" / "configs" / "gpt-tiny.yaml"
WORDS = [
    "the", "node", "rank", "loss", "step", "model", "data", "train", "save", "stop", "resume", "replica",
]  # fmt: skip


def prepared_tokens(root: Path) -> Path:
    """root/tokens: a prepared directory (train.bin, val.bin, meta.json) of ~1 MB of text, made once."""
    out = root / "tokens"
    if (out / "meta.json").exists():
        return out
    from ddp_train.prepare import main as prepare

    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    src = root / "corpus.txt"
    lines = (" ".join(rng.choices(WORDS, k=12)) + ".\n" for _ in range(16000))
    src.write_text("".join(lines), encoding="utf-8")
    assert prepare([str(src), "--out", str(out), "--workers", "1", "--progress", "never"]) == 0
    return out


def trainer_args(tokens: Path, steps: int = 30, workers: int = 1) -> list[str]:
    """`--config` and `--set`s of a users' run of `steps` steps, a checkpoint every 10."""
    return [
        "--config", str(CONFIG),
        "--set", "data.name=tokens", "--set", f"data.tokens.path={tokens}",
        "--set", "model.gpt.vocab_size=auto",
        "--set", f"data.num_workers={workers}",
        "--set", "model.gpt.n_embd=128", "--set", "model.gpt.n_layer=2",
        "--set", f"train.max_steps={steps}", "--set", f"train.decay_steps={steps}",
        "--set", "checkpoint.interval_steps=10", "--set", "log.interval_steps=1",
    ]  # fmt: skip
