"""A family's transformer from one ``.safetensors`` file (``model.<family>.transformer``), the
steps every family with an original layout shares: check and read the file, take off the
wrapper prefix of a ComfyUI checkpoint (``model.diffusion_model.`` / ``diffusion_model.``),
turn the original layout into diffusers' names with the family's map, check the tensors
against the model built from ``model.path`` or the preset, and say in one line what is wrong
or what else a single file needs. The family passes its names, keys, map and wording as a
:class:`TransformerFile`; its own module keeps the map and telling its releases apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # ComfyUI's checkpoints, bare ones
ENDS = ("weight", "bias")
Value = TypeVar("Value")


@dataclass(frozen=True)
class TransformerFile:
    """What one family's transformer file is, for the shared steps and their messages."""

    setting: str  # the config key every message names: "model.<family>.transformer"
    name: str  # the architecture, in "not a whole <name> transformer"
    release: str  # the releases' name, in "use the <release> folder"
    article: str  # "a" or "an", as name and release are read aloud
    original_key: str  # a tensor every file in the original layout holds
    diffusers_key: str  # one every file in diffusers' names holds
    layouts: tuple[str, str]  # a few (original, diffusers) names, for "neither ... nor ..."
    folder_parts: str  # what a diffusers folder holds beside the transformer
    from_original: Callable[[dict[str, Tensor]], dict[str, Tensor]]  # KeyError / ValueError
    # under a prefix, read only the prefixed tensors (a checkpoint that holds its VAE and text
    # encoders too); else take every prefix off in turn and keep every tensor
    transformer_only: bool
    # the family's own diagnosis of (missing, unexpected) names, checked first: the message
    # after "<setting> <path>: ", or None
    mismatch: Callable[[list[str], list[str]], str | None] | None = None


def swap_scale_shift(weight: Tensor) -> Tensor:
    """(shift, scale) rows ↔ (scale, shift) rows of a modulation (the original layout stores
    the final one, diffusers the other way round)."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def count_blocks(state: Mapping[str, Any], blocks: str) -> int:
    """The number of blocks ``blocks.N.`` in ``state``."""
    indices = {int(key.split(".")[1]) for key in state if key.startswith(blocks + ".")}
    return max(indices) + 1 if indices else 0


def strip_prefixes(
    state: Mapping[str, Value], prefixes: Iterable[str], transformer_only: bool
) -> dict[str, Value]:
    """``state`` under names without a checkpoint's wrapper prefix (:class:`TransformerFile`'s
    ``transformer_only``: the first prefix found selects the tensors under it)."""
    state = dict(state)
    for prefix in prefixes:
        if any(key.startswith(prefix) for key in state):
            stripped = {
                key.removeprefix(prefix): value
                for key, value in state.items()
                if not transformer_only or key.startswith(prefix)
            }
            if transformer_only:
                return stripped
            state = stripped
    return state


def read_transformer_file(path: str | Path, file: TransformerFile) -> dict[str, Tensor]:
    """The transformer file ``path`` as a diffusers state dict, float32 (any float dtype in
    the file, fp8 included); every problem one line naming ``file.setting``."""
    from safetensors.torch import load_file

    from impasto.models.single_file.file_errors import check_safetensors

    check_safetensors(path, file.setting)  # missing, unreadable, truncated: say which
    state = strip_prefixes(load_file(str(path)), PREFIXES, file.transformer_only)
    where, article = f"{file.setting} {path}", file.article
    if file.original_key in state:
        try:
            state = file.from_original(state)
        except (KeyError, ValueError) as error:
            detail = f"no {error.args[0]!r}" if isinstance(error, KeyError) else str(error)
            raise ValueError(
                f"{where}: not a whole {file.name} transformer in the original layout "
                f"({detail}); point it at {article} {file.release} transformer file"
            ) from None
    elif file.diffusers_key not in state:
        original, diffusers = file.layouts
        raise ValueError(
            f"{where}: neither {article} {file.name} transformer's original layout ({original}) "
            f"nor diffusers' ({diffusers})"
        )
    return {key: value.float() for key, value in state.items()}


def load_transformer_file(
    path: str | Path, transformer: torch.nn.Module, file: TransformerFile
) -> None:
    """Load the file ``path`` into ``transformer`` in place (every tensor, shapes checked); its
    parameters may be on the meta device (built from a config alone), they take the file's."""
    from impasto.models.io import own_aligned_storage

    state = read_transformer_file(path, file)
    expected = transformer.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    diagnosis = file.mismatch(missing, unexpected) if file.mismatch is not None else None
    if diagnosis is not None:
        raise ValueError(f"{file.setting} {path}: {diagnosis}")
    if missing or unexpected or wrong:
        problem = (
            f"no {missing[0]!r}" if missing else
            f"an extra {unexpected[0]!r}" if unexpected else
            f"{wrong[0]!r} of shape {tuple(state[wrong[0]].shape)}, not "
            f"{tuple(expected[wrong[0]].shape)}"
        )  # fmt: skip
        raise ValueError(
            f"{file.setting} {path}: does not fit the transformer of model.path / model.preset "
            f"({problem}); use the {file.release} folder (or preset) the file was trained from"
        )
    transformer.load_state_dict(state, strict=True, assign=True)
    own_aligned_storage(transformer)


def write_transformer_file(tensors: Mapping[str, Tensor], out: Path, family: str) -> Path:
    """``impasto export --format single-file`` of a transformer family: ``tensors`` (already
    in the family's original layout and the export dtype) as one ``.safetensors`` file
    ``out``, with the header ``{"impasto.family": family, "format": "pt"}``."""
    from safetensors.torch import save_file

    if out.suffix.lower() != ".safetensors":
        raise ValueError(
            f"export --out {out}: the single file needs a .safetensors name, e.g. "
            f"{out.with_suffix('.safetensors').name}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"impasto.family": family, "format": "pt"}
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(out), metadata)
    return out


def file_variant(path: str | Path, variant: Callable[[Iterable[str]], str | None]) -> str | None:
    """``variant`` (a family's ``transformer_variant``) of a ``.safetensors`` file's tensor
    names, read from its header (None: unreadable)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            return variant(handle.keys())
    except (OSError, SafetensorError):
        return None


def folder_config(path: str | Path) -> dict[str, Any] | None:
    """The ``transformer/config.json`` of the diffusers folder ``path`` (None: unreadable)."""
    try:
        return json.loads((Path(path) / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return None


def single_file_advice(
    path: str | Path, setting: str, file: TransformerFile, release: tuple[str, str] | None
) -> str:
    """The one-line error for a single file given (as ``setting``) where a diffusers folder
    belongs. ``release``: what the file is and the folder it wants (``("FLUX.1-dev",
    "FLUX.1-dev")``), from its names; None for a file that is not the family's transformer."""
    parts = file.folder_parts
    if release is None:
        return (
            f"{setting} {path}: a single file, and not {file.article} {file.name} transformer; "
            f"set {setting} to a diffusers {file.release} folder ({parts}, transformer/, "
            "scheduler/)"
        )
    what, folder = release
    return (
        f"{setting} {path}: {file.article} {what} transformer file, without the VAE and text "
        f"encoders; set model.path to a diffusers {folder} folder ({parts}) and "
        f"{file.setting} to this file"
    )
