"""The two SDXL CLIP tokenizers, built offline from the files bundled in ``impasto/assets/clip``.

SDXL (Podell et al. 2023, arXiv:2307.01952) uses the same OpenAI CLIP BPE vocabulary for both
text encoders (CLIP ViT-L/14 and OpenCLIP ViT-bigG/14); they differ only in the pad token: the
diffusers checkpoint ``stabilityai/stable-diffusion-xl-base-1.0`` pads ``tokenizer`` with
``<|endoftext|>`` (id 49407) and ``tokenizer_2`` with ``!`` (id 0, as open_clip does).
"""

from __future__ import annotations

from importlib.resources import as_file, files

from transformers import CLIPTokenizer

CLIP_MAX_LENGTH = 77
TOKENIZER_PAD_TOKEN = "<|endoftext|>"
TOKENIZER_2_PAD_TOKEN = "!"


def load_clip_tokenizer(pad_token: str) -> CLIPTokenizer:
    """Load the bundled CLIP tokenizer with ``pad_token`` and a 77-token maximum length."""
    asset_dir = files("impasto") / "assets" / "clip"
    # from_pretrained(dir) reads vocab.json + merges.txt in transformers 4.x and 5.x alike; in 5.x
    # the constructor's `vocab_file=` keyword is silently ignored, so do not build it directly.
    with as_file(asset_dir) as clip_dir:
        return CLIPTokenizer.from_pretrained(
            str(clip_dir),
            pad_token=pad_token,
            model_max_length=CLIP_MAX_LENGTH,
            local_files_only=True,
        )


def load_clip_tokenizers() -> tuple[CLIPTokenizer, CLIPTokenizer]:
    """Return SDXL's ``(tokenizer, tokenizer_2)``: pad ``<|endoftext|>`` and pad ``!``."""
    return load_clip_tokenizer(TOKENIZER_PAD_TOKEN), load_clip_tokenizer(TOKENIZER_2_PAD_TOKEN)
