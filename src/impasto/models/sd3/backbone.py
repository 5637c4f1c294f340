"""SD3.5 as a :class:`~impasto.models.backbone.Backbone`: the only module that knows how the SD3
transformer, its three text encoders and its VAE are called (docs/sd3.md).

The denoiser's input and output are latents ``[B, 16, h, w]`` as for every family (the SD3
transformer patchifies them itself), so the objective (rectified flow, target ε − x0) and the
samplers work unchanged. The transformer is called as diffusers'
``train_dreambooth_lora_sd3.py`` and ``StableDiffusion3Pipeline`` call it: latents, the time
``t·T`` (T = 1000), the joint text tokens and the pooled text vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from impasto.models import autoencoder
from impasto.models.backbone import Batch, adapter_layers
from impasto.models.components import TEXT_TARGETS, PromptEmbeds
from impasto.models.sd3.options import Sd3Options
from impasto.models.sd3.text import ENCODING_RULE, encode_text
from impasto.models.transformer_families import TransformerBackbone
from impasto.models.video_autoencoder import FrameReader

BLOCK_LIST = "transformer_blocks"
PATCH = 2  # latent pixels per token side (the transformer's patch_size)

# inside a joint block: the image stream's attention (and SD3.5 Medium's second one, attn2,
# over the image tokens alone), the text stream's projections (the last block has no text
# output: no to_add_out, no ff_context)
_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
              "to_add_out")  # fmt: skip
_FEED_FORWARD = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
_MODULATION = ("norm1.linear", "norm1_context.linear")

# lora.targets preset → module-name suffixes inside the transformer's blocks (docs/sd3.md,
# LoRA). attention is diffusers' train_dreambooth_lora_sd3.py default --lora_layers
# (attn.to_q ... attn.to_add_out) plus the same projections of the second attention (attn2).
TRANSFORMER_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": _ATTENTION,
    "attention_ff": (*_ATTENTION, *_FEED_FORWARD),
    "attention_ff_conv": (*_ATTENTION, *_FEED_FORWARD, *_MODULATION),  # SD3 has no convs
}


@dataclass(frozen=True)
class Sd3Conditioning:
    """SD3's conditioning for B rows: the joint text tokens and the pooled vector."""

    prompt_embeds: Tensor  # [B, 77 + L, D_t5]
    pooled_prompt_embeds: Tensor  # [B, P_l + P_g]

    def cat(self, other: Sd3Conditioning) -> Sd3Conditioning:
        """``[self; other]`` along the batch axis (classifier-free guidance)."""
        return Sd3Conditioning(
            torch.cat([self.prompt_embeds, other.prompt_embeds]),
            torch.cat([self.pooled_prompt_embeds, other.pooled_prompt_embeds]),
        )


class Sd3Backbone(TransformerBackbone):
    """SD3.5's transformer, VAE, CLIP-L, CLIP-G and T5 behind the backbone protocol."""

    family = "sd3"
    # samples on its own ladder (OwnSampling) but with classifier-free guidance, not a
    # guidance input (impasto.inference writes "CFG scale" for it, not "Distilled CFG Scale")
    classifier_free_guidance = True

    options_type = Sd3Options

    def blocks(self) -> dict[str, nn.Module]:
        blocks = getattr(self.components.transformer, BLOCK_LIST)
        return {f"{BLOCK_LIST}.{index}": block for index, block in enumerate(blocks)}

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        """None: SD3 reads both CLIPs' penultimate layer *and* their projected pooled output
        (last layer, final norm, projection), and the transformer reads every weight."""
        return ()

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        if part == "transformer":
            module = self.components.transformer
            targets = adapter_layers(module, TRANSFORMER_TARGETS[preset])
            return [name for name in targets if name.startswith(BLOCK_LIST + ".")]
        if part in ("text_encoder", "text_encoder_2"):
            return adapter_layers(getattr(self.components, part), TEXT_TARGETS[preset])
        raise ValueError(f"parts.{part}: T5 trains frozen only in the sd3 family; remove it")

    # -- latents (impasto.models.autoencoder) ------------------------------------------
    def latent_posterior(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        return autoencoder.latent_posterior(self.components.vae, pixels)

    def clip_posterior(
        self, read_frames: FrameReader, num_frames: int, chunk_frames: int = 16
    ) -> tuple[Tensor, Tensor]:
        raise ValueError("data.video: the sd3 family trains on images; remove data.video")

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
        """``(C, h, w)`` of an H×W image (``frames``: None or 1; SD3 takes no clips)."""
        if frames not in (None, 1):
            raise ValueError("data.video: the sd3 family trains on images; remove data.video")
        channels, factor = self.latent_format()
        step = factor * PATCH
        if height <= 0 or width <= 0 or height % step or width % step:
            raise ValueError(
                f"height and width must be positive multiples of {step} (the VAE's "
                f"downsampling {factor} × SD3's 2×2 patches), got {height}x{width}"
            )
        table = self.components.transformer.config.pos_embed_max_size  # patches a side
        limit = (table or 0) * step
        if table is not None and (height > limit or width > limit):
            raise ValueError(
                f"height and width must be at most {limit} (the transformer's position "
                f"table of {limit // step} patches a side), got {height}x{width}"
            )
        return channels, height // factor, width // factor

    # -- conditioning ---------------------------------------------------------------------
    def _encoders(self) -> tuple[tuple[nn.Module, ...], tuple[object, ...]]:
        parts = self.components
        return (
            (parts.text_encoder, parts.text_encoder_2, parts.text_encoder_3),
            (parts.tokenizer, parts.tokenizer_2, parts.tokenizer_3),
        )

    def encode_captions(self, captions: list[str]) -> PromptEmbeds:
        encoders, tokenizers = self._encoders()
        return encode_text(encoders, tokenizers, captions, self.options.text_length)

    def text_from_cache(self, batch: Batch) -> PromptEmbeds | None:
        if batch.prompt_embeds is None:
            return None
        device, dtype = self.device, self.dtype
        return PromptEmbeds(
            batch.prompt_embeds.to(device, dtype), batch.pooled_prompt_embeds.to(device, dtype)
        )

    def condition(self, text: PromptEmbeds, batch: Batch) -> Sd3Conditioning:
        return Sd3Conditioning(text.prompt_embeds, text.pooled_prompt_embeds)

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> Sd3Conditioning:
        """The prompts' conditioning on the transformer's device and dtype."""
        embeds = self.encode_text(prompts)
        device, dtype = self.device, self.dtype
        return Sd3Conditioning(
            embeds.prompt_embeds.to(device=device, dtype=dtype),
            embeds.pooled_prompt_embeds.to(device=device, dtype=dtype),
        )

    # -- sampling as StableDiffusion3Pipeline (impasto.sampling.process.OwnSampling) ---------
    def sampling_ladder(self, num_steps: int, height: int, width: int) -> tuple[Tensor, Tensor]:
        """``StableDiffusion3Pipeline``'s ladder, from the model's own scheduler config
        (SD3.5's: n times from 1, evenly spaced in the unshifted time, shifted by 3), the same
        at every size; ``objective.flow_shift`` plays no part (docs/sd3.md, Shift)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        scheduler = self.components.scheduler()
        if scheduler.config.use_dynamic_shifting:
            raise ValueError(
                "the model's scheduler shifts by the image size (use_dynamic_shifting), which "
                "the SD3.5 releases do not; use their scheduler config (shift 3.0)"
            )
        scheduler.set_timesteps(num_steps)
        return scheduler.timesteps.float(), scheduler.sigmas.float()

    def sampling_shift(self) -> float:
        """The shift of the model's scheduler config (SD3.5's: 3.0)."""
        return float(self.components.scheduler_config.get("shift", 1.0))

    def embedded_guidance(self, condition: Sd3Conditioning, guidance_scale: float) -> None:
        """None: SD3 samples with classifier-free guidance, as StableDiffusion3Pipeline."""
        return None

    def forward(
        self, x_t: Tensor, timesteps: Tensor, condition: Sd3Conditioning,
        skip_layers: list[int] | None = None,
    ) -> Tensor:  # fmt: skip
        """The velocity at latents ``x_t`` ``[B, C, h, w]`` and times ``t·T`` ``[B]`` (or one
        time for all rows); ``skip_layers``: joint blocks to leave out (skip-layer guidance,
        sampling only). The inputs go in the transformer's weight dtype (its patch embedding
        is a convolution, which takes no other: diffusers' script casts them the same way)."""
        dtype = self.dtype
        return self.components.transformer(
            hidden_states=x_t.to(dtype),
            timestep=timesteps.expand(x_t.shape[0]),
            encoder_hidden_states=condition.prompt_embeds.to(dtype),
            pooled_projections=condition.pooled_prompt_embeds.to(dtype),
            skip_layers=skip_layers,
            return_dict=False,
        )[0]

    def forward_packed(
        self, x_ts: list[Tensor], timesteps: list[Tensor], conditions: list[Sd3Conditioning],
        capacity: int | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """No packing yet: one forward per group."""
        return [self.forward(*group) for group in zip(x_ts, timesteps, conditions, strict=True)]

    def sequence_length(self, height: int, width: int, frames: int = 1) -> int:
        """Image tokens of an H×W image (the text's are added to each by the transformer)."""
        if frames != 1:
            raise ValueError("data.video: the sd3 family trains on images; remove data.video")
        _, rows, cols = self.latent_shape(height, width)
        return (rows // PATCH) * (cols // PATCH)

    def tensor_parallel_plan(self) -> None:
        """None: not built yet for SD3 (docs/sd3.md, not yet)."""
        return None

    def context_parallel_plan(self) -> None:
        """None: not built yet for SD3 (docs/sd3.md, not yet)."""
        return None

    def pipeline_stage(self, stage: int, num_stages: int) -> None:
        """None: not built yet for SD3 (docs/sd3.md, not yet)."""
        return None

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        parts = self.components
        if kind == "latents":
            return parts.vae, str(parts.vae.dtype)
        backend = getattr(parts.tokenizer_3, "backend_tokenizer", None)
        t5_definition = backend.to_str() if backend is not None else type(parts.tokenizer_3)
        return (
            parts.text_encoder, parts.text_encoder_2, parts.text_encoder_3, parts.tokenizer,
            parts.tokenizer_2, parts.tokenizer_3, repr((t5_definition, ENCODING_RULE)),
            self.options.text_length,
        )  # fmt: skip

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"impasto.family": self.family}
