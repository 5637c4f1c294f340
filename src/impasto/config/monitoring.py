"""Config sections of watching a run (docs/monitoring.md): ``log`` (sinks, wandb, the
profiler) and ``eval`` (the validation loss on held-out data)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from impasto.config.data import SourceConfig
from impasto.config.section import MAX_STEPS, Int, Section, Seed


class ProfileConfig(Section):
    """A torch.profiler schedule: skip ``wait`` steps, warm up ``warmup``, record ``active``."""

    wait: Int = Field(1, ge=0, le=MAX_STEPS)
    warmup: Int = Field(1, ge=0, le=MAX_STEPS)
    active: Int = Field(3, ge=1, le=1000)


class WandbConfig(Section):
    """Weights & Biases (``pip install wandb``): offline writes RUN/wandb/ to sync later."""

    enabled: bool = False
    project: str = Field("impasto", min_length=1)
    entity: str | None = None
    mode: Literal["offline", "online"] = "offline"


class LogConfig(Section):
    every_steps: Int = Field(1, ge=1, le=MAX_STEPS)
    jsonl: bool = True
    tensorboard: bool = True
    progress_bar: bool = Field(
        True, description="false: one line per logging step instead (batch jobs, log files)"
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    profile: ProfileConfig | None = Field(
        None,
        description="trace steps with torch.profiler into RUN/profile/ (TensorBoard) and print "
        "the top kernels; null: off",
    )


class EvalSetConfig(SourceConfig):
    """A named held-out set: a data source (as in data.sources) evaluated, never trained on."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")


class EvalConfig(Section):
    """Validation loss on held-out data (data.validation_split and/or ``sets``), at fixed
    stratified timesteps with fixed noise, comparable across steps and runs."""

    every_steps: Int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="0: no validation loss; else every N steps and at the end",
    )
    timesteps: Int = Field(
        8, ge=1, le=1000, description="stratified timesteps per image (bucket b: its midpoint)"
    )
    max_images: Int = Field(
        256, ge=1, le=100_000, description="per set: the first N held-out images (fixed)"
    )
    batch_size: Int | None = Field(None, ge=1, le=4096, description="default: data.batch_size")
    seed: Seed = Field(0, description="the fixed noise and caption choices")
    sets: list[EvalSetConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names_differ(self) -> EvalConfig:
        names = [eval_set.name for eval_set in self.sets]
        taken = sorted({"ema"} & set(names) | {name for name in names if names.count(name) > 1})
        if taken:
            raise ValueError(
                f"eval.sets: name {taken[0]!r} is taken (the names must differ, and val/ema/ "
                "holds the EMA weights' losses); rename the set"
            )
        return self
