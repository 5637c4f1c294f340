"""An SD3.5 transformer from one ``.safetensors`` file (``model.sd3.transformer``): the original
layout Stability AI release and ComfyUI loads (``joint_blocks.N.x_block.attn.qkv``,
``context_block``, ``x_embedder``, ``final_layer`` ..., with or without a
``model.diffusion_model.`` / ``diffusion_model.`` prefix; e.g. ``sd3.5_large.safetensors`` or
a fine-tune from a model site), or diffusers' names. Weights of any float dtype are read as
float32 into the architecture of ``model.path`` (or the preset). In a file that holds more
than the transformer (a checkpoint with its text encoders and VAE), only the tensors under
the ``model.diffusion_model.`` prefix are read.

The original layout fuses what diffusers keeps apart: each attention's q, k and v (the image
stream's ``x_block.attn``, the text stream's ``context_block.attn``, SD3.5 Medium's second
image attention ``x_block.attn2``) are stacked in one ``qkv``; the final modulation and the
last block's text modulation hold (shift, scale) where diffusers has (scale, shift). The map is
ComfyUI's ``comfy.utils.mmdit_to_diffusers`` read backwards; ``tests/test_sd3_single_file.py``
holds it against that map and diffusers' own ``convert_sd3_transformer_checkpoint_to_diffusers``.

:func:`to_original` is the inverse map: ``impasto export --format single-file`` of an SD3 run
writes the transformer in the original layout under ``model.diffusion_model.``, the file
ComfyUI's checkpoint loader and ``model.sd3.transformer`` read. Reading, prefixes, checks and
messages: :mod:`impasto.models.transformer_single_file`, with SD3's map, wording and releases
passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from impasto.models import transformer_single_file as shared
from impasto.models.transformer_single_file import ENDS, PREFIXES, TransformerFile, swap_scale_shift

SETTING = "model.sd3.transformer"
ORIGINAL_KEY = "x_embedder.proj.weight"  # present in every original-layout SD3 transformer
DIFFUSERS_KEY = "pos_embed.proj.weight"

BASIC = {  # diffusers name → original name (weight and bias)
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
}
IMAGE_LINEARS = {  # inside a joint block, every block
    "norm1.linear": "x_block.adaLN_modulation.1", "attn.to_out.0": "x_block.attn.proj",
    "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
}  # fmt: skip
TEXT_LINEARS = {  # every block but the last (it keeps no text output)
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "attn.to_add_out": "context_block.attn.proj",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
QK_NORMS = {  # RMS norms of the queries and keys (SD3.5), weights only
    "attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
}  # fmt: skip
FUSED_QKV = (
    (("attn.to_q", "attn.to_k", "attn.to_v"), "x_block.attn.qkv"),
    (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "context_block.attn.qkv"),
)
SECOND_ATTENTION = {"attn2.to_out.0": "x_block.attn2.proj"}  # SD3.5 Medium's dual blocks
SECOND_NORMS = {"attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
SECOND_QKV = (("attn2.to_q", "attn2.to_k", "attn2.to_v"), "x_block.attn2.qkv")


def from_original(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """An original-layout SD3 transformer's tensors under diffusers' names (KeyError naming a
    missing tensor, ValueError naming one left over)."""
    source = dict(state)
    take = source.pop
    out: dict[str, Tensor] = {"pos_embed.pos_embed": take("pos_embed")}
    depth = shared.count_blocks(source, "joint_blocks")
    for i in range(depth):
        block, original = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        last = i == depth - 1
        dual = f"{original}.x_block.attn2.qkv.weight" in source
        qk_norm = f"{original}.x_block.attn.ln_q.weight" in source
        linears = (
            IMAGE_LINEARS | ({} if last else TEXT_LINEARS) | (SECOND_ATTENTION if dual else {})
        )
        fused = FUSED_QKV + ((SECOND_QKV,) if dual else ())
        for end in ENDS:
            for names, qkv in fused:
                parts = take(f"{original}.{qkv}.{end}").chunk(3, dim=0)
                for name, part in zip(names, parts, strict=True):
                    out[f"{block}.{name}.{end}"] = part
            for name, stored in linears.items():
                out[f"{block}.{name}.{end}"] = take(f"{original}.{stored}.{end}")
            if last:  # a text modulation of (shift, scale) only, in the original order
                stored = take(f"{original}.context_block.adaLN_modulation.1.{end}")
                out[f"{block}.norm1_context.linear.{end}"] = swap_scale_shift(stored)
        norms = (QK_NORMS if qk_norm else {}) | (SECOND_NORMS if qk_norm and dual else {})
        for name, stored in norms.items():
            out[f"{block}.{name}.weight"] = take(f"{original}.{stored}.weight")
    for end in ENDS:
        for name, stored in BASIC.items():
            out[f"{name}.{end}"] = take(f"{stored}.{end}")
        out[f"norm_out.linear.{end}"] = swap_scale_shift(
            take(f"final_layer.adaLN_modulation.1.{end}")
        )
    if source:
        raise ValueError(f"a tensor the SD3 transformer does not have: {sorted(source)[0]!r}")
    return out


def to_original(state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """A diffusers SD3 transformer's state dict in the original layout, under ``prefix``: the
    inverse of :func:`from_original`."""
    source = dict(state)
    take = source.pop
    out: dict[str, Tensor] = {"pos_embed": take("pos_embed.pos_embed")}
    depth = 1 + max(
        int(key.split(".")[1]) for key in source if key.startswith("transformer_blocks.")
    )
    for i in range(depth):
        block, original = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        last = i == depth - 1
        dual = f"{block}.attn2.to_q.weight" in source
        qk_norm = f"{block}.attn.norm_q.weight" in source
        linears = (
            IMAGE_LINEARS | ({} if last else TEXT_LINEARS) | (SECOND_ATTENTION if dual else {})
        )
        fused = FUSED_QKV + ((SECOND_QKV,) if dual else ())
        for end in ENDS:
            for names, qkv in fused:
                parts = [take(f"{block}.{name}.{end}") for name in names]
                out[f"{original}.{qkv}.{end}"] = torch.cat(parts, dim=0)
            for name, stored in linears.items():
                out[f"{original}.{stored}.{end}"] = take(f"{block}.{name}.{end}")
            if last:
                modulation = take(f"{block}.norm1_context.linear.{end}")
                out[f"{original}.context_block.adaLN_modulation.1.{end}"] = swap_scale_shift(
                    modulation
                )
        norms = (QK_NORMS if qk_norm else {}) | (SECOND_NORMS if qk_norm and dual else {})
        for name, stored in norms.items():
            out[f"{original}.{stored}.weight"] = take(f"{block}.{name}.weight")
    for end in ENDS:
        for name, stored in BASIC.items():
            out[f"{stored}.{end}"] = take(f"{name}.{end}")
        out[f"final_layer.adaLN_modulation.1.{end}"] = swap_scale_shift(
            take(f"norm_out.linear.{end}")
        )
    if source:
        raise ValueError(
            f"a tensor the SD3 original layout has no place for: {sorted(source)[0]!r}"
        )
    return {f"{prefix}{key}": value for key, value in out.items()}


def write_single_file(backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype) -> Path:
    """``impasto export --format single-file`` of an SD3.5 run (``FamilySpec.exports``): the
    rebuilt transformer (adapters merged, cast to ``dtype`` by the exporter) as one
    ``.safetensors`` file ``out`` in the original layout under ``model.diffusion_model.``, as
    Stability AI release it (``sd3.5_large.safetensors``: the transformer alone; its text
    encoders and VAE stay in the diffusers folder)."""
    state = backbone.components.transformer.state_dict()
    tensors = to_original(state, PREFIXES[0])
    return shared.write_transformer_file(tensors, out, record.get("family", "sd3"))


# -- reading and loading a file (impasto.models.transformer_single_file) ---------------------
FOLDER_PARTS = (
    "vae/, text_encoder/ (CLIP-L), text_encoder_2/ (CLIP-G), text_encoder_3/ (T5), tokenizer/, "
    "tokenizer_2/, tokenizer_3/"
)
FILE = TransformerFile(
    setting=SETTING,
    name="SD3",
    release="SD3.5",
    article="an",
    original_key=ORIGINAL_KEY,
    diffusers_key=DIFFUSERS_KEY,
    layouts=("x_embedder, joint_blocks ...", "pos_embed, transformer_blocks ..."),
    folder_parts=FOLDER_PARTS,
    from_original=from_original,
    transformer_only=True,  # an all-in-one checkpoint: its transformer only
)


read_transformer_file = partial(shared.read_transformer_file, file=FILE)
"""The transformer file ``path`` as a diffusers state dict, float32 (module docstring);
every problem one line naming ``model.sd3.transformer``."""

load_transformer_file = partial(shared.load_transformer_file, file=FILE)
"""Load the file ``path`` into ``transformer`` in place (every tensor, shapes checked); its
parameters may be on the meta device (built from a config alone), they take the file's."""


# -- telling an SD3 transformer file and its release from its keys ---------------------------
RELEASES = {"large": "SD3.5 Large", "medium": "SD3.5 Medium", "unknown": "SD3"}
LARGE_DEPTH = 38  # SD3.5 Large's joint blocks (Medium's and SD3 Medium's: 24)


def transformer_variant(keys: Iterable[str]) -> str | None:
    """``"medium"`` for an SD3 transformer's tensor names with the second image attention
    (SD3.5 Medium's ``x_block.attn2`` / ``attn2``), ``"large"`` for 38 joint blocks without it
    (SD3.5 Large and Large Turbo), ``"unknown"`` for another SD3 transformer (SD3 Medium);
    None for names that are not an SD3 transformer's (original layout or diffusers', any
    prefix: an all-in-one ComfyUI checkpoint's ``model.diffusion_model.``)."""
    names = set(shared.strip_prefixes(dict.fromkeys(keys), (*PREFIXES, "transformer."), True))
    if ORIGINAL_KEY in names and any(key.startswith("joint_blocks.") for key in names):
        blocks, second = "joint_blocks.", ".x_block.attn2."
    elif DIFFUSERS_KEY in names and "context_embedder.weight" in names:
        blocks, second = "transformer_blocks.", ".attn2."
    else:
        return None
    if any(second in key for key in names):
        return "medium"
    depth = len({key.split(".")[1] for key in names if key.startswith(blocks)})
    return "large" if depth == LARGE_DEPTH else "unknown"


file_variant = partial(shared.file_variant, variant=transformer_variant)
""":func:`transformer_variant` of a ``.safetensors`` file's header (None: unreadable)."""


def variant_of_model(
    path: str | None, preset: str | None, transformer_file: str | None
) -> str | None:
    """``"large"`` / ``"medium"`` of the model a config names (``model.path``,
    ``model.preset``, ``model.sd3.transformer``), read from config files and headers only;
    None where they do not say."""
    from impasto.models.sd3.components import PRESET_VARIANTS

    if transformer_file is not None:
        variant = file_variant(transformer_file)
    elif path is not None:
        config = shared.folder_config(path)
        if config is None:
            return None
        variant = (
            "medium" if config.get("dual_attention_layers") else
            "large" if config.get("num_layers") == LARGE_DEPTH else None
        )  # fmt: skip
    else:
        variant = PRESET_VARIANTS.get(preset or "")
    return None if variant == "unknown" else variant


def single_file_advice(path: str | Path, setting: str) -> str:
    """The one-line error for a single file given where a diffusers SD3.5 folder belongs:
    what the file is and what else SD3 needs."""
    variant = file_variant(path)
    release = None
    if variant is not None:
        release = (RELEASES[variant], RELEASES[variant] if variant != "unknown" else "SD3.5")
    return shared.single_file_advice(path, setting, FILE, release)
