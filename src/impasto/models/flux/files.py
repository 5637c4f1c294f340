"""Loading FLUX.1 from a local diffusers folder (``model.path``), offline, float32: the layout
of ``black-forest-labs/FLUX.1-dev`` (``transformer/``, ``vae/``, ``text_encoder/`` (CLIP-L),
``text_encoder_2/`` (T5), ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``), safetensors
weights only (pickled weights can run code when loaded). ``save_flux_folder`` writes the same
layout, which ``FluxPipeline.from_pretrained`` reads too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from impasto.models.flux.components import DEV_SCHEDULER, FluxComponents
from impasto.models.io import (
    DIFFUSERS_WEIGHTS,
    TRANSFORMERS_DTYPE_KWARG,
    TRANSFORMERS_WEIGHTS,
    check_weights,
    own_aligned_storage,
)

SETTING = "model.path"
LAYOUT = (
    "expected a diffusers FLUX.1 folder (transformer/, vae/, text_encoder/, text_encoder_2/, "
    "tokenizer/, tokenizer_2/, scheduler/)"
)
_FP32 = {"torch_dtype": torch.float32}
_FP32_TRANSFORMERS = {TRANSFORMERS_DTYPE_KWARG: torch.float32}
NETWORKS: dict[str, tuple[Any, tuple[str, ...], dict[str, Any]]] = {
    "transformer": (FluxTransformer2DModel, DIFFUSERS_WEIGHTS, _FP32),
    "vae": (AutoencoderKL, DIFFUSERS_WEIGHTS, _FP32),
    "text_encoder": (CLIPTextModel, TRANSFORMERS_WEIGHTS, _FP32_TRANSFORMERS),
    "text_encoder_2": (T5EncoderModel, TRANSFORMERS_WEIGHTS, _FP32_TRANSFORMERS),
}
"""subfolder → (class, weight file names (any one), from_pretrained's dtype keyword)."""


def _first_line(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def _check_subfolder(root: Path, name: str, weights: tuple[str, ...]) -> None:
    folder = root / name
    if not (folder / "config.json").is_file():
        raise ValueError(f"{SETTING} {root}: no {name}/config.json; {LAYOUT}")
    if not any((folder / weight).is_file() for weight in weights):
        raise ValueError(
            f"{SETTING} {root}: no safetensors weights in {name}/ (expected {weights[0]}); "
            "re-save it with save_pretrained (safetensors)"
        )


def _load_network(root: Path, name: str) -> torch.nn.Module:
    model_class, weights, dtype = NETWORKS[name]
    _check_subfolder(root, name, weights)
    try:
        module = model_class.from_pretrained(
            str(root), subfolder=name, local_files_only=True, use_safetensors=True, **dtype
        )
    except Exception as error:  # corrupt or truncated files, configs of another class
        weight = next(root / name / w for w in weights if (root / name / w).is_file())
        check_weights(root, weight)  # unreadable, not safetensors, truncated: say which
        raise ValueError(
            f"{SETTING} {root}: cannot load {name}/ as {model_class.__name__} "
            f"({_first_line(error)}); re-save or re-copy it"
        ) from None
    return own_aligned_storage(module).eval()


def _load_tokenizer(root: Path, name: str, tokenizer_class: Any) -> Any:
    if not (root / name).is_dir():
        raise ValueError(f"{SETTING} {root}: no {name}/ folder; {LAYOUT}")
    try:
        return tokenizer_class.from_pretrained(str(root), subfolder=name, local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{SETTING} {root}: cannot load {name}/ as {tokenizer_class.__name__} "
            f"({_first_line(error)}); copy the tokenizer files of the release there"
        ) from None


def _scheduler_config(root: Path) -> dict[str, Any]:
    """``scheduler/scheduler_config.json``; FLUX.1-dev's where the folder has none."""
    file = root / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        return dict(DEV_SCHEDULER)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{SETTING} {root}: cannot read {file.name} ({error})") from None
    scheduler_class = "FlowMatchEulerDiscreteScheduler"
    if (
        not isinstance(config, dict)
        or config.get("_class_name", scheduler_class) != scheduler_class
    ):
        raise ValueError(
            f"{SETTING} {root}: scheduler/ is not a FlowMatchEulerDiscreteScheduler; {LAYOUT}"
        )
    return {key: value for key, value in config.items() if not key.startswith("_")}


def _transformer_from_config(root: Path) -> torch.nn.Module:
    """The folder's transformer architecture with its tensors on the meta device (nothing
    allocated): the weights come from another file."""
    folder = root / "transformer"
    if not (folder / "config.json").is_file():
        raise ValueError(f"{SETTING} {root}: no transformer/config.json; {LAYOUT}")
    try:
        config = FluxTransformer2DModel.load_config(str(folder), local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{SETTING} {root}: cannot read transformer/config.json ({_first_line(error)})"
        ) from None
    with torch.device("meta"):
        return FluxTransformer2DModel.from_config(config).eval()


def load_flux_folder(
    path: str | Path, text_length: int, transformer_weights: bool = True
) -> FluxComponents:
    """The FLUX.1 diffusers folder ``path`` (module docstring), float32, eval mode, offline;
    T5 pads to ``text_length`` tokens. ``transformer_weights`` False: the transformer's
    architecture only, on the meta device (``model.flux.transformer`` brings the weights)."""
    root = Path(path)
    if root.suffix.lower() == ".safetensors":
        from impasto.models.flux.single_file import single_file_advice

        raise ValueError(single_file_advice(root, SETTING))
    if not root.is_dir():
        raise ValueError(f"{SETTING} {root}: not a folder; {LAYOUT}")
    names = [name for name in NETWORKS if transformer_weights or name != "transformer"]
    networks = {name: _load_network(root, name) for name in names}
    if not transformer_weights:
        networks["transformer"] = _transformer_from_config(root)
    tokenizer_2 = _load_tokenizer(root, "tokenizer_2", T5Tokenizer)
    tokenizer_2.model_max_length = text_length
    return FluxComponents(
        transformer=networks["transformer"],
        vae=networks["vae"],
        text_encoder=networks["text_encoder"],
        text_encoder_2=networks["text_encoder_2"],
        tokenizer=_load_tokenizer(root, "tokenizer", CLIPTokenizer),
        tokenizer_2=tokenizer_2,
        scheduler_config=_scheduler_config(root),
    )


def save_flux_folder(components: FluxComponents, path: str | Path) -> Path:
    """Write ``components`` as a diffusers FLUX.1 folder (``FluxPipeline`` layout)."""
    from diffusers import FluxPipeline

    root = Path(path)
    pipeline = FluxPipeline(
        scheduler=components.scheduler(),
        vae=components.vae,
        text_encoder=components.text_encoder,
        tokenizer=components.tokenizer,
        text_encoder_2=components.text_encoder_2,
        tokenizer_2=components.tokenizer_2,
        transformer=components.transformer,
    )
    pipeline.save_pretrained(str(root), safe_serialization=True)
    return root


def write_diffusers_folder(
    backbone: Any, out: Path, record: dict[str, Any], dtype: torch.dtype
) -> Path:
    """``impasto export --format diffusers`` of a FLUX run (``FamilySpec.exports``): the
    rebuilt backbone (adapters merged, cast to ``dtype`` by the exporter) as a diffusers
    FLUX.1 folder, which ``FluxPipeline.from_pretrained`` and ``model.path`` read, with
    ``record`` beside it (``impasto-model.json``: the family and size, which ``impasto
    sample`` reads; the folder's scheduler config says how it samples)."""
    from impasto.models.exported import write_record

    root = save_flux_folder(backbone.components, out)
    write_record(root, record)
    return root
