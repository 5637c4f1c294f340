"""What ``impasto bench`` times, shared by the one-process bench (:mod:`impasto.bench`) and
the parallel one (:mod:`impasto.bench.parallel`): the variants, their configs, a synthetic
batch, and the trainer's step."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from impasto.config import Config, build_config
from impasto.config.load import apply_override
from impasto.data import Batch
from impasto.distributed import RunGroup
from impasto.precision import resolve_precision
from impasto.train.methods import WHOLE_STEP, Rows
from impasto.train.optim import set_lr
from impasto.train.setup import build_step_setup

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "checkpointing": {"memory.gradient_checkpointing": "all"},
    "fused": {"memory.fused_backward": True, "optim.max_grad_norm": None},
    "pure_bf16": {"train.mixed_precision": "pure_bf16", "optim.name": "adamw_bf16_sr"},
    "low_memory": {
        "train.mixed_precision": "pure_bf16",
        "optim.name": "adamw_bf16_sr",
        "memory.fused_backward": True,
        "optim.max_grad_norm": None,
        "memory.gradient_checkpointing": "all",
    },
    "adafactor": {
        "optim.name": "adafactor",
        "memory.fused_backward": True,
        "optim.max_grad_norm": None,
        "memory.gradient_checkpointing": "all",
    },
    "channels_last": {"memory.channels_last": True},
    "compile": {"memory.compile": "blocks"},
    "compile_unet": {"memory.compile": "unet"},
    "cuda_graphs": {"memory.compile": "blocks", "memory.compile_mode": "reduce-overhead"},
    "lora": {"parts.unet": "lora"},
    "lora_r32": {"parts.unet": "lora", "lora.rank": 32, "lora.alpha": 32},
    "offload": {"memory.offload_blocks": True},
    # the base under LoRA in one byte per weight: with --set parts.<part>=lora
    "float8": {"memory.frozen_dtype": "float8"},
    "int8": {"memory.frozen_dtype": "int8"},
    "adamw_8bit": {"optim.name": "adamw_8bit"},
}
"""Named sets of config overrides: what ``--variants`` can ask for."""


def bench_config(
    model: str,
    resolution: int,
    batch: int,
    precision: str,
    device: str,
    overrides: Sequence[str] = (),
    variant: dict[str, Any] | None = None,
) -> Config:
    """The config of one variant: the model preset, a synthetic batch's size, the overrides."""
    raw: dict[str, Any] = {
        "model": {"preset": model},
        "data": {"path": "synthetic", "resolution": resolution, "batch_size": batch},
        "optim": {"lr": 1e-5},
        "train": {"max_steps": 1, "mixed_precision": precision, "device": device},
        "log": {"tensorboard": False, "progress_bar": False},
    }
    for key, value in (variant or {}).items():
        apply_override(raw, f"{key}={json.dumps(value)}")
    for assignment in overrides:
        apply_override(raw, assignment)
    return build_config(raw)


def synthetic_batch(unet_config, batch: int, resolution: int, seed: int = 0) -> Batch:
    """A batch as the cache delivers it: latents' posterior and text embeddings, random."""
    generator = torch.Generator().manual_seed(seed)
    side, channels = resolution // 8, unet_config.in_channels
    pooled = (
        unet_config.projection_class_embeddings_input_dim - 6 * unet_config.addition_time_embed_dim
    )
    sizes = torch.tensor([[resolution, resolution]] * batch)
    return Batch(
        pixel_values=None,
        captions=[""] * batch,
        original_sizes=sizes,
        crop_top_lefts=torch.zeros(batch, 2, dtype=torch.long),
        target_sizes=sizes,
        indices=torch.arange(batch),
        latent_mean=torch.randn(batch, channels, side, side, generator=generator),
        latent_std=torch.full((batch, channels, side, side), 0.01),
        prompt_embeds=torch.randn(batch, 77, unet_config.cross_attention_dim, generator=generator),
        pooled_prompt_embeds=torch.randn(batch, pooled, generator=generator),
    )


class ImpastoStep:
    """The trainer's step (its setup, micro-step, update and EMA) on a fresh model; with a
    ``group``, this rank's part of a parallel step (its rows of the global batch, as the
    trainer draws them)."""

    def __init__(self, config: Config, device: torch.device, group: RunGroup | None = None) -> None:
        precision = resolve_precision(config.train.mixed_precision, device)
        self.setup = build_step_setup(config, device, precision, group)
        self.max_grad_norm = config.optim.max_grad_norm
        self.rows = WHOLE_STEP
        if group is not None and group.world > 1:
            self.rows = Rows(group.rank, group.world, config.data.batch_size)
        backbone = self.setup.backbone
        self.unet = backbone.denoiser()
        self.number = 0
        # Latents and text come with the batch: free the memory of the untrained encoders.
        for name, module in backbone.modules().items():
            if name not in self.setup.trainable and module is not self.unet:
                module.to("cpu")

    def prepare(self, batch: Batch) -> None:
        self.batch = batch

    def __call__(self) -> None:
        setup = self.setup
        set_lr(setup.optimizer, 1.0)
        setup.micro_step(self.batch, torch.Generator().manual_seed(self.number), rows=self.rows)
        setup.update(self.max_grad_norm)
        self.number += 1
        if setup.ema is not None:
            setup.ema.update(self.number)


def time_steps(
    step: Callable[[], None], device: torch.device, warmup: int, steps: int
) -> tuple[float, float | None]:
    """(seconds per step, peak memory GiB or None on CPU) after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    sync_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync_device(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return seconds, peak


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def show_value(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
