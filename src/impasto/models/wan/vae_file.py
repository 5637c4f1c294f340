"""Wan 2.1's VAE from one ``.safetensors`` file (``model.vae`` of the wan family): Wan-AI's and
ComfyUI's ``wan_2.1_vae.safetensors`` in the original layout (``encoder.conv1``,
``encoder.downsamples.N.residual.M``, ``decoder.upsamples.N``, ``encoder.head`` ...), renamed by
diffusers' own ``convert_wan_vae_to_diffusers``, or a file with diffusers' names. Read as
float32 into the architecture of the model's own VAE; a file of another network, a missing
tensor or a wrong shape is one line naming ``model.vae``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from torch import Tensor

from impasto.models.single_file.file_errors import open_tensor_file

SETTING = "model.vae"
ORIGINAL_KEY = "encoder.downsamples.0.residual.0.gamma"
DIFFUSERS_KEY = "encoder.down_blocks.0.norm1.gamma"


def read_wan_vae_file(path: Path) -> dict[str, Tensor]:
    """The file's tensors under diffusers' names, float32 (original layout converted)."""
    from impasto.models.encoder_files import file_kind

    with open_tensor_file(path, SETTING) as file:
        keys = file.keys()
        if ORIGINAL_KEY not in keys and DIFFUSERS_KEY not in keys:
            kind, _ = file_kind(keys)
            found = "not a network impasto knows" if kind == "unknown" else kind
            raise ValueError(
                f"{SETTING} {path}: {found}, not a Wan 2.1 VAE (wan_2.1_vae.safetensors); "
                "check the file"
            )
        tensors = {key: file.read(key).float() for key in keys}
    if ORIGINAL_KEY in tensors:
        return convert_wan_vae_to_diffusers(tensors)
    return tensors


def load_wan_vae_file(path: str | Path, like: AutoencoderKLWan) -> AutoencoderKLWan:
    """The VAE in the file ``path``, with the architecture of ``like`` (the model's own VAE,
    maybe on the meta device); float32, eval mode, frozen."""
    path = Path(path)
    state = read_wan_vae_file(path)
    with torch.random.fork_rng(devices=[]):  # the throwaway init draws from the global RNG
        vae = AutoencoderKLWan.from_config(dict(like.config))
    expected = vae.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or extra or wrong:
        problem = (
            f"no {missing[0]!r}" if missing else f"an extra {extra[0]!r}" if extra else
            f"{wrong[0]!r} of shape {tuple(state[wrong[0]].shape)}, not "
            f"{tuple(expected[wrong[0]].shape)}"
        )  # fmt: skip
        raise ValueError(
            f"{SETTING} {path}: does not fit this model's Wan VAE ({problem}); is it the VAE "
            "of another model (Wan 2.2's has 48 channels)?"
        )
    vae.load_state_dict(state, strict=True)
    return vae.float().eval().requires_grad_(False)
