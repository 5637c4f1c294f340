"""The DiT's text encoders: SDXL's CLIP pair, or one transformers text encoder from a local
folder (issue #31), and how one encoder's output becomes the DiT's conditioning.

A text folder (``model.text_encoder``, or an exported DiT) has one of three layouts:

- SDXL: ``text_encoder/`` and ``text_encoder_2/`` (with ``tokenizer/`` and ``tokenizer_2/``);
  SDXL's conditioning (:func:`impasto.models.components.encode_prompts`);
- diffusers, one encoder: ``text_encoder/`` and ``tokenizer/`` (PixArt, Wan);
- transformers: one encoder's ``config.json`` and safetensors weights, and its tokenizer's
  files, side by side (``save_pretrained`` of both into one folder).

One encoder conditions as PixArt, SD3 and Wan do (:func:`encode_single`):

- tokens: the **last hidden state** ``[B, L, D]`` (T5's ``last_hidden_state``; not CLIP's
  penultimate layer, which SDXL reads). Prompts are padded on the right, or truncated, to L
  tokens: ``model.dit.text_length``, by default the tokenizer's ``model_max_length`` capped at
  :data:`DEFAULT_MAX_TEXT_LENGTH`. The encoder sees the attention mask, so a prompt's tokens
  do not depend on L. The padding positions are then set to zero (Wan 2.1's choice). The DiT's
  cross-attention does not mask them: the text cache, packs and every attention kernel stay as
  they are, and a model sees the same zeros in training and sampling;
- pooled: the encoder's projected output (``text_embeds``, CLIP with projection), else its
  pooled output (``pooler_output``: CLIPTextModel, BERT), else the mean of the hidden states
  over the prompt's real tokens (T5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoTokenizer

from impasto.models.components import PromptEmbeds

CLIP_TOKENS = 77  # what SDXL's CLIP pair encodes
DEFAULT_MAX_TEXT_LENGTH = 256  # tokens; SD3 and PixArt-Σ read T5 at 256 and 300

ENCODER_CLASSES: dict[str, str] = {
    "t5": "T5EncoderModel",
    "mt5": "MT5EncoderModel",
    "umt5": "UMT5EncoderModel",
}
"""``config.json``'s ``model_type`` → the transformers class of its encoder alone (a full T5
folder loads its encoder only). Other types: the class its ``architectures`` names, else
``AutoModel``."""

# lora.targets preset → module-name suffixes of one text encoder: CLIP (q_proj ... fc2), T5 and
# UMT5 (q, k, v, o, wi, wo, wi_0, wi_1), BERT (query, key, value), LLaMA-like (o_proj ...).
SINGLE_TEXT_TARGETS: dict[str, tuple[str, ...]] = {
    "attention": (
        *("q_proj", "k_proj", "v_proj", "out_proj", "o_proj"),
        *("q", "k", "v", "o", "query", "key", "value"),
    ),
    "attention_ff": (
        *("q_proj", "k_proj", "v_proj", "out_proj", "o_proj", "fc1", "fc2"),
        *("q", "k", "v", "o", "wi", "wo", "wi_0", "wi_1", "query", "key", "value"),
        *("gate_proj", "up_proj", "down_proj"),
    ),
}
SINGLE_TEXT_TARGETS["attention_ff_conv"] = SINGLE_TEXT_TARGETS["attention_ff"]

ENCODING_RULE = "last_hidden_state; padding zeroed; pooled: text_embeds | pooler_output | mean"
"""What :func:`encode_single` computes (part of the text cache's key: change it with it)."""

SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = (
    *("tokenizer_config.json", "tokenizer.json", "spiece.model", "tokenizer.model"),
    *("vocab.json", "vocab.txt"),
)  # any one: the files a transformers tokenizer is read from


class TextEncoders(NamedTuple):
    """One text folder's encoders and tokenizers; ``encoder_2`` and ``tokenizer_2`` are None
    for a single encoder."""

    encoder: nn.Module
    encoder_2: nn.Module | None
    tokenizer: Any
    tokenizer_2: Any | None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_text_folder(
    path: str | Path, setting: str, text_length: int | None = None,
    cap: int | None = DEFAULT_MAX_TEXT_LENGTH,
) -> TextEncoders:  # fmt: skip
    """The encoders of the text folder ``path`` (any layout of the module docstring), float32,
    eval mode, offline. One encoder reads ``text_length`` tokens, by default its tokenizer's
    ``model_max_length`` capped at ``cap`` (None: as saved). ``setting`` names the config key
    in the one-line errors."""
    root = Path(path)
    if (root / "text_encoder_2").is_dir():
        check_pair_length(text_length)
        return load_sdxl_pair(root, setting)
    if (root / "text_encoder" / "config.json").is_file():
        model_dir = root / "text_encoder"
        tokenizer_dir = root / "tokenizer" if (root / "tokenizer").is_dir() else model_dir
    elif (root / "config.json").is_file():
        model_dir = tokenizer_dir = root
    else:
        raise ValueError(
            f"{setting} {root}: no text encoder there; point it at a folder holding one "
            "transformers text encoder and its tokenizer (save_pretrained), or a diffusers "
            "folder with text_encoder/ and tokenizer/ (text_encoder_2/ too for SDXL's pair)"
        )
    encoder = load_encoder(model_dir, setting)
    tokenizer = load_tokenizer(tokenizer_dir, setting, encoder, text_length, cap)
    return TextEncoders(encoder, None, tokenizer, None)


def check_pair_length(text_length: int | None) -> None:
    """SDXL's CLIP pair encodes 77 tokens; the DiT may read the first ``text_length`` of them."""
    if text_length is not None and text_length > CLIP_TOKENS:
        raise ValueError(
            f"model.dit.text_length: {text_length}, but SDXL's CLIP pair encodes "
            f"{CLIP_TOKENS} tokens; set it to at most {CLIP_TOKENS}"
        )


def load_sdxl_pair(root: Path, setting: str) -> TextEncoders:
    """The two CLIP encoders and tokenizers of a folder in the diffusers SDXL layout."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from impasto.models.io import TRANSFORMERS_DTYPE_KWARG, load_component
    from impasto.models.io import load_tokenizer as load_clip_folder_tokenizer
    from impasto.models.tokenizers import TOKENIZER_2_PAD_TOKEN, TOKENIZER_PAD_TOKEN

    for sub in ("text_encoder", "text_encoder_2"):
        if not (root / sub / "config.json").is_file():
            raise ValueError(
                f"{setting} {root}: no {sub}/config.json; it needs the diffusers SDXL layout "
                "(text_encoder/ and text_encoder_2/ inside)"
            )
    fp32 = {TRANSFORMERS_DTYPE_KWARG: torch.float32}
    return TextEncoders(
        load_component(CLIPTextModel, root, "text_encoder", **fp32),
        load_component(CLIPTextModelWithProjection, root, "text_encoder_2", **fp32),
        load_clip_folder_tokenizer(root, "tokenizer", TOKENIZER_PAD_TOKEN),
        load_clip_folder_tokenizer(root, "tokenizer_2", TOKENIZER_2_PAD_TOKEN),
    )


def load_encoder(folder: Path, setting: str) -> nn.Module:
    """The transformers text encoder saved in ``folder``, float32, eval mode, offline
    (safetensors only: pickled weights can run code when loaded)."""
    from impasto.models.io import TRANSFORMERS_DTYPE_KWARG, own_aligned_storage

    if not any((folder / name).is_file() for name in SAFETENSORS_WEIGHTS):
        raise ValueError(
            f"{setting} {folder}: no model.safetensors; save the text encoder there with "
            "save_pretrained (safetensors weights)"
        )
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{setting} {folder}: config.json is not a transformers model's ({_first_line(error)})"
        ) from None
    name = ENCODER_CLASSES.get(config.model_type) or next(iter(config.architectures or ()), "")
    model_class = getattr(transformers, name, None) if name else None
    if model_class is None and getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{setting} {folder}: a {config.model_type} encoder-decoder; save its encoder alone "
            "(model.get_encoder().save_pretrained) with the tokenizer"
        )
    try:
        encoder = (model_class or AutoModel).from_pretrained(
            str(folder), local_files_only=True, use_safetensors=True,
            **{TRANSFORMERS_DTYPE_KWARG: torch.float32},
        )  # fmt: skip
    except Exception as error:
        raise ValueError(
            f"{setting} {folder}: cannot load the text encoder ({_first_line(error)})"
        ) from None
    return own_aligned_storage(encoder).eval()


def load_tokenizer(
    folder: Path, setting: str, encoder: nn.Module, text_length: int | None, cap: int | None
) -> Any:
    """The tokenizer saved in ``folder``, padding on the right to its text length (see
    :func:`load_text_folder`), which it keeps as ``model_max_length``."""
    fix = "save the encoder's tokenizer there (tokenizer.save_pretrained)"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer of the model's type: all <unk>
        raise ValueError(f"{setting} {folder}: no tokenizer files; {fix}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{setting} {folder}: cannot load its tokenizer ({_first_line(error)}); {fix}"
        ) from None
    if tokenizer.pad_token is None:
        raise ValueError(
            f"{setting} {folder}: the tokenizer has no pad token; set tokenizer.pad_token and "
            "save it again"
        )
    saved = int(tokenizer.model_max_length)
    length = text_length or (min(saved, cap) if cap is not None else saved)
    positions = getattr(encoder.config, "max_position_embeddings", None)
    if isinstance(positions, int) and length > positions:
        raise ValueError(
            f"model.dit.text_length: {length} tokens, but the text encoder has "
            f"{positions} positions; set it to at most {positions}"
        )
    tokenizer.model_max_length = length
    tokenizer.padding_side = "right"
    return tokenizer


def encode_single(
    encoder: nn.Module, tokenizer: Any, prompts: list[str], length: int | None = None
) -> PromptEmbeds:
    """One encoder's conditioning of ``prompts`` (the module docstring): tokens
    ``[B, L, D]`` with zeros at the padding, pooled ``[B, P]``; on the encoder's device and
    dtype. L: ``length``, by default the tokenizer's ``model_max_length``. Gradients flow
    unless the caller disables them."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("encode_single expects a non-empty list of prompt strings")
    length = length or tokenizer.model_max_length
    tokens = tokenizer(
        prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
    )
    device = next(encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    output = encoder(input_ids=ids, attention_mask=mask)
    padding = (mask == 0)[..., None]  # [B, L, 1]
    hidden = output.last_hidden_state.masked_fill(padding, 0.0)
    return PromptEmbeds(hidden, pooled_text(output, hidden, padding))


def pooled_text(output: Any, hidden: Tensor, padding: Tensor) -> Tensor:
    """``text_embeds``, else ``pooler_output``, else the mean of ``hidden`` ``[B, L, D]``
    (zero at the padding) over the real tokens: ``[B, P]``."""
    for name in ("text_embeds", "pooler_output"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    real = (~padding).sum(dim=1).clamp(min=1).to(hidden.dtype)  # [B, 1]
    return hidden.sum(dim=1) / real


def text_dims(encoders: TextEncoders, setting: str = "model.text_encoder") -> tuple[int, int]:
    """(features of a text token, of the pooled text) of ``encoders``' conditioning; a
    one-line error naming ``setting`` if a single encoder cannot encode a prompt."""
    encoder, encoder_2 = encoders.encoder, encoders.encoder_2
    if encoder_2 is not None:  # SDXL: both encoders' tokens side by side; encoder 2's pooled
        return encoder.config.hidden_size + encoder_2.config.hidden_size, (
            encoder_2.config.projection_dim
        )
    # The pooled output's width depends on the class: ask the encoder, on a few tokens.
    length = min(encoders.tokenizer.model_max_length, 8)
    try:
        with torch.no_grad():
            embeds = encode_single(encoder, encoders.tokenizer, [""], length)
    except Exception as error:
        raise ValueError(
            f"{setting}: this {type(encoder).__name__} does not encode a prompt "
            f"({_first_line(error)}); save a text encoder alone (e.g. CLIPTextModel, "
            "T5EncoderModel) with its tokenizer"
        ) from None
    return embeds.prompt_embeds.shape[-1], embeds.pooled_prompt_embeds.shape[-1]


def tokenizer_identity(tokenizer: Any) -> str:
    """What one encoder's tokens depend on beyond the vocabulary (the text cache's key): the
    fast tokenizer's whole definition (normaliser, model, post-processor), the padding side
    and :data:`ENCODING_RULE`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else type(tokenizer).__name__
    return repr((definition, tokenizer.padding_side, ENCODING_RULE))
