"""Rebuild the trained model of a checkpoint (for sampling, and exports from issue #5).

A checkpoint stores the trained weights and the resolved config; the frozen components are
rebuilt from ``model.*`` of that config (the preset, or the diffusers folder it was trained from).

Memory: a fully trained part's weights are copied from its file one tensor at a time into the
rebuilt module (a full SDXL UNet is 10 GB in fp32: reading the file whole would hold it twice);
adapter weights are small and read whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from impasto.checkpoint import sharded
from impasto.checkpoint.sharded import is_sharded
from impasto.checkpoint.state import STATE_FILE, latest_checkpoint
from impasto.config import Config, build_config
from impasto.config.load import read_yaml
from impasto.models.backbone import Backbone, build_backbone
from impasto.models.single_file.stream import TensorFile

if TYPE_CHECKING:
    from impasto.models.parts import Part


def model_metadata(config: Config) -> dict[str, str]:
    """What kind of model a run trains, as safetensors header strings (``impasto.*`` keys).

    Exporters read this to mark v-prediction, zero-terminal-SNR and flow models in the formats
    other tools load (the UNet weights alone do not say how to sample them).
    """
    objective = config.objective
    metadata = {
        "impasto.prediction_type": objective.prediction_type,
        "impasto.zero_terminal_snr": str(objective.zero_terminal_snr).lower(),
        "impasto.num_train_timesteps": str(objective.num_train_timesteps),
    }
    if objective.is_flow:
        metadata["impasto.flow_shift"] = repr(objective.flow_shift)
        if objective.flow_shift_resolution is not None:
            metadata["impasto.flow_shift_resolution"] = str(objective.flow_shift_resolution)
    else:
        metadata["impasto.schedule"] = objective.schedule
        metadata["impasto.beta_start"] = repr(objective.beta_start)
        metadata["impasto.beta_end"] = repr(objective.beta_end)
    if objective.zero_terminal_snr:
        metadata["impasto.terminal_sigma"] = repr(objective.terminal_sigma)
    return metadata


def read_model_metadata(path: str | Path) -> dict[str, str]:
    """The ``impasto.*`` header of a checkpoint's (or run's newest) ``unet.safetensors`` (a
    sharded checkpoint keeps it in its ``state.json``)."""
    checkpoint = resolve_checkpoint(path)
    if is_sharded(checkpoint):
        metadata = sharded.read_model_metadata(checkpoint).get("unet", {})
        return {key: value for key, value in metadata.items() if key.startswith("impasto.")}
    weights = checkpoint / "unet.safetensors"
    try:
        with safe_open(weights, framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{weights}: cannot read the safetensors header ({error})") from None
    return {key: value for key, value in metadata.items() if key.startswith("impasto.")}


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest checkpoint of a run directory."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: does not exist; check the path of the run or checkpoint")
    if (path / STATE_FILE).is_file():
        return path
    newest = latest_checkpoint(path / "checkpoints")
    if newest is None:
        raise ValueError(
            f"{path}: neither a checkpoint (no {STATE_FILE}) nor a run directory with "
            "checkpoints/; pass RUN or RUN/checkpoints/step-XXXXXXXX"
        )
    return newest


def is_run_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is an impasto checkpoint or a run directory with checkpoints."""
    path = Path(path)
    return (path / STATE_FILE).is_file() or (path / "checkpoints").is_dir()


def build_starting_backbone(config: Config) -> Backbone:
    """The model a run starts from: ``config.model``'s (a preset, a diffusers folder, a single
    file), or, when ``model.path`` is an impasto checkpoint or run directory, that checkpoint's
    trained model (its newest checkpoint) with any adapters merged into the weights, so a run
    can fine-tune (or reward-tune) the result of another."""
    from impasto.models.parts import merge_adapters

    path = config.model.path
    if path is None or not is_run_checkpoint(path):
        return build_backbone(config)
    source, backbone = load_trained(path)
    if source.model.family != config.model.family:
        raise ValueError(
            f"model.path {path} holds a model.family {source.model.family!r} run; set "
            f"model.family: {source.model.family}"
        )
    trained, wanted = model_metadata(source), model_metadata(config)
    for key, value in trained.items():
        if wanted.get(key) != value:
            field = key.removeprefix("impasto.")
            raise ValueError(
                f"model.path {path} was trained with objective.{field}: {value}; set "
                f"objective.{field}: {value} (the model predicts what it was trained to)"
            )
    for module in backbone.parts().values():
        merge_adapters(module)
    return backbone


def load_trained(path: str | Path, ema: bool = False) -> tuple[Config, Backbone]:
    """The config and the backbone, with the trained parts, of a checkpoint or run directory.

    The parts are rebuilt as the run built them (``parts``/``lora`` of its config: adapters
    injected, then their weights loaded), every module frozen and in eval mode. ``ema``: the
    trained parameters take the checkpoint's EMA weights (``ema.safetensors``) instead.
    """
    from impasto.models.parts import load_part_weights, prepare_parts

    checkpoint = resolve_checkpoint(path)
    config = read_checkpoint_config(checkpoint)
    backbone = build_starting_backbone(config)
    parts = prepare_parts(config, backbone)
    # Fully trained parts are copied from their files tensor by tensor; adapters are read whole.
    full = {name for name, part in parts.items() if not part.is_adapter}
    streamed = set() if is_sharded(checkpoint) else full
    tensors = read_weights(checkpoint, set(parts) - streamed)
    where = f"checkpoint {checkpoint}"
    load_part_weights({n: p for n, p in parts.items() if n not in streamed}, tensors, where)
    for name in sorted(streamed):
        copy_from_file(parts[name], checkpoint / f"{name}.safetensors", where)
    if ema:
        load_ema_weights(parts, checkpoint)
    for module in backbone.modules().values():
        module.requires_grad_(False).eval()
    return config, backbone


def read_checkpoint_config(checkpoint: Path) -> Config:
    """The resolved config a checkpoint directory holds (``config.yaml``)."""
    config_file = checkpoint / "config.yaml"
    if not config_file.is_file():
        raise ValueError(f"checkpoint {checkpoint}: no config.yaml; it was not written by impasto")
    return build_config(read_yaml(config_file))  # strict: duplicate keys, aliases, UTF-8


def _copy_tensors(
    targets: dict[str, torch.Tensor], weights: Path, where: str, mismatch: str
) -> None:
    """Copy each tensor of the safetensors file ``weights`` into ``targets`` (same names), one
    at a time, with plain reads (a memory map would keep the whole file resident); ``mismatch``
    formats the error for a name or shape that does not fit (``{bad}``: the name)."""
    try:
        handle = TensorFile(weights)
    except (OSError, ValueError) as error:
        raise ValueError(f"{where}: cannot read {weights.name} ({error})") from None
    with handle:
        names = set(handle.keys())
        if names != targets.keys():
            bad = sorted(targets.keys() - names) or sorted(names - targets.keys())
            raise ValueError(f"{where}: " + mismatch.format(bad=repr(bad[0])))
        for name, target in targets.items():
            if handle.shapes[name] != tuple(target.shape):
                raise ValueError(f"{where}: " + mismatch.format(bad=repr(name)))
            try:
                handle.read_into(name, target)
            except (OSError, ValueError) as error:
                raise ValueError(f"{where}: cannot read {weights.name} ({error})") from None


def copy_from_file(part: Part, weights: Path, where: str) -> None:
    """Load a fully trained part's weights from its ``NAME.safetensors``, tensor by tensor."""
    if not weights.is_file():
        raise ValueError(f"{where}: no {part.name}.safetensors; it was not written by this run")
    mismatch = (
        f"{part.name} weights do not match the model ({{bad}}); was model.*, parts.* or "
        "lora.* changed? restore it or use --no-resume"
    )
    _copy_tensors(part.module.state_dict(keep_vars=True), weights, where, mismatch)


def read_weights(checkpoint: Path, names: set[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The weights entries ``names`` of a checkpoint that has them: its ``NAME.safetensors``
    files, or whole tensors from the shards of a parallel run's checkpoint (any rank count)."""
    if is_sharded(checkpoint):
        return sharded.read_weights(checkpoint, names)
    tensors = {}
    for name in sorted(names):
        weights = checkpoint / f"{name}.safetensors"
        if not weights.is_file():
            continue  # load_part_weights names the missing file
        try:
            tensors[name] = load_file(weights)
        except (OSError, SafetensorError) as error:
            raise ValueError(
                f"checkpoint {checkpoint}: cannot read {weights.name} ({error})"
            ) from None
    return tensors


def load_ema_weights(parts: dict, checkpoint: Path) -> None:
    """Copy ``ema.safetensors`` (keys ``part.parameter``, as the trainer's EMA names them) into
    the trained parameters (tensor by tensor); one-line error when it is missing or does not
    fit."""
    trained = {
        f"{name}.{param_name}": param
        for name, part in parts.items()
        for param_name, param in part.module.named_parameters()
        if param.requires_grad
    }
    missing = f"checkpoint {checkpoint}: no ema.safetensors; the run trained without ema.enabled"
    if not is_sharded(checkpoint):
        weights = checkpoint / "ema.safetensors"
        if not weights.is_file():
            raise ValueError(missing)
        mismatch = "ema.safetensors does not fit the model ({bad})"
        _copy_tensors(trained, weights, f"checkpoint {checkpoint}", mismatch)
        return
    shadows = read_weights(checkpoint, {"ema"}).get("ema")
    if shadows is None:
        raise ValueError(missing)
    if shadows.keys() != trained.keys():
        odd = sorted(shadows.keys() ^ trained.keys())[0]
        raise ValueError(
            f"checkpoint {checkpoint}: ema.safetensors does not fit the model ({odd!r})"
        )
    with torch.no_grad():
        for name, param in trained.items():
            param.copy_(shadows[name])
