"""SD3.5's text conditioning, as diffusers' ``StableDiffusion3Pipeline.encode_prompt`` and
``train_dreambooth_lora_sd3.py`` compute it:

- tokens ``[B, 77 + L, D_t5]``: CLIP-L's and CLIP-G's *penultimate* hidden states of the prompt
  padded to 77 tokens, concatenated on the feature axis (768 + 1280) and zero-padded to T5's
  width (4096), followed on the sequence axis by T5's last hidden state of the prompt padded
  (or truncated) to L tokens (``model.sd3.text_length``), run without an attention mask;
- pooled ``[B, P_l + P_g]``: both CLIPs' projected pooled outputs (``text_embeds``),
  concatenated (768 + 1280 = 2048).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from impasto.models.components import PromptEmbeds

ENCODING_RULE = (
    "sd3: clip-l, clip-g hidden_states[-2] at 77 tokens, cat, padded to t5; t5 no mask; "
    "pooled text_embeds of both"
)
"""What :func:`encode_text` computes (part of the text cache's key: change it with it)."""


def _ids(tokenizer: Any, prompts: list[str], length: int, device: Any) -> Any:
    tokens = tokenizer(
        prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    )
    return tokens.input_ids.to(device)


def _clip(encoder: nn.Module, tokenizer: Any, prompts: list[str], device: Any):
    ids = _ids(tokenizer, prompts, tokenizer.model_max_length, next(encoder.parameters()).device)
    output = encoder(ids, output_hidden_states=True)
    return output.hidden_states[-2].to(device), output.text_embeds.to(device)


def encode_text(
    encoders: tuple[nn.Module, nn.Module, nn.Module], tokenizers: tuple[Any, Any, Any],
    prompts: list[str], length: int,
) -> PromptEmbeds:  # fmt: skip
    """SD3's conditioning of ``prompts`` (module docstring) on T5's device and dtype; the
    encoders are (CLIP-L, CLIP-G, T5) and their tokenizers. Gradients flow unless the caller
    disables them."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("encode_text expects a non-empty list of prompt strings")
    clip_l, clip_g, t5 = encoders
    tokenizer_l, tokenizer_g, tokenizer_t5 = tokenizers
    t5_device = next(t5.parameters()).device
    hidden_l, pooled_l = _clip(clip_l, tokenizer_l, prompts, t5_device)
    hidden_g, pooled_g = _clip(clip_g, tokenizer_g, prompts, t5_device)
    t5_hidden = t5(_ids(tokenizer_t5, prompts, length, t5_device), output_hidden_states=False)[0]
    clip_hidden = torch.cat([hidden_l, hidden_g], dim=-1)
    width = t5_hidden.shape[-1]
    if clip_hidden.shape[-1] > width:
        raise ValueError(
            f"CLIP-L + CLIP-G give {clip_hidden.shape[-1]} features, more than T5's {width}: "
            "use the text encoders of one SD3.5 release"
        )
    clip_hidden = nn.functional.pad(clip_hidden, (0, width - clip_hidden.shape[-1]))
    tokens = torch.cat([clip_hidden.to(t5_hidden.dtype), t5_hidden], dim=-2)
    return PromptEmbeds(tokens, torch.cat([pooled_l, pooled_g], dim=-1))
