"""SDXL model components and the text/size conditioning computed from them.

Conditioning follows SDXL (Podell et al. 2023, arXiv:2307.01952, sections 2.1-2.2) exactly as
diffusers' ``StableDiffusionXLPipeline.encode_prompt`` and ``_get_add_time_ids`` compute it, so
that a model trained here samples correctly with the stock diffusers pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from torch import Tensor, nn
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

# lora.targets preset → module-name suffixes of a transformers CLIP text encoder.
TEXT_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "attention_ff": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    "attention_ff_conv": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


def unused_text_layers(part: str, module: nn.Module) -> tuple[str, ...]:
    """SDXL reads encoder 1's *penultimate* hidden states and never its pooled output, so the
    last layer and the final norm of encoder 1 get no gradient."""
    if part != "text_encoder":
        return ()
    text_model = getattr(module, "text_model", module)  # transformers 5 flattens CLIPTextModel
    prefix = "text_model." if text_model is not module else ""
    last = len(text_model.encoder.layers) - 1
    return (f"{prefix}encoder.layers.{last}.", f"{prefix}final_layer_norm.")


@dataclass
class SDXLComponents:
    """The six SDXL parts a training run needs (the scheduler is a pure function elsewhere)."""

    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel  # CLIP ViT-L/14 in SDXL
    text_encoder_2: CLIPTextModelWithProjection  # OpenCLIP ViT-bigG/14 in SDXL
    tokenizer: CLIPTokenizer  # pads with "<|endoftext|>"
    tokenizer_2: CLIPTokenizer  # pads with "!"

    @property
    def vae_scaling_factor(self) -> float:
        """Latent scale: ``latents = vae.encode(x).latent_dist.sample() * vae_scaling_factor``."""
        return float(self.vae.config.scaling_factor)

    def to(self, device: torch.device | str) -> SDXLComponents:
        """Move the four networks to ``device`` in place (dtype unchanged); return ``self``."""
        for module in (self.unet, self.vae, self.text_encoder, self.text_encoder_2):
            module.to(device)
        return self


@dataclass(frozen=True)
class PromptEmbeds:
    """SDXL text conditioning for a batch of ``B`` prompts."""

    prompt_embeds: Tensor  # [B, 77, D1 + D2]: penultimate hidden states of both encoders
    pooled_prompt_embeds: Tensor  # [B, P]: projected pooled output (text_embeds) of encoder 2


def _tokenize(tokenizer: CLIPTokenizer, prompts: list[str]) -> Tensor:
    """Token ids ``[B, 77]``: truncated and padded to ``model_max_length`` like diffusers."""
    return tokenizer(
        prompts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def encode_prompts(components: SDXLComponents, prompts: list[str]) -> PromptEmbeds:
    """Encode ``prompts`` as ``StableDiffusionXLPipeline.encode_prompt`` does (no CFG, no LoRA).

    Each encoder sees its own tokenizer's ids; SDXL conditions on the penultimate layer
    (``hidden_states[-2]``) of both, concatenated on the feature axis ([B, 77, 768 + 1280] for
    the released model), and on encoder 2's projected pooled output ([B, 1280]). The result is
    on encoder 2's device and dtype. Gradients flow unless the caller disables them.
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError("encode_prompts expects a non-empty list of prompt strings")
    encoder_1, encoder_2 = components.text_encoder, components.text_encoder_2
    ids_1 = _tokenize(components.tokenizer, prompts).to(encoder_1.device)
    ids_2 = _tokenize(components.tokenizer_2, prompts).to(encoder_2.device)
    output_1 = encoder_1(ids_1, output_hidden_states=True)
    output_2 = encoder_2(ids_2, output_hidden_states=True)
    hidden_1 = output_1.hidden_states[-2].to(device=encoder_2.device)
    prompt_embeds = torch.cat([hidden_1, output_2.hidden_states[-2]], dim=-1)
    return PromptEmbeds(
        prompt_embeds=prompt_embeds.to(dtype=encoder_2.dtype),
        pooled_prompt_embeds=output_2.text_embeds,
    )


def add_time_ids(
    original_sizes: Tensor,
    crop_top_lefts: Tensor,
    target_sizes: Tensor,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """SDXL micro-conditioning ``[B, 6]``: orig_h, orig_w, crop_top, crop_left, target_h, target_w.

    Inputs are ``[B, 2]`` tensors in (height, width) / (top, left) order, as in diffusers
    ``StableDiffusionXLPipeline._get_add_time_ids`` and ``train_text_to_image_sdxl.py``.
    """
    for name, sizes in (
        ("original_sizes", original_sizes),
        ("crop_top_lefts", crop_top_lefts),
        ("target_sizes", target_sizes),
    ):
        if sizes.ndim != 2 or sizes.shape[1] != 2 or sizes.shape[0] != original_sizes.shape[0]:
            raise ValueError(f"{name} must have shape [B, 2], got {tuple(sizes.shape)}")
    return torch.cat([original_sizes, crop_top_lefts, target_sizes], dim=1).to(dtype)
