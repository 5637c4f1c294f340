"""Wan 2.1 text-to-video's networks (diffusers' ``WanTransformer3DModel`` and
``AutoencoderKLWan``, transformers' ``UMT5EncoderModel``), its scheduler config, and the
presets, randomly initialised from ``model.init_seed``:

- ``tiny``: the real Wan 2.1 wiring at widths that run on a CPU in milliseconds (diffusers' own
  Wan pipeline tests build theirs the same way): two blocks of 2 heads of 12, a 3-channel-base
  ``AutoencoderKLWan`` (16 latent channels, 8× spatial and 4× temporal compression), a 2-layer
  umT5 over the tiny T5 tokenizer of the flux family;
- ``1.3b`` and ``14b``: Wan2.1-T2V-1.3B's and -14B's architectures at full size (the configs of
  their diffusers folders, ``Wan-AI/Wan2.1-T2V-*-Diffusers``) with random weights and the tiny
  tokenizer, for ``impasto bench --estimate`` (built on the meta device there). Weights come
  from ``model.path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
from torch import nn
from transformers import UMT5Config, UMT5EncoderModel

from impasto.models.flux.text import tiny_t5_tokenizer

PART_NAMES = ("transformer", "text_encoder")
"""The parts, in order: the transformer, umT5 (frozen only: ``build``)."""

# Wan2.1-T2V-*-Diffusers' scheduler/scheduler_config.json: UniPC on flow sigmas shifted by
# flow_shift (3.0 for 480p; WanPipeline's docs give 5.0 for 720p).
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "final_sigmas_type": "zero",
    "lower_order_final": True,
    "predict_x0": True,
    "timestep_spacing": "linspace",
}
SCHEDULER_CLASS = "UniPCMultistepScheduler"

TINY_TEXT_WIDTH = 32  # the tiny umT5's width (the transformer's text_dim)


@dataclass
class WanComponents:
    """The transformer, its video VAE, umT5 with its tokenizer, and the scheduler's config."""

    transformer: WanTransformer3DModel
    vae: AutoencoderKLWan
    text_encoder: UMT5EncoderModel
    tokenizer: Any  # a T5 / umT5 tokenizer
    scheduler_config: dict[str, Any]

    def parts(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in PART_NAMES}

    def networks(self) -> dict[str, nn.Module]:
        return self.parts() | {"vae": self.vae}

    def scheduler(self) -> UniPCMultistepScheduler:
        return UniPCMultistepScheduler.from_config(self.scheduler_config)


def tiny_transformer() -> WanTransformer3DModel:
    """Two blocks of 2 heads of 12 (width 24), Wan 2.1's RMS q/k norm across heads and its
    cross-attention norm."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=TINY_TEXT_WIDTH, freq_dim=256, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip


def tiny_vae() -> AutoencoderKLWan:
    """Wan 2.1's VAE layout at base width 3 (diffusers' Wan pipeline tests)."""
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )  # fmt: skip


def _umt5(vocab: int, width: int, kv: int, ff: int, layers: int, heads: int) -> UMT5EncoderModel:
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab, d_model=width, d_kv=kv, d_ff=ff, num_layers=layers,
            num_heads=heads, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
            relative_attention_max_distance=128, tie_word_embeddings=False,
        )
    )  # fmt: skip


def tiny_umt5(vocab: int) -> UMT5EncoderModel:
    return _umt5(vocab, TINY_TEXT_WIDTH, 8, 64, 2, 4)


def full_transformer(large: bool) -> WanTransformer3DModel:
    """Wan2.1-T2V-14B's (40 blocks of 40 × 128, FFN 13824) or -1.3B's (30 blocks of 12 × 128,
    FFN 8960) transformer (transformer/config.json of the releases)."""
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=40 if large else 12, attention_head_dim=128,
        in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
        ffn_dim=13824 if large else 8960, num_layers=40 if large else 30, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )  # fmt: skip


def full_umt5() -> UMT5EncoderModel:
    """umT5-XXL's encoder (text_encoder/config.json of the releases)."""
    return _umt5(256384, 4096, 64, 10240, 24, 64)


def _components(networks: tuple, text_length: int) -> WanComponents:
    transformer, vae, umt5 = networks
    components = WanComponents(
        transformer, vae, umt5, tiny_t5_tokenizer(text_length), dict(SCHEDULER)
    )
    for module in components.networks().values():
        module.eval()
    return components


def _build_full(seed: int, text_length: int, large: bool) -> WanComponents:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        networks = full_transformer(large), AutoencoderKLWan(), full_umt5()
    return _components(networks, text_length)


def build_1_3b(seed: int, text_length: int) -> WanComponents:
    """Wan2.1-T2V-1.3B's architecture, random (the module docstring)."""
    return _build_full(seed, text_length, large=False)


def build_14b(seed: int, text_length: int) -> WanComponents:
    """Wan2.1-T2V-14B's architecture, random (the module docstring)."""
    return _build_full(seed, text_length, large=True)


def build_tiny(seed: int, text_length: int) -> WanComponents:
    """The ``tiny`` preset from ``seed`` (the global RNG is left as it was); umT5 reads
    ``text_length`` tokens."""
    tokenizer = tiny_t5_tokenizer(text_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        umt5 = tiny_umt5(len(tokenizer))
        transformer = tiny_transformer()
        vae = tiny_vae()
    return _components((transformer, vae, umt5), text_length)


PRESETS = {"tiny": build_tiny, "1.3b": build_1_3b, "14b": build_14b}
"""``model.preset`` → ``builder(seed, text_length)``."""
