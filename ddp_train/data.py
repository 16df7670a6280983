"""Datasets (synthetic tasks, memory-mapped uint16 token files, plug-ins) and resumable per-rank batches."""

from __future__ import annotations

import functools
import json
import logging
import mmap
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import warnings
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ddp_train import stackdump, storage, workerproc
from ddp_train.config import Config, ConfigError
from ddp_train.plugins import call_plugin


class SyntheticClassification(Dataset):
    """x ~ N(0, I); label = argmax of a fixed random 2-layer teacher network. Learnable, deterministic."""

    def __init__(self, num_samples: int, in_dim: int, n_classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_dim, generator=g)
        self.w1 = torch.randn(in_dim, 4 * n_classes, generator=g) / in_dim**0.5
        self.w2 = torch.randn(4 * n_classes, n_classes, generator=g)
        self.y = self.label(self.x)

    def label(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher's labels for inputs x."""
        return (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)

    def held_out(self, num_samples: int, seed: int) -> SyntheticClassification:
        """Fresh inputs (own seed) labelled by the same teacher: a validation split of the same task."""
        val = object.__new__(SyntheticClassification)
        g = torch.Generator().manual_seed(seed)
        val.x = torch.randn(num_samples, self.x.shape[1], generator=g)
        val.w1, val.w2 = self.w1, self.w2
        val.y = self.label(val.x)
        return val

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def markov_tokens(
    num_seqs: int, length: int, vocab_size: int, seed: int, sample_seed: int | None = None
) -> torch.Tensor:
    """`num_seqs` sequences from a fixed sparse Markov chain: each token has <= 4 successors (p .7/.1/.1/.1).

    The best possible loss is the chain's entropy (~0.94 nats) against ln(vocab_size) at init. The chain
    comes from `seed`; with `sample_seed` the sequences are drawn from their own stream (a val split).
    """
    g = torch.Generator().manual_seed(seed)
    k = min(4, vocab_size)
    succ = torch.randint(vocab_size, (vocab_size, k), generator=g)
    if sample_seed is not None:
        g = torch.Generator().manual_seed(sample_seed)
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

    def __init__(
        self,
        path: str,
        block_size: int,
        vocab_size: int,
        dtype: str = "uint16",
        field: str = "data.tokens.path",
    ) -> None:
        self.path, self.block_size, self.vocab_size, self.field = str(path), block_size, vocab_size, field
        self.dtype = _DTYPES[dtype]
        width = self.dtype.itemsize
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise ConfigError(self.path, field, f"cannot open: {exc.strerror or exc}") from None
        if size % width:
            odd = "odd" if width == 2 else f"not a multiple of {width}"
            raise ConfigError(self.path, field, f"size {size} is {odd}; not a {dtype} token file")
        self.num_tokens = size // width
        if self.num_tokens < block_size + 1:
            raise ConfigError(
                self.path,
                field,
                f"{self.num_tokens} tokens, fewer than block_size + 1 ({block_size + 1})",
            )
        self._tokens: torch.Tensor | None = None
        self._map: mmap.mmap | None = None

    def _open(self) -> torch.Tensor:
        """Map the file (in each process, DataLoader workers included); a file gone or shrunk since the
        size check is a ConfigError naming it, like every other bad token file."""
        try:
            with open(self.path, "rb") as f:
                # ACCESS_READ: shared read-only pages, the page cache's own. A private writable map
                # (ACCESS_COPY) is charged to every rank and worker as if written, so a strict overcommit
                # (vm.overcommit_memory=2) refuses it with ENOMEM for a large file.
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():
                # torch.frombuffer of a read-only buffer warns once that the tensor is writable anyway
                # (torch 2.13 csrc/utils/tensor_new.cpp, "The given buffer is not writable"); this
                # tensor is only ever sliced and copied by .to(int64) in __getitem__, never written.
                warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
                self._tokens = torch.frombuffer(self._map, dtype=self.dtype, count=self.num_tokens)
        except OSError as exc:
            raise ConfigError(self.path, self.field, f"cannot open: {exc.strerror or exc}") from None
        except ValueError:
            raise ConfigError(
                self.path, self.field, f"shorter than the {self.num_tokens} tokens it had at start"
            ) from None
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


_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
VAL_SEED_OFFSET = 1_000_003  # the synthetic val split's own sample stream: seed + this


@dataclass
class TokenSource:
    """Where token data lives: a prepared directory (with its meta.json) or a raw uint16 file."""

    train: Path
    val: Path | None
    dtype: str
    meta: dict[str, Any] | None
    meta_path: Path | None


def token_source(cfg: Config) -> TokenSource:
    """Resolve data.tokens: a directory must hold meta.json (written by `ddp-train prepare`)."""
    path = Path(cfg.data.tokens.path or "").expanduser()
    val = Path(cfg.data.tokens.val_path).expanduser() if cfg.data.tokens.val_path else None
    if not path.is_dir():
        return TokenSource(path, val, "uint16", None, None)
    meta_path = path / "meta.json"
    meta = read_meta(meta_path)
    return TokenSource(path / "train.bin", val or path / "val.bin", meta["dtype"], meta, meta_path)


def read_meta(meta_path: Path) -> dict[str, Any]:
    """A prepared directory's meta.json, checked for the fields the trainer uses."""
    where = str(meta_path)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            where, "data.tokens.path", "no meta.json: prepare the directory with `ddp-train prepare`"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(where, None, f"unreadable meta.json ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise ConfigError(where, None, "not a JSON object")
    if meta.get("dtype") not in _DTYPES:
        raise ConfigError(where, "dtype", f"{meta.get('dtype')!r} is not one of {', '.join(_DTYPES)}")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 2:
        raise ConfigError(where, "vocab_size", f"{vocab!r} is not an integer >= 2")
    return meta


def resolve_vocab(cfg: Config) -> None:
    """Before the model is built: take model.gpt.vocab_size from meta.json ('auto') or check it fits."""
    gpt = cfg.model.gpt
    uses_tokens = cfg.data.name == "tokens" and cfg.model.name == "gpt"
    src = token_source(cfg) if uses_tokens else None
    meta = src.meta if src else None
    if gpt.vocab_size == "auto":
        if meta is None:
            raise ConfigError(
                "config", "model.gpt.vocab_size", "'auto' needs data.tokens.path to be a prepared directory"
            )
        gpt.vocab_size = int(meta["vocab_size"])
        return
    if meta is not None and int(gpt.vocab_size) > meta["vocab_size"]:
        logging.getLogger("ddp_train").warning(
            "model.gpt.vocab_size %s > %s's vocab_size %s: fine as padding (gpt2's 50304 for 50257), "
            "wasted rows otherwise",
            gpt.vocab_size,
            src.meta_path,
            meta["vocab_size"],
        )
    if meta is not None and int(gpt.vocab_size) < meta["vocab_size"]:
        need, kind = meta["vocab_size"], meta.get("tokenizer", {}).get("kind", "?")
        raise ConfigError(
            str(src.meta_path),
            "vocab_size",
            f"{need} (tokenizer {kind}) does not fit model.gpt.vocab_size {gpt.vocab_size} of the config; "
            f"set it to 'auto' or >= {need}",
        )


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
        src = token_source(cfg)
        return TokenFile(str(src.train), cfg.model.gpt.block_size, int(vocab), src.dtype)
    dataset = call_plugin("data.plugin", cfg.data.plugin or "", cfg.data.plugin_args)
    if not (isinstance(dataset, Sized) and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            "config",
            "data.plugin",
            f"{cfg.data.plugin} returned {type(dataset).__name__}, not a map-style Dataset",
        )
    return dataset


def build_val_dataset(cfg: Config, train: Dataset) -> Dataset | None:
    """The validation split matching cfg.data (None: the data has none, e.g. a raw .bin without val_path)."""
    name, n_val = cfg.data.name, cfg.data.synthetic.val_samples
    if name == "synthetic" and n_val == 0:
        return None
    if name == "synthetic" and cfg.model.name == "gpt":
        gpt = cfg.model.gpt
        seed = cfg.seed + VAL_SEED_OFFSET
        return TokenSequences(markov_tokens(n_val, gpt.block_size + 1, gpt.vocab_size, cfg.seed, seed))
    if name == "synthetic":
        assert isinstance(train, SyntheticClassification)
        return train.held_out(n_val, cfg.seed + VAL_SEED_OFFSET)
    if name == "tokens":
        src = token_source(cfg)
        if src.val is None:
            return None
        vocab = int(cfg.model.gpt.vocab_size) if cfg.model.name == "gpt" else 65536
        field = "data.tokens.val_path" if cfg.data.tokens.val_path else "data.tokens.path"
        return TokenFile(str(src.val), cfg.model.gpt.block_size, vocab, src.dtype, field)
    return None  # plug-in data: no val split


class ResumableBatchSampler:
    """Endless batches of one rank's shard, epoch after epoch, starting at any (epoch, position).

    Epoch e's order is DistributedSampler's with shuffle and drop_last (torch/utils/data/distributed.py):
    randperm(len) from a generator seeded with seed + e, cut to a multiple of the world size, every
    world_size-th index from `rank` on; only whole batches are used. The order stays a tensor: no
    Python list of the epoch (~9M ints per rank on OpenWebText), only one batch's ints at a time.
    Iterated in the training process by the DataLoader, which may run ahead of the batches consumed;
    the consumed position is kept by ShardedBatches.
    """

    def __init__(self, num_items: int, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        self.num_items, self.batch_size, self.rank, self.world_size = num_items, batch_size, rank, world_size
        self.seed = seed
        self.per_rank = num_items // world_size  # DistributedSampler's num_samples with drop_last
        self.batches_per_epoch = self.per_rank // batch_size
        self.start = (0, 0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """This rank's sample indices of `epoch`, in order (whole batches only), as an int64 tensor."""
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        perm = torch.randperm(self.num_items, generator=g)
        mine = perm[: self.per_rank * self.world_size][self.rank :: self.world_size]
        return mine[: self.batches_per_epoch * self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, position = self.start
        while True:
            order = self.epoch_order(epoch)
            for b in range(position, self.batches_per_epoch):
                yield order[b * self.batch_size : (b + 1) * self.batch_size].tolist()
            epoch, position = epoch + 1, 0


@dataclass
class _LoadFailure:
    """A ConfigError raised while loading a batch, carried as data across the worker boundary.

    The DataLoader re-raises a worker's exception by calling its class with one string (the formatted
    traceback); ConfigError takes three arguments, so it would turn into a RuntimeError traceback
    (torch/utils/_utils.py ExceptionWrapper.reraise). As data it reaches ShardedBatches.next intact.
    """

    source: str
    field: str | None
    message: str


class _Guarded(Dataset):
    """`dataset` whose ConfigErrors become a _LoadFailure batch (see _collate)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitems__(self, indices: list[int]) -> Any:
        try:
            batched = getattr(self.dataset, "__getitems__", None)  # a plug-in's own batched read
            return batched(indices) if batched else [self.dataset[i] for i in indices]
        except ConfigError as exc:
            return _LoadFailure(exc.source, exc.field, exc.message)


def _collate(items: Any) -> Any:
    return items if isinstance(items, _LoadFailure) else default_collate(items)


def worker_start_method(device: torch.device, dataset: Dataset | None = None) -> str | None:
    """How DataLoader workers start: `forkserver` once CUDA and NCCL are up in this process (torch 2.13
    nn/parallel/distributed.py, DDP's warning: "NCCL2 [is] not fork safe ... likely experience
    deadlocks"), so workers are started by a clean server process and receive the dataset pickled
    (TokenFile pickles without its map and maps the file itself). On CPU the default fork: no CUDA,
    no NCCL, and no server process to import torch again. A data.plugin dataset that cannot be
    pickled (a class defined in a function, a lambda, an open file) keeps fork, with a warning."""
    if device.type != "cuda":
        return None
    if dataset is not None and not isinstance(dataset, (TokenFile, TokenSequences, SyntheticClassification)):
        try:
            pickle.dumps(dataset)
        except Exception as exc:  # pickle raises PicklingError, AttributeError, TypeError, ...
            logging.getLogger("ddp_train").warning(
                "data.plugin's dataset cannot be pickled (%s: %s): its DataLoader workers are fork()ed, "
                "which NCCL does not support; make it picklable to start them from a forkserver",
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return None
    return "forkserver"


def _worker_init(rank_pid: int, _worker_id: int) -> None:
    """A DataLoader worker leaves a stop to its rank (workerproc.py). torch's workers keep the default
    actions (torch 2.13 utils/data/_utils/signal_handling.py handles SIGSEGV/SIGBUS/SIGFPE only): a stop
    killed them mid-step and the rank failed with "DataLoader worker (pid N) is killed by signal:
    Terminated" before it could save. The rank ends them itself (ShardedBatches.close). A forked worker
    also leaves the stall watchdog's stack dump to its rank (stackdump.not_in_a_worker), first: lifting
    the stops is the last step of the init, so a worker that no longer holds them is fully set up."""
    stackdump.not_in_a_worker()
    workerproc.leave_stops_to(rank_pid)


class ShardedBatches:
    """This rank's batches from one long-lived DataLoader; resumable mid-epoch, bit-exact.

    State is (epoch, position): the epoch's order comes from seed + epoch (ResumableBatchSampler) and
    `position` batches of it were consumed, so a restored loader continues with exactly the next batch.
    With num_workers > 0 the workers live for the whole run (persistent_workers), each loading
    prefetch_factor batches ahead, pinned in page-locked memory when pin_memory is set.
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
        prefetch_factor: int = 2,
        worker_start: str | None = None,
    ) -> None:
        self.dataset, self.batch_size, self.rank, self.seed = dataset, batch_size, rank, seed
        self.num_workers, self.pin_memory, self.index_log = num_workers, pin_memory, index_log
        self.sampler = ResumableBatchSampler(len(dataset), batch_size, rank, world_size, seed)  # type: ignore[arg-type]
        self.batches_per_epoch = self.sampler.batches_per_epoch
        if self.batches_per_epoch == 0:
            raise ConfigError(
                "config",
                "train.batch_size",
                f"{batch_size} per rank x {world_size} rank(s) needs at least {batch_size * world_size} "
                f"samples; the dataset has {len(dataset)}",  # type: ignore[arg-type]
            )
        # An own generator: a DataLoader otherwise draws its worker base seed from the global RNG, so a
        # loader started at a resume point would shift dropout's random stream against an unbroken run.
        self.loader = DataLoader(
            _Guarded(dataset),
            batch_sampler=self.sampler,
            collate_fn=_collate,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            multiprocessing_context=worker_start if num_workers > 0 else None,
            worker_init_fn=functools.partial(_worker_init, os.getpid()) if num_workers > 0 else None,
            generator=torch.Generator().manual_seed(seed),
        )
        self.worker_start = worker_start
        self.epoch, self.position = 0, 0
        self._it: Iterator[Any] | None = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._it = None  # batches prefetched from the old position are dropped when the loader restarts

    def epoch_indices(self, epoch: int) -> list[int]:
        """The sample indices this rank draws in `epoch`, in order (whole batches only)."""
        return self.sampler.epoch_order(epoch).tolist()

    def _log_epoch(self) -> None:
        if self.index_log is None:
            return
        with (
            storage.guarded("writing the index dump", self.index_log),
            storage.open_output(self.index_log, "a", encoding="utf-8") as f,
        ):
            record = {"rank": self.rank, "epoch": self.epoch, "position": self.position}
            f.write(json.dumps({**record, "indices": self.epoch_indices(self.epoch)}) + "\n")

    def next(self) -> Any:
        """The next batch, moving to the next epoch (new order) when this one is used up."""
        new_epoch = self.position >= self.batches_per_epoch
        if new_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        started = self._it is None
        if started:
            self.sampler.start = (self.epoch, self.position)
            forkserver = self.num_workers > 0 and self.worker_start == "forkserver"
            if forkserver:
                # before the block: starting the resource tracker ends with SIG_UNBLOCK of SIGINT and
                # SIGTERM (CPython 3.11 multiprocessing/resource_tracker.py), which would lift ours
                multiprocessing.resource_tracker.ensure_running()
            with workerproc.stops_held():
                if forkserver:
                    multiprocessing.forkserver.ensure_running()  # its workers inherit the held mask
                self._it = iter(self.loader)  # persistent workers: started once, restarted only after a load
        if started or new_epoch:
            self._log_epoch()
        batch = next(self._it)
        if isinstance(batch, _LoadFailure):
            raise ConfigError(batch.source, batch.field, batch.message)
        self.position += 1
        return batch

    def close(self) -> None:
        """Stop the worker processes (they would otherwise live until the loader is collected)."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)  # torch's own cleanup, also run by its __del__
        if shutdown is not None:
            shutdown()
        # torch ends a worker that did not leave within 5 s with terminate(), a SIGTERM, which ours
        # ignore (_worker_init): one still busy in a slow __getitem__ gets SIGKILL instead
        for worker in getattr(it, "_workers", []):
            if worker.is_alive():
                worker.kill()
                worker.join()


def train_batches(
    cfg: Config, dataset: Dataset, rank: int, world_size: int, device: torch.device, index_log: Path | None
) -> ShardedBatches:
    """This rank's batches of the training set, as `train.batch_size`, `seed` and `data.*` ask."""
    workers = cfg.data.num_workers
    return ShardedBatches(
        dataset,
        cfg.train.batch_size,
        rank,
        world_size,
        cfg.seed,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        index_log=index_log,
        prefetch_factor=cfg.data.prefetch_factor,
        worker_start=worker_start_method(device, dataset) if workers else None,
    )
