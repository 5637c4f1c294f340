"""SDXL as a :class:`~impasto.models.backbone.Backbone`: the only module that knows how the
SDXL networks are called (UNet conventions, both CLIP encoders, the VAE's scaling).

Conditioning follows SDXL (Podell et al. 2023, arXiv:2307.01952, §2.1-2.2) exactly as diffusers'
``StableDiffusionXLPipeline`` computes it, so a model trained here samples correctly with the
stock pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from impasto.models import autoencoder
from impasto.models.backbone import (
    Batch,
    FamilySpec,
    adapter_layers,
    register_backbone,
    register_family,
)
from impasto.models.components import (
    TEXT_TARGETS,
    PromptEmbeds,
    SDXLComponents,
    add_time_ids,
    encode_prompts,
    unused_text_layers,
)
from impasto.models.video_autoencoder import FrameReader

PART_NAMES = ("unet", "text_encoder", "text_encoder_2")

# lora.targets preset → module-name suffixes of the diffusers UNet (CLIP's: TEXT_TARGETS).
UNET_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": ("to_q", "to_k", "to_v", "to_out.0"),
    "attention_ff": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
    "attention_ff_conv": (
        *("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"),
        *("conv1", "conv2", "conv_shortcut", "time_emb_proj"),
    ),
}


@dataclass(frozen=True)
class SDXLConditioning:
    """SDXL UNet conditioning for B rows: text, pooled text and size micro-conditioning."""

    prompt_embeds: Tensor  # [B, 77, D1 + D2]
    pooled_prompt_embeds: Tensor  # [B, P]
    time_ids: Tensor  # [B, 6]

    def cat(self, other: SDXLConditioning) -> SDXLConditioning:
        """``[self; other]`` along the batch axis (classifier-free guidance's double batch)."""
        return SDXLConditioning(
            torch.cat([self.prompt_embeds, other.prompt_embeds]),
            torch.cat([self.pooled_prompt_embeds, other.pooled_prompt_embeds]),
            torch.cat([self.time_ids, other.time_ids]),
        )


def unet_blocks(unet: nn.Module) -> dict[str, nn.Module]:
    """A diffusers UNet's blocks in execution order: ``down.N``, ``mid``, ``up.N``."""
    blocks = {f"down.{i}": block for i, block in enumerate(unet.down_blocks)}
    if unet.mid_block is not None:
        blocks["mid"] = unet.mid_block
    blocks.update({f"up.{i}": block for i, block in enumerate(unet.up_blocks)})
    return blocks


class SDXLBackbone:
    """SDXL's UNet, VAE and two CLIP text encoders behind the backbone protocol."""

    family = "sdxl"

    def __init__(self, components: SDXLComponents) -> None:
        self.components = components

    # -- networks -------------------------------------------------------------------------
    def parts(self) -> dict[str, nn.Module]:
        return {name: getattr(self.components, name) for name in PART_NAMES}

    def frozen(self) -> dict[str, nn.Module]:
        return {"vae": self.components.vae}

    def modules(self) -> dict[str, nn.Module]:
        return self.parts() | self.frozen()

    def denoiser(self) -> nn.Module:
        return self.components.unet

    def with_denoiser(self, denoiser: nn.Module) -> SDXLBackbone:
        return SDXLBackbone(replace(self.components, unet=denoiser))

    @property
    def device(self) -> torch.device:
        # The first parameter's, as diffusers' ``unet.device`` finds it once it has looked for a
        # group-offloading hook (impasto never applies one) in every submodule: that walk took
        # 4 % of the CPU demo's step time (a step asks for the device 4 times).
        return next(self.components.unet.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.components.unet.dtype

    def to(self, device: torch.device | str) -> SDXLBackbone:
        self.components.to(device)
        return self

    def blocks(self) -> dict[str, nn.Module]:
        return unet_blocks(self.components.unet)

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        return unused_text_layers(part, getattr(self.components, part))

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        module = getattr(self.components, part)
        suffixes = UNET_TARGETS[preset] if part == "unet" else TEXT_TARGETS[preset]
        skip = self.unused_parameters(part)
        return adapter_layers(module, suffixes, skip)

    # -- latents (impasto.models.autoencoder) ------------------------------------------
    def latent_posterior(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        return autoencoder.latent_posterior(self.components.vae, pixels)

    def clip_posterior(
        self, read_frames: FrameReader, num_frames: int, chunk_frames: int = 16
    ) -> tuple[Tensor, Tensor]:
        vae = self.components.vae
        return autoencoder.clip_posterior_chunked(vae, read_frames, num_frames, chunk_frames)

    def encode_latents(self, sample: Tensor) -> Tensor:
        return autoencoder.encode_latents(self.components.vae, sample)

    def decode_latents(self, latents: Tensor) -> Tensor:
        return autoencoder.decode_latents(self.components.vae, latents)

    def decode_images(self, latents: Tensor, checkpointing: bool = False) -> Tensor:
        return autoencoder.decode_images(self.components.vae, latents, checkpointing)

    def latent_format(self) -> tuple[int, int]:
        return autoencoder.latent_format(self.components.vae)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        factor = self.latent_format()[1]
        if height <= 0 or width <= 0 or height % factor or width % factor:
            raise ValueError(
                f"height and width must be positive multiples of {factor} (the VAE's "
                f"downsampling factor), got {height}x{width}"
            )
        return int(self.components.unet.config.in_channels), height // factor, width // factor

    # -- conditioning ---------------------------------------------------------------------
    def encode_text(self, captions: list[str]) -> PromptEmbeds:
        return encode_prompts(self.components, captions)

    def text_from_cache(self, batch: Batch) -> PromptEmbeds | None:
        if batch.prompt_embeds is None:
            return None
        device, dtype = self.device, self.dtype  # straight to the UNet, in its dtype
        return PromptEmbeds(
            batch.prompt_embeds.to(device, dtype), batch.pooled_prompt_embeds.to(device, dtype)
        )

    def condition(self, text: PromptEmbeds, batch: Batch) -> SDXLConditioning:
        time_ids = add_time_ids(
            batch.original_sizes, batch.crop_top_lefts, batch.target_sizes, dtype=torch.float32
        )
        return SDXLConditioning(text.prompt_embeds, text.pooled_prompt_embeds, time_ids)

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> SDXLConditioning:
        """Time ids with original = target = (height, width) and crop (0, 0), as the pipeline;
        on the UNet's device and in its dtype."""
        embeds = encode_prompts(self.components, prompts)
        sizes = torch.tensor([[height, width]] * len(prompts))
        time_ids = add_time_ids(sizes, torch.zeros_like(sizes), sizes)
        device, dtype = self.device, self.dtype
        return SDXLConditioning(
            prompt_embeds=embeds.prompt_embeds.to(device=device, dtype=dtype),
            pooled_prompt_embeds=embeds.pooled_prompt_embeds.to(device=device, dtype=dtype),
            time_ids=time_ids.to(device=device, dtype=dtype),
        )

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: SDXLConditioning) -> Tensor:
        return self.components.unet(
            x_t,
            timesteps,
            encoder_hidden_states=condition.prompt_embeds,
            added_cond_kwargs={
                "text_embeds": condition.pooled_prompt_embeds,
                "time_ids": condition.time_ids.to(x_t.device),
            },
        ).sample

    def forward_packed(
        self, x_ts: list[Tensor], timesteps: list[Tensor], conditions: list[SDXLConditioning],
        capacity: int | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """A UNet cannot pack: one forward per group."""
        return [self.forward(*group) for group in zip(x_ts, timesteps, conditions, strict=True)]

    def sequence_length(self, height: int, width: int, frames: int = 1) -> int:
        """Latent positions (an image's: the UNet takes no clips)."""
        if frames != 1:
            raise ValueError("data.video: the sdxl family trains on images; remove data.video")
        _, rows, cols = self.latent_shape(height, width)
        return rows * cols

    def tensor_parallel_plan(self) -> None:
        """None: the UNet is mostly convolutions, which Megatron's split does not cover."""
        return None

    def context_parallel_plan(self) -> None:
        """None: a UNet's convolutions read neighbouring pixels, not a sequence to split."""
        return None

    def pipeline_stage(self, stage: int, num_stages: int) -> None:
        """None: the UNet's skip connections cross every level (no sequence of blocks)."""
        return None

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        parts = self.components
        if kind == "latents":
            return parts.vae, str(parts.vae.dtype)
        return parts.text_encoder, parts.text_encoder_2, parts.tokenizer, parts.tokenizer_2

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"impasto.family": self.family}


@register_backbone("sdxl")
def build_sdxl_backbone(config: Any) -> SDXLBackbone:
    """SDXL from ``config.model``: a preset, a diffusers folder or a single file."""
    from impasto.models import load_model

    return SDXLBackbone(load_model(config))


register_family("sdxl")(FamilySpec(parts=PART_NAMES, presets=("tiny", "demo", "sdxl")))
