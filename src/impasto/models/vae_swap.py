"""``model.vae``: another VAE in place of the model's own, e.g. an fp16-fix SDXL VAE.

Three forms are read, all offline:

- a diffusers ``AutoencoderKL`` folder (``config.json`` + weights), or a whole diffusers SDXL
  folder, whose ``vae/`` is taken;
- a ``.safetensors`` file with diffusers names (``encoder.down_blocks.0.resnets.0...``), such as
  ``sdxl.vae.safetensors`` of the fp16-fix VAE; the architecture is the model's own VAE's (or
  the config impasto stored in the file, see :mod:`impasto.models.vae_files`);
- a ``.safetensors`` file in the original (LDM) layout (``encoder.down.0.block.0...``, with or
  without a ``first_stage_model.`` / ``vae.`` prefix), such as Stability's ``sdxl_vae.safetensors``;
  renamed by diffusers' own converter.

Every problem (a path that does not exist, cannot be read or is not safetensors, a truncated
file, another kind of file, missing tensors, wrong shapes) is one line naming ``model.vae``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import LDM_VAE_KEYS, convert_ldm_vae_checkpoint
from safetensors import SafetensorError, safe_open

from impasto.models.single_file.file_errors import check_safetensors, missing_error
from impasto.models.vae_files import CONFIG_KEY

SETTING = "model.vae"
DIFFUSERS_KEY = "encoder.down_blocks.0.resnets.0.conv1.weight"
LDM_KEY = "encoder.down.0.block.0.conv1.weight"  # after a first_stage_model. / vae. prefix
LDM_PREFIXES = ("", "first_stage_model.", "vae.")
CONFIG_NAME = "config.json"
LDM_VAE_PARTS = {"encoder", "decoder", "quant_conv", "post_quant_conv"}  # under the prefix


def _error(path: Path, problem: str) -> ValueError:
    return ValueError(f"{SETTING} {path}: {problem}")


def load_vae(path: str | Path, like: AutoencoderKL) -> AutoencoderKL:
    """The VAE at ``path`` (a folder or a ``.safetensors`` file), float32, in eval mode.

    ``like`` is the model's own VAE: its architecture is used for a file that carries none,
    and the new VAE must fit it (the same latent channels), so the denoiser reads its latents.
    """
    path = Path(path)
    if path.is_dir():
        vae = _load_folder(path)
    elif path.is_file():
        if path.suffix.lower() != ".safetensors":
            raise _error(path, "expected a diffusers VAE folder or a .safetensors file")
        vae = _load_file(path, like)
    else:
        raise missing_error(path, SETTING, "file" if path.suffix else "folder")
    latent, expected = vae.config.latent_channels, like.config.latent_channels
    if latent != expected:
        raise _error(path, f"a VAE with {latent} latent channels; this model's has {expected}")
    return vae.float().eval().requires_grad_(False)


def _load_folder(path: Path) -> AutoencoderKL:
    folder = path / "vae" if (path / "vae" / CONFIG_NAME).is_file() else path
    if not (folder / CONFIG_NAME).is_file():
        raise _error(path, f"no {CONFIG_NAME}; expected a diffusers AutoencoderKL folder")
    try:
        with torch.random.fork_rng(devices=[]):  # the throwaway init draws from the global RNG
            return AutoencoderKL.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # corrupt weights, a config of another model, missing files
        weights = folder / "diffusion_pytorch_model.safetensors"
        if weights.is_file():  # unreadable, not safetensors, truncated, corrupt: say which
            check_safetensors(weights, SETTING, f"{SETTING} {path}: {weights.relative_to(path)}")
        raise _error(path, f"cannot load it as an AutoencoderKL ({_first_line(error)})") from None


def _load_file(path: Path, like: AutoencoderKL) -> AutoencoderKL:
    check_safetensors(path, SETTING)  # unreadable, not safetensors, truncated, corrupt
    with _opened(path) as handle:  # the names first, then only the VAE's tensors
        metadata, names = handle.metadata() or {}, set(handle.keys())
    config = json.loads(metadata[CONFIG_KEY]) if CONFIG_KEY in metadata else dict(like.config)
    with torch.random.fork_rng(devices=[]):
        vae = AutoencoderKL.from_config(config)
    if DIFFUSERS_KEY in names:
        state = _read_tensors(path, [key for key in vae.state_dict() if key in names])
    elif any(prefix + LDM_KEY in names for prefix in LDM_PREFIXES):
        state = convert_ldm_vae_checkpoint(_read_tensors(path, ldm_vae_names(names)), vae.config)
    else:
        raise _error(path, "not a VAE: it has neither diffusers nor original (LDM) VAE names")
    expected = vae.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise _error(path, f"{len(missing)} VAE tensors missing (e.g. {missing[0]}); is it an "
                     "SDXL VAE?")  # fmt: skip
    for key, tensor in expected.items():
        found = state[key]
        if found.shape != tensor.shape:
            if found.numel() == tensor.numel():  # 1x1-conv attention of old files
                state[key] = found.reshape(tensor.shape)
                continue
            raise _error(path, f"{key} has shape {tuple(found.shape)}, this model's VAE "
                         f"{tuple(tensor.shape)}; is it a VAE of another model?")  # fmt: skip
    vae.load_state_dict({key: state[key].float() for key in expected}, strict=True)
    return vae


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """The file's safetensors handle (its header read, no tensor yet); a one-line error."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as error:
        raise _error(path, f"cannot read it as safetensors ({_first_line(error)})") from None


def _read_tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the file and no other: of a whole checkpoint (an SD3.5 file of
    16 GB), its VAE's ~160 MB."""
    with _opened(path) as handle:
        return {name: handle.get_tensor(name) for name in names}


def ldm_vae_names(names: set[str]) -> list[str]:
    """The VAE's tensors among ``names`` in the original layout: the encoder, the decoder and
    their quant convs, under the prefix diffusers' ``convert_ldm_vae_checkpoint`` takes (the
    last of ``LDM_VAE_KEYS`` found, else none); a checkpoint's other networks are left."""
    found = [key for key in LDM_VAE_KEYS if any(name.startswith(key) for name in names)]
    prefix = found[-1] if found else ""
    return sorted(
        name
        for name in names
        if name.startswith(prefix) and name[len(prefix) :].split(".")[0] in LDM_VAE_PARTS
    )


def _first_line(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
