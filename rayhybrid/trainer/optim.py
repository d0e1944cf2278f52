"""AdamW and the learning-rate schedule (linear warmup, then cosine/linear/constant decay)."""

from __future__ import annotations

import math

import torch

from rayhybrid.config.schema import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based); a pure function of the step, so a
    resumed or resized run follows the same schedule."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=(0.9, 0.95), eps=1e-8)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
