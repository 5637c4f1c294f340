"""The DiT family as a :class:`~impasto.models.backbone.Backbone`: the only module that knows how
the DiT, its text encoders and its autoencoder are called.

Text conditioning is SDXL's (both CLIP encoders' penultimate hidden states concatenated for the
tokens, encoder 2's projected pooled output for the modulation; :func:`encode_prompts`), or one
transformers encoder's (:mod:`impasto.models.dit.text`: its last hidden state, zero at the
padding, and its pooled output). Either way the text cache, caption dropout and the samplers'
empty prompt work unchanged. Latents come from any diffusers ``AutoencoderKL``
(:mod:`impasto.models.autoencoder`): the demo VAE (default), SDXL's, or a 16-channel one (SD3 /
FLUX: ``shift_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers import AutoencoderKL
from torch import Tensor, nn

from impasto.models import autoencoder
from impasto.models.backbone import (
    Batch,
    ContextParallelPlan,
    PipelineStagePlan,
    TensorParallelPlan,
    adapter_layers,
)
from impasto.models.components import (
    TEXT_TARGETS,
    PromptEmbeds,
    encode_prompts,
    unused_text_layers,
)
from impasto.models.dit.network import DiT
from impasto.models.dit.text import SINGLE_TEXT_TARGETS, encode_single, tokenizer_identity
from impasto.models.video_autoencoder import FrameReader

PART_NAMES = ("transformer", "text_encoder", "text_encoder_2")
"""Every part a DiT may have; one with a single text encoder has no ``text_encoder_2``."""

# lora.targets preset → module-name suffixes of the DiT (docs/dit.md, key layout).
TRANSFORMER_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": ("to_q", "to_k", "to_v", "to_out"),
    "attention_ff": ("to_q", "to_k", "to_v", "to_out", "fc1", "fc2", "gate", "up", "down"),
    "attention_ff_conv": (
        *("to_q", "to_k", "to_v", "to_out", "fc1", "fc2", "gate", "up", "down"),
        *("modulation", "patch_embed", "linear"),
    ),
}


@dataclass
class DiTComponents:
    """The DiT, its autoencoder, and its text encoders with their tokenizers: SDXL's two
    CLIPs, or one encoder (``text_encoder_2`` and ``tokenizer_2`` None)."""

    transformer: DiT
    vae: AutoencoderKL
    text_encoder: nn.Module
    text_encoder_2: nn.Module | None
    tokenizer: Any
    tokenizer_2: Any | None

    @property
    def single_text_encoder(self) -> bool:
        return self.text_encoder_2 is None

    def parts(self) -> dict[str, nn.Module]:
        """The networks that may train, by part name (those the DiT has)."""
        named = {name: getattr(self, name) for name in PART_NAMES}
        return {name: module for name, module in named.items() if module is not None}

    def networks(self) -> dict[str, nn.Module]:
        return self.parts() | {"vae": self.vae}


@dataclass(frozen=True)
class DiTConditioning:
    """The DiT's conditioning for B rows: text tokens and pooled text."""

    prompt_embeds: Tensor  # [B, L, text_dim]
    pooled_prompt_embeds: Tensor  # [B, pooled_dim]

    def cat(self, other: DiTConditioning) -> DiTConditioning:
        """``[self; other]`` along the batch axis (classifier-free guidance; packs)."""
        return DiTConditioning(
            torch.cat([self.prompt_embeds, other.prompt_embeds]),
            torch.cat([self.pooled_prompt_embeds, other.pooled_prompt_embeds]),
        )


class DiTBackbone:
    """The DiT family behind the backbone protocol."""

    family = "dit"

    def __init__(self, components: DiTComponents, kernel: str = "auto") -> None:
        self.components = components
        self.kernel = kernel  # the attention kernel of packed batches (model.dit.kernel)

    # -- networks -------------------------------------------------------------------------
    def parts(self) -> dict[str, nn.Module]:
        return self.components.parts()

    def frozen(self) -> dict[str, nn.Module]:
        return {"vae": self.components.vae}

    def modules(self) -> dict[str, nn.Module]:
        return self.parts() | self.frozen()

    def denoiser(self) -> nn.Module:
        return self.components.transformer

    def with_denoiser(self, denoiser: nn.Module) -> DiTBackbone:
        return DiTBackbone(replace(self.components, transformer=denoiser), self.kernel)

    @property
    def device(self) -> torch.device:
        return self.components.transformer.time_embed.linear_1.weight.device  # on every stage

    @property
    def dtype(self) -> torch.dtype:
        return self.components.transformer.time_embed.linear_1.weight.dtype

    def to(self, device: torch.device | str) -> DiTBackbone:
        for module in self.modules().values():
            module.to(device)
        return self

    def blocks(self) -> dict[str, nn.Module]:
        blocks = self.components.transformer.blocks  # a list, or a pipeline stage's dict
        return {f"blocks.{name}": block for name, block in blocks.named_children()}

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        if part == "transformer" or self.components.single_text_encoder:
            return ()  # one encoder: its last layer, final norm and pooling are all read
        return unused_text_layers(part, getattr(self.components, part))

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        if part == "transformer":
            suffixes = TRANSFORMER_TARGETS[preset]
        elif self.components.single_text_encoder:
            suffixes = SINGLE_TEXT_TARGETS[preset]
        else:
            suffixes = TEXT_TARGETS[preset]
        module = getattr(self.components, part)
        targets = adapter_layers(module, suffixes, self.unused_parameters(part))
        if not targets:
            raise ValueError(
                f"parts.{part}: no linear layer of this {type(module).__name__} is named as "
                f"lora.targets {preset} expects ({', '.join(suffixes)}); train it full"
            )
        return targets

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

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``(C, h, w)`` of an image; with ``frames``, ``(C, t, h, w)`` of a clip of that many
        frames (``t``: its latent frames; a one-line error where the frame count does not
        fit the autoencoder's rule or the DiT's ``frame_patch``)."""
        channels, factor = self.latent_format()
        step = factor * self.components.transformer.config.patch_size
        if height <= 0 or width <= 0 or height % step or width % step:
            raise ValueError(
                f"height and width must be positive multiples of {step} (the VAE's "
                f"downsampling {factor} × the DiT's patch size), got {height}x{width}"
            )
        if frames is None:
            return channels, height // factor, width // factor
        return channels, self.latent_frames(frames), height // factor, width // factor

    def temporal_compression(self) -> int:
        """Frames per latent frame after the first: 4 with a video autoencoder (clips of
        k·4 + 1 frames), 1 with an image VAE (which takes one frame only)."""
        return autoencoder.temporal_compression(self.components.vae)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` frames (ValueError where they do not fit)."""
        vae, step = self.components.vae, self.temporal_compression()
        if frames != 1 and not autoencoder.is_video_vae(vae):
            raise ValueError(
                f"a clip of {frames} frames: this DiT's autoencoder ({type(vae).__name__}) "
                "encodes images; set model.dit.autoencoder: video (or model.vae to a Wan 2.1 VAE)"
            )
        if frames < 1 or (frames - 1) % step:
            low = max(1, (frames - 1) // step * step + 1)
            raise ValueError(
                f"a clip of {frames} frames: the video autoencoder takes k·{step}+1 frames "
                f"(1, {1 + step}, {1 + 2 * step}, ...), e.g. {low} or {low + step}"
            )
        config = self.components.transformer.config
        latent = autoencoder.latent_frames(vae, frames)
        if latent % config.frame_patch:
            raise ValueError(
                f"model.dit.frame_patch {config.frame_patch} does not divide the {latent} latent "
                f"frames of a clip of {frames} frames; use clips of a multiple of "
                f"{config.frame_patch} latent frames"
            )
        return latent

    # -- conditioning ---------------------------------------------------------------------
    def encode_text(self, captions: list[str]) -> PromptEmbeds:
        parts = self.components
        if parts.single_text_encoder:
            return encode_single(parts.text_encoder, parts.tokenizer, captions)
        return encode_prompts(parts, captions)

    def text_from_cache(self, batch: Batch) -> PromptEmbeds | None:
        if batch.prompt_embeds is None:
            return None
        device, dtype = self.device, self.dtype
        return PromptEmbeds(
            batch.prompt_embeds.to(device, dtype), batch.pooled_prompt_embeds.to(device, dtype)
        )

    def condition(self, text: PromptEmbeds, batch: Batch) -> DiTConditioning:
        return DiTConditioning(text.prompt_embeds, text.pooled_prompt_embeds)

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> DiTConditioning:
        embeds = self.encode_text(prompts)
        device, dtype = self.device, self.dtype
        return DiTConditioning(
            embeds.prompt_embeds.to(device=device, dtype=dtype),
            embeds.pooled_prompt_embeds.to(device=device, dtype=dtype),
        )

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: DiTConditioning) -> Tensor:
        """Latents ``x_t``: images ``[B, C, h, w]`` or clips ``[B, C, F, h, w]``."""
        return self.components.transformer(
            x_t, timesteps, condition.prompt_embeds, condition.pooled_prompt_embeds
        )

    def forward_packed(
        self, x_ts: list[Tensor], timesteps: list[Tensor], conditions: list[DiTConditioning],
        capacity: int | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """Groups of different shapes (images and clips) as one pack (attention stays inside
        each sample)."""
        condition = conditions[0]
        for other in conditions[1:]:
            condition = condition.cat(other)
        return self.components.transformer(
            x_ts, torch.cat(timesteps), condition.prompt_embeds, condition.pooled_prompt_embeds,
            capacity=capacity, kernel=self.kernel,
        )  # fmt: skip

    def sequence_length(self, height: int, width: int, frames: int = 1) -> int:
        """Tokens of a sample of ``height`` × ``width`` pixels and ``frames`` frames (1: an
        image): (t / pt)·(h / p)·(w / p) of its latents, t its latent frames."""
        shape = self.latent_shape(height, width, frames)
        config = self.components.transformer.config
        patch = config.patch_size
        return (shape[1] // config.frame_patch) * (shape[-2] // patch) * (shape[-1] // patch)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """Megatron's split of every block (docs/dit.md, parallelism): q, k, v, the MLP's
        first layer(s) by columns (heads / hidden features), the outputs by rows; the
        modulation vectors are whole on every rank. Names a block lacks (``cross`` of an
        ``adaln`` block, ``attn_temporal`` outside spatiotemporal blocks) are skipped."""
        transformer = self.components.transformer
        config = transformer.config
        attentions = ("attn", "attn_temporal", "cross")
        return TensorParallelPlan(
            blocks=tuple(transformer.blocks.children()),
            gathers=(*attentions, "mlp"),
            colwise=(*(f"{attn}.{name}" for attn in attentions
                       for name in ("to_q", "to_k", "to_v")), "mlp.fc1", "mlp.gate", "mlp.up"),
            rowwise=(*(f"{attn}.to_out" for attn in attentions), "mlp.fc2", "mlp.down"),
            head_norms=tuple(f"{attn}.{norm}" for attn in attentions
                             for norm in ("norm_q", "norm_k")),
            sequence_norms=("norm1", "norm_temporal", "norm_cross", "norm2"),
            conditioned=("modulation",),
            token_index="document",
            output="final",
            token_multiple="token_multiple",
            divisible={
                "attention heads": config.hidden_size // config.head_dim,
                "MLP features": next(transformer.blocks.children()).mlp_width,
            },
        )  # fmt: skip

    def context_parallel_plan(self) -> ContextParallelPlan:
        """Ulysses over the DiT's sequence (docs/dit.md, parallelism): ``DiT.sequence_parallel``
        splits the tokens between the patch embedding and the final layer and exchanges the
        heads around every attention kernel, so the group size must divide the heads."""
        config = self.components.transformer.config
        return ContextParallelPlan(
            hook="sequence_parallel",
            token_multiple="token_multiple",
            divisible={"attention heads": config.hidden_size // config.head_dim},
        )

    def pipeline_stage(self, stage: int, num_stages: int) -> PipelineStagePlan:
        """This DiT's blocks ``stage_blocks(…)`` with the embedders every stage needs
        (:mod:`.pipeline`; docs/dit.md, parallelism); the other blocks are dropped."""
        from impasto.models.dit.pipeline import SHARED, DiTStage

        stage_module = DiTStage(self.components.transformer, stage, num_stages)
        return PipelineStagePlan(
            self.with_denoiser(stage_module), SHARED, stage_module.is_first, stage_module.is_last
        )

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        parts = self.components
        if kind == "latents":
            return parts.vae, str(parts.vae.dtype)
        if parts.single_text_encoder:
            return parts.text_encoder, parts.tokenizer, tokenizer_identity(parts.tokenizer)
        return parts.text_encoder, parts.text_encoder_2, parts.tokenizer, parts.tokenizer_2

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"impasto.family": self.family}
