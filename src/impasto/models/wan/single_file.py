"""``model.wan.transformer``: the Wan 2.1 transformer's weights from one ``.safetensors`` file,
loaded into ``model.path``'s (or the preset's) architecture: the original layout people
download (Wan-AI's and ComfyUI's ``wan2.1_t2v_1.3B_fp16.safetensors``: ``blocks.N.self_attn.q``,
``head.head`` ..., with or without ComfyUI's ``model.diffusion_model.`` prefix), renamed by
diffusers' own ``convert_wan_transformer_to_diffusers``, or a file in diffusers' names. Every
problem is one line naming the setting.

:func:`to_original` is the inverse rename: ``impasto export --format single-file`` of a Wan run
writes the transformer in Wan-AI's names without a prefix, as
``wan2.1_t2v_1.3B_fp16.safetensors`` holds them: the file ComfyUI's diffusion-model loader and
``model.wan.transformer`` read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from impasto.models import transformer_single_file as shared
from impasto.models.single_file.file_errors import check_safetensors

SETTING = "model.wan.transformer"
DIFFUSERS_MARKER = "condition_embedder."  # a name only diffusers' layout has


def read_transformer_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The file's tensors in diffusers' ``WanTransformer3DModel`` names."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    check_safetensors(path, SETTING)  # missing, unreadable, not safetensors, truncated
    state = load_file(str(path))
    if any(key.startswith(DIFFUSERS_MARKER) for key in state):
        return state
    return convert_wan_transformer_to_diffusers(state)


def load_transformer_file(path: str | Path, transformer: torch.nn.Module) -> None:
    """Load ``path`` (module docstring) into ``transformer`` in place, in its dtype (float32);
    a file of another architecture (missing or extra tensors, other shapes) is a one-line
    error. Its parameters may be on the meta device (the files-only build): they take the
    file's tensors, assigned, with nothing allocated before."""
    from impasto.models.io import own_aligned_storage

    state = read_transformer_state(path)
    expected = transformer.state_dict()
    where = f"{SETTING} {path}"
    for names, problem in ((set(expected) - set(state), "missing"),
                           (set(state) - set(expected), "not in this transformer")):  # fmt: skip
        if names:
            raise ValueError(
                f"{where}: {len(names)} tensors {problem} (e.g. {min(names)}); is it a Wan 2.1 "
                "text-to-video transformer of model.path's (or the preset's) size?"
            )
    for key, tensor in expected.items():
        if state[key].shape != tensor.shape:
            raise ValueError(
                f"{where}: {key} has shape {tuple(state[key].shape)}, the model's is "
                f"{tuple(tensor.shape)}; use the transformer of model.path's release (1.3B/14B)"
            )
    state = {key: state[key].to(tensor.dtype) for key, tensor in expected.items()}
    transformer.load_state_dict(state, strict=True, assign=True)
    own_aligned_storage(transformer)  # the file's float32 tensors may lie unaligned


# diffusers' module → Wan-AI's (wan/modules/model.py, which ComfyUI's comfy/ldm/wan keeps)
TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "proj_out": "head.head",
}
ATTENTIONS = {"attn1": "self_attn", "attn2": "cross_attn"}
ATTENTION_LAYERS = {
    "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k",
}  # fmt: skip
# inside a block; diffusers' norm2 (before the cross-attention) is Wan's norm3
BLOCK_MODULES = {"norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2"} | {
    f"{ours}.{layer}": f"{theirs}.{name}"
    for ours, theirs in ATTENTIONS.items()
    for layer, name in ATTENTION_LAYERS.items()
}
HEAD_TABLE = "scale_shift_table"  # the head's modulation; a block's is blocks.N.modulation


def original_name(key: str) -> str:
    """Wan-AI's name of the diffusers ``WanTransformer3DModel`` tensor ``key`` (ValueError for
    one the text-to-video layout has no place for)."""
    module, _, leaf = key.rpartition(".")
    if key == HEAD_TABLE:
        return "head.modulation"
    if key.startswith("blocks."):
        _, index, rest = key.split(".", 2)
        if rest == "scale_shift_table":
            return f"blocks.{index}.modulation"
        module, _, leaf = rest.rpartition(".")
        if module in BLOCK_MODULES:
            return f"blocks.{index}.{BLOCK_MODULES[module]}.{leaf}"
    elif module in TOP_MODULES:
        return f"{TOP_MODULES[module]}.{leaf}"
    raise ValueError(
        f"a tensor the Wan 2.1 text-to-video original layout has no place for: {key!r}"
    )


def to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Wan 2.1 text-to-video transformer's state dict under Wan-AI's names: the
    inverse of ``convert_wan_transformer_to_diffusers``."""
    return {original_name(key): tensor for key, tensor in state.items()}


def write_single_file(backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype) -> Path:
    """``impasto export --format single-file`` of a Wan run (``FamilySpec.exports``): the
    rebuilt transformer (adapters merged, cast to ``dtype`` by the exporter) as one
    ``.safetensors`` file ``out`` in Wan-AI's names, without a prefix, as
    ``wan2.1_t2v_1.3B_fp16.safetensors`` (the transformer alone: ComfyUI's
    ``models/diffusion_models/``); its VAE and umT5 stay in the diffusers folder."""
    tensors = to_original(backbone.components.transformer.state_dict())
    return shared.write_transformer_file(tensors, out, record.get("family", "wan"))
