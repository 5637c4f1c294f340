"""The Wan family's config section, ``model.wan``: the length of the umT5 prompt and another
transformer file.

Validated like every section (unknown key, wrong type or value: one line naming
``model.wan.<key>``) when the family is built or a run's config is checked.
"""

from __future__ import annotations

from pydantic import Field

from impasto.config.section import Int, PathStr, Section

MAX_TEXT_LENGTH = 512  # umT5 tokens: WanPipeline's max_sequence_length default, Wan's text_len


class WanOptions(Section):
    """``model.wan``: umT5's length and tokenizer, the transformer's and umT5's files."""

    text_length: Int | None = Field(
        None,
        ge=1,
        le=MAX_TEXT_LENGTH,
        description="umT5 tokens per prompt (WanPipeline's max_sequence_length; each "
        "prompt's embeddings past its own tokens are zeros); default: a model.path folder's "
        "tokenizer model_max_length (an exported run keeps its own), else 512 as Wan 2.1",
    )
    transformer: PathStr | None = Field(
        None,
        description="a .safetensors file of the transformer alone, in the original layout "
        "(Wan-AI's / ComfyUI's blocks.N.self_attn.q ..., e.g. wan2.1_t2v_1.3B_fp16.safetensors "
        "or a fine-tune) or diffusers' names, loaded into model.path's (or the preset's) "
        "architecture in place of its own",
    )
    text_encoder: PathStr | None = Field(
        None,
        description="a .safetensors file of the umT5-XXL encoder in transformers' layout "
        "(ComfyUI's umt5_xxl_fp16.safetensors or _fp8_e4m3fn), loaded in place of text_encoder",
    )
    tokenizer: PathStr | None = Field(
        None,
        description="a folder with umT5's tokenizer (tokenizer/ of a Wan2.1 diffusers release), "
        "needed with text_encoder and no model.path",
    )
