"""What the released-transformer families (``models/flux``, ``models/sd3`` ...) share to load a
local diffusers folder (``model.path``) offline, in float32, safetensors weights only (pickled
weights can run code when loaded): each network from its subfolder, each tokenizer, the
scheduler's config, or the transformer's architecture alone on the meta device (its weights
then come from a single file). Every problem is one line naming ``model.path``, the subfolder
and the way out; ``layout`` is the family's sentence of what the folder should hold. Also the
outline every such family builds its components by (:func:`build_components`, from the
family's :class:`FamilyBuild`) and the networks part of its backbone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from impasto.models.io import (
    DIFFUSERS_WEIGHTS,
    TRANSFORMERS_DTYPE_KWARG,
    TRANSFORMERS_WEIGHTS,
    check_weights,
    own_aligned_storage,
)

SETTING = "model.path"
FP32_DIFFUSERS = (DIFFUSERS_WEIGHTS, {"torch_dtype": torch.float32})
FP32_TRANSFORMERS = (TRANSFORMERS_WEIGHTS, {TRANSFORMERS_DTYPE_KWARG: torch.float32})
SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def first_line(error: BaseException) -> str:
    """The first line of the innermost cause of ``error`` (at most 200 characters)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def check_subfolder(root: Path, name: str, weights: tuple[str, ...], layout: str) -> None:
    """A one-line error unless ``root/name`` has a config and one of ``weights``."""
    folder = root / name
    if not (folder / "config.json").is_file():
        raise ValueError(f"{SETTING} {root}: no {name}/config.json; {layout}")
    if not any((folder / weight).is_file() for weight in weights):
        raise ValueError(
            f"{SETTING} {root}: no safetensors weights in {name}/ (expected {weights[0]}); "
            "re-save it with save_pretrained (safetensors)"
        )


def load_network(
    root: Path, name: str, model_class: Any, kind: tuple[tuple[str, ...], dict[str, Any]],
    layout: str,
) -> torch.nn.Module:  # fmt: skip
    """``model_class`` from the subfolder ``name`` of ``root``, float32, eval mode, offline;
    ``kind``: :data:`FP32_DIFFUSERS` or :data:`FP32_TRANSFORMERS`."""
    weights, dtype = kind
    check_subfolder(root, name, weights, layout)
    try:
        module = model_class.from_pretrained(
            str(root), subfolder=name, local_files_only=True, use_safetensors=True, **dtype
        )
    except Exception as error:  # corrupt or truncated files, configs of another class
        weight = next(root / name / w for w in weights if (root / name / w).is_file())
        check_weights(root, weight)  # unreadable, not safetensors, truncated: say which
        raise ValueError(
            f"{SETTING} {root}: cannot load {name}/ as {model_class.__name__} "
            f"({first_line(error)}); re-save or re-copy it"
        ) from None
    return own_aligned_storage(module).eval()


def load_tokenizer(root: Path, name: str, tokenizer_class: Any, layout: str) -> Any:
    """``tokenizer_class`` from the subfolder ``name`` of ``root``, offline."""
    if not (root / name).is_dir():
        raise ValueError(f"{SETTING} {root}: no {name}/ folder; {layout}")
    try:
        return tokenizer_class.from_pretrained(str(root), subfolder=name, local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{SETTING} {root}: cannot load {name}/ as {tokenizer_class.__name__} "
            f"({first_line(error)}); copy the tokenizer files of the release there"
        ) from None


def scheduler_config(root: Path, default: dict[str, Any], layout: str) -> dict[str, Any]:
    """``scheduler/scheduler_config.json`` (a flow-matching Euler scheduler's) without its
    private keys; ``default`` where the folder has none."""
    file = root / "scheduler" / "scheduler_config.json"
    if not file.is_file():
        return dict(default)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{SETTING} {root}: cannot read {file.name} ({error})") from None
    if not isinstance(config, dict) or config.get("_class_name", SCHEDULER_CLASS) != (
        SCHEDULER_CLASS
    ):
        raise ValueError(f"{SETTING} {root}: scheduler/ is not a {SCHEDULER_CLASS}; {layout}")
    return {key: value for key, value in config.items() if not key.startswith("_")}


def transformer_from_config(root: Path, model_class: Any, layout: str) -> torch.nn.Module:
    """The folder's transformer architecture with its tensors on the meta device (nothing
    allocated): the weights come from another file."""
    folder = root / "transformer"
    if not (folder / "config.json").is_file():
        raise ValueError(f"{SETTING} {root}: no transformer/config.json; {layout}")
    try:
        config = model_class.load_config(str(folder), local_files_only=True)
    except Exception as error:
        raise ValueError(
            f"{SETTING} {root}: cannot read transformer/config.json ({first_line(error)})"
        ) from None
    with torch.device("meta"):
        return model_class.from_config(config).eval()


def check_folder(root: Path, family_files: str, transformer_setting: str, layout: str) -> None:
    """A one-line error if ``root`` is a single file or not a folder; ``family_files`` names
    the family's folder in the message (``a diffusers SD3.5 folder``), ``transformer_setting``
    the option that takes a transformer file."""
    if root.suffix.lower() == ".safetensors":
        raise ValueError(
            f"{SETTING} {root}: a single file; set {SETTING} to {family_files} (its VAE and "
            f"text encoders) and {transformer_setting} to this file"
        )
    if not root.is_dir():
        raise ValueError(f"{SETTING} {root}: not a folder; {layout}")


def swap_vae(path: str | Path, like: Any) -> Any:
    """``model.vae`` in place of the image VAE ``like`` (:func:`.vae_swap.load_vae`)."""
    from impasto.models.vae_swap import load_vae

    return load_vae(path, like)


@dataclass(frozen=True)
class FamilyBuild:
    """One family's steps in :func:`build_components`, and the wording of its messages."""

    family: str  # the config's name: model.<family> holds its options
    spec: Any  # its FamilySpec, which reads and checks those options
    frozen_part: str  # the part that may only be frozen (the T5 encoder) ...
    frozen_name: str  # ... as the message names it: "T5"
    frozen_way_out: str  # the message's advice after "frozen": "or train parts.text_encoder"
    load_folder: Callable[[Any, Any], Any]  # (model.path, options) → components
    build_preset: Callable[[Any, Any], Any]  # (config.model, options) → components
    files_only: Callable[[Any, Any], bool]  # (config.model, options): every network from a file
    load_transformer_file: Callable[[Any, torch.nn.Module], None]  # into it, in place
    load_text_files: Callable[[Any, Any, Any], None]  # (components, config.model, options)
    load_vae: Callable[[Any, Any], Any]  # (model.vae, the components' VAE) → a VAE


def check_parts(parts: Any, build: FamilyBuild) -> None:
    """``parts.<frozen_part>`` may only be frozen: a one-line error otherwise (None: the config
    has no parts section, as sampling's)."""
    if parts is None:
        return
    name, mode = build.frozen_part, parts.mode(build.frozen_part)
    if mode != "frozen":
        raise ValueError(
            f"parts.{name}: {mode}, but the {build.family} family trains {build.frozen_name} "
            f"frozen only; set parts.{name}: frozen ({build.frozen_way_out})"
        )


def build_components(config: Any, build: FamilyBuild) -> tuple[Any, Any]:
    """``(components, options)`` of ``config.model``: the folder ``model.path`` or the preset,
    then the transformer file, ``model.vae`` and the text encoders' files. With every network
    from a file and no folder, the preset gives the architecture alone, its parameters on the
    meta device (nothing initialised); the files' tensors are assigned to them."""
    from impasto.models.single_file.load import parameters_on_meta

    model = config.model
    options = build.spec.read_options(model.options, build.family)
    check_parts(getattr(config, "parts", None), build)  # sampling builds from the model alone
    if model.path is not None:
        components = build.load_folder(model.path, options)
    elif build.files_only(model, options):  # the preset's architecture, the files' weights
        with parameters_on_meta():
            components = build.build_preset(model, options)
    else:
        components = build.build_preset(model, options)
    if options.transformer is not None:  # a single transformer file (original layout)
        build.load_transformer_file(options.transformer, components.transformer)
    if model.vae is not None:  # another VAE of the same latent space
        components.vae = build.load_vae(model.vae, components.vae)
    build.load_text_files(components, model, options)  # the encoders' files, T5's tokenizer
    return components, options


class TransformerBackbone:
    """The networks part of the backbone protocol, the same for every released-transformer
    family: ``components`` (a dataclass with ``transformer``, ``vae`` and ``parts()``) and the
    family's ``options`` (``options_type()`` when None). A family's class sets ``family``,
    ``options_type`` and ``probe`` (the transformer's layer whose weight gives its device and
    dtype) and adds its conditioning, latents and sampling."""

    family: str
    options_type: type
    probe: str = "proj_out"

    def __init__(self, components: Any, options: Any = None) -> None:
        self.components = components
        self.options = options or self.options_type()
        # texts → encodings once the text encoders are released (impasto.train.text_release)
        self.text_table: Callable[[list[str]], Any] | None = None

    def encode_text(self, captions: list[str]) -> Any:
        """The captions' encodings: the family's ``encode_captions`` through its text
        encoders, or the table that stands in for them after their release."""
        if self.text_table is not None:
            return self.text_table(captions)
        return self.encode_captions(captions)

    def encode_captions(self, captions: list[str]) -> Any:
        raise NotImplementedError

    def parts(self) -> dict[str, torch.nn.Module]:
        return self.components.parts()

    def frozen(self) -> dict[str, torch.nn.Module]:
        return {"vae": self.components.vae}

    def text_encoders(self) -> dict[str, torch.nn.Module]:
        """The parts besides the transformer. Every text encoding of these families, in
        training and in ``sampling_condition``, goes through ``encode_text``: a run with
        cached text embeddings may release them (:mod:`impasto.train.text_release`)."""
        denoiser = self.denoiser()
        return {name: part for name, part in self.parts().items() if part is not denoiser}

    def modules(self) -> dict[str, torch.nn.Module]:
        return self.parts() | self.frozen()

    def denoiser(self) -> torch.nn.Module:
        return self.components.transformer

    def with_denoiser(self, denoiser: torch.nn.Module) -> Any:
        other = type(self)(replace(self.components, transformer=denoiser), self.options)
        other.text_table = self.text_table  # the released encoders' table, if any
        return other

    @property
    def device(self) -> torch.device:
        return self.components.transformer.get_submodule(self.probe).weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.components.transformer.get_submodule(self.probe).weight.dtype

    def to(self, device: torch.device | str) -> Any:
        for module in self.modules().values():
            module.to(device)
        return self
