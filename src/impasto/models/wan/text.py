"""Wan 2.1's text conditioning, as diffusers' ``WanPipeline.encode_prompt`` computes it (and
musubi-tuner / diffusion-pipe cache it): the prompt cleaned (``prompt_clean``), tokenized to L
tokens (``model.wan.text_length``) with its attention mask, umT5's last hidden state run *with*
the mask, then every position past the prompt's own tokens set to zero: ``[B, L, D]``. Wan has
no pooled vector (the pooled field is an empty ``[B, 0]``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from impasto.models.components import PromptEmbeds

ENCODING_RULE = "wan: prompt_clean; umt5 last_hidden_state with mask; zeros past the tokens"
"""What :func:`encode_text` computes (part of the text cache's key: change it with it)."""


def encode_text(
    encoder: nn.Module, tokenizer: Any, prompts: list[str], length: int
) -> PromptEmbeds:
    """Wan's conditioning of ``prompts`` (module docstring) on umT5's device and dtype.
    Gradients flow unless the caller disables them."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("encode_text expects a non-empty list of prompt strings")
    # WanPipeline's own cleaning (imported here: the pipelines' module loads much of diffusers)
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    tokens = tokenizer(
        [prompt_clean(prompt) for prompt in prompts], padding="max_length", max_length=length,
        truncation=True, add_special_tokens=True, return_attention_mask=True,
        return_tensors="pt",
    )  # fmt: skip
    device = next(encoder.parameters()).device
    mask = tokens.attention_mask.to(device)
    # on the meta device (bench --estimate: shapes only) transformers cannot inspect a mask
    attention_mask = None if device.type == "meta" else mask
    hidden = encoder(tokens.input_ids.to(device), attention_mask).last_hidden_state
    hidden = hidden * mask[..., None].to(hidden.dtype)  # the pipeline's u[:v], then zeros
    return PromptEmbeds(hidden, hidden.new_zeros(hidden.shape[0], 0))


def tokenizer_identity(tokenizer: Any) -> str:
    """What the tokens depend on beyond the vocabulary (the text cache's key)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else type(tokenizer).__name__
    return repr((definition, ENCODING_RULE))
