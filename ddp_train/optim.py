"""Optimizer (AdamW or SGD; fused AdamW on CUDA), the warmup + cosine learning-rate schedule and the
mixed-precision setup (autocast, GradScaler)."""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ddp_train.config import ConfigError, OptimConfig

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def mixed_precision(t: OptimConfig, device: torch.device) -> tuple[torch.amp.GradScaler, Any]:
    """(GradScaler, autocast context) of `train.precision`: a scaler for fp16 only (enabled=False
    otherwise), no autocast for fp32, whose matmuls run as TF32 on CUDA (enabled here)."""
    if t.precision == "fp16" and device.type != "cuda":
        raise ConfigError("config", "train.precision", "'fp16' needs CUDA (use bf16 or fp32 on CPU)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    amp = _AMP_DTYPES.get(t.precision)
    return scaler, torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step `step` (0-based).

    Linear warmup lr*(step+1)/warmup_steps, then a cosine from lr down to min_lr at decay_steps
    (default max_steps), min_lr afterwards.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay = cfg.decay_steps if cfg.decay_steps is not None else cfg.max_steps
    if step >= decay:
        return cfg.min_lr
    ratio = (step - cfg.warmup_steps) / max(1, decay - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW/SGD with weight decay on matrices only (not biases, norms); fused AdamW on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    extra = {}
    if device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        extra["fused"] = True
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), **extra)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> LambdaLR:
    """A LambdaLR following lr_at (its state_dict goes into the checkpoint)."""
    return LambdaLR(optimizer, lambda step: lr_at(step, cfg) / cfg.lr)
