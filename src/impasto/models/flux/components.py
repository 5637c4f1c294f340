"""FLUX.1's networks (diffusers' ``FluxTransformer2DModel`` and ``AutoencoderKL``, transformers'
``CLIPTextModel`` and ``T5EncoderModel``), its scheduler config, and the presets, randomly
initialised from ``model.init_seed``:

- ``tiny``: the real FLUX wiring at widths that run on a CPU in milliseconds (diffusers' own
  FLUX pipeline tests build theirs the same way);
- ``dev`` and ``schnell``: FLUX.1-dev's and FLUX.1-schnell's architectures at full size (the
  configs of their diffusers folders: a 12 B transformer, CLIP-L, T5-XXL, the 16-channel VAE)
  with random weights and the tiny T5 tokenizer, for ``impasto bench --estimate`` (built on
  the meta device there) and GPU benchmarks. Weights come from ``model.path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from impasto.models.flux.text import tiny_t5_tokenizer
from impasto.models.presets import CLIP_BOS_TOKEN_ID, CLIP_EOS_TOKEN_ID, CLIP_VOCAB_SIZE
from impasto.models.tokenizers import TOKENIZER_PAD_TOKEN, load_clip_tokenizer

PART_NAMES = ("transformer", "text_encoder", "text_encoder_2")
"""The parts, in order: the transformer, CLIP-L, T5 (frozen only: see
``transformer_families.check_parts``)."""

# FLUX.1-dev's scheduler/scheduler_config.json: the shift of the sampling ladder grows with
# the image's tokens (mu from base_shift at base_image_seq_len to max_shift at
# max_image_seq_len; FluxPipeline's calculate_shift).
DEV_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
}

# FLUX.1-schnell's: one fixed shift (1: none), no dynamic shifting.
SCHNELL_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
}

# FLUX.1's VAE: 16 latent channels, 8× downsampling, its latent statistics (vae/config.json).
FLUX_SCALING_FACTOR = 0.3611
FLUX_SHIFT_FACTOR = 0.1159

TINY_WIDTH = 32  # CLIP's and T5's hidden size in the tiny preset


@dataclass
class FluxComponents:
    """The transformer, its VAE, CLIP-L and T5 with their tokenizers, and the scheduler's
    config (the sampling ladder's shift)."""

    transformer: FluxTransformer2DModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    text_encoder_2: T5EncoderModel
    tokenizer: Any  # CLIPTokenizer, 77 tokens
    tokenizer_2: Any  # T5Tokenizer
    scheduler_config: dict[str, Any]

    def parts(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in PART_NAMES}

    def networks(self) -> dict[str, nn.Module]:
        return self.parts() | {"vae": self.vae}

    def scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)


def tiny_transformer(text_dim: int, pooled_dim: int) -> FluxTransformer2DModel:
    """One double-stream and one single-stream block, 2 heads of 16, guidance embedding (dev)."""
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16 * 4,  # the VAE's 16 channels, packed 2×2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to the head width, as FLUX's (16, 56, 56)
    )


def tiny_vae() -> AutoencoderKL:
    """FLUX's VAE layout (16 channels, 8× downsampling, no quant convs, its scale and shift)."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=8,
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=FLUX_SCALING_FACTOR,
        shift_factor=FLUX_SHIFT_FACTOR,
    )


def tiny_clip() -> CLIPTextModel:
    """CLIP-L's wiring (quick GELU, pooled at the end token) at width 32, 2 layers."""
    config = CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=TINY_WIDTH,
        intermediate_size=4 * TINY_WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        projection_dim=TINY_WIDTH,
        bos_token_id=CLIP_BOS_TOKEN_ID,
        eos_token_id=CLIP_EOS_TOKEN_ID,
        pad_token_id=CLIP_EOS_TOKEN_ID,
    )
    return CLIPTextModel(config)


def tiny_t5(vocab_size: int) -> T5EncoderModel:
    """T5 v1.1's wiring (gated GELU, relative positions) at width 32, 2 layers."""
    config = T5Config(
        vocab_size=vocab_size,
        d_model=TINY_WIDTH,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
    )
    return T5EncoderModel(config)


def full_transformer(guidance_embeds: bool) -> FluxTransformer2DModel:
    """FLUX.1's transformer (19 double-stream and 38 single-stream blocks of 24 × 128)."""
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=guidance_embeds, axes_dims_rope=(16, 56, 56),
    )  # fmt: skip


def full_vae() -> AutoencoderKL:
    """FLUX.1's VAE (vae/config.json of the release)."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
        layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
        use_quant_conv=False, use_post_quant_conv=False,
        scaling_factor=FLUX_SCALING_FACTOR, shift_factor=FLUX_SHIFT_FACTOR,
    )  # fmt: skip


def full_clip() -> CLIPTextModel:
    """CLIP ViT-L/14's text encoder (text_encoder/config.json of the release)."""
    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=CLIP_VOCAB_SIZE, hidden_size=768, intermediate_size=3072,
            num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
            hidden_act="quick_gelu", projection_dim=768, bos_token_id=CLIP_BOS_TOKEN_ID,
            eos_token_id=CLIP_EOS_TOKEN_ID, pad_token_id=CLIP_EOS_TOKEN_ID,
        )
    )  # fmt: skip


def full_t5() -> T5EncoderModel:
    """T5 v1.1 XXL's encoder (text_encoder_2/config.json of the release)."""
    return T5EncoderModel(
        T5Config(
            vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            relative_attention_num_buckets=32, relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
        )
    )  # fmt: skip


def _build_full(
    seed: int, text_length: int, guidance_embeds: bool, scheduler: dict
) -> FluxComponents:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        networks = full_transformer(guidance_embeds), full_vae(), full_clip(), full_t5()
    transformer, vae, text_encoder, text_encoder_2 = networks
    components = FluxComponents(
        transformer, vae, text_encoder, text_encoder_2, load_clip_tokenizer(TOKENIZER_PAD_TOKEN),
        tiny_t5_tokenizer(text_length), dict(scheduler),
    )  # fmt: skip
    for module in components.networks().values():
        module.eval()
    return components


def build_dev(seed: int, text_length: int) -> FluxComponents:
    """FLUX.1-dev's architecture, random (the module docstring)."""
    return _build_full(seed, text_length, True, DEV_SCHEDULER)


def build_schnell(seed: int, text_length: int) -> FluxComponents:
    """FLUX.1-schnell's architecture, random: no guidance embedding, a fixed shift of 1."""
    return _build_full(seed, text_length, False, SCHNELL_SCHEDULER)


def build_tiny(seed: int, text_length: int) -> FluxComponents:
    """The ``tiny`` preset from ``seed`` (the global RNG is left as it was); T5 pads to
    ``text_length`` tokens."""
    tokenizer_2 = tiny_t5_tokenizer(text_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = tiny_clip()
        text_encoder_2 = tiny_t5(len(tokenizer_2))
        transformer = tiny_transformer(TINY_WIDTH, TINY_WIDTH)
        vae = tiny_vae()
    components = FluxComponents(
        transformer, vae, text_encoder, text_encoder_2,
        load_clip_tokenizer(TOKENIZER_PAD_TOKEN), tokenizer_2, dict(DEV_SCHEDULER),
    )  # fmt: skip
    for module in components.networks().values():
        module.eval()
    return components


PRESETS = {"tiny": build_tiny, "dev": build_dev, "schnell": build_schnell}
"""``model.preset`` → ``builder(seed, text_length)``."""
