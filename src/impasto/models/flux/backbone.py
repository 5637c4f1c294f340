"""FLUX.1 as a :class:`~impasto.models.backbone.Backbone`: the only module that knows how the
FLUX transformer, its text encoders and its VAE are called (docs/flux.md).

The denoiser's input and output are latents ``[B, 16, h, w]`` as for every family; the
backbone packs them into FLUX's tokens (:mod:`.layout`) around each transformer call, so the
objective (rectified flow, target ε − x0) and the samplers work unchanged. The transformer is
called as diffusers' ``train_dreambooth_lora_flux.py`` and ``FluxPipeline`` call it: time
``t·T / T = t``, the guidance embedding's value from ``model.flux``, zero text ids and
(0, row, column) image ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from impasto.models import autoencoder
from impasto.models.backbone import Batch, adapter_layers
from impasto.models.components import TEXT_TARGETS, PromptEmbeds
from impasto.models.flux import layout
from impasto.models.flux.ladder import ladder
from impasto.models.flux.options import DEFAULT_GUIDANCE, FluxOptions
from impasto.models.flux.text import encode_text, tokenizer_identity
from impasto.models.transformer_families import TransformerBackbone
from impasto.models.video_autoencoder import FrameReader

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
"""The transformer's block lists in execution order: double-stream, then single-stream."""

_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
              "to_add_out")  # fmt: skip
_FEED_FORWARD = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
                 "proj_mlp", "proj_out")  # fmt: skip
_MODULATION = ("norm1.linear", "norm1_context.linear", "norm.linear")

# lora.targets preset → module-name suffixes inside the transformer's blocks (docs/flux.md,
# LoRA). attention_ff is diffusers' train_dreambooth_lora_flux.py default --lora_layers (the
# attention of both kinds of block, the double blocks' feed-forward) plus the single blocks'
# MLP (proj_mlp in, proj_out out: their feed-forward, fused with the attention's output).
TRANSFORMER_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": _ATTENTION,
    "attention_ff": (*_ATTENTION, *_FEED_FORWARD),
    "attention_ff_conv": (*_ATTENTION, *_FEED_FORWARD, *_MODULATION),  # FLUX has no convs
}


@dataclass(frozen=True)
class FluxConditioning:
    """FLUX's conditioning for B rows: T5 tokens, CLIP's pooled output, the guidance value."""

    prompt_embeds: Tensor  # [B, L, D_t5]
    pooled_prompt_embeds: Tensor  # [B, D_clip]
    guidance: Tensor  # [B] float32

    def cat(self, other: FluxConditioning) -> FluxConditioning:
        """``[self; other]`` along the batch axis (classifier-free guidance)."""
        return FluxConditioning(
            torch.cat([self.prompt_embeds, other.prompt_embeds]),
            torch.cat([self.pooled_prompt_embeds, other.pooled_prompt_embeds]),
            torch.cat([self.guidance, other.guidance]),
        )


class FluxBackbone(TransformerBackbone):
    """FLUX.1's transformer, VAE, CLIP-L and T5 behind the backbone protocol."""

    family = "flux"

    options_type = FluxOptions
    probe = "x_embedder"

    def blocks(self) -> dict[str, nn.Module]:
        transformer = self.components.transformer
        return {f"{name}.{index}": block for name in BLOCK_LISTS
                for index, block in enumerate(getattr(transformer, name))}  # fmt: skip

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        """None: CLIP's pooled output reads its last layer and final norm, and the
        transformer reads every weight."""
        return ()

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        if part == "transformer":
            module = self.components.transformer
            targets = adapter_layers(module, TRANSFORMER_TARGETS[preset])
            return [name for name in targets if name.startswith(BLOCK_LISTS)]
        if part == "text_encoder":
            return adapter_layers(self.components.text_encoder, TEXT_TARGETS[preset])
        raise ValueError(f"parts.{part}: T5 trains frozen only in the flux family; remove it")

    # -- latents (impasto.models.autoencoder) ------------------------------------------
    def latent_posterior(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        return autoencoder.latent_posterior(self.components.vae, pixels)

    def clip_posterior(
        self, read_frames: FrameReader, num_frames: int, chunk_frames: int = 16
    ) -> tuple[Tensor, Tensor]:
        raise ValueError("data.video: the flux family trains on images; remove data.video")

    def encode_latents(self, sample: Tensor) -> Tensor:
        return autoencoder.encode_latents(self.components.vae, sample)

    def decode_latents(self, latents: Tensor) -> Tensor:
        return autoencoder.decode_latents(self.components.vae, latents)

    def decode_images(self, latents: Tensor, checkpointing: bool = False) -> Tensor:
        return autoencoder.decode_images(self.components.vae, latents, checkpointing)

    def latent_format(self) -> tuple[int, int]:
        return autoencoder.latent_format(self.components.vae)

    def latent_shape(
        self, height: int, width: int, frames: int | None = None
    ) -> tuple[int, int, int]:
        """``(C, h, w)`` of an H×W image (``frames``: None or 1; FLUX takes no clips)."""
        if frames not in (None, 1):
            raise ValueError("data.video: the flux family trains on images; remove data.video")
        channels, factor = self.latent_format()
        step = factor * layout.PATCH
        if height <= 0 or width <= 0 or height % step or width % step:
            raise ValueError(
                f"height and width must be positive multiples of {step} (the VAE's "
                f"downsampling {factor} × FLUX's 2×2 packing), got {height}x{width}"
            )
        return channels, height // factor, width // factor

    # -- conditioning ---------------------------------------------------------------------
    def encode_captions(self, captions: list[str]) -> PromptEmbeds:
        parts = self.components
        return encode_text(
            parts.text_encoder, parts.tokenizer, parts.text_encoder_2, parts.tokenizer_2,
            captions, self.options.text_length,
        )  # fmt: skip

    def text_from_cache(self, batch: Batch) -> PromptEmbeds | None:
        if batch.prompt_embeds is None:
            return None
        device, dtype = self.device, self.dtype
        return PromptEmbeds(
            batch.prompt_embeds.to(device, dtype), batch.pooled_prompt_embeds.to(device, dtype)
        )

    def _conditioning(self, text: PromptEmbeds, guidance: float) -> FluxConditioning:
        rows = text.prompt_embeds.shape[0]
        values = torch.full((rows,), guidance, dtype=torch.float32, device=self.device)
        return FluxConditioning(text.prompt_embeds, text.pooled_prompt_embeds, values)

    def condition(self, text: PromptEmbeds, batch: Batch) -> FluxConditioning:
        """The training guidance ``model.flux.guidance`` for every row (diffusers' script)."""
        return self._conditioning(text, self.options.guidance)

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> FluxConditioning:
        """The prompts' conditioning on the transformer's device and dtype, at FluxPipeline's
        default guidance value (:meth:`embedded_guidance` sets the one asked for)."""
        embeds = self.encode_text(prompts)
        device, dtype = self.device, self.dtype
        embeds = PromptEmbeds(
            embeds.prompt_embeds.to(device=device, dtype=dtype),
            embeds.pooled_prompt_embeds.to(device=device, dtype=dtype),
        )
        return self._conditioning(embeds, DEFAULT_GUIDANCE)

    # -- sampling as FluxPipeline (impasto.sampling.process.OwnSampling) --------------------
    def sampling_ladder(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        """FluxPipeline's ladder for an H×W image (:mod:`.ladder`): its shift grows with the
        image's tokens; ``objective.flow_shift`` plays no part."""
        _, rows, cols = self.latent_shape(height, width)
        tokens = layout.sequence_length(rows, cols)
        return ladder(self.components.scheduler_config, num_steps, tokens)

    def embedded_guidance(
        self, condition: FluxConditioning, guidance_scale: float
    ) -> FluxConditioning:
        """FLUX samples as FluxPipeline does by default, without classifier-free guidance:
        FLUX.1-dev's transformer takes ``guidance_scale`` as its guidance embedding's value
        (FluxPipeline's ``guidance_scale``); FLUX.1-schnell's has no guidance input and
        ignores it."""
        values = torch.full_like(condition.guidance, guidance_scale)
        return replace(condition, guidance=values)

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: FluxConditioning) -> Tensor:
        """The velocity at latents ``x_t`` ``[B, C, h, w]`` and times ``t·T`` ``[B]`` (or one
        time for all rows): the transformer's packed tokens, unpacked."""
        transformer = self.components.transformer
        batch, _, height, width = x_t.shape
        text = condition.prompt_embeds
        guidance = condition.guidance if transformer.config.guidance_embeds else None
        output = transformer(
            hidden_states=layout.pack_latents(x_t),
            timestep=timesteps.expand(batch) / 1000,  # diffusers scales t·T back to t
            guidance=guidance,
            pooled_projections=condition.pooled_prompt_embeds,
            encoder_hidden_states=text,
            txt_ids=layout.text_ids(text.shape[1], x_t.device, x_t.dtype),
            img_ids=layout.image_ids(height, width, x_t.device, x_t.dtype),
            return_dict=False,
        )[0]
        return layout.unpack_latents(output, height, width)

    def forward_packed(
        self, x_ts: list[Tensor], timesteps: list[Tensor], conditions: list[FluxConditioning],
        capacity: int | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """No packing yet: one forward per group."""
        return [self.forward(*group) for group in zip(x_ts, timesteps, conditions, strict=True)]

    def sequence_length(self, height: int, width: int, frames: int = 1) -> int:
        """Image tokens of an H×W image (the text's are added to each by the transformer)."""
        if frames != 1:
            raise ValueError("data.video: the flux family trains on images; remove data.video")
        _, rows, cols = self.latent_shape(height, width)
        return layout.sequence_length(rows, cols)

    def tensor_parallel_plan(self) -> None:
        """None: not built yet for FLUX (docs/flux.md, not yet)."""
        return None

    def context_parallel_plan(self) -> None:
        """None: not built yet for FLUX (docs/flux.md, not yet)."""
        return None

    def pipeline_stage(self, stage: int, num_stages: int) -> None:
        """None: not built yet for FLUX (docs/flux.md, not yet)."""
        return None

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        parts = self.components
        if kind == "latents":
            return parts.vae, str(parts.vae.dtype)
        return (
            parts.text_encoder, parts.text_encoder_2, parts.tokenizer, parts.tokenizer_2,
            tokenizer_identity(parts.tokenizer_2), self.options.text_length,
        )  # fmt: skip

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"impasto.family": self.family}
