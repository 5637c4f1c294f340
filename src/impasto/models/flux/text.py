"""FLUX's text conditioning, as diffusers' ``FluxPipeline.encode_prompt`` and
``train_dreambooth_lora_flux.py`` compute it:

- tokens: T5's last hidden state ``[B, L, D]`` of the prompt padded (or truncated) to L tokens
  (``model.flux.text_length``, 512 for FLUX.1-dev). T5 is run *without* an attention mask and
  the padding is kept as T5 encodes it: the transformer was trained on exactly that;
- pooled: CLIP-L's ``pooler_output`` ``[B, 768]`` (the final-norm state at the end token) of
  the prompt padded to 77 tokens.

:func:`tiny_t5_tokenizer` builds a small Unigram T5 tokenizer in code (the tiny preset's; no
file is shipped or downloaded): the special tokens of T5 (``<pad>`` 0, ``</s>`` 1, ``<unk>``
2), then single characters and ``▁``-prefixed letters, so every prompt tokenizes offline.
"""

from __future__ import annotations

import string
from typing import Any

from torch import nn
from transformers import T5Tokenizer

from impasto.models.components import PromptEmbeds

ENCODING_RULE = "flux: clip pooler_output at 77 tokens; t5 last_hidden_state, no mask"
"""What :func:`encode_text` computes (part of the text cache's key: change it with it)."""

TINY_T5_CHARACTERS = string.ascii_letters + string.digits + string.punctuation


def tiny_t5_tokenizer(length: int) -> T5Tokenizer:
    """A small T5 tokenizer (about 150 pieces) padding to ``length`` tokens."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(char, -5.0) for char in TINY_T5_CHARACTERS]
    pieces += [("▁" + char, -4.0) for char in string.ascii_letters]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=length)


def _ids(tokenizer: Any, prompts: list[str], length: int, device: Any) -> Any:
    tokens = tokenizer(
        prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    )
    return tokens.input_ids.to(device)


def encode_text(
    clip: nn.Module, clip_tokenizer: Any, t5: nn.Module, t5_tokenizer: Any,
    prompts: list[str], length: int,
) -> PromptEmbeds:  # fmt: skip
    """FLUX's conditioning of ``prompts`` (module docstring): T5 tokens ``[B, length, D]`` and
    CLIP's pooled output ``[B, P]``, each on its encoder's device and dtype. Gradients flow
    unless the caller disables them."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("encode_text expects a non-empty list of prompt strings")
    clip_device = next(clip.parameters()).device
    clip_ids = _ids(clip_tokenizer, prompts, clip_tokenizer.model_max_length, clip_device)
    pooled = clip(clip_ids, output_hidden_states=False).pooler_output
    t5_ids = _ids(t5_tokenizer, prompts, length, next(t5.parameters()).device)
    hidden = t5(t5_ids, output_hidden_states=False)[0]
    return PromptEmbeds(hidden, pooled)


def tokenizer_identity(tokenizer: Any) -> str:
    """What T5's tokens depend on beyond its vocabulary (the text cache's key): the fast
    tokenizer's whole definition, and :data:`ENCODING_RULE`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else type(tokenizer).__name__
    return repr((definition, ENCODING_RULE))
