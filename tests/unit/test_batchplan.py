"""The global batch kept for any world size (ddp_train/batchplan.py), and the data order it promises on a
resume at another world size, checked against the trainer's own sampler."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_train.batchplan import (
    MAX_ACCUM,
    BatchError,
    apply,
    resume_position,
    resumed_data,
    split,
)
from ddp_train.data import ResumableBatchSampler


@pytest.mark.parametrize(
    ("world", "per_rank", "accum"),
    [(4, 12, 1), (3, 8, 2), (2, 12, 2), (1, 12, 4), (6, 8, 1), (8, 6, 1), (16, 3, 1)],
)
def test_48_sequences_with_batch_size_12(world: int, per_rank: int, accum: int) -> None:
    s = split(48, world, 12)
    assert (s.per_rank, s.accum) == (per_rank, accum)
    assert s.per_rank * s.world * s.accum == 48


@given(g=st.integers(1, 5000), w=st.integers(1, 64), b=st.integers(1, 512))
def test_a_split_is_exact_never_grows_the_batch_and_shrinks_it_least(g: int, w: int, b: int) -> None:
    try:
        s = split(g, w, b)
    except BatchError as e:
        assert g % w != 0 or g // w > MAX_ACCUM  # refused only when not whole, or accum past its maximum
        assert "\n" not in str(e)
        return
    assert s.per_rank * w * s.accum == g and s.per_rank <= b
    each = g // w
    assert not [d for d in range(s.per_rank + 1, min(each, b) + 1) if each % d == 0]


def test_a_refusal_is_one_line_naming_the_world_sizes_that_keep_it() -> None:
    with pytest.raises(BatchError) as e:
        split(512, 24, 16)
    assert str(e.value) == (
        "global batch 512 cannot be split evenly over 24 ranks (512/24 is not whole); world sizes that keep "
        "it: 1, 2, 4, 8, 16, 32, 64, ..."
    )
    with pytest.raises(BatchError, match=r"needs 4099 micro-batches of 1 a step \(at most 4096\)"):
        split(4099 * 2, 2, 8)  # 4099 is prime: only micro-batches of 1 make it


def test_a_prime_share_of_a_rank_is_made_of_micro_batches_of_one() -> None:
    s = split(13 * 4, 4, 8)
    assert (s.per_rank, s.accum) == (1, 13)


def _consumed(num: int, world: int, per_rank: int, seed: int, start: int, micro: int) -> list[int]:
    """Every rank's sample indices of epoch 0, `micro` micro-batches from `start`, in global step order."""
    out: list[int] = []
    samplers = [ResumableBatchSampler(num, per_rank, r, world, seed) for r in range(world)]
    orders = [s.epoch_order(0) for s in samplers]
    for m in range(start, start + micro):
        for order in orders:
            out.extend(order[m * per_rank : (m + 1) * per_rank].tolist())
    return out


@pytest.mark.parametrize(("old", "new"), [((4, 12), (3, 12)), ((3, 12), (2, 12)), ((2, 12), (4, 12))])
def test_a_resume_at_another_world_size_goes_on_with_the_next_sequences_of_the_epoch(old, new) -> None:
    """Kept global batch, translated position: the sequences after the resume are exactly those an
    unbroken run would have reached next (as a set per step: the order within a step is the ranks')."""
    num, seed, g = 4800, 7, 48
    a, b = split(g, old[0], old[1]), split(g, new[0], new[1])
    steps_before, steps_after = 5, 4
    before = _consumed(num, a.world, a.per_rank, seed, 0, steps_before * a.accum)
    position = resume_position(steps_before * a.accum, a.accum, b.accum)
    after = _consumed(num, b.world, b.per_rank, seed, position, steps_after * b.accum)
    order = ResumableBatchSampler(num, 1, 0, 1, seed).epoch_order(0).tolist()  # the epoch's permutation
    assert sorted(before) == sorted(order[: steps_before * g])
    for k in range(steps_after):  # step by step: the same sequences as the straight permutation
        got = after[k * g : (k + 1) * g]
        assert sorted(got) == sorted(order[(steps_before + k) * g : (steps_before + k + 1) * g])


def test_a_partial_step_at_the_epochs_start_is_rounded_down() -> None:
    assert resume_position(6, 3, 2) == 4
    assert resume_position(7, 3, 2) == 4  # 4.67 -> 4: a few sequences seen again, none skipped
    with pytest.raises(BatchError):
        resume_position(-1, 1, 1)


def test_apply_sets_the_train_section_and_says_so_only_when_it_changed() -> None:
    from ddp_train.config import OptimConfig

    t = OptimConfig(batch_size=12, grad_accum_steps=1, global_batch=48)
    assert apply(t, 4) is None and (t.batch_size, t.grad_accum_steps) == (12, 1)
    said = apply(t, 3)
    assert said == "global batch 48 kept on 3 rank(s): batch_size 8 x grad_accum_steps 2 (configured 12 x 1)"
    assert (t.batch_size, t.grad_accum_steps) == (8, 2)


def test_resumed_data_moves_the_position_for_the_same_global_batch_and_warns_for_another() -> None:
    data = {"epoch": 3, "position": 10}
    assert resumed_data(data, (12, 4, 1), (12, 4, 1)) == (data, None, False)
    assert resumed_data(data, None, (12, 4, 1)) == (data, None, False)  # an old checkpoint
    moved, said, warn = resumed_data(data, (12, 4, 1), (8, 3, 2))
    assert moved == {"epoch": 3, "position": 20} and not warn
    assert said == (
        "global batch 48 kept: 12 x 4 rank(s) x 1 now 8 x 3 x 2; the epoch goes on 480 sequences in, where "
        "it stopped"
    )
    same, said, warn = resumed_data(data, (12, 4, 1), (12, 3, 1))
    assert same == data and warn
    assert said.startswith("global batch 48 (12 x 4 rank(s) x 1) now 36 (12 x 3 x 1): steps, learning rate")
    assert said.endswith("train.global_batch: 48 keeps it")
