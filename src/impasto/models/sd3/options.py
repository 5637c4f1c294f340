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
    """``model.sd3``: T5's length and another transformer file."""

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
