"""A FLUX transformer from one ``.safetensors`` file (``model.flux.transformer``): the
original layout Black Forest Labs release and ComfyUI loads (``double_blocks.N.img_attn.qkv``,
``single_blocks.N.linear1``, ``img_in``, ``final_layer`` ..., with or without a
``model.diffusion_model.`` / ``diffusion_model.`` prefix; e.g. ``flux1-dev.safetensors`` or a
fine-tune from a model site), or diffusers' names. Weights of any float dtype (fp8 included)
are read as float32 into the architecture of ``model.path`` (or the preset).

The original layout fuses what diffusers keeps apart: a double block's ``qkv`` is q, k and v
stacked, a single block's ``linear1`` is q, k, v and the MLP's input (``proj_mlp``) stacked,
and the final modulation holds (shift, scale) where diffusers has (scale, shift). The map is
ComfyUI's ``comfy.utils.flux_to_diffusers`` read backwards (``tests/test_flux_single_file.py``
holds it against ComfyUI's map and diffusers' own converter). Reading, prefixes, checks and
messages are shared with the other transformer families
(:mod:`impasto.models.transformer_single_file`); here are FLUX's map, wording and variants.

:func:`to_original` is the inverse map: ``impasto export --format single-file`` of a FLUX run
writes the transformer in BFL's layout without a prefix, as ``flux1-dev.safetensors`` holds it
(a FLUX.1-dev model keeps its ``guidance_in``, a FLUX.1-schnell one has none): the file
ComfyUI's diffusion-model loader and ``model.flux.transformer`` read.
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

SETTING = "model.flux.transformer"
ORIGINAL_KEY = "img_in.weight"  # present in every original-layout FLUX transformer
DIFFUSERS_KEY = "x_embedder.weight"

# diffusers' name inside a double block → the original name (weights and biases)
DOUBLE_LINEARS = {
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}  # fmt: skip
FUSED_QKV = (
    (("to_q", "to_k", "to_v"), "img_attn.qkv"),
    (("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv"),
)  # a double block's (q, k, v) of the image and of the text stream, each fused in one layer
DOUBLE_NORMS = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
}
SINGLE_LINEARS = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
SINGLE_NORMS = {
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}
BASIC_LINEARS = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",  # dev only
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
}


def from_original(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """An original-layout FLUX transformer's tensors under diffusers' names (KeyError naming
    a missing tensor, ValueError naming one left over)."""
    source = dict(state)
    take = source.pop
    hidden = source[ORIGINAL_KEY].shape[0]
    out: dict[str, Tensor] = {}
    for i in range(shared.count_blocks(source, "double_blocks")):
        block, original = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for end in ENDS:
            for names, fused in FUSED_QKV:
                parts = take(f"{original}.{fused}.{end}").chunk(3, dim=0)
                for name, part in zip(names, parts, strict=True):
                    out[f"{block}.attn.{name}.{end}"] = part
            for name, fused in DOUBLE_LINEARS.items():
                out[f"{block}.{name}.{end}"] = take(f"{original}.{fused}.{end}")
        for name, fused in DOUBLE_NORMS.items():
            out[f"{block}.{name}"] = take(f"{original}.{fused}")
    for i in range(shared.count_blocks(source, "single_blocks")):
        block, original = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for end in ENDS:
            linear1 = take(f"{original}.linear1.{end}")
            sizes = (hidden, hidden, hidden, linear1.shape[0] - 3 * hidden)
            q, k, v, mlp = linear1.split(sizes, dim=0)
            out |= {f"{block}.attn.to_q.{end}": q, f"{block}.attn.to_k.{end}": k,
                    f"{block}.attn.to_v.{end}": v, f"{block}.proj_mlp.{end}": mlp}  # fmt: skip
            for name, fused in SINGLE_LINEARS.items():
                out[f"{block}.{name}.{end}"] = take(f"{original}.{fused}.{end}")
        for name, fused in SINGLE_NORMS.items():
            out[f"{block}.{name}"] = take(f"{original}.{fused}")
    for end in ENDS:
        for name, original in BASIC_LINEARS.items():
            if f"{original}.{end}" in source:
                out[f"{name}.{end}"] = take(f"{original}.{end}")
        modulation = take(f"final_layer.adaLN_modulation.1.{end}")
        out[f"norm_out.linear.{end}"] = swap_scale_shift(modulation)
    if source:
        raise ValueError(f"a tensor the FLUX transformer does not have: {sorted(source)[0]!r}")
    return out


def to_original(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A diffusers FLUX transformer's state dict in BFL's original layout: the inverse of
    :func:`from_original` (q, k, v stacked in ``qkv``; a single block's q, k, v and MLP input
    in ``linear1``, in that order; the final modulation as (shift, scale))."""
    source = dict(state)
    take = source.pop
    out: dict[str, Tensor] = {}
    for i in range(shared.count_blocks(source, "transformer_blocks")):
        block, original = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for end in ENDS:
            for names, fused in FUSED_QKV:
                parts = [take(f"{block}.attn.{name}.{end}") for name in names]
                out[f"{original}.{fused}.{end}"] = torch.cat(parts, dim=0)
            for name, fused in DOUBLE_LINEARS.items():
                out[f"{original}.{fused}.{end}"] = take(f"{block}.{name}.{end}")
        for name, fused in DOUBLE_NORMS.items():
            out[f"{original}.{fused}"] = take(f"{block}.{name}")
    for i in range(shared.count_blocks(source, "single_transformer_blocks")):
        block, original = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        for end in ENDS:
            names = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
            parts = [take(f"{block}.{name}.{end}") for name in names]
            out[f"{original}.linear1.{end}"] = torch.cat(parts, dim=0)
            for name, fused in SINGLE_LINEARS.items():
                out[f"{original}.{fused}.{end}"] = take(f"{block}.{name}.{end}")
        for name, fused in SINGLE_NORMS.items():
            out[f"{original}.{fused}"] = take(f"{block}.{name}")
    for end in ENDS:
        for name, original in BASIC_LINEARS.items():
            if f"{name}.{end}" in source:  # the guidance embedding: FLUX.1-dev only
                out[f"{original}.{end}"] = take(f"{name}.{end}")
        out[f"final_layer.adaLN_modulation.1.{end}"] = swap_scale_shift(
            take(f"norm_out.linear.{end}")
        )
    if source:
        raise ValueError(
            f"a tensor the FLUX original layout has no place for: {sorted(source)[0]!r}"
        )
    return out


def write_single_file(backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype) -> Path:
    """``impasto export --format single-file`` of a FLUX run (``FamilySpec.exports``): the
    rebuilt transformer (adapters merged, cast to ``dtype`` by the exporter) as one
    ``.safetensors`` file ``out`` in BFL's layout, without a prefix, as
    ``flux1-dev.safetensors`` (the transformer alone: ComfyUI's ``models/diffusion_models/``);
    its VAE and text encoders stay in the diffusers folder or their own files."""
    tensors = to_original(backbone.components.transformer.state_dict())
    return shared.write_transformer_file(tensors, out, record.get("family", "flux"))


# -- reading and loading a file (impasto.models.transformer_single_file) ---------------------
FOLDER_PARTS = "vae/, text_encoder/ (CLIP-L), text_encoder_2/ (T5), tokenizer/, tokenizer_2/"


def _variant_mismatch(missing: list[str], unexpected: list[str]) -> str | None:
    """The right family, the other variant (a guidance embedding too many or too few): say
    which is which."""
    if not any("guidance_embedder" in key for key in (*missing, *unexpected)):
        return None
    have, want = ("dev", "schnell") if unexpected else ("schnell", "dev")
    return (
        f"a FLUX.1-{have} transformer, but model.path / model.preset is FLUX.1-{want}'s "
        f"(guidance embedding); use the FLUX.1-{have} folder or preset"
    )


FILE = TransformerFile(
    setting=SETTING,
    name="FLUX",
    release="FLUX.1",
    article="a",
    original_key=ORIGINAL_KEY,
    diffusers_key=DIFFUSERS_KEY,
    layouts=("img_in, double_blocks ...", "x_embedder, transformer_blocks ..."),
    folder_parts=FOLDER_PARTS,
    from_original=from_original,
    transformer_only=False,  # a stray tensor beside the prefixed ones is named, not dropped
    mismatch=_variant_mismatch,
)


read_transformer_file = partial(shared.read_transformer_file, file=FILE)
"""The transformer file ``path`` as a diffusers state dict, float32 (module docstring);
every problem one line naming ``model.flux.transformer``."""

load_transformer_file = partial(shared.load_transformer_file, file=FILE)
"""Load the file ``path`` into ``transformer`` in place (every tensor, shapes checked; a
file of the other variant says so)."""


# -- telling a FLUX transformer file and its variant from its keys --------------------------
GUIDANCE_KEYS = (
    "guidance_in.in_layer.weight",  # original layout
    "time_text_embed.guidance_embedder.linear_1.weight",  # diffusers'
)
DIFFUSERS_BLOCKS = "single_transformer_blocks."


def transformer_variant(keys: Iterable[str]) -> str | None:
    """``"dev"`` for a FLUX transformer's tensor names with a guidance embedding (FLUX.1-dev
    and its fine-tunes), ``"schnell"`` without; None for names that are not a FLUX
    transformer's (original layout or diffusers', any prefix)."""
    names = set(shared.strip_prefixes(dict.fromkeys(keys), (*PREFIXES, "transformer."), False))
    original = ORIGINAL_KEY in names and any(key.startswith("double_blocks.") for key in names)
    diffusers = DIFFUSERS_KEY in names and any(key.startswith(DIFFUSERS_BLOCKS) for key in names)
    if not (original or diffusers):
        return None
    return "dev" if any(key in names for key in GUIDANCE_KEYS) else "schnell"


file_variant = partial(shared.file_variant, variant=transformer_variant)
""":func:`transformer_variant` of a ``.safetensors`` file's header (None: unreadable)."""


def variant_of_model(
    path: str | None, preset: str | None, transformer_file: str | None
) -> str | None:
    """``"dev"`` / ``"schnell"`` of the model a config names (``model.path``,
    ``model.preset``, ``model.flux.transformer``), read from config files and headers only;
    None where they do not say."""
    if transformer_file is not None:
        return file_variant(transformer_file)
    if path is not None:
        config = shared.folder_config(path)
        if config is None:
            return None
        return "dev" if config.get("guidance_embeds") else "schnell"
    return "schnell" if preset == "schnell" else "dev"  # tiny has dev's guidance embedding


def single_file_advice(path: str | Path, setting: str) -> str:
    """The one-line error for a single file given where a diffusers FLUX.1 folder belongs:
    what the file is and what else FLUX needs."""
    variant = file_variant(path)
    release = None if variant is None else (f"FLUX.1-{variant}", f"FLUX.1-{variant}")
    return shared.single_file_advice(path, setting, FILE, release)
