"""A small learnable text corpus for the prepare + train tests, and the val-loss bound they assert."""

from __future__ import annotations

import random
from pathlib import Path

SENTENCES = [
    "the cat sat on the mat.",
    "a dog ran to the red house.",
    "my bird sang in the old tree.",
    "the fox hid under a green bush.",
]
# nats per byte: well under the corpus' unigram byte entropy (2.74 nats; ln 256 = 5.55 at init), so a
# model below it uses context; 60 steps of gpt-tiny on 2 CPU ranks reach ~1.3.
VAL_LOSS_BOUND = 1.6


def text_corpus(path: Path, lines: int = 6000, seed: int = 0) -> Path:
    """Sentences drawn from a small set, one per line."""
    rng = random.Random(seed)
    path.write_text("".join(rng.choice(SENTENCES) + "\n" for _ in range(lines)), encoding="utf-8")
    return path
