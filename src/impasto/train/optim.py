"""Optimizers and learning-rate schedules, each picked by name from a registry.

The LR schedule is a pure function of the optimizer step (nanoGPT's ``get_lr``), so a resumed
run needs only the step counter to continue the schedule exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from impasto.train.sr_adamw import AdamWBF16

if TYPE_CHECKING:
    from impasto.config.schema import OptimConfig


def adam_options(config: OptimConfig) -> dict[str, Any]:
    """The Adam family's shared settings from the ``optim`` section."""
    return {
        "lr": config.lr,
        "betas": config.betas,
        "eps": config.eps,
        "weight_decay": config.weight_decay,
    }


def build_adamw(params: Iterable, config: OptimConfig) -> torch.optim.Optimizer:
    """Decoupled weight decay Adam (Loshchilov & Hutter, arXiv:1711.05101).

    Fused (one kernel for all tensors) when every parameter is a plain CUDA tensor, foreach
    otherwise (sharded FSDP weights included: the step then sanitises non-finite gradients
    itself instead of passing ``found_inf`` to the kernel).
    """
    groups = _as_groups(params)
    on_cuda = _all_on_cuda(groups) and not _any_sharded(groups)
    return torch.optim.AdamW(
        groups,
        **adam_options(config),
        foreach=not on_cuda,
        fused=on_cuda,
    )


def build_adamw_bf16_sr(params: Iterable, config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with fp32 moments and stochastic rounding into bf16 weights (``sr_adamw``)."""
    return AdamWBF16(
        params,
        **adam_options(config),
    )


def build_adafactor(params: Iterable, config: OptimConfig) -> torch.optim.Optimizer:
    """Adafactor with a fixed LR (Shazeer & Stern, arXiv:1804.04235), no first moment.

    The schedule stays ours (``relative_step=False``) and the update is not scaled by the
    weight's RMS; ``betas`` and ``eps`` do not apply (its eps pair has another meaning).
    """
    from transformers.optimization import Adafactor

    return Adafactor(
        params,
        lr=config.lr,
        weight_decay=config.weight_decay,
        relative_step=False,
        scale_parameter=False,
        warmup_init=False,
    )


def build_adamw_8bit(params: Iterable, config: OptimConfig) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW with block-wise 8-bit moments (Dettmers et al., arXiv:2110.02861)."""
    try:
        import bitsandbytes
    except ImportError:
        raise ValueError(
            "optim.name adamw_8bit needs bitsandbytes: pip install bitsandbytes (or, in the "
            "impasto checkout, pip install -e '.[bnb]')"
        ) from None
    groups = _as_groups(params)
    if not _all_on_cuda(groups):
        raise ValueError("optim.name adamw_8bit needs a CUDA GPU (train.device cuda)")
    return bitsandbytes.optim.AdamW8bit(
        groups,
        **adam_options(config),
    )


def build_prodigy(params: Iterable, config: OptimConfig) -> torch.optim.Optimizer:
    """Prodigy, Adam that estimates its own step size (Mishchenko & Defazio, arXiv:2306.06101).

    ``lr`` multiplies the estimate: use 1.0. Weight decay is decoupled, as in AdamW.
    """
    groups = _as_groups(params)
    lrs = {group["lr"] for group in groups if "lr" in group and group["lr"] != 0}
    if len(lrs) > 1:
        raise ValueError(
            f"optim.name prodigy needs one lr for all parts, got {sorted(lrs)}; unset parts.*_lr"
        )
    try:
        from prodigyopt import Prodigy
    except ImportError:
        raise ValueError(
            "optim.name prodigy needs prodigyopt: pip install prodigyopt (or, in the impasto "
            "checkout, pip install -e '.[prodigy]')"
        ) from None
    return Prodigy(
        groups,
        **adam_options(config),
        decouple=True,
    )


def _as_groups(params: Iterable) -> list[dict[str, Any]]:
    """Param groups as a list of dicts (a plain iterable of tensors becomes one group)."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return items
    return [{"params": items}]


def _all_on_cuda(groups: list[dict[str, Any]]) -> bool:
    params = [param for group in groups for param in group["params"]]
    return bool(params) and all(param.is_cuda for param in params)


def _any_sharded(groups: list[dict[str, Any]]) -> bool:
    return any(hasattr(param, "device_mesh") for group in groups for param in group["params"])


# name → builder(params or param groups, optim config). docs/optimizers.md compares them.
OPTIMIZERS: dict[str, Callable[[Iterable, OptimConfig], torch.optim.Optimizer]] = {
    "adamw": build_adamw,
    "adamw_bf16_sr": build_adamw_bf16_sr,
    "adafactor": build_adafactor,
    "adamw_8bit": build_adamw_8bit,
    "prodigy": build_prodigy,
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


class LRSchedule:
    """The learning rate of every step, a pure function of the step (``lr_multiplier``) applied
    to each param group's base LR. Its state is its settings, recorded in checkpoints; the
    step itself is the train counters' (nanoGPT's ``get_lr(it)``, torchtitan's Stateful
    scheduler)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimConfig, total: int):
        self.optimizer = optimizer
        self.settings = {
            "schedule": config.lr_schedule,
            "warmup_steps": config.warmup_steps,
            "total_steps": total,
            "min_lr_ratio": config.min_lr_ratio,
        }

    def apply(self, step: int) -> float:
        """Set the LR of optimizer step ``step`` (0-based); returns param group 0's."""
        settings = self.settings
        multiplier = lr_multiplier(
            step,
            settings["schedule"],
            settings["warmup_steps"],
            settings["total_steps"],
            settings["min_lr_ratio"],
        )
        return set_lr(self.optimizer, multiplier)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.settings)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: a resumed run follows its config's schedule (a changed one is
        reported with the config's differences)."""
