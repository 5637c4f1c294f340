"""The ``weighted`` reward: a weighted sum of other rewards, r = Σ_i w_i · r_i(images, prompts).

Each term of ``reward.terms`` is built through :func:`impasto.rewards.build_reward`, so a term
can be any kind, a plug-in's or another ``weighted`` included; its ``weight`` is w_i (a
negative weight penalises). Use it to trade one reward against another, e.g. PickScore plus
a small aesthetic term against reward hacking of either (DRaFT, Clark et al. 2023,
arXiv:2309.17400, trains on each of these rewards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from impasto.rewards import Reward, build_reward, register_reward

if TYPE_CHECKING:
    from impasto.config.draftp import RewardConfig


class WeightedReward:
    """Σ_i w_i · r_i(images, prompts) ``[B]`` float32; ``embed`` is the first term's."""

    def __init__(self, terms: list[tuple[float, Reward]]) -> None:
        if not terms:
            raise ValueError("reward.kind weighted sums reward.terms; list at least one term")
        self.terms = terms

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        total = torch.zeros(images.shape[0], dtype=torch.float32, device=images.device)
        for weight, reward in self.terms:
            total = total + weight * reward(images, prompts).float()
        return total

    def embed(self, images: Tensor) -> Tensor:
        return self.terms[0][1].embed(images)


@register_reward("weighted")
def build_weighted(config: RewardConfig, device: torch.device) -> WeightedReward:
    """Build each of ``reward.terms`` on ``device`` and pair it with its ``weight``."""
    return WeightedReward([(term.weight, build_reward(term, device)) for term in config.terms])


__all__ = ["WeightedReward", "build_weighted"]
