"""Datasets (synthetic tasks, memory-mapped uint16 token files, plug-ins) and resumable per-rank batches."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_train.config import Config, ConfigError
from ddp_train.plugins import call_plugin


class SyntheticClassification(Dataset):
    """x ~ N(0, I); label = argmax of a fixed random 2-layer teacher network. Learnable, deterministic."""

    def __init__(self, num_samples: int, in_dim: int, n_classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_dim, generator=g)
        w1 = torch.randn(in_dim, 4 * n_classes, generator=g) / in_dim**0.5
        w2 = torch.randn(4 * n_classes, n_classes, generator=g)
        self.y = (torch.tanh(self.x @ w1) @ w2).argmax(dim=1)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def markov_tokens(num_seqs: int, length: int, vocab_size: int, seed: int) -> torch.Tensor:
    """`num_seqs` sequences from a fixed sparse Markov chain: each token has <= 4 successors (p .7/.1/.1/.1).

    The best possible loss is the chain's entropy (~0.94 nats) against ln(vocab_size) at init.
    """
    g = torch.Generator().manual_seed(seed)
    k = min(4, vocab_size)
    succ = torch.randint(vocab_size, (vocab_size, k), generator=g)
    probs = torch.tensor([0.7, 0.1, 0.1, 0.1][:k])
    cum = (probs / probs.sum()).cumsum(0)
    cum[-1] = 1.0
    out = torch.empty(length, num_seqs, dtype=torch.int64)  # time-major: each step writes one row
    out[0] = torch.randint(vocab_size, (num_seqs,), generator=g)
    for t in range(1, length):
        choice = torch.searchsorted(cum, torch.rand(num_seqs, generator=g)).clamp_(max=k - 1)
        out[t] = succ[out[t - 1], choice]
    return out.t().contiguous()


class TokenSequences(Dataset):
    """Rows of a (n, block_size + 1) token tensor as (inputs, next-token targets)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i]
        return row[:-1], row[1:]


class TokenFile(Dataset):
    """nanoGPT-style token file (raw uint16 ids), memory-mapped and cut into non-overlapping blocks.

    Item i is tokens[i*block_size : (i+1)*block_size + 1] split into inputs and shifted targets. The
    map is opened lazily in each process (DataLoader workers included); pages are shared, never copied.
    """

    def __init__(self, path: str, block_size: int, vocab_size: int) -> None:
        self.path, self.block_size, self.vocab_size = str(path), block_size, vocab_size
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise ConfigError(self.path, "data.tokens.path", f"cannot open: {exc.strerror or exc}") from None
        if size % 2:
            raise ConfigError(self.path, "data.tokens.path", f"size {size} is odd; not a uint16 token file")
        self.num_tokens = size // 2
        if self.num_tokens < block_size + 1:
            raise ConfigError(
                self.path,
                "data.tokens.path",
                f"{self.num_tokens} tokens, fewer than block_size + 1 ({block_size + 1})",
            )
        self._tokens: torch.Tensor | None = None
        self._map: mmap.mmap | None = None

    def _open(self) -> torch.Tensor:
        with open(self.path, "rb") as f:
            # ACCESS_COPY: a writable (copy-on-write) view, so torch.frombuffer needs no copy or warning.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._tokens = torch.frombuffer(self._map, dtype=torch.uint16, count=self.num_tokens)
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokens"] = state["_map"] = None
        return state

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self._tokens if self._tokens is not None else self._open()
        start = i * self.block_size
        chunk = tokens[start : start + self.block_size + 1].to(torch.int64)
        top = int(chunk.max())
        if top >= self.vocab_size:
            raise ConfigError(
                self.path, "model.gpt.vocab_size", f"token id {top} >= vocab_size {self.vocab_size}"
            )
        return chunk[:-1], chunk[1:]


def build_dataset(cfg: Config) -> Dataset:
    """The dataset named by cfg.data, shaped for cfg.model."""
    name = cfg.data.name
    if name == "synthetic" and cfg.model.name == "gpt":
        gpt = cfg.model.gpt
        rows = markov_tokens(cfg.data.synthetic.num_samples, gpt.block_size + 1, gpt.vocab_size, cfg.seed)
        return TokenSequences(rows)
    if name == "synthetic":
        m = cfg.model.mlp
        return SyntheticClassification(cfg.data.synthetic.num_samples, m.in_dim, m.n_classes, cfg.seed)
    if name == "tokens":
        vocab = cfg.model.gpt.vocab_size if cfg.model.name == "gpt" else 65536
        return TokenFile(str(Path(cfg.data.tokens.path or "").expanduser()), cfg.model.gpt.block_size, vocab)
    dataset = call_plugin("data.plugin", cfg.data.plugin or "", cfg.data.plugin_args)
    if not (isinstance(dataset, Sized) and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            "config",
            "data.plugin",
            f"{cfg.data.plugin} returned {type(dataset).__name__}, not a map-style Dataset",
        )
    return dataset


class ShardedBatches:
    """This rank's batches: DistributedSampler shards, `set_epoch` at every epoch, resumable mid-epoch.

    State is (epoch, position): the epoch's permutation comes from seed + epoch and `position` batches
    of it were consumed, so a restored loader continues with exactly the next batch.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        index_log: Path | None = None,
    ) -> None:
        self.dataset, self.batch_size, self.rank, self.seed = dataset, batch_size, rank, seed
        self.num_workers, self.pin_memory, self.index_log = num_workers, pin_memory, index_log
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError(
                "config",
                "train.batch_size",
                f"{batch_size} per rank x {world_size} rank(s) needs at least {batch_size * world_size} "
                f"samples; the dataset has {len(dataset)}",  # type: ignore[arg-type]
            )
        self.epoch, self.position = 0, 0
        self._it: Iterator[Any] | None = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._it = None

    def epoch_indices(self, epoch: int) -> list[int]:
        """The sample indices this rank draws in `epoch`, in order (whole batches only)."""
        self.sampler.set_epoch(epoch)
        return list(self.sampler)[: self.batches_per_epoch * self.batch_size]

    def _start(self) -> None:
        indices = self.epoch_indices(self.epoch)
        if self.index_log is not None:
            with open(self.index_log, "a", encoding="utf-8") as f:
                record = {
                    "rank": self.rank,
                    "epoch": self.epoch,
                    "position": self.position,
                    "indices": indices,
                }
                f.write(json.dumps(record) + "\n")
        bs = self.batch_size
        batches = [indices[i * bs : (i + 1) * bs] for i in range(self.position, self.batches_per_epoch)]
        # An own generator: a DataLoader otherwise draws its worker base seed from the global RNG, so a
        # loader created at a resume point would shift dropout's random stream against an unbroken run.
        loader = DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(self.seed + self.epoch),
        )
        self._it = iter(loader)

    def next(self) -> Any:
        """The next batch, moving to the next epoch (new permutation) when this one is used up."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self._start()
        assert self._it is not None
        batch = next(self._it)
        self.position += 1
        return batch
