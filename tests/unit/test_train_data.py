"""Datasets and per-rank batches: synthetic tasks, uint16 token files, DistributedSampler sharding."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
import torch

from ddp_train.config import Config, ConfigError, load_config
from ddp_train.data import (
    ShardedBatches,
    SyntheticClassification,
    TokenFile,
    TokenSequences,
    build_dataset,
    markov_tokens,
)


def write_tokens(path: Path, ids: list[int]) -> Path:
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))  # what nanoGPT's prepare.py writes (np.uint16)
    return path


def test_synthetic_classification_is_deterministic_and_balanced_enough():
    a = SyntheticClassification(512, 16, 4, seed=3)
    b = SyntheticClassification(512, 16, 4, seed=3)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.y, SyntheticClassification(512, 16, 4, seed=4).y)
    counts = torch.bincount(a.y, minlength=4)
    assert (counts > 20).all(), counts  # every class present: the task is not trivial
    x, y = a[7]
    assert x.shape == (16,) and y.dtype == torch.int64


def test_markov_tokens_follow_a_sparse_chain():
    rows = markov_tokens(64, 33, vocab_size=50, seed=0)
    assert rows.shape == (64, 33) and rows.dtype == torch.int64
    assert int(rows.min()) >= 0 and int(rows.max()) < 50
    assert torch.equal(rows, markov_tokens(64, 33, vocab_size=50, seed=0))
    successors: dict[int, set[int]] = {}
    for row in rows.tolist():
        for a, b in zip(row, row[1:]):
            successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4  # learnable: at most 4 next tokens each
    x, y = TokenSequences(rows)[0]
    assert torch.equal(x[1:], y[:-1])


def test_token_file_blocks(tmp_path):
    ids = [(i * 7) % 1000 for i in range(1001)]
    ds = TokenFile(str(write_tokens(tmp_path / "train.bin", ids)), block_size=100, vocab_size=1000)
    assert len(ds) == 10  # (1001 - 1) // 100 non-overlapping blocks
    x, y = ds[3]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == ids[300:400] and y.tolist() == ids[301:401]
    assert ds[9][1].tolist() == ids[901:1001]
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    assert torch.equal(clone[3][0], x)


def test_token_file_high_ids_are_unsigned(tmp_path):
    ds = TokenFile(str(write_tokens(tmp_path / "t.bin", [65535, 40000, 1])), block_size=2, vocab_size=65536)
    assert ds[0][0].tolist() == [65535, 40000]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x00\x02", "is odd"),
        (struct.pack("<3H", 1, 2, 3), r"fewer than block_size \+ 1"),
        (b"", "0 tokens"),
    ],
)
def test_bad_token_files(tmp_path, content, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        TokenFile(str(path), block_size=8, vocab_size=100)


def test_missing_token_file_and_out_of_vocab_ids(tmp_path):
    with pytest.raises(ConfigError, match="cannot open"):
        TokenFile(str(tmp_path / "missing.bin"), 8, 100)
    ds = TokenFile(str(write_tokens(tmp_path / "t.bin", [1, 2, 300, 4, 5])), block_size=4, vocab_size=100)
    with pytest.raises(ConfigError, match="token id 300 >= vocab_size 100"):
        ds[0]


def test_build_dataset_follows_the_model(tmp_path):
    gpt = build_dataset(load_config(None, ["model.name=gpt", "data.synthetic.num_samples=8"]))
    assert isinstance(gpt, TokenSequences) and len(gpt) == 8 and gpt[0][0].shape == (32,)
    assert isinstance(build_dataset(Config()), SyntheticClassification)
    path = write_tokens(tmp_path / "t.bin", list(range(64)) * 4)
    cfg = load_config(None, ["model.name=gpt", "data.name=tokens", f"data.tokens.path={path}"])
    assert isinstance(build_dataset(cfg), TokenFile)


# --- sharding -------------------------------------------------------------------------------------


def shards(n: int = 100, batch: int = 5, world: int = 2, seed: int = 0) -> list[ShardedBatches]:
    ds = SyntheticClassification(n, 4, 3, seed=0)
    return [ShardedBatches(ds, batch, rank, world, seed) for rank in range(world)]


def test_ranks_get_disjoint_shards_covering_the_data_and_a_new_order_each_epoch():
    ranks = shards()
    for epoch in (0, 1, 2):
        a, b = (r.epoch_indices(epoch) for r in ranks)
        assert len(a) == len(b) == 50
        assert not set(a) & set(b)
        assert set(a) | set(b) == set(range(100))
    assert ranks[0].epoch_indices(0) != ranks[0].epoch_indices(1)
    assert ranks[0].epoch_indices(1) == shards()[0].epoch_indices(1)  # deterministic from seed + epoch
    assert shards(seed=1)[0].epoch_indices(0) != ranks[0].epoch_indices(0)


def test_next_walks_epochs_and_uses_set_epoch():
    rank0 = shards()[0]
    ds = rank0.dataset
    seen = [rank0.next() for _ in range(rank0.batches_per_epoch + 1)]
    assert rank0.epoch == 1 and rank0.position == 1
    flat = torch.cat([x for x, _ in seen[:-1]])
    expected = torch.stack([ds[i][0] for i in rank0.epoch_indices(0)])
    assert torch.equal(flat, expected)
    assert torch.equal(seen[-1][0], torch.stack([ds[i][0] for i in rank0.epoch_indices(1)[:5]]))


def test_restored_position_continues_with_exactly_the_next_batch():
    straight = shards()[1]
    batches = [straight.next()[1] for _ in range(13)]  # crosses into epoch 1
    resumed = shards()[1]
    first = shards()[1]
    for _ in range(7):
        first.next()
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"epoch": 0, "position": 7}
    assert all(torch.equal(resumed.next()[1], b) for b in batches[7:])


def test_index_log_records_every_epoch(tmp_path):
    ds = SyntheticClassification(40, 4, 3, seed=0)
    log = tmp_path / "idx.jsonl"
    sb = ShardedBatches(ds, 5, 1, 2, 0, index_log=log)
    for _ in range(6):
        sb.next()
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and '"epoch": 1' in lines[1] and '"rank": 1' in lines[0]


def test_too_small_dataset_is_a_config_error():
    ds = SyntheticClassification(10, 4, 3, seed=0)
    with pytest.raises(ConfigError, match=r"train.batch_size: 8 per rank x 2 rank"):
        ShardedBatches(ds, 8, 0, 2, 0)


def test_loading_batches_never_touches_the_global_rng():
    """A loader (re)created at a resume point must not shift dropout's random stream."""
    before = torch.get_rng_state()
    sb = shards()[0]
    sb.load_state_dict({"epoch": 1, "position": 3})
    for _ in range(sb.batches_per_epoch):
        sb.next()
    assert torch.equal(torch.get_rng_state(), before)


def test_worker_processes_read_the_memory_mapped_file(tmp_path):
    ids = [i % 500 for i in range(2001)]
    ds = TokenFile(str(write_tokens(tmp_path / "t.bin", ids)), block_size=50, vocab_size=500)
    inline = ShardedBatches(ds, 4, 0, 2, seed=1)
    workers = ShardedBatches(ds, 4, 0, 2, seed=1, num_workers=2)
    for _ in range(6):  # crosses an epoch: workers are started again with the new order
        (xa, ya), (xb, yb) = inline.next(), workers.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
