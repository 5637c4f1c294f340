"""Config sections of reward fine-tuning: the DRaFT+ method (``draftp``) and its ``reward``
(docs/draftp.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from impasto.config.section import Section


class RewardConfig(Section):
    """A differentiable reward of images and their prompts (``impasto.rewards.REWARDS``)."""

    kind: str = Field(
        "demo",
        description="clip_score, aesthetic, demo, weighted, or a registered reward "
        "(entry point group impasto.rewards)",
    )
    path: str | None = Field(
        None,
        description="clip_score: a local Hugging Face CLIPModel folder (PickScore v1, OpenAI or "
        "LAION CLIP); aesthetic: the CLIP ViT-L/14 folder its head reads",
    )
    head: str | None = Field(
        None, description="aesthetic: the LAION improved-aesthetic-predictor MLP weights"
    )
    weight: float = Field(1.0, description="weighted: this term's factor")
    terms: list[RewardConfig] = Field(
        default_factory=list, description="weighted: the rewards summed, each with its weight"
    )
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="the reward model's weights (bf16 halves its memory on a GPU)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="keyword options of a registered reward"
    )

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

    truncation_steps: int = Field(
        1, ge=1, description="K: the last K sampler steps run with gradients (DRaFT-K)"
    )
    kl_coeff: float = Field(
        0.2,
        ge=0,
        description="weight of mean((d_ft - d_base)^2) over the K steps (NeMo-Aligner's KL)",
    )
    lv_samples: int = Field(
        0,
        ge=0,
        description="DRaFT-LV: re-noise the sampled x0 to the last step this many times and "
        "average their rewards (needs truncation_steps 1); 0: off",
    )
    num_steps: int = Field(40, ge=1, description="sampler steps per image")
    guidance_scale: float = Field(5.0, ge=0, description="classifier-free guidance while training")
    sampler: str = Field(
        "euler", description="euler, ddim or euler_ancestral (a single-step sampler)"
    )
    spacing: Literal["leading", "trailing", "linspace"] | None = Field(
        None, description="default: trailing with zero terminal SNR, else leading"
    )
    negative_prompt: str = ""
    resolution: int | None = Field(None, ge=8, description="default: data.resolution")
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
        if self.resolution is not None and self.resolution % 8:
            raise ValueError(f"draftp.resolution must be a multiple of 8, got {self.resolution}")
        return self
