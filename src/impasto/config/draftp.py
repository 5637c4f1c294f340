"""Config sections of reward fine-tuning: the DRaFT+ method (``draftp``) and its ``reward``
(docs/draftp.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from impasto.config.section import MAX_SAMPLER_STEPS, Float, Int, PathStr, Resolution, Section


class RewardConfig(Section):
    """A differentiable reward of images and their prompts (``impasto.rewards.REWARDS``)."""

    kind: str = Field(
        "demo",
        description="clip_score, aesthetic, demo, weighted, or a registered reward "
        "(entry point group impasto.rewards)",
    )
    path: PathStr | None = Field(
        None,
        description="clip_score: a local Hugging Face CLIPModel folder (PickScore v1, OpenAI or "
        "LAION CLIP); aesthetic: the CLIP ViT-L/14 folder its head reads",
    )
    head: PathStr | None = Field(
        None, description="aesthetic: the LAION improved-aesthetic-predictor MLP weights"
    )
    weight: Float = Field(1.0, description="weighted: this term's factor")
    terms: list[RewardConfig] = Field(
        default_factory=list, description="weighted: the rewards summed, each with its weight"
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="the reward model's weights (bf16 halves its memory on a GPU)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="keyword options of a registered reward"
    )

    @field_validator("options")
    @classmethod
    def _finite_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Any-typed, so Section's allow_inf_nan does not reach them: look through them here.
        for key, option in _leaves(value, ""):
            if isinstance(option, float) and not math.isfinite(option):
                raise ValueError(f"option {key} should be a finite number, got {option}")
        return value

    @model_validator(mode="after")
    def _terms_for_weighted_only(self) -> RewardConfig:
        if self.kind == "weighted" and not self.terms:
            raise ValueError("reward.kind weighted sums reward.terms; list at least one term")
        if self.kind != "weighted" and self.terms:
            raise ValueError(
                f"reward.terms belong to kind weighted, not {self.kind!r}; remove them or set "
                "reward.kind: weighted"
            )
        return self


class DraftpConfig(Section):
    """DRaFT+ (``objective.method: draftp``): sample from the prompts, backpropagate the
    reward through the last ``truncation_steps`` sampler steps, with a KL leash to the base."""

    truncation_steps: Int = Field(
        1,
        ge=1,
        le=MAX_SAMPLER_STEPS,
        description="K: the last K sampler steps run with gradients (DRaFT-K)",
    )
    kl_coeff: Float = Field(
        0.2,
        ge=0,
        description="weight of mean((d_ft - d_base)^2) over the K steps (NeMo-Aligner's KL)",
    )
    lv_samples: Int = Field(
        0,
        ge=0,
        le=64,
        description="DRaFT-LV: re-noise the sampled x0 to the last step this many times and "
        "average their rewards (needs truncation_steps 1); 0: off",
    )
    num_steps: Int = Field(40, ge=1, le=MAX_SAMPLER_STEPS, description="sampler steps per image")
    guidance_scale: Float = Field(5.0, ge=0, description="classifier-free guidance while training")
    sampler: str = Field(
        "euler", description="euler, ddim or euler_ancestral (a single-step sampler)"
    )
    spacing: Literal["leading", "trailing", "linspace"] | None = Field(
        None, description="default: trailing with zero terminal SNR, else leading"
    )
    negative_prompt: str = ""
    resolution: Resolution | None = Field(None, description="default: data.resolution")
    checkpoint_steps: bool = Field(
        True,
        description="recompute each gradient step's denoiser in backward instead of keeping "
        "its activations",
    )
    checkpoint_decoder: bool = Field(
        True, description="gradient checkpointing through the VAE decoder"
    )

    @model_validator(mode="after")
    def _fits(self) -> DraftpConfig:
        if self.truncation_steps > self.num_steps:
            raise ValueError(
                f"draftp.truncation_steps {self.truncation_steps} is more than the "
                f"{self.num_steps} sampler steps (num_steps); lower it"
            )
        if self.lv_samples and self.truncation_steps != 1:
            raise ValueError(
                "draftp.lv_samples (DRaFT-LV) re-noises to the last step only; set "
                "truncation_steps: 1"
            )
        return self


def _leaves(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every non-container value in nested dicts and lists."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _leaves(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{key}.{index}")
    else:
        yield key, value
