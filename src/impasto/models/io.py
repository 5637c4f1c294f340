"""Save and load SDXL components as a diffusers ``StableDiffusionXLPipeline`` folder.

The folder layout is the one of ``stabilityai/stable-diffusion-xl-base-1.0`` (model_index.json
plus one subfolder per component, safetensors weights), so a checkpoint written here loads with
``StableDiffusionXLPipeline.from_pretrained`` and every tool that reads diffusers folders.
"""

from __future__ import annotations

import json
import shutil
from importlib.resources import as_file, files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
from packaging.version import Version
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from impasto.models.components import SDXLComponents
from impasto.models.tokenizers import (
    CLIP_MAX_LENGTH,
    TOKENIZER_2_PAD_TOKEN,
    TOKENIZER_PAD_TOKEN,
    load_clip_tokenizer,
)

if TYPE_CHECKING:  # importing the pipelines is slow and prints transformers notices
    from diffusers import StableDiffusionXLPipeline

SETTING = "model.path"
DIFFUSERS_FOLDER = (
    "a diffusers SDXL folder (model_index.json, unet/, vae/, text_encoder/, "
    "text_encoder_2/, tokenizer/, tokenizer_2/)"
)
EXPECTED_LAYOUT = f"expected {DIFFUSERS_FOLDER}"
# safetensors only: pickled .bin weights can run code when loaded (DESIGN §6).
DIFFUSERS_WEIGHTS = (
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
)
TRANSFORMERS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
COMPONENT_WEIGHTS = {
    "unet": DIFFUSERS_WEIGHTS,
    "vae": DIFFUSERS_WEIGHTS,
    "text_encoder": TRANSFORMERS_WEIGHTS,
    "text_encoder_2": TRANSFORMERS_WEIGHTS,
}
# transformers renamed `torch_dtype` to `dtype` in 4.56 and warns on the old name from 5.0.
TRANSFORMERS_DTYPE_KWARG = (
    "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
)


def sdxl_scheduler() -> EulerDiscreteScheduler:
    """The noise schedule shipped with SDXL 1.0 base (``scheduler/scheduler_config.json``)."""
    return EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        timestep_spacing="leading",
        steps_offset=1,
        interpolation_type="linear",
        use_karras_sigmas=False,
    )


def to_pipeline(components: SDXLComponents) -> StableDiffusionXLPipeline:
    """Wrap ``components`` (shared, not copied) in a diffusers pipeline with SDXL's scheduler."""
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline(
        vae=components.vae,
        text_encoder=components.text_encoder,
        text_encoder_2=components.text_encoder_2,
        tokenizer=components.tokenizer,
        tokenizer_2=components.tokenizer_2,
        unet=components.unet,
        scheduler=sdxl_scheduler(),
        force_zeros_for_empty_prompt=True,  # as SDXL 1.0 base
    )


def save_diffusers(components: SDXLComponents, path: str | Path, scheduler: Any = None) -> None:
    """Write ``components`` to ``path`` as a diffusers SDXL folder with safetensors weights.

    ``scheduler``: the one to ship (default SDXL's ε scheduler; exports pass the one matching
    the trained objective).
    """
    path = Path(path)
    pipe = to_pipeline(components)
    if scheduler is not None:
        pipe.scheduler = scheduler
    pipe.save_pretrained(path, safe_serialization=True)
    # transformers 5 saves only tokenizer.json; 4.x's CLIPTokenizer needs vocab.json + merges.txt,
    # which the SDXL release also ships, so add them for portability.
    with as_file(files("impasto") / "assets" / "clip") as asset_dir:
        for subfolder in ("tokenizer", "tokenizer_2"):
            for name in ("vocab.json", "merges.txt"):
                if not (path / subfolder / name).exists():
                    shutil.copyfile(Path(asset_dir) / name, path / subfolder / name)


def _check_component(root: Path, subfolder: str, weight_names: tuple[str, ...]) -> None:
    """Raise a one-line ``ValueError`` if ``root/subfolder`` lacks its config or weights."""
    folder = root / subfolder
    if folder.is_file():
        raise ValueError(
            f"model.path {root}: {subfolder} is a file, not a folder; {EXPECTED_LAYOUT}"
        )
    if not folder.is_dir():
        raise ValueError(f"model.path {root}: no {subfolder}/ folder; {EXPECTED_LAYOUT}")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.path {root}: no {subfolder}/config.json; {EXPECTED_LAYOUT}")
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except OSError as err:  # permission denied, an I/O error
        from impasto.models.single_file.file_errors import os_error

        label = f"model.path {root}: {subfolder}/config.json"
        raise os_error(folder / "config.json", SETTING, err, label=label) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"model.path {root}: {subfolder}/config.json is not valid JSON ({err}); "
            "re-save or re-copy it"
        ) from err
    if not any((folder / name).is_file() for name in weight_names):
        if any(folder.glob("*.bin")):
            raise ValueError(
                f"model.path {root}: {subfolder}/ has only pickled .bin weights; impasto loads "
                "safetensors only: convert with save_pretrained(..., safe_serialization=True)"
            )
        raise ValueError(
            f"model.path {root}: no weights in {subfolder}/ (expected {weight_names[0]}); "
            "re-save the model with save_pretrained"
        )


def _weights_file(folder: Path, weight_names: tuple[str, ...]) -> Path:
    return next(folder / name for name in weight_names if (folder / name).is_file())


def _first_line(err: BaseException) -> str:
    """First line of the innermost cause: diffusers re-raises safetensors errors vaguely."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def check_weights(root: Path, weights: Path) -> None:
    """A one-line ``ValueError`` if the safetensors file ``weights`` of the folder ``root``
    cannot be read, is not safetensors, is truncated or is corrupt (its header only is read;
    a sharded model's index is not checked)."""
    from impasto.models.single_file.file_errors import check_safetensors

    if weights.suffix == ".safetensors":
        check_safetensors(weights, SETTING, f"model.path {root}: {weights.relative_to(root)}")


def load_component(model_class: Any, root: Path, subfolder: str, **kwargs: Any) -> Any:
    """``model_class.from_pretrained`` on a checked local subfolder, its tensors in memory of
    their own (:func:`own_aligned_storage`); errors become one line."""
    try:
        module = model_class.from_pretrained(
            str(root), subfolder=subfolder, local_files_only=True, use_safetensors=True, **kwargs
        )
    except Exception as err:  # corrupt or truncated files: safetensors, torch, json errors
        weights = _weights_file(root / subfolder, COMPONENT_WEIGHTS[subfolder])
        check_weights(root, weights)  # unreadable, not safetensors, truncated, corrupt: say which
        raise ValueError(
            f"model.path {root}: cannot load {weights} ({_first_line(err)}); if the file is "
            "corrupt or truncated, re-save or re-copy it"
        ) from err
    return own_aligned_storage(module)


ALIGNMENT = 64  # bytes: what the CPU kernels' vector loads (and the caching allocator) assume


def own_aligned_storage(module: torch.nn.Module) -> torch.nn.Module:
    """Copy every CPU tensor of ``module`` that lies at an address not a multiple of
    :data:`ALIGNMENT` into memory of its own, one tensor at a time.

    ``from_pretrained`` may keep a float32 file's tensors as views of the memory-mapped file,
    at whatever offset the safetensors header left them. The CPU's matrix kernels take another
    code path for unaligned data and round differently (a diffusers folder then sampled
    1/255 off the run it was exported from, with one thread); the views also keep the file
    mapped, so replacing it under a live process would change the weights."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.device.type == "cpu" and tensor.data_ptr() % ALIGNMENT:
                tensor.data = tensor.data.clone()
    return module


def load_tokenizer(root: Path, subfolder: str, fallback_pad_token: str) -> CLIPTokenizer:
    """The folder's tokenizer if it has one, else the bundled CLIP tokenizer with that pad."""
    if not (root / subfolder).is_dir():
        return load_clip_tokenizer(fallback_pad_token)
    try:
        tokenizer = CLIPTokenizer.from_pretrained(
            str(root), subfolder=subfolder, local_files_only=True
        )
    except Exception as err:
        raise ValueError(
            f"model.path {root}: cannot load {subfolder}/ ({_first_line(err)}); "
            "delete that folder to use the bundled CLIP tokenizer"
        ) from err
    if tokenizer.model_max_length > CLIP_MAX_LENGTH:  # configs without model_max_length
        tokenizer.model_max_length = CLIP_MAX_LENGTH
    return tokenizer


def load_diffusers(path: str | Path) -> SDXLComponents:
    """Load the SDXL components of the diffusers folder ``path`` in float32, offline.

    Missing ``tokenizer/`` or ``tokenizer_2/`` folders fall back to the bundled CLIP tokenizers.
    """
    from impasto.models.single_file.file_errors import check_folder

    root = Path(path)
    check_folder(root, SETTING, f"{DIFFUSERS_FOLDER}, or at a single-file .safetensors")
    if not (root / "model_index.json").is_file():
        raise ValueError(f"model.path {root}: no model_index.json; {EXPECTED_LAYOUT}")
    for subfolder, weight_names in COMPONENT_WEIGHTS.items():
        _check_component(root, subfolder, weight_names)
    fp32 = {"torch_dtype": torch.float32}
    fp32_transformers = {TRANSFORMERS_DTYPE_KWARG: torch.float32}
    return SDXLComponents(
        unet=load_component(UNet2DConditionModel, root, "unet", **fp32),
        vae=load_component(AutoencoderKL, root, "vae", **fp32),
        text_encoder=load_component(CLIPTextModel, root, "text_encoder", **fp32_transformers),
        text_encoder_2=load_component(
            CLIPTextModelWithProjection, root, "text_encoder_2", **fp32_transformers
        ),
        tokenizer=load_tokenizer(root, "tokenizer", TOKENIZER_PAD_TOKEN),
        tokenizer_2=load_tokenizer(root, "tokenizer_2", TOKENIZER_2_PAD_TOKEN),
    )
