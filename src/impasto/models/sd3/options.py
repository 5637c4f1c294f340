"""The SD3.5 family's config section, ``model.sd3``: the length of the T5 prompt and another
transformer file.

Validated like every section (unknown key, wrong type or value: one line naming
``model.sd3.<key>``) when the family is built or a run's config is checked.
"""

from __future__ import annotations

from pydantic import Field

from impasto.config.section import Int, PathStr, Section

MAX_TEXT_LENGTH = 512  # T5 tokens: StableDiffusion3Pipeline refuses more than 512
DEFAULT_TEXT_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default


class Sd3Options(Section):
    """``model.sd3``: T5's length and tokenizer, the transformer's and text encoders' files."""

    text_length: Int = Field(
        DEFAULT_TEXT_LENGTH,
        ge=1,
        le=MAX_TEXT_LENGTH,
        description="T5 tokens per prompt (StableDiffusion3Pipeline's max_sequence_length, "
        "256 by default; diffusers' SD3 LoRA script trains at 77)",
    )
    transformer: PathStr | None = Field(
        None,
        description="a .safetensors file of the transformer alone, in the original layout "
        "(Stability's / ComfyUI's joint_blocks ..., e.g. a fine-tune's) or diffusers' names, "
        "loaded into model.path's (or the preset's) architecture in place of its own",
    )
    text_encoder: PathStr | None = Field(
        None,
        description="a .safetensors file of CLIP-L (ComfyUI's clip_l.safetensors, or a whole "
        "checkpoint holding text_encoders.clip_l.*), loaded in place of text_encoder",
    )
    text_encoder_2: PathStr | None = Field(
        None,
        description="a .safetensors file of CLIP-G (OpenCLIP bigG: ComfyUI's clip_g.safetensors, "
        "or a checkpoint's text_encoders.clip_g.*), loaded in place of text_encoder_2",
    )
    text_encoder_3: PathStr | None = Field(
        None,
        description="a .safetensors file of the T5-XXL encoder (t5xxl_fp16.safetensors or "
        "t5xxl_fp8_e4m3fn.safetensors), loaded in place of text_encoder_3",
    )
    tokenizer_3: PathStr | None = Field(
        None,
        description="a folder with T5's tokenizer (tokenizer_3/ of an SD3.5 release), needed "
        "with text_encoder_3 and no model.path",
    )
