"""Validation loss: fixed, disjoint per-rank slices of the val split, in eval mode, reduced across ranks.

The slices never change between evaluations (no shuffling, no RNG drawn), so evaluating does not move
any random stream: a resumed run stays bit-exact with an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_train import distributed


class Evaluator:
    """Rank r evaluates samples r, r + world, r + 2 world, ... up to `batches` batches of `batch_size`."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        batches: int,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        self.dataset, self.device = dataset, device
        indices = list(range(rank, len(dataset), world_size))[: batches * batch_size]  # type: ignore[arg-type]
        self.batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.dataset[i] for i in indices]
        x = torch.stack([it[0] for it in items]).to(self.device, non_blocking=True)
        y = torch.stack([it[1] for it in items]).to(self.device, non_blocking=True)
        return x, y

    def evaluate(self, model: nn.Module, autocast: Any = None) -> float:
        """Mean loss per sample over every rank's slice (a collective: all ranks must call it)."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)
        try:
            with torch.no_grad():
                for indices in self.batches:
                    x, y = self._batch(indices)
                    with autocast if autocast is not None else contextlib.nullcontext():
                        loss = model(x, y)
                    totals[0] += loss.detach().double() * len(indices)
                    totals[1] += len(indices)
        finally:
            model.train(was_training)
        distributed.all_reduce_sum(totals)
        loss_sum, count = totals.tolist()
        return loss_sum / count if count else float("nan")


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
