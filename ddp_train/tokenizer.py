"""Tokenizers for `ddp-train prepare`: byte-level (built in), a BPE trained on the corpus, or a named file.

The BPE and file tokenizers use Hugging Face `tokenizers` (the optional extra `ddp-train[bpe]`). Nothing
is ever fetched from a hub: a tokenizer is either built here or read from a file on disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ddp_train.config import ConfigError
from ddp_train.digest import file_sha256
from ddp_train.text import install_hint

BYTE_VOCAB = 256
BPE_FILE = "tokenizer.json"
SPECIALS = ("<|endoftext|>",)


class Tokenizer(Protocol):
    """What prepare needs: a vocabulary size, text -> ids, ids -> text, and a description for meta.json."""

    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: no training, no file, exact round trip."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"kind": "byte"}


def _hf() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(
            "prepare",
            "--tokenizer",
            f"BPE and tokenizer files need Hugging Face tokenizers: {install_hint('tokenizers', 'bpe')}",
        ) from None
    return tokenizers


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from (or saved to) a tokenizer.json file."""

    def __init__(self, tok: Any, path: Path, kind: str) -> None:
        self.tok, self.path, self.kind = tok, path, kind
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "file": self.path.name, "sha256": file_sha256(self.path)}


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style: exact round trip, no unknown tokens) and save it to `out`."""
    tk = _hf()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return HFTokenizer(tok, out, "bpe")


def load_file(path: str | Path, kind: str = "file") -> HFTokenizer:
    """A tokenizer.json the user names; a missing one is refused with how to provide it (no download)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            str(path),
            "--tokenizer",
            "no such tokenizer file; nothing is downloaded: save one where a hub is reachable with "
            "`tokenizers.Tokenizer.from_pretrained(NAME).save('tokenizer.json')`, copy it here and pass "
            "its path (or use --tokenizer byte or bpe)",
        )
    tk = _hf()
    try:
        tok = tk.Tokenizer.from_file(str(p))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception for bad files
        raise ConfigError(str(p), "--tokenizer", f"not a tokenizers JSON file ({_first_line(exc)})") from None
    return HFTokenizer(tok, p.resolve(), kind)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(exc).__name__
