"""Rewards: differentiable scores of generated images against their prompts, for reward
fine-tuning (``objective.method: draftp``, docs/draftp.md).

A reward is built from the ``reward`` config section by the builder its ``kind`` names in
:data:`REWARDS`. Built-in kinds register themselves below; a package adds its own either by
calling :func:`register_reward` at import, or through the entry point group
``impasto.rewards`` (``name = "package.module:builder"``), loaded the first time a kind is
looked up. Every reward takes images ``[B, 3, H, W]`` in [0, 1] on its device (any size: its
own preprocessing resizes them, in torch, so gradients flow) and returns ``[B]`` float32.
No reward downloads weights: each reads local files named in the config.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

from impasto.registry import lookup, registrar

if TYPE_CHECKING:
    from impasto.config.draftp import RewardConfig

ENTRY_POINT_GROUP = "impasto.rewards"


@runtime_checkable
class Reward(Protocol):
    """A differentiable reward (see the module docstring)."""

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        """``[B]`` float32 rewards of ``images`` ``[B, 3, H, W]`` in [0, 1] for ``prompts``."""

    def embed(self, images: Tensor) -> Tensor:
        """A fixed embedding ``[B, D]`` of ``images`` (the diversity measure compares images
        in it); rewards without an image model may return the images' downsampled pixels."""


RewardBuilder = Callable[["RewardConfig", torch.device], Reward]

REWARDS: dict[str, RewardBuilder] = {}
"""``reward.kind`` → a builder ``(RewardConfig, device) -> Reward``."""

register_reward = registrar(REWARDS, "reward")
"""Decorator: ``@register_reward("name")`` on a builder ``(RewardConfig, device) -> Reward``."""

_entry_points_loaded = False


def load_reward_entry_points() -> None:
    """Register the rewards other installed packages declare in the ``impasto.rewards``
    entry point group (once per process); a broken one is a one-line error naming it."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in REWARDS:
            continue
        try:
            builder = point.load()
        except Exception as error:  # noqa: BLE001  (any import failure of a plug-in)
            raise ValueError(
                f"reward entry point {point.name!r} ({point.value}) failed to load: {error}"
            ) from None
        register_reward(point.name)(builder)


def reward_kinds() -> list[str]:
    """Every registered reward kind, entry points included."""
    load_reward_entry_points()
    return sorted(REWARDS)


def build_reward(config: RewardConfig, device: torch.device | str = "cpu") -> Reward:
    """The reward ``config.kind`` names, built on ``device``, frozen and in eval mode."""
    load_reward_entry_points()
    builder = lookup(REWARDS, config.kind, "reward.kind", "reward")
    return builder(config, torch.device(device))


__all__ = [
    "ENTRY_POINT_GROUP",
    "REWARDS",
    "Reward",
    "RewardBuilder",
    "build_reward",
    "load_reward_entry_points",
    "register_reward",
    "reward_kinds",
]

from impasto.rewards import clip, demo_judge, weighted  # noqa: E402, F401  (built-in rewards)
