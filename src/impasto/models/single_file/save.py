"""Write SDXL components as one safetensors file in the original SGM layout (A1111, ComfyUI, Forge).

The key map is :func:`sgm_state_dict`; this module only casts, checks and writes. ComfyUI and
Forge pick the model type from tensors outside the networks (``v_pred``, ``ztsnr``, ``edm_mean``
in ``comfy/supported_models.py``): pass them as ``extra_keys``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from impasto.models.components import SDXLComponents
from impasto.models.single_file.configs import CONFIGS_METADATA_KEY, configs_of
from impasto.models.single_file.keymap import sgm_state_dict
from impasto.models.single_file.load import SAFETENSORS_SUFFIX

EXPORT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """A CPU, contiguous copy-or-view of ``tensor``; floating tensors in ``dtype``, others as is."""
    tensor = tensor.detach().to("cpu")
    if tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def _check_metadata(metadata: Mapping[str, str]) -> None:
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"single-file metadata must map str to str, got {key!r}: {value!r}")
    if CONFIGS_METADATA_KEY in metadata:
        raise ValueError(f"metadata key {CONFIGS_METADATA_KEY!r} is reserved for impasto")


def save_single_file(
    components: SDXLComponents,
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float16,
    extra_keys: Mapping[str, Tensor] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``components`` to ``path`` (``*.safetensors``) as an SGM-layout SDXL checkpoint.

    Floating tensors are cast to ``dtype`` (float16, bfloat16 or float32); CLIP-L's int64
    ``position_ids`` stay int64. ``extra_keys`` are written beside the networks, cast alike (for
    example ``{"v_pred": torch.tensor([]), "ztsnr": torch.tensor([])}`` marks a v-prediction
    zero-terminal-SNR model for ComfyUI). ``metadata`` goes into the safetensors header, with
    the networks' configs under ``"impasto.configs"`` so that :func:`load_single_file` rebuilds
    non-SDXL-sized architectures. The file is written beside ``path`` and renamed into place.
    """
    path = Path(path)
    if path.suffix.lower() != SAFETENSORS_SUFFIX:
        raise ValueError(f"single-file export {path}: name the file *{SAFETENSORS_SUFFIX}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"single-file export dtype must be one of {EXPORT_DTYPES}, got {dtype}")
    metadata = dict(metadata or {})
    _check_metadata(metadata)
    state = {key: _cast(tensor, dtype) for key, tensor in sgm_state_dict(components).items()}
    for key, tensor in (extra_keys or {}).items():
        if key in state:
            raise ValueError(f"extra key {key!r} would overwrite a model tensor")
        state[key] = _cast(tensor, dtype)
    metadata[CONFIGS_METADATA_KEY] = configs_of(components).to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    save_file(state, str(partial), metadata=metadata)
    os.replace(partial, path)  # a reader never sees a half-written checkpoint
