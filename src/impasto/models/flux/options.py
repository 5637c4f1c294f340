"""The FLUX family's config section, ``model.flux``: the guidance the transformer is given in
training, a transformer file, and the length of the T5 prompt.

Validated like every section (unknown key, wrong type or value: one line naming
``model.flux.<key>``) when the family is built or a run's config is checked.
"""

from __future__ import annotations

from pydantic import Field

from impasto.config.section import Float, Int, PathStr, Section

MAX_TEXT_LENGTH = 512  # T5 tokens: FluxPipeline refuses a max_sequence_length above 512
DEFAULT_GUIDANCE = 3.5  # diffusers' train_dreambooth_lora_flux.py and FluxPipeline both use 3.5


class FluxOptions(Section):
    """``model.flux``: FLUX.1-dev's guidance embedding in training, the transformer's and
    the text encoders' files, T5's tokenizer and length. (Sampling takes its guidance value
    from ``sample.guidance_scale``.)"""

    guidance: Float = Field(
        DEFAULT_GUIDANCE,
        ge=0,
        le=100,
        description="the guidance value a guidance-distilled transformer (FLUX.1-dev) is given "
        "in training (diffusers' --guidance_scale; ai-toolkit trains at 1); unused by a "
        "transformer without a guidance embedding (FLUX.1-schnell)",
    )
    transformer: PathStr | None = Field(
        None,
        description="a .safetensors file of the transformer alone, in the original layout "
        "(Black Forest Labs' flux1-dev.safetensors, ComfyUI's, a fine-tune's) or diffusers' "
        "names, loaded into model.path's (or the preset's) architecture in place of its own",
    )
    text_encoder: PathStr | None = Field(
        None,
        description="a .safetensors file of CLIP-L alone (ComfyUI's clip_l.safetensors), loaded in "
        "place of model.path's (or the preset's) text_encoder",
    )
    text_encoder_2: PathStr | None = Field(
        None,
        description="a .safetensors file of the T5-XXL encoder alone (t5xxl_fp16.safetensors or "
        "t5xxl_fp8_e4m3fn.safetensors), loaded in place of text_encoder_2",
    )
    tokenizer_2: PathStr | None = Field(
        None,
        description="a folder with T5's tokenizer (tokenizer_2/ of a FLUX.1 release: spiece.model "
        "or tokenizer.json), needed with text_encoder_2 and no model.path",
    )
    text_length: Int = Field(
        MAX_TEXT_LENGTH,
        ge=1,
        le=MAX_TEXT_LENGTH,
        description="T5 tokens per prompt (FluxPipeline's max_sequence_length): 512 for "
        "FLUX.1-dev, 256 for FLUX.1-schnell",
    )
