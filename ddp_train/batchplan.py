"""The global batch (sequences per optimizer step) kept for any world size: which per-rank micro-batch and
how many micro-batches per step make it, the one line that says why it cannot be made, and where a
resumed epoch goes on at another world size. Pure arithmetic, no torch: the trainer applies it at its
start (`train.global_batch`; `ddp-launch restart` asks for the checkpoint's with 'auto').

The per-rank batch (`train.batch_size`) is what fits in memory; it never grows. It shrinks only when the
global batch per rank is not a multiple of it, to the largest divisor that is not above it, and
`grad_accum_steps` makes up the rest: a global batch of 48 on 4 ranks with batch_size 12 is 12 x 1, on 3
ranks 8 x 2 (16 a rank), on 2 ranks 12 x 2.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_ACCUM = 4096  # train.grad_accum_steps' maximum in the schema


class BatchError(ValueError):
    """The global batch cannot be made exactly on this many ranks; the message is one line."""


@dataclass(frozen=True)
class Split:
    """How `global_batch` sequences a step are made on `world` ranks."""

    global_batch: int
    world: int
    per_rank: int  # train.batch_size: sequences in one micro-batch of one rank
    accum: int  # train.grad_accum_steps


def split(global_batch: int, world: int, max_per_rank: int) -> Split:
    """The Split of `global_batch` over `world` ranks with at most `max_per_rank` a micro-batch; BatchError
    when `global_batch` is not a whole number of sequences a rank, or would need over MAX_ACCUM steps."""
    if global_batch < 1 or world < 1 or max_per_rank < 1:
        raise BatchError(
            f"global batch {global_batch}, {world} rank(s), batch_size {max_per_rank}: each must be >= 1"
        )
    if global_batch % world:
        raise BatchError(
            f"global batch {global_batch} cannot be split evenly over {world} ranks "
            f"({global_batch}/{world} is not whole); world sizes that keep it: {_sizes(global_batch)}"
        )
    each = global_batch // world
    per_rank = max(d for d in range(1, min(each, max_per_rank) + 1) if each % d == 0)
    accum = each // per_rank
    if accum > MAX_ACCUM:
        raise BatchError(
            f"global batch {global_batch} on {world} ranks needs {accum} micro-batches of {per_rank} a step "
            f"(at most {MAX_ACCUM}): raise train.batch_size or lower the global batch"
        )
    return Split(global_batch, world, per_rank, accum)


def resume_position(position: int, old_accum: int, new_accum: int) -> int:
    """The loader position (micro-batches of one rank's shard into the epoch) at which a run with
    `new_accum` micro-batches a step goes on from one saved after `position` micro-batches of `old_accum`
    a step, the global batch being the same: as many sequences of the epoch behind it (the epoch's order
    is one permutation dealt out rank by rank, data.ResumableBatchSampler, so the sequences behind are the
    same ones). A step that straddled the epoch's start leaves a part of a step: rounded down, those few
    sequences are seen again rather than skipped."""
    if old_accum < 1 or new_accum < 1 or position < 0:
        raise BatchError(
            f"loader position {position}, {old_accum} and {new_accum} micro-batches a step: invalid"
        )
    return position * new_accum // old_accum


def _sizes(global_batch: int) -> str:
    sizes = [w for w in range(1, min(global_batch, 64) + 1) if global_batch % w == 0]
    return ", ".join(map(str, sizes)) + (", ..." if global_batch > 64 else "")  # itself, at least


def apply(train, world: int) -> str | None:
    """Set `train.batch_size` and `train.grad_accum_steps` (a config's `train` section) from its
    `global_batch` for `world` ranks; the line to log when they differ from the configured ones, else
    None. BatchError when the world size cannot make it."""
    s = split(train.global_batch, world, train.batch_size)
    said = (train.batch_size, train.grad_accum_steps)
    train.batch_size, train.grad_accum_steps = s.per_rank, s.accum
    if said == (s.per_rank, s.accum):
        return None
    return (
        f"global batch {s.global_batch} kept on {world} rank(s): batch_size {s.per_rank} x grad_accum_steps "
        f"{s.accum} (configured {said[0]} x {said[1]})"
    )


def shape(state: dict) -> tuple | None:
    """(batch_size, world, grad_accum_steps) of the run that saved checkpoint `state`; None for a
    checkpoint that does not say (one saved before these were recorded, or not by the trainer)."""
    train = (state.get("config") or {}).get("train") or {}
    found = (train.get("batch_size"), state.get("world_size"), train.get("grad_accum_steps"))
    return None if None in found else tuple(int(x) for x in found)


def resumed_data(data: dict, then: tuple | None, now: tuple) -> tuple[dict, str | None, bool]:
    """The loader state to resume with, what to log, and whether it is a warning: `then` and `now` are
    (batch_size, world, grad_accum_steps) of the checkpoint's run and of this one. The same global batch
    at another shape moves the position to as many sequences into the epoch; another global batch keeps
    the position and warns that the batch and the data order differ from an unbroken run."""
    if then is None or tuple(then) == tuple(now):
        return data, None, False
    (b0, w0, a0), (b1, w1, a1) = then, now
    g0, g1 = b0 * w0 * a0, b1 * w1 * a1
    if g0 != g1:
        said = (
            f"global batch {g0} ({b0} x {w0} rank(s) x {a0}) now {g1} ({b1} x {w1} x {a1}): steps, "
            f"learning rate and data order differ from an unbroken run; train.global_batch: {g0} keeps it"
        )
        return data, said, True
    moved = {**data, "position": resume_position(int(data["position"]), a0, a1)}
    said = (
        f"global batch {g1} kept: {b0} x {w0} rank(s) x {a0} now {b1} x {w1} x {a1}; the epoch goes on "
        f"{moved['position'] * b1 * w1} sequences in, where it stopped"
    )
    return moved, said, False
