"""``model.wan.transformer``: the Wan 2.1 transformer's weights from one ``.safetensors`` file,
loaded into ``model.path``'s (or the preset's) architecture: the original layout people
download (Wan-AI's and ComfyUI's ``wan2.1_t2v_1.3B_fp16.safetensors``: ``blocks.N.self_attn.q``,
``head.head`` ..., with or without ComfyUI's ``model.diffusion_model.`` prefix), renamed by
diffusers' own ``convert_wan_transformer_to_diffusers``, or a file in diffusers' names. Every
problem is one line naming the setting.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

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
