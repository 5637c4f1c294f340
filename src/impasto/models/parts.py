"""Which parts of a backbone train, and how: full weights, a peft adapter (LoRA family), or
frozen.

Config section ``parts`` names a mode per part (``Backbone.parts()``); ``lora`` holds the
adapter settings. The same functions serve the trainer (what to optimise and checkpoint) and
``load_trained`` (rebuild a checkpoint's model for sampling and export), so a run and its reload
agree by construction.

Parameters a family never reads (``Backbone.unused_parameters``: SDXL's encoder 1 last layer
and final norm) are kept frozen (full fine-tuning) or get no adapter (LoRA): every trainable
parameter then receives a gradient, which DDP requires (no ``find_unused_parameters``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import peft
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor, nn

if TYPE_CHECKING:
    from impasto.config.schema import Config, LoraConfig
    from impasto.models.backbone import Backbone

ADAPTER_NAME = "default"


def peft_config(lora: LoraConfig, targets: list[str]) -> peft.PeftConfig:
    """The peft config of ``lora.kind``: LoRA (Hu et al. 2021), DoRA (Liu et al. 2024),
    LoHa (Hyeon-Woo et al. 2022) or LoKr (Yeh et al. 2024, LyCORIS)."""
    alpha = lora.rank if lora.alpha is None else lora.alpha
    if lora.kind in ("lora", "dora"):
        return peft.LoraConfig(
            r=lora.rank,
            lora_alpha=alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,
            use_dora=lora.kind == "dora",
        )
    config_class = {"loha": peft.LoHaConfig, "lokr": peft.LoKrConfig}[lora.kind]
    return config_class(
        r=lora.rank, alpha=alpha, module_dropout=lora.dropout, target_modules=targets
    )


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass
class Part:
    """One trained component: its module, mode (``full`` or an adapter kind) and learning rate."""

    name: str
    module: nn.Module
    mode: str
    lr: float

    @property
    def is_adapter(self) -> bool:
        return self.mode != "full"

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    def state_dict(self) -> dict[str, Tensor]:
        """What the checkpoint stores: the whole module, or only the adapter weights."""
        if self.is_adapter:
            return peft.get_peft_model_state_dict(self.module, adapter_name=ADAPTER_NAME)
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Tensor], strict: bool = False) -> LoadResult:
        if not self.is_adapter:
            result = self.module.load_state_dict(state, strict=strict)
            return LoadResult(list(result.missing_keys), list(result.unexpected_keys))
        expected = set(self.state_dict())
        result = LoadResult(sorted(expected - set(state)), sorted(set(state) - expected))
        if not result.missing_keys and not result.unexpected_keys:
            peft.set_peft_model_state_dict(self.module, state, adapter_name=ADAPTER_NAME)
        return result


def has_adapters(module: nn.Module) -> bool:
    """Whether peft adapters (LoRA, DoRA, LoHa, LoKr) are injected in ``module``."""
    return any(isinstance(child, BaseTunerLayer) for child in module.modules())


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """``module`` computes as its base model inside the block: every adapter layer passes its
    input to the base layer only (peft's ``disable_adapter``, for injected adapters). Which
    parameters require gradients is left as it was (peft's switch would change it)."""
    layers = [child for child in module.modules() if isinstance(child, BaseTunerLayer)]
    enabled = [not layer.disable_adapters for layer in layers]
    flags = [(param, param.requires_grad) for layer in layers for param in layer.parameters()]
    try:
        for layer in layers:
            layer.enable_adapters(False)
        yield
    finally:
        for layer, was_enabled in zip(layers, enabled, strict=True):
            layer.enable_adapters(was_enabled)
        for param, requires_grad in flags:
            param.requires_grad_(requires_grad)


def without_adapters(forward: Callable[..., Tensor], module: nn.Module) -> Callable[..., Tensor]:
    """``forward`` computed with ``module``'s adapters switched off: the base model's."""

    def base_forward(*args: Any) -> Tensor:
        with adapters_disabled(module):
            return forward(*args)

    return base_forward


def merge_adapters(module: nn.Module) -> None:
    """Fold every peft adapter of ``module`` into its base layer and drop the adapter, in place."""
    for name, child in list(module.named_modules()):
        if isinstance(child, BaseTunerLayer):
            child.merge(safe_merge=True)
            parent_name, _, attribute = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attribute, child.get_base_layer())


def _mode(config: Config, part: str) -> str:
    mode = config.parts.mode(part)
    return config.lora.kind if mode == "lora" else mode


def prepare_parts(config: Config, backbone: Backbone) -> dict[str, Part]:
    """Freeze everything, then make each configured part trainable (injecting adapters).

    Adapters are initialised from the global RNG: seed it first for a reproducible run.
    Returns the trained parts by name, in the backbone's order; frozen parts are not listed.
    """
    for module in backbone.modules().values():
        module.requires_grad_(False)
    parts = {}
    for name, module in backbone.parts().items():
        mode = _mode(config, name)
        if mode == "frozen":
            continue
        if mode == "full":
            module.requires_grad_(True)
            skip = backbone.unused_parameters(name)
            for param_name, param in module.named_parameters():
                if skip and param_name.startswith(skip):
                    param.requires_grad_(False)
        else:
            targets = backbone.adapter_targets(name, config.lora.targets)
            peft.inject_adapter_in_model(peft_config(config.lora, targets), module, ADAPTER_NAME)
            for param_name, param in module.named_parameters():
                param.requires_grad_(f".{ADAPTER_NAME}" in param_name)  # lora_A.default.weight
        lr = config.parts.lr(name) or config.optim.lr
        parts[name] = Part(name, module, mode, lr)
    return parts


def param_groups(parts: dict[str, Part]) -> list[dict[str, Any]]:
    """One optimizer param group per trained part, with its own learning rate."""
    return [
        {"params": list(part.parameters()), "lr": part.lr, "name": name}
        for name, part in parts.items()
    ]


def set_train_mode(parts: dict[str, Part], backbone: Backbone) -> None:
    """Trained parts in train mode (dropout), the rest in eval mode."""
    for name, module in backbone.modules().items():
        module.train(name in parts)


def load_part(part: Part, state: dict[str, Tensor]) -> None:
    """Load a part's checkpoint tensors; one-line ``ValueError`` when they do not fit."""
    result = part.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        bad = (result.missing_keys or result.unexpected_keys)[0]
        raise ValueError(
            f"{part.name} weights do not match the model ({bad!r}); was model.*, parts.* or "
            "lora.* changed? restore it or use --no-resume"
        )


def load_part_weights(
    parts: dict[str, Part], tensors: dict[str, dict[str, Tensor]], where: str
) -> None:
    """Load each part's checkpoint tensors (``NAME.safetensors``); one-line error on mismatch."""
    for name, part in parts.items():
        if name not in tensors:
            raise ValueError(f"{where}: no {name}.safetensors; it was not written by this run")
        try:
            load_part(part, tensors[name])
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None


def init_adapters_from_kohya(parts: dict[str, Part], lora: LoraConfig) -> int:
    """Start the adapters from the kohya LoRA file ``lora.init_from``; returns layers loaded.

    The file may cover fewer layers than ``lora.targets`` (the rest keep their identity
    init); an entry for a layer without an adapter, another rank or alpha is an error.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from impasto.models.lora_kohya import from_kohya
    from impasto.models.single_file.file_errors import check_safetensors

    path = lora.init_from
    if lora.kind != "lora":
        raise ValueError(f"lora.init_from: a kohya LoRA starts kind lora, not {lora.kind}")
    check_safetensors(path, "lora.init_from")  # missing, unreadable, truncated: say which
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as error:
        raise ValueError(f"lora.init_from: cannot read {path} ({error})") from None
    adapters = {name: part.module for name, part in parts.items() if part.is_adapter}
    alpha = lora.rank if lora.alpha is None else lora.alpha
    try:
        states = from_kohya(adapters, tensors, lora.rank, alpha)
    except ValueError as error:
        raise ValueError(f"lora.init_from {path}: {error}") from None
    for name, state in states.items():
        if state:
            peft.set_peft_model_state_dict(parts[name].module, state, adapter_name=ADAPTER_NAME)
    return sum(len(state) for state in states.values()) // 2
