"""Optimizers and learning-rate schedules, each picked by name from a registry.

The LR schedule is a pure function of the optimizer step (nanoGPT's ``get_lr``), so a resumed
run needs only the step counter to continue the schedule exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from impasto.config.schema import OptimConfig


def build_adamw(params: Iterable, config: OptimConfig) -> torch.optim.Optimizer:
    """Decoupled weight decay Adam (Loshchilov & Hutter, arXiv:1711.05101)."""
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=True,
    )


# name → builder(params or param groups, optim config); issue #7 adds bf16 SR AdamW and 8-bit.
OPTIMIZERS: dict[str, Callable[[Iterable, OptimConfig], torch.optim.Optimizer]] = {
    "adamw": build_adamw,
}


def _constant(progress: float, min_ratio: float) -> float:
    return 1.0


def _linear(progress: float, min_ratio: float) -> float:
    return 1.0 - (1.0 - min_ratio) * progress


def _cosine(progress: float, min_ratio: float) -> float:
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# name → decay(progress in [0, 1], min_ratio) → multiplier, applied after warmup.
LR_SCHEDULES: dict[str, Callable[[float, float], float]] = {
    "constant": _constant,
    "linear": _linear,
    "cosine": _cosine,
}


def lr_multiplier(
    step: int, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0
) -> float:
    """The LR multiplier for optimizer step ``step`` (0-based).

    Warmup is linear, (step + 1)/(warmup + 1) as in nanoGPT, so the first step already learns;
    afterwards the named decay runs over the remaining ``total_steps − warmup_steps`` steps.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return LR_SCHEDULES[schedule](progress, min_ratio)


def set_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> float:
    """Scale every param group's base LR (``initial_lr``) by ``multiplier``; return group 0's."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * multiplier
    return optimizer.param_groups[0]["lr"]
