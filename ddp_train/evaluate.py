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
from ddp_train.config import Config
from ddp_train.distributed import DistEnv


class Evaluator:
    """Rank r evaluates samples r, r + world, r + 2 world, ... up to `batches` batches of `batch_size`,
    every `interval_steps` steps and after the last one."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        batches: int,
        rank: int,
        world_size: int,
        device: torch.device,
        interval_steps: int = 0,
    ) -> None:
        self.dataset, self.device, self.interval_steps = dataset, device, interval_steps
        indices = list(range(rank, len(dataset), world_size))[: batches * batch_size]  # type: ignore[arg-type]
        self.batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]

    @classmethod
    def from_config(cls, cfg: Config, dataset: Dataset, env: DistEnv, device: torch.device) -> Evaluator:
        """The run's evaluator (`eval.*`) over the val split `dataset`."""
        e = cfg.eval
        return cls(
            dataset, cfg.train.batch_size, e.batches, env.rank, env.world_size, device, e.interval_steps
        )

    def due(self, step: int, last: bool) -> bool:
        """Whether `step` (`last`: the run's last step) ends with a validation."""
        return bool(self.interval_steps) and (step % self.interval_steps == 0 or last)

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


class BestValLoss:
    """The lowest finite validation loss so far and its step, checkpointed as {"val_loss", "step"}
    (both None before the first validation)."""

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        state = state or {}
        self.val_loss: float | None = state.get("val_loss")
        self.step: int | None = state.get("step")

    def update(self, loss: float, step: int) -> bool:
        """Keep `loss` of `step` when it is finite and lower than the best; whether it was kept."""
        if not math.isfinite(loss) or (self.val_loss is not None and loss >= self.val_loss):
            return False
        self.val_loss, self.step = loss, step
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"val_loss": self.val_loss, "step": self.step}


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
