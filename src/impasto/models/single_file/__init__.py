"""SDXL single-file checkpoints (the original SGM layout of A1111, ComfyUI and Forge), in and out.

- :func:`load_single_file`: an SDXL base ``.safetensors`` (or, opted in, ``.ckpt``) file ->
  :class:`~impasto.models.SDXLComponents`, refusing other families with a one-line reason.
- :func:`save_single_file`: components -> one safetensors file those tools load.
- :func:`detect_checkpoint`: the model family of a file from its tensor names and shapes.
- :func:`unet_module_to_sgm`: diffusers UNet module name -> SGM name (kohya LoRA keys).
- :func:`sgm_state_dict`: the export's key map, usable on meta-device modules.
- :func:`read_configs`: the architecture of a single file, from its header alone.
- :func:`write_safetensors`, :class:`TensorFile`: safetensors written (and cast) and read one
  tensor at a time, without a memory map; :class:`SafetensorsFileError` and its kinds (not
  safetensors, truncated, corrupt) for a file that is not a usable one.
- :mod:`~impasto.models.single_file.file_errors`: the one-line errors for a file a setting
  names (missing, a folder, unreadable, not safetensors, truncated, corrupt).
"""

from __future__ import annotations

from impasto.models.single_file.configs import (
    ComponentConfigs,
    build_components,
    configs_of,
    sdxl_base_configs,
)
from impasto.models.single_file.detect import detect_checkpoint
from impasto.models.single_file.keymap import (
    clip_text_model_key,
    sgm_state_dict,
    unet_module_to_sgm,
)
from impasto.models.single_file.load import load_single_file, read_configs
from impasto.models.single_file.save import save_single_file
from impasto.models.single_file.stream import (
    CorruptSafetensorsError,
    NotSafetensorsError,
    SafetensorsFileError,
    TensorFile,
    TruncatedSafetensorsError,
    write_safetensors,
)

__all__ = [
    "CorruptSafetensorsError",
    "NotSafetensorsError",
    "SafetensorsFileError",
    "TensorFile",
    "TruncatedSafetensorsError",
    "ComponentConfigs",
    "build_components",
    "clip_text_model_key",
    "configs_of",
    "detect_checkpoint",
    "load_single_file",
    "read_configs",
    "save_single_file",
    "sdxl_base_configs",
    "sgm_state_dict",
    "unet_module_to_sgm",
    "write_safetensors",
]
