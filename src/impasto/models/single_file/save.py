"""Write SDXL components as one safetensors file in the original SGM layout (A1111, ComfyUI, Forge).

The key map is :func:`sgm_state_dict`; this module only checks and writes. ComfyUI and
Forge pick the model type from tensors outside the networks (``v_pred``, ``ztsnr``, ``edm_mean``
in ``comfy/supported_models.py``): pass them as ``extra_keys``.

Memory: the tensors are cast one at a time as they are written (:func:`write_safetensors`), so
an fp16 export of an fp32 model needs the model plus one cast tensor, not a second model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from impasto.models.components import SDXLComponents
from impasto.models.single_file.configs import CONFIGS_METADATA_KEY, configs_of
from impasto.models.single_file.keymap import sgm_state_dict
from impasto.models.single_file.load import SAFETENSORS_SUFFIX
from impasto.models.single_file.stream import write_safetensors

EXPORT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    non-SDXL-sized architectures. The file is written beside ``path`` and renamed into place;
    ``components`` are only read (each tensor is cast as it is written).
    """
    path = Path(path)
    if path.suffix.lower() != SAFETENSORS_SUFFIX:
        raise ValueError(f"single-file export {path}: name the file *{SAFETENSORS_SUFFIX}")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"single-file export dtype must be one of {EXPORT_DTYPES}, got {dtype}")
    metadata = dict(metadata or {})
    _check_metadata(metadata)
    state = sgm_state_dict(components)  # the modules' own tensors (views), not copies
    for key, tensor in (extra_keys or {}).items():
        if key in state:
            raise ValueError(f"extra key {key!r} would overwrite a model tensor")
        state[key] = tensor
    metadata[CONFIGS_METADATA_KEY] = configs_of(components).to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, state, dtype=dtype, metadata=metadata)
