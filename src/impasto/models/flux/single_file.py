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
holds it against ComfyUI's map and diffusers' own converter).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

SETTING = "model.flux.transformer"
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
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
ENDS = ("weight", "bias")


def _blocks(state: dict[str, Tensor], prefix: str) -> int:
    """The number of blocks ``prefix.N.`` in ``state``."""
    indices = {int(key.split(".")[1]) for key in state if key.startswith(prefix + ".")}
    return max(indices) + 1 if indices else 0


def swap_scale_shift(weight: Tensor) -> Tensor:
    """(shift, scale) rows ↔ (scale, shift) rows of the final modulation."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def from_original(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """An original-layout FLUX transformer's tensors under diffusers' names (KeyError naming
    a missing tensor, ValueError naming one left over)."""
    source = dict(state)
    take = source.pop
    hidden = source[ORIGINAL_KEY].shape[0]
    out: dict[str, Tensor] = {}
    for i in range(_blocks(source, "double_blocks")):
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
    for i in range(_blocks(source, "single_blocks")):
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


def read_transformer_file(path: str | Path) -> dict[str, Tensor]:
    """The transformer file ``path`` as a diffusers state dict, float32 (module docstring);
    every problem one line naming ``model.flux.transformer``."""
    from safetensors.torch import load_file

    from impasto.models.single_file.file_errors import check_safetensors

    check_safetensors(path, SETTING)  # missing, unreadable, truncated: say which
    state = load_file(str(path))
    for prefix in PREFIXES:
        if any(key.startswith(prefix) for key in state):
            state = {key.removeprefix(prefix): value for key, value in state.items()}
    if ORIGINAL_KEY in state:
        try:
            state = from_original(state)
        except (KeyError, ValueError) as error:
            detail = f"no {error.args[0]!r}" if isinstance(error, KeyError) else str(error)
            raise ValueError(
                f"{SETTING} {path}: not a whole FLUX transformer in the original layout "
                f"({detail}); point it at a FLUX.1 transformer file"
            ) from None
    elif DIFFUSERS_KEY not in state:
        raise ValueError(
            f"{SETTING} {path}: neither a FLUX transformer's original layout (img_in, "
            "double_blocks ...) nor diffusers' (x_embedder, transformer_blocks ...)"
        )
    return {key: value.float() for key, value in state.items()}


def load_transformer_file(path: str | Path, transformer: torch.nn.Module) -> None:
    """Load the file ``path`` into ``transformer`` in place (every tensor, shapes checked); its
    parameters may be on the meta device (built from a config alone), they take the file's."""
    from impasto.models.io import own_aligned_storage

    state = read_transformer_file(path)
    expected = transformer.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    guidance = [key for key in (*missing, *unexpected) if "guidance_embedder" in key]
    if guidance:  # the right family, the other variant: say which is which
        have, want = ("dev", "schnell") if unexpected else ("schnell", "dev")
        raise ValueError(
            f"{SETTING} {path}: a FLUX.1-{have} transformer, but model.path / model.preset is "
            f"FLUX.1-{want}'s (guidance embedding); use the FLUX.1-{have} folder or preset"
        )
    if missing or unexpected or wrong:
        problem = (
            f"no {missing[0]!r}" if missing else
            f"an extra {unexpected[0]!r}" if unexpected else
            f"{wrong[0]!r} of shape {tuple(state[wrong[0]].shape)}, not "
            f"{tuple(expected[wrong[0]].shape)}"
        )  # fmt: skip
        raise ValueError(
            f"{SETTING} {path}: does not fit the transformer of model.path / model.preset "
            f"({problem}); use the FLUX.1 folder (or preset) the file was trained from"
        )
    transformer.load_state_dict(state, strict=True, assign=True)
    own_aligned_storage(transformer)


# -- telling a FLUX transformer file and its variant from its keys --------------------------
GUIDANCE_KEYS = (
    "guidance_in.in_layer.weight",  # original layout
    "time_text_embed.guidance_embedder.linear_1.weight",  # diffusers'
)
DIFFUSERS_BLOCKS = "single_transformer_blocks."
FOLDER_PARTS = "vae/, text_encoder/ (CLIP-L), text_encoder_2/ (T5), tokenizer/, tokenizer_2/"


def _unprefixed(keys: object) -> set[str]:
    keys = set(keys)  # type: ignore[call-overload]
    for prefix in (*PREFIXES, "transformer."):
        if any(key.startswith(prefix) for key in keys):
            keys = {key.removeprefix(prefix) for key in keys}
    return keys


def transformer_variant(keys: object) -> str | None:
    """``"dev"`` for a FLUX transformer's tensor names with a guidance embedding (FLUX.1-dev
    and its fine-tunes), ``"schnell"`` without; None for names that are not a FLUX
    transformer's (original layout or diffusers', any prefix)."""
    names = _unprefixed(keys)
    original = ORIGINAL_KEY in names and any(key.startswith("double_blocks.") for key in names)
    diffusers = DIFFUSERS_KEY in names and any(key.startswith(DIFFUSERS_BLOCKS) for key in names)
    if not (original or diffusers):
        return None
    return "dev" if any(key in names for key in GUIDANCE_KEYS) else "schnell"


def file_variant(path: str | Path) -> str | None:
    """:func:`transformer_variant` of a ``.safetensors`` file's header (None: unreadable)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            return transformer_variant(handle.keys())
    except (OSError, SafetensorError):
        return None


def variant_of_model(
    path: str | None, preset: str | None, transformer_file: str | None
) -> str | None:
    """``"dev"`` / ``"schnell"`` of the model a config names (``model.path``,
    ``model.preset``, ``model.flux.transformer``), read from config files and headers only;
    None where they do not say."""
    import json

    if transformer_file is not None:
        return file_variant(transformer_file)
    if path is not None:
        try:
            config = json.loads((Path(path) / "transformer" / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return "dev" if config.get("guidance_embeds") else "schnell"
    return "schnell" if preset == "schnell" else "dev"  # tiny has dev's guidance embedding


def single_file_advice(path: str | Path, setting: str) -> str:
    """The one-line error for a single file given where a diffusers FLUX.1 folder belongs:
    what the file is and what else FLUX needs."""
    variant = file_variant(path)
    if variant is None:
        return (
            f"{setting} {path}: a single file, and not a FLUX transformer; set {setting} to a "
            f"diffusers FLUX.1 folder ({FOLDER_PARTS}, transformer/, scheduler/)"
        )
    return (
        f"{setting} {path}: a FLUX.1-{variant} transformer file, without the VAE and text "
        f"encoders; set model.path to a diffusers FLUX.1-{variant} folder ({FOLDER_PARTS}) "
        "and model.flux.transformer to this file"
    )
