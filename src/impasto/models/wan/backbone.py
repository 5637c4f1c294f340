"""Wan 2.1 as a :class:`~impasto.models.backbone.Backbone`: the only module that knows how the
Wan transformer, umT5 and the video VAE are called (docs/wan.md).

The denoiser's input and output are latents ``[B, 16, t, h, w]`` of clips (``[B, 16, h, w]`` of
images, run as one-frame clips), so the objective (rectified flow, target ε − x0) and the
samplers work unchanged. The transformer is called as ``WanPipeline`` calls it: latents, the
time ``t·T`` (T = 1000) and the umT5 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from impasto.models import autoencoder
from impasto.models.backbone import Batch, adapter_layers
from impasto.models.components import PromptEmbeds
from impasto.models.transformer_families import TransformerBackbone
from impasto.models.video_autoencoder import FrameReader, check_num_frames
from impasto.models.wan.options import WanOptions
from impasto.models.wan.text import encode_text, tokenizer_identity

BLOCK_LIST = "blocks"

# inside a block: self-attention (attn1) and cross-attention (attn2) projections, the FFN.
_ATTENTION = tuple(f"{attn}.{name}" for attn in ("attn1", "attn2")
                   for name in ("to_q", "to_k", "to_v", "to_out.0"))  # fmt: skip
_FEED_FORWARD = ("ffn.net.0.proj", "ffn.net.2")

# lora.targets preset → module-name suffixes inside the transformer's blocks (docs/wan.md,
# LoRA): attention_ff is musubi-tuner's and diffusion-pipe's Wan LoRA (every linear layer of
# the blocks: attn1, attn2 q/k/v/o and the FFN); Wan's modulation is a table, not a layer.
TRANSFORMER_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": _ATTENTION,
    "attention_ff": (*_ATTENTION, *_FEED_FORWARD),
    "attention_ff_conv": (*_ATTENTION, *_FEED_FORWARD),
}


@dataclass(frozen=True)
class WanConditioning:
    """Wan's conditioning for B rows: the umT5 tokens."""

    prompt_embeds: Tensor  # [B, L, D]

    def cat(self, other: WanConditioning) -> WanConditioning:
        """``[self; other]`` along the batch axis (classifier-free guidance)."""
        return WanConditioning(torch.cat([self.prompt_embeds, other.prompt_embeds]))


class WanBackbone(TransformerBackbone):
    """Wan 2.1's transformer, video VAE and umT5 behind the backbone protocol (and the
    optional :class:`~impasto.sampling.process.OwnSampling`: its scheduler's ladder)."""

    family = "wan"

    options_type = WanOptions

    def blocks(self) -> dict[str, nn.Module]:
        blocks = getattr(self.components.transformer, BLOCK_LIST)
        return {f"{BLOCK_LIST}.{index}": block for index, block in enumerate(blocks)}

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        """None: umT5 and the text-to-video transformer read every weight."""
        return ()

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        if part == "transformer":
            module = self.components.transformer
            targets = adapter_layers(module, TRANSFORMER_TARGETS[preset])
            return [name for name in targets if name.startswith(BLOCK_LIST + ".")]
        raise ValueError(f"parts.{part}: umT5 trains frozen only in the wan family; remove it")

    # -- latents (impasto.models.autoencoder: Wan's VAE, WanPipeline's latent map) ---------
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
        """``(C, h, w)`` of an H×W image; with ``frames`` (4n + 1), ``(C, t, h, w)`` of a clip,
        ``t = 1 + (frames − 1)/4``."""
        channels, factor = self.latent_format()
        patch = self.components.transformer.config.patch_size[-1]
        step = factor * patch
        if height <= 0 or width <= 0 or height % step or width % step:
            raise ValueError(
                f"height and width must be positive multiples of {step} (the VAE's "
                f"downsampling {factor} × Wan's 2×2 patches), got {height}x{width}"
            )
        if frames is None:
            return channels, height // factor, width // factor
        check_num_frames(frames)
        return channels, 1 + (frames - 1) // 4, height // factor, width // factor

    # -- conditioning ---------------------------------------------------------------------
    def encode_captions(self, captions: list[str]) -> PromptEmbeds:
        parts = self.components
        length = self.options.text_length or parts.tokenizer.model_max_length
        return encode_text(parts.text_encoder, parts.tokenizer, captions, length)

    def text_from_cache(self, batch: Batch) -> PromptEmbeds | None:
        if batch.prompt_embeds is None:
            return None
        device, dtype = self.device, self.dtype
        return PromptEmbeds(
            batch.prompt_embeds.to(device, dtype), batch.pooled_prompt_embeds.to(device, dtype)
        )

    def condition(self, text: PromptEmbeds, batch: Batch) -> WanConditioning:
        return WanConditioning(text.prompt_embeds)

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> WanConditioning:
        """The prompts' conditioning on the transformer's device and dtype."""
        embeds = self.encode_text(prompts)
        return WanConditioning(embeds.prompt_embeds.to(device=self.device, dtype=self.dtype))

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: WanConditioning) -> Tensor:
        """The velocity at latents ``x_t`` (``[B, C, t, h, w]`` clips or ``[B, C, h, w]``
        images) and times ``t·T`` ``[B]`` (or one time for all rows), in the transformer's
        dtype (its patch embedding is a convolution), as WanPipeline calls it."""
        image = x_t.dim() == 4
        clips = x_t[:, :, None] if image else x_t
        dtype = self.dtype
        velocity = self.components.transformer(
            hidden_states=clips.to(dtype),
            timestep=timesteps.expand(x_t.shape[0]),
            encoder_hidden_states=condition.prompt_embeds.to(dtype),
            return_dict=False,
        )[0]
        return velocity[:, :, 0] if image else velocity

    def forward_packed(
        self, x_ts: list[Tensor], timesteps: list[Tensor], conditions: list[WanConditioning],
        capacity: int | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """No packing yet: one forward per group."""
        return [self.forward(*group) for group in zip(x_ts, timesteps, conditions, strict=True)]

    def sequence_length(self, height: int, width: int, frames: int = 1) -> int:
        """Tokens of a clip of ``frames`` H×W frames (1: an image): t·(h/2)·(w/2)."""
        if frames == 1:
            _, rows, cols = self.latent_shape(height, width)
            return (rows // 2) * (cols // 2)
        _, latent_frames, rows, cols = self.latent_shape(height, width, frames)
        return latent_frames * (rows // 2) * (cols // 2)

    # -- sampling (OwnSampling) --------------------------------------------------------------
    def sampling_ladder(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        """``(timesteps [n], ts [n + 1])``: WanPipeline's scheduler's (UniPC on flow sigmas
        shifted by its ``flow_shift``), for impasto's flow samplers (UniPC by default)."""
        from impasto.models.wan.sampling import wan_ladder

        return wan_ladder(self, num_steps)

    @property
    def own_sampler(self) -> str:
        """``"unipc"``, WanPipeline's sampler (``impasto.sampling.process.default_sampler``:
        the sampler when none is asked)."""
        from impasto.models.wan.sampling import own_sampler

        return own_sampler(self)

    def embedded_guidance(self, condition: WanConditioning, guidance_scale: float) -> None:
        """None: Wan samples with classifier-free guidance (the negative prompt's branch)."""
        return None

    def tensor_parallel_plan(self) -> None:
        """None: not built yet for Wan (docs/wan.md, not yet)."""
        return None

    def context_parallel_plan(self) -> None:
        """None: not built yet for Wan (docs/wan.md, not yet)."""
        return None

    def pipeline_stage(self, stage: int, num_stages: int) -> None:
        """None: not built yet for Wan (docs/wan.md, not yet)."""
        return None

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        parts = self.components
        if kind == "latents":
            return parts.vae, str(parts.vae.dtype)
        return (
            parts.text_encoder, parts.tokenizer, tokenizer_identity(parts.tokenizer),
            self.options.text_length or parts.tokenizer.model_max_length,
        )  # fmt: skip

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"impasto.family": self.family}
