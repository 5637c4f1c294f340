"""What one optimizer step needs, built from a config: the trainer and ``impasto bench`` share
it, so the benchmark times exactly the step that trains."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from impasto.config import Config
from impasto.models import SDXLComponents, load_model
from impasto.objectives.objective import Objective
from impasto.train.ema import EMA
from impasto.train.fused import FusedBackwardOptimizer
from impasto.train.memo import EncodingMemo
from impasto.train.memory import (
    apply_memory_options,
    attention_context,
    combined,
    set_weight_dtypes,
)
from impasto.train.offload import BlockOffload
from impasto.train.optim import OPTIMIZERS
from impasto.train.parts import (
    Part,
    init_adapters_from_kohya,
    param_groups,
    prepare_parts,
    set_train_mode,
    trains_text_encoders,
)
from impasto.train.precision import autocast_factory
from impasto.train.step import training_step


@dataclass
class StepSetup:
    """The models, what trains in them, and how a step runs."""

    models: SDXLComponents
    trainable: dict[str, Part]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | FusedBackwardOptimizer
    fused: FusedBackwardOptimizer | None
    objective: Objective
    memo: EncodingMemo
    ema: EMA | None
    autocast: object  # a context factory: autocast and the attention kernel
    train_text: bool
    offload: BlockOffload | None = None

    def micro_step(self, batch, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward one micro-batch (loss × ``scale``); returns the detached loss."""
        out = training_step(
            self.models, self.objective, batch, generator, self.autocast, self.memo,
            train_text=self.train_text,
        )  # fmt: skip
        (out.loss * scale).backward()
        return out.loss.detach()

    def update(self, max_grad_norm: float | None) -> tuple[float, bool]:
        """Clip and step (unless a gradient is non-finite); returns (grad norm, finite).

        With fused backward the parameters already stepped inside backward; this only reads the
        norm and whether every gradient was finite (see :mod:`impasto.train.fused`)."""
        if self.fused is not None:
            grad_norm, nonfinite = self.fused.finish_step()
            return grad_norm, nonfinite == 0
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_grad_norm or math.inf).item()
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, finite


def build_step_setup(
    config: Config, device: torch.device, precision: torch.dtype | None
) -> StepSetup:
    """Load the model, make the configured parts trainable, apply the memory options, and build
    the optimizer, objective and EMA. Seeds the global RNG (adapters initialise from it)."""
    torch.manual_seed(config.train.seed)
    models = load_model(config)
    trainable = prepare_parts(config, models)
    if config.lora.init_from:
        count = init_adapters_from_kohya(trainable, config.lora)
        print(f"impasto: started {count} LoRA layers from {config.lora.init_from}")
    set_train_mode(trainable, models)
    set_weight_dtypes(models, config.train.mixed_precision, config.memory.vae_dtype)
    models.to(device)
    apply_memory_options(models.unet, config.memory)
    offload = None
    if config.memory.offload_blocks:  # after dtypes and layout, before the optimizer
        offload = BlockOffload(models.unet, device, resident=config.memory.resident_blocks)
    groups = param_groups(trainable)
    build = partial(OPTIMIZERS[config.optim.name], config=config.optim)
    fused = FusedBackwardOptimizer(groups, build) if config.memory.fused_backward else None
    return StepSetup(
        models=models,
        trainable=trainable,
        params=[param for group in groups for param in group["params"]],
        optimizer=fused or build(groups),
        fused=fused,
        objective=Objective.from_config(config.objective),
        memo=EncodingMemo.from_config(config),
        ema=build_ema(config, trainable),
        autocast=combined(
            autocast_factory(device, precision), attention_context(config.memory.attention)
        ),
        train_text=trains_text_encoders(config),
        offload=offload,
    )


def build_ema(config: Config, parts: dict[str, Part]) -> EMA | None:
    """The EMA of every trained parameter (``ema.enabled``), named ``part.parameter``."""
    ema = config.ema
    if not ema.enabled:
        return None
    named = [
        (f"{name}.{param_name}", param)
        for name, part in parts.items()
        for param_name, param in part.module.named_parameters()
        if param.requires_grad
    ]
    return EMA(named, ema.decay, ema.warmup, ema.inv_gamma, ema.power, ema.update_every, ema.device)
