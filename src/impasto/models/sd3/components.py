"""Stable Diffusion 3.5's networks (diffusers' ``SD3Transformer2DModel`` and ``AutoencoderKL``,
transformers' ``CLIPTextModelWithProjection`` twice (CLIP-L, CLIP-G) and ``T5EncoderModel``),
its scheduler config, and the presets, randomly initialised from ``model.init_seed``:

- ``tiny``: the real SD3.5 wiring at widths that run on a CPU in milliseconds (diffusers' own
  SD3 pipeline tests build theirs the same way): two joint blocks of 2 heads of 64, the first
  with SD3.5 Medium's second (dual) attention, RMS query/key norms as SD3.5, CLIP-L and CLIP-G of
  different widths whose features are padded to T5's, the 16-channel VAE with SD3's scale and
  shift;
- ``medium`` and ``large``: SD3.5 Medium's and Large's architectures at full size (the configs
  of their diffusers folders) with random weights and the tiny T5 tokenizer, for
  ``impasto bench --estimate`` (built on the meta device there) and GPU benchmarks. Weights
  come from ``model.path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5EncoderModel

from impasto.models.flux.components import full_t5, tiny_t5
from impasto.models.flux.text import tiny_t5_tokenizer
from impasto.models.presets import CLIP_BOS_TOKEN_ID, CLIP_EOS_TOKEN_ID, CLIP_VOCAB_SIZE
from impasto.models.tokenizers import (
    TOKENIZER_2_PAD_TOKEN,
    TOKENIZER_PAD_TOKEN,
    load_clip_tokenizer,
)

PART_NAMES = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
"""The parts, in order: the transformer, CLIP-L, CLIP-G, T5 (frozen only: ``build``)."""

# SD3.5's scheduler/scheduler_config.json: one fixed shift of 3, no dynamic shifting.
SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}

# SD3's VAE: 16 latent channels, 8× downsampling, its latent statistics (vae/config.json).
SD3_SCALING_FACTOR = 1.5305
SD3_SHIFT_FACTOR = 0.0609

TINY_T5_WIDTH = 32  # flux's tiny T5 (the joint attention width of the tiny transformer)
TINY_CLIP_L_WIDTH = 8
TINY_CLIP_G_WIDTH = 16  # L + G = 24 features, padded to T5's 32 as 768 + 1280 are to 4096


@dataclass
class Sd3Components:
    """The transformer, its VAE, CLIP-L, CLIP-G and T5 with their tokenizers, and the
    scheduler's config (the sampling ladder's shift)."""

    transformer: SD3Transformer2DModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModelWithProjection  # CLIP-L
    text_encoder_2: CLIPTextModelWithProjection  # CLIP-G
    text_encoder_3: T5EncoderModel
    tokenizer: Any  # CLIPTokenizer, pads with <|endoftext|>
    tokenizer_2: Any  # CLIPTokenizer, pads with "!"
    tokenizer_3: Any  # T5 tokenizer
    scheduler_config: dict[str, Any]

    def parts(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in PART_NAMES}

    def networks(self) -> dict[str, nn.Module]:
        return self.parts() | {"vae": self.vae}

    def scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)


def _clip(
    width: int, layers: int, heads: int, act: str, pad_token_id: int, intermediate: int
) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(
        CLIPTextConfig(
            vocab_size=CLIP_VOCAB_SIZE, hidden_size=width, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
            hidden_act=act, projection_dim=width, bos_token_id=CLIP_BOS_TOKEN_ID,
            eos_token_id=CLIP_EOS_TOKEN_ID, pad_token_id=pad_token_id,
        )
    )  # fmt: skip


def tiny_clips() -> tuple[CLIPTextModelWithProjection, CLIPTextModelWithProjection]:
    """CLIP-L's wiring (quick GELU, 2 layers, width 8) and CLIP-G's (GELU, 3 layers, 16)."""
    clip_l = _clip(TINY_CLIP_L_WIDTH, 2, 2, "quick_gelu", CLIP_EOS_TOKEN_ID, 4 * TINY_CLIP_L_WIDTH)
    clip_g = _clip(TINY_CLIP_G_WIDTH, 3, 2, "gelu", 0, 4 * TINY_CLIP_G_WIDTH)
    return clip_l, clip_g


def tiny_transformer() -> SD3Transformer2DModel:
    """Two joint blocks of 2 heads of 64 (width 128): as in every SD3 release, heads of 64 and
    as many heads as blocks, which ComfyUI reads the architecture from (depth = width / 64);
    the first block with a second attention (SD3.5 Medium's dual attention), RMS q/k norms."""
    return SD3Transformer2DModel(
        sample_size=8,  # latents of 64×64 images
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=64,
        num_attention_heads=2,
        joint_attention_dim=TINY_T5_WIDTH,
        caption_projection_dim=128,  # the transformer's width, as SD3.5's
        pooled_projection_dim=TINY_CLIP_L_WIDTH + TINY_CLIP_G_WIDTH,
        out_channels=16,
        pos_embed_max_size=16,  # up to 256×256 images
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )


def _vae(channels: tuple[int, ...], layers: int, groups: int, sample_size: int) -> AutoencoderKL:
    """SD3's VAE layout (16 channels, 8× downsampling, no quant convs, its scale and shift)."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=channels,
        layers_per_block=layers, latent_channels=16, norm_num_groups=groups,
        sample_size=sample_size, use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=SD3_SCALING_FACTOR, shift_factor=SD3_SHIFT_FACTOR,
    )  # fmt: skip


def tiny_vae() -> AutoencoderKL:
    return _vae((8, 8, 16, 16), 1, 8, 64)


def full_transformer(large: bool) -> SD3Transformer2DModel:
    """SD3.5 Large's (38 joint blocks of 38 × 64) or Medium's (24 of 24 × 64, blocks 0-12 with
    the second attention) transformer (transformer/config.json of the releases)."""
    depth = 38 if large else 24
    return SD3Transformer2DModel(
        sample_size=128, patch_size=2, in_channels=16, num_layers=depth,
        attention_head_dim=64, num_attention_heads=depth, joint_attention_dim=4096,
        caption_projection_dim=64 * depth, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=192 if large else 384,
        dual_attention_layers=() if large else tuple(range(13)), qk_norm="rms_norm",
    )  # fmt: skip


def full_vae() -> AutoencoderKL:
    """SD3.5's VAE (vae/config.json of the releases)."""
    return _vae((128, 256, 512, 512), 2, 32, 1024)


def full_clips() -> tuple[CLIPTextModelWithProjection, CLIPTextModelWithProjection]:
    """CLIP ViT-L/14's and OpenCLIP ViT-bigG/14's text encoders with their projections."""
    clip_l = _clip(768, 12, 12, "quick_gelu", CLIP_EOS_TOKEN_ID, 3072)
    clip_g = _clip(1280, 32, 20, "gelu", 0, 5120)
    return clip_l, clip_g


def _components(networks: tuple, text_length: int) -> Sd3Components:
    transformer, vae, (clip_l, clip_g), t5 = networks
    components = Sd3Components(
        transformer, vae, clip_l, clip_g, t5, load_clip_tokenizer(TOKENIZER_PAD_TOKEN),
        load_clip_tokenizer(TOKENIZER_2_PAD_TOKEN), tiny_t5_tokenizer(text_length),
        dict(SCHEDULER),
    )  # fmt: skip
    for module in components.networks().values():
        module.eval()
    return components


def _build_full(seed: int, text_length: int, large: bool) -> Sd3Components:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        networks = full_transformer(large), full_vae(), full_clips(), full_t5()
    return _components(networks, text_length)


def build_medium(seed: int, text_length: int) -> Sd3Components:
    """SD3.5 Medium's architecture, random (the module docstring)."""
    return _build_full(seed, text_length, large=False)


def build_large(seed: int, text_length: int) -> Sd3Components:
    """SD3.5 Large's architecture, random (the module docstring)."""
    return _build_full(seed, text_length, large=True)


def build_tiny(seed: int, text_length: int) -> Sd3Components:
    """The ``tiny`` preset from ``seed`` (the global RNG is left as it was); T5 pads to
    ``text_length`` tokens."""
    tokenizer_3 = tiny_t5_tokenizer(text_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clips = tiny_clips()
        t5 = tiny_t5(len(tokenizer_3))
        transformer = tiny_transformer()
        vae = tiny_vae()
    return _components((transformer, vae, clips, t5), text_length)


PRESETS = {"tiny": build_tiny, "medium": build_medium, "large": build_large}
"""``model.preset`` → ``builder(seed, text_length)``."""
PRESET_DEPTHS = {"tiny": 2, "medium": 24, "large": 38}
"""``model.preset`` → its joint blocks (known without building it)."""
PRESET_VARIANTS = {"tiny": "medium", "medium": "medium", "large": "large"}
"""``model.preset`` → the release it has the wiring of (tiny: Medium's second attention)."""
