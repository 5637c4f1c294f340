"""The DiT family's config section, ``model.dit``: the architecture beyond its size.

Validated like every section (unknown key, wrong type or value: one line naming
``model.dit.<key>``) when the family is built or a run's config is checked.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from impasto.config.section import Int, Section

MAX_GRID = 1024  # patches per side of a learned position table
MAX_TEXT_LENGTH = 4096  # text tokens per prompt (T5 models read 512; Wan's UMT5 512)
Kernel = Literal["auto", "flex", "varlen", "grouped", "sdpa"]
KERNELS = get_args(Kernel)  # model.dit.kernel


class DiTOptions(Section):
    """``model.dit``: block variant, patches, positions, normalisation, text length, the
    attention layout and the attention kernel of packs."""

    block: Literal["adaln", "cross", "llama"] = Field(
        "cross",
        description="adaln: adaLN-Zero from time and pooled text (DiT); cross: adaLN-Zero plus "
        "cross-attention to the text tokens (NeMo's default); llama: RMSNorm, SwiGLU, adaLN "
        "modulation and cross-attention (MovieGen)",
    )
    patch_size: Literal[1, 2, 4] = Field(2, description="latent pixels per patch side")
    frame_patch: Literal[1, 2] = Field(
        1,
        description="latent frames per token: a clip's frame count must be a multiple of it "
        "(2 cannot take images, which are one frame)",
    )
    qk_norm: Literal["rms", "layer", "none"] = Field(
        "rms", description="normalise queries and keys per head (training stability)"
    )
    position: Literal["rope", "sincos", "learned"] = Field(
        "rope",
        description="rope: axial rotary positions over (frame, row, column); sincos: fixed 2-D "
        "sine-cosine embedding added to the tokens (DiT); learned: a table of max_grid patches "
        "per side",
    )
    max_grid: Int = Field(
        64, ge=1, le=MAX_GRID, description="patches per side of the learned position table"
    )
    text_length: Int | None = Field(
        None,
        ge=1,
        le=MAX_TEXT_LENGTH,
        description="text tokens per prompt: a single text encoder in model.text_encoder "
        "pads (with zeros) or truncates to it (default: its tokenizer's model_max_length, at "
        "most 256); with SDXL's CLIP pair (77 tokens) the transformer reads the first "
        "text_length of them (CLIP is causal: the same states; default: all 77)",
    )
    autoencoder: Literal["image", "video"] = Field(
        "image",
        description="image: an image VAE (the demo VAE, or model.vae: a diffusers "
        "AutoencoderKL); video: a causal video VAE that takes clips (the tiny demo video VAE, "
        "or model.vae: Wan 2.1's AutoencoderKLWan folder), for data.video",
    )
    attention: Literal["full", "spatiotemporal", "alternating"] = Field(
        "full",
        description="which tokens self-attention reads: full (every token of its sample); "
        "spatiotemporal (ST-DiT: each block attends within each frame, then within each patch "
        "position across the frames); alternating (Latte: even blocks within each frame, odd "
        "blocks within each patch position)",
    )
    kernel: Kernel = Field(
        "auto",
        description="the kernel of packed batches: flex (FlexAttention document mask), varlen "
        "(torch.nn.attention.varlen, CUDA, bf16/fp16), grouped (SDPA over each shape group), "
        "sdpa (SDPA with a mask over the pack); auto: varlen on CUDA in bf16/fp16, else flex "
        "on CUDA, grouped on the CPU",
    )

    @field_validator("attention", mode="before")
    @classmethod
    def _kernel_moved(cls, value: Any) -> Any:
        # model.dit.attention named the packed kernel before the frame axis came.
        if value in KERNELS:
            raise PydanticCustomError(
                "kernel_moved",
                "the kernel option is now model.dit.kernel: set model.dit.kernel: {kernel} "
                "(attention now takes full, spatiotemporal or alternating)",
                {"kernel": value},
            )
        return value
