"""Tell which model family a single-file checkpoint holds, from its key names and a few shapes.

The markers are the module roots of each family's reference code, as A1111
(``modules/sd_models_config.py``), ComfyUI (``comfy/model_detection.py``) and diffusers
(``loaders/single_file_utils.py``) detect them: SD 1.x conditions on a transformers CLIP
(``cond_stage_model.transformer``), SD 2.x on OpenCLIP-H (``cond_stage_model.model``), SDXL base
on CLIP-L + OpenCLIP-G (``conditioner.embedders.0.transformer`` + ``.1.model``), the SDXL refiner
on OpenCLIP-G alone (``conditioner.embedders.0.model``); SD3 is an MMDiT (``joint_blocks``,
or diffusers' ``context_embedder`` + ``pos_embed.proj``;
:func:`impasto.models.sd3.single_file.transformer_variant` tells SD3.5 Large from Medium) and
Flux a double/single-stream DiT (``double_blocks``, or diffusers' ``single_transformer_blocks``;
:func:`impasto.models.flux.single_file.transformer_variant` tells FLUX.1-dev from schnell).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from impasto.models.single_file.keymap import CLIP_G_PREFIX, CLIP_L_PREFIX, UNET_PREFIX

Shapes = Mapping[str, tuple[int, ...]]

SDXL_BASE = "sdxl-base"
UNKNOWN = "unknown"
# What each refused kind is, for the error message.
REFUSED_KINDS = {
    "sdxl-refiner": "an SDXL refiner checkpoint",
    "sd1": "a Stable Diffusion 1.x checkpoint",
    "sd2": "a Stable Diffusion 2.x checkpoint",
    "sd3": "a Stable Diffusion 3 checkpoint",
    "flux": "a Flux checkpoint",
}

# The refiner's UNet: 384 base channels, context 1280 (OpenCLIP-G only), a 2560-wide `label_emb`
# (pooled 1280 + 5 size/score embeddings of 256). Base: 320, 2048, 2816.
_REFINER_ADM_IN_CHANNELS = 2560
_LABEL_EMB = UNET_PREFIX + "label_emb.0.0.weight"
_FIRST_CROSS_ATTENTION = "transformer_blocks.0.attn2.to_k.weight"
_SD1_CONTEXT_DIM, _SD2_CONTEXT_DIM = 768, 1024
# SGM-format SD 2.x files hold OpenCLIP-H (width 1024) where the refiner holds OpenCLIP-G (1280).
_SGM_OPEN_CLIP_0 = "conditioner.embedders.0.model."
_SGM_OPEN_CLIP_0_WIDTH = _SGM_OPEN_CLIP_0 + "ln_final.weight"


def _has_prefix(shapes: Shapes, *prefixes: str) -> bool:
    return any(key.startswith(prefixes) for key in shapes)


def _contains(shapes: Shapes, fragment: str) -> bool:
    return any(fragment in key for key in shapes)


def _unet_context_dim(shapes: Shapes) -> int | None:
    """Width of the text the UNet cross-attends to (in features of the first ``attn2.to_k``)."""
    for key, shape in shapes.items():
        if key.startswith(UNET_PREFIX) and key.endswith(_FIRST_CROSS_ATTENTION) and len(shape) == 2:
            return shape[1]
    return None


def _unet_only_kind(shapes: Shapes) -> str:
    """The family of a file holding only a UNet, from its conditioning widths."""
    if _LABEL_EMB in shapes:
        # SDXL's `label_emb` embeds the pooled text + size conditioning; SD 1.x/2.x have none.
        refiner = shapes[_LABEL_EMB][-1] == _REFINER_ADM_IN_CHANNELS
        return "sdxl-refiner" if refiner else SDXL_BASE
    context_dim = _unet_context_dim(shapes)
    return {_SD1_CONTEXT_DIM: "sd1", _SD2_CONTEXT_DIM: "sd2"}.get(context_dim, UNKNOWN)


# Checked in order; the first rule that holds names the kind.
_RULES: tuple[tuple[str, Callable[[Shapes], bool]], ...] = (
    ("flux", lambda shapes: _contains(shapes, "double_blocks.")),
    # a FLUX transformer with diffusers' names (SD3's diffusers transformer has no single blocks)
    ("flux", lambda shapes: _contains(shapes, "single_transformer_blocks.")),
    ("sd3", lambda shapes: _contains(shapes, "joint_blocks.")),
    # an SD3 transformer with diffusers' names (its text tokens' context_embedder, patches)
    (
        "sd3",
        lambda shapes: (
            _contains(shapes, "context_embedder.") and _contains(shapes, "pos_embed.proj.")
        ),
    ),
    ("sd1", lambda shapes: _has_prefix(shapes, "cond_stage_model.transformer.")),
    ("sd2", lambda shapes: _has_prefix(shapes, "cond_stage_model.model.")),
    ("sd2", lambda shapes: shapes.get(_SGM_OPEN_CLIP_0_WIDTH, (0,))[0] == _SD2_CONTEXT_DIM),
    ("sdxl-refiner", lambda shapes: _has_prefix(shapes, _SGM_OPEN_CLIP_0)),
    (SDXL_BASE, lambda shapes: _has_prefix(shapes, CLIP_L_PREFIX, CLIP_G_PREFIX)),
)


def detect_checkpoint(keys_and_shapes: Shapes) -> str:
    """The kind of checkpoint with these tensor names and shapes.

    One of ``"sdxl-base"`` (SGM layout: ``model.diffusion_model.*``,
    ``conditioner.embedders.0.transformer.*``, ``conditioner.embedders.1.model.*``,
    ``first_stage_model.*``), ``"sdxl-refiner"``, ``"sd1"``, ``"sd2"``, ``"sd3"``, ``"flux"``
    or ``"unknown"``. A file with only some of SDXL's components still detects as
    ``"sdxl-base"``; :func:`~impasto.models.single_file.load_single_file` then names the
    missing one. Only names and shapes are read, so a safetensors header is enough.
    """
    for kind, holds in _RULES:
        if holds(keys_and_shapes):
            return kind
    if _has_prefix(keys_and_shapes, UNET_PREFIX):
        return _unet_only_kind(keys_and_shapes)
    return UNKNOWN
