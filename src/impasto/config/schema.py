"""The typed, validated, frozen configuration of a run (DESIGN §3).

Every section is a pydantic model with ``extra="forbid"``: an unknown key is an error, never
silently ignored. Validation here is structural only (types, ranges, unknown keys, rules between
fields) and this package imports no other impasto package, so a bad key fails in a fraction of a
second without torch (issue #13). Names that select code (a schedule, an optimizer, a sampler)
are checked against the registries beside that code by :func:`impasto.train.checks.check_config`.
Sections with a module of their own in this package: ``data`` and ``cache`` (``data``),
``objective``, ``memory`` and ``ema`` (``memory``), ``log`` and ``eval`` (``monitoring``),
``draftp`` and ``reward`` (``draftp``), ``parallel``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from impasto.config.data import CacheConfig, DataConfig
from impasto.config.draftp import DraftpConfig, RewardConfig
from impasto.config.memory import EmaConfig, MemoryConfig
from impasto.config.monitoring import (  # noqa: F401  (ProfileConfig, WandbConfig: re-exported)
    EvalConfig,
    LogConfig,
    ProfileConfig,
    WandbConfig,
)
from impasto.config.objective import ObjectiveConfig
from impasto.config.parallel import ParallelConfig, check_pipeline
from impasto.config.section import (
    MAX_SAMPLER_STEPS,
    MAX_STEPS,
    Float,
    Int,
    PathStr,
    Resolution,
    Section,
    Seed,
)
from impasto.config.video import DEFAULT_TEMPORAL_COMPRESSION, MAX_FRAMES, frame_rule_problem

CONFIG_VERSION = 1

# Upper bounds no real run reaches; each keeps an absurd value from torch (issue #16).
MAX_LORA_RANK = 4096  # SDXL adapters use 4 to 256; 4096 is full rank for most of its layers
MAX_EPOCHS = 10**6
MAX_GRAD_ACCUM = 65536
MAX_IMAGES_PER_PROMPT = 256
DEVICE = r"auto|cpu|mps|cuda(:\d{1,4})?"  # the forms train.device takes
DEVICE_FORMS = "auto, cpu, cuda, cuda:N (N a GPU index, e.g. cuda:1) or mps"


class ModelConfig(Section):
    """Where the model comes from: a built-in preset or local weights, of ``family``. The
    family's own options sit in a section named after it (``model.<family>``), validated by the
    family (:func:`impasto.train.checks.check_config`)."""

    model_config = ConfigDict(extra="allow")

    family: str = Field("sdxl", description="the model family (impasto.models.BACKBONES)")
    preset: str | None = Field(None, description="a built-in preset of the family")
    path: PathStr | None = Field(
        None,
        description="local weights: for SDXL a diffusers folder or a single-file "
        ".safetensors checkpoint; for another family, what it reads (docs)",
    )
    vae: PathStr | None = Field(
        None,
        description="another VAE: a diffusers AutoencoderKL folder or a .safetensors file "
        "(diffusers or original layout), e.g. an fp16-fix SDXL VAE; default: the model's own",
    )
    text_encoder: PathStr | None = Field(
        None,
        description="text encoders from elsewhere, for a family that takes them (the diffusion "
        "transformer): a diffusers SDXL folder (its two CLIP encoders), or a folder holding one "
        "transformers text encoder and its tokenizer (T5, CLIP ...; or text_encoder/ and "
        "tokenizer/ inside)",
    )
    init_seed: Seed = Field(0, description="seed of the random init of preset models")
    allow_pickle: bool = Field(
        False, description="read a .ckpt/.pt single file (torch.load, weights_only)"
    )

    @model_validator(mode="before")
    @classmethod
    def _only_the_familys_section(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        family = data.get("family", "sdxl")
        errors = []
        for key, value in data.items():
            if key in cls.model_fields:
                continue
            if key != family:
                message = (
                    "unknown key; a family's options sit under model.<family> "
                    f"(model.family: {family})"
                )
                errors.append(_line(key, value, "unknown_key", message))
            elif not isinstance(value, dict):
                errors.append(_line(key, value, "model_type", "must be a section of keys"))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.preset is None) == (self.path is None):
            raise ValueError(
                "set exactly one of model.preset (e.g. tiny) or model.path (a diffusers folder "
                "or a single-file .safetensors)"
            )
        return self

    @property
    def options(self) -> dict[str, Any]:
        """The family's section (``model.<family>``), as written; empty if absent."""
        return dict((self.model_extra or {}).get(self.family) or {})


def _positive_number(value: object) -> bool:
    """A finite number > 0 as a :data:`Float` reads one (``1e-4`` comes from YAML as a string)."""
    if isinstance(value, bool):
        return False
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isfinite(number) and number > 0


def _line(key: str, value: object, kind: str, message: str) -> dict[str, Any]:
    """A pydantic line error at ``key`` (the section's path is prefixed by pydantic)."""
    return {"type": PydanticCustomError(kind, message), "loc": (key,), "input": value}


PartMode = Literal["full", "lora", "frozen"]
PART_MODES = ("full", "lora", "frozen")
PART_NAME = re.compile(r"[a-z][a-z0-9_]*")
TEXT_PART_PREFIX = "text_encoder"


def is_text_part(name: str) -> bool:
    """Parts named ``text_encoder*`` are text encoders (every family names them so)."""
    return name.startswith(TEXT_PART_PREFIX)


class PartsConfig(Section):
    """What trains: each part of the family in full, through an adapter (section ``lora``), or
    not, and its learning rate (``<part>_lr``, default ``optim.lr``). The part names come from
    the family (SDXL: unet, text_encoder, text_encoder_2; checked by
    :func:`impasto.train.checks.check_config`). A part not named keeps its default: text
    encoders (``text_encoder*``) frozen, the denoiser full."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _modes_and_rates(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        errors = []
        for key, value in data.items():
            if not isinstance(key, str) or not PART_NAME.fullmatch(key):
                errors.append(_line(str(key), value, "part_name", "a part name is lowercase "
                                    "letters, digits and _"))  # fmt: skip
            elif key.endswith("_lr"):
                if value is not None and not _positive_number(value):
                    errors.append(_line(key, value, "part_lr", "must be a finite number > 0"))
            elif value not in PART_MODES:
                errors.append(_line(key, value, "part_mode", "must be full, lora or frozen"))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    @model_validator(mode="after")
    def _something_trains(self) -> PartsConfig:
        named = self.named()
        denoisers = [name for name in named if not is_text_part(name)]
        if denoisers and all(mode == "frozen" for mode in named.values()):
            raise ValueError(
                f"every part is frozen; set parts.{denoisers[0]} (or a text encoder) to full "
                "or lora"
            )
        return self

    def named(self) -> dict[str, str]:
        """The modes the config names, by part."""
        extra = self.model_extra or {}
        return {key: value for key, value in extra.items() if not key.endswith("_lr")}

    def mode(self, part: str) -> str:
        """``part``'s mode: as named, else frozen for a text encoder and full for the rest."""
        default = "frozen" if is_text_part(part) else "full"
        return self.named().get(part, default)

    def lr(self, part: str) -> float | None:
        """``part``'s own learning rate (``parts.<part>_lr``), or None for ``optim.lr``."""
        value = (self.model_extra or {}).get(f"{part}_lr")
        return None if value is None else float(value)

    def training_text_encoders(self) -> list[str]:
        """The text encoders the config trains (full or lora)."""
        return [
            name for name, mode in self.named().items() if is_text_part(name) and mode != "frozen"
        ]


class LoraConfig(Section):
    """The adapter of the parts set to ``lora`` (peft): LoRA, DoRA, LoHa or LoKr."""

    kind: Literal["lora", "dora", "loha", "lokr"] = "lora"
    rank: Int = Field(16, ge=1, le=MAX_LORA_RANK)
    alpha: Float | None = Field(None, gt=0, description="default: rank (scale alpha/rank = 1)")
    dropout: Float = Field(0.0, ge=0, lt=1)
    targets: Literal["attention", "attention_ff", "attention_ff_conv"] = Field(
        "attention", description="attention; + feed-forward; + ResNet convs and projections"
    )
    init_from: PathStr | None = Field(
        None, description="a kohya LoRA .safetensors to start the adapters from (kind: lora)"
    )


class OptimConfig(Section):
    name: str = "adamw"
    lr: Float = Field(1e-4, gt=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    weight_decay: Float = Field(0.01, ge=0)
    max_grad_norm: Float | None = Field(1.0, gt=0, description="null disables clipping")
    lr_schedule: str = "constant"
    warmup_steps: Int = Field(0, ge=0, le=MAX_STEPS)
    min_lr_ratio: Float = Field(0.0, ge=0, le=1, description="floor of linear/cosine decay")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


class TrainConfig(Section):
    output_dir: PathStr = "runs/default"
    seed: Seed = 0
    max_steps: Int | None = Field(None, ge=1, le=MAX_STEPS, description="optimizer steps")
    max_epochs: Int | None = Field(None, ge=1, le=MAX_EPOCHS)
    grad_accum_steps: Int = Field(1, ge=1, le=MAX_GRAD_ACCUM)
    mixed_precision: Literal["auto", "bf16", "fp32", "pure_bf16"] = Field(
        "auto",
        description="auto: bf16 autocast where native, else fp32; bf16: autocast with fp32 "
        "weights; pure_bf16: bf16 weights (optim adamw_bf16_sr or adafactor)",
    )
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N or mps")
    max_nonfinite_steps: Int = Field(
        5, ge=1, le=MAX_STEPS, description="stop after this many non-finite steps in a row"
    )

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        if not re.fullmatch(DEVICE, value):
            raise ValueError(f"unknown device, got {value!r}; use {DEVICE_FORMS}")
        return value

    @model_validator(mode="after")
    def _has_length(self) -> TrainConfig:
        if self.max_steps is None and self.max_epochs is None:
            raise ValueError("set train.max_steps or train.max_epochs")
        return self


class CheckpointConfig(Section):
    model_config = ConfigDict(validate_by_name=True)  # merged with Section's

    every_steps: Int = Field(500, ge=1, le=MAX_STEPS)
    every_minutes: Float | None = Field(
        None,
        gt=0,
        le=7 * 24 * 60,
        description="also save when this many minutes passed since the last save (wall clock)",
    )
    keep_last: Int = Field(3, ge=1, le=MAX_STEPS)
    save_final: bool = True
    async_save: bool = Field(
        False,
        alias="async",
        description="parallel strategies: write the sharded checkpoint in the background while "
        "the next steps run (it becomes the newest checkpoint once every rank has written it)",
    )


class SampleConfig(Section):
    """Validation samples during training: a grid of ``prompts`` (then those of
    ``prompts_file``) every ``every_steps`` steps; also the run's ``impasto sample`` defaults."""

    every_steps: Int = Field(0, ge=0, le=MAX_STEPS, description="0: no samples during training")
    prompts: tuple[str, ...] = ()
    prompts_file: PathStr | None = Field(
        None,
        description="more prompts, one per line after sample.prompts, with kohya's per-prompt "
        "options --n --w --h --s --d --l (docs/sampling.md)",
    )
    negative_prompt: str = ""
    images_per_prompt: Int = Field(1, ge=1, le=MAX_IMAGES_PER_PROMPT)
    num_steps: Int = Field(30, ge=1, le=MAX_SAMPLER_STEPS)
    guidance_scale: Float = Field(5.0, ge=0)
    guidance_rescale: Float = Field(
        0.0, ge=0, le=1, description="phi of Lin et al. 2023, 3.4 (0: off; they use 0.7)"
    )
    sampler: str | None = Field(
        None,
        description="a sampler's name (docs/objectives.md); null: the model family's own "
        "(Wan: unipc, as WanPipeline; every other family: euler)",
    )
    spacing: Literal["leading", "trailing", "linspace"] | None = Field(
        None, description="default: trailing with zero terminal SNR, else leading (SDXL)"
    )
    seed: Seed = Field(
        0,
        description="grid image j (prompt-major) uses seed + j unless its line sets --d; "
        "impasto sample: image i of each prompt uses seed + i",
    )
    resolution: Resolution | None = Field(None, description="default: data.resolution")
    frames: Int | None = Field(
        None, ge=1, le=MAX_FRAMES,
        description="samples are clips of this many frames, k·4+1 (a video model; "
        "docs/video.md); null: images",
    )  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> SampleConfig:
        if self.every_steps and not self.prompts and self.prompts_file is None:
            raise ValueError(
                "every_steps is set but prompts is empty and prompts_file unset; add "
                "validation prompts"
            )
        return self


PURE_BF16_OPTIMIZERS = ("adamw_bf16_sr",)  # Adafactor rounds bf16 weights to nearest


class Config(Section):
    """A whole run. Sections mirror the architecture (DESIGN §3, §4)."""

    config_version: Int = CONFIG_VERSION
    model: ModelConfig
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    data: DataConfig
    cache: CacheConfig = Field(default_factory=CacheConfig)
    parts: PartsConfig = Field(default_factory=PartsConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    draftp: DraftpConfig = Field(default_factory=DraftpConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)

    @model_validator(mode="after")
    def _eval_has_data(self) -> Config:
        if self.eval.every_steps and not (self.data.validation_split or self.eval.sets):
            raise ValueError(
                "eval.every_steps: the validation loss needs held-out images; set "
                "data.validation_split (e.g. 0.05) or list eval.sets"
            )
        return self

    @model_validator(mode="after")
    def _memory_options_fit(self) -> Config:
        memory = self.memory
        if memory.fused_backward and self.train.grad_accum_steps != 1:
            raise ValueError(
                "memory.fused_backward steps while gradients arrive; set train.grad_accum_steps: 1"
            )
        if memory.fused_backward and self.optim.max_grad_norm is not None:
            raise ValueError(
                "memory.fused_backward cannot clip by the global gradient norm (it is known only "
                "after every step); set optim.max_grad_norm: null"
            )
        if memory.fused_backward and self.optim.name == "prodigy":
            raise ValueError(
                "memory.fused_backward gives each parameter its own optimizer, but Prodigy "
                "estimates one step size over all of them; use another optimizer or no fusion"
            )
        if memory.offload_blocks and memory.compile != "none":
            raise ValueError(
                "memory.offload_blocks runs the offloaded blocks uncompiled (their weights move "
                "every step); set memory.compile: none"
            )
        self._parallel_options_fit()
        if memory.frozen_dtype == "bf16" and self.train.mixed_precision != "bf16":
            raise ValueError(
                "memory.frozen_dtype: bf16 weights meet fp32 activations without autocast; set "
                "train.mixed_precision: bf16 (pure_bf16 already holds every weight in bf16)"
            )
        pure_bf16 = self.train.mixed_precision == "pure_bf16"
        if pure_bf16 and self.optim.name not in PURE_BF16_OPTIMIZERS:
            raise ValueError(
                f"train.mixed_precision: pure_bf16 needs an optimizer that updates bf16 weights "
                f"without losing small steps: optim.name {' or '.join(PURE_BF16_OPTIMIZERS)}"
            )
        return self

    def _parallel_options_fit(self) -> None:
        strategy, memory = self.parallel.strategy, self.memory
        tp, cp = self.parallel.tp, self.parallel.cp
        check_pipeline(self)
        if tp > 1 and strategy not in ("fsdp", "hsdp"):
            raise ValueError(
                f"parallel.tp {tp} splits the blocks inside a data-parallel run sharded by fsdp "
                f"or hsdp, not {strategy}; set parallel.strategy: fsdp"
            )
        if cp > 1 and strategy not in ("fsdp", "hsdp"):
            raise ValueError(
                f"parallel.cp {cp} splits each sample's tokens inside a data-parallel run "
                f"sharded by fsdp or hsdp (which sums the shards' gradients), not {strategy}; "
                "set parallel.strategy: fsdp"
            )
        pack, split = self.data.pack_tokens, tp * cp
        if pack is not None and pack % split:
            what = "parallel.tp" if cp == 1 else "parallel.cp" if tp == 1 else ""
            what = what or "parallel.tp x parallel.cp"
            raise ValueError(
                f"data.pack_tokens {pack} does not split into {what} {split} equal parts of the "
                f"sequence; make it a multiple of {what}"
            )
        if strategy == "none":
            if self.checkpoint.async_save:
                raise ValueError(
                    "checkpoint.async writes sharded checkpoints of a parallel run; set "
                    "parallel.strategy (ddp, fsdp, hsdp) or checkpoint.async: false"
                )
            return
        if memory.fused_backward:
            raise ValueError(
                f"memory.fused_backward steps each weight inside backward, before "
                f"parallel.strategy {strategy} has reduced its gradient across ranks; set "
                "memory.fused_backward: false (sharding saves the memory it would)"
            )
        if memory.offload_blocks:
            raise ValueError(
                f"memory.offload_blocks moves weights that parallel.strategy {strategy} manages; "
                "set memory.offload_blocks: false (fsdp shards the weights instead)"
            )
        sharded = strategy in ("fsdp", "hsdp")
        if sharded and memory.frozen_dtype == "bf16":
            raise ValueError(
                f"memory.frozen_dtype: bf16 mixes dtypes in one sharded group of "
                f"parallel.strategy {strategy}; set parallel.param_dtype: bf16 instead"
            )
        if sharded and self.optim.name == "adamw_8bit":
            raise ValueError(
                f"optim.name adamw_8bit (bitsandbytes) cannot step the sharded weights of "
                f"parallel.strategy {strategy}; use adamw (or ddp)"
            )
        if sharded and self.ema.enabled and self.ema.device == "cpu":
            raise ValueError(
                f"ema.device: cpu keeps full copies on the host, but parallel.strategy {strategy} "
                "shards the EMA like its weights; set ema.device: same"
            )

    @model_validator(mode="after")
    def _sample_frames_fit(self) -> Config:
        # The video autoencoder's frame rule; data.video says its temporal compression.
        video = self.data.video
        step = DEFAULT_TEMPORAL_COMPRESSION if video is None else video.temporal_compression
        frames = self.sample.frames
        problem = None if frames is None else frame_rule_problem("sample.frames", frames, step)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _sampler_steps_fit(self) -> Config:
        # A DDPM model is sampled on fewer timesteps than it was trained on; with as many or
        # more, the spacings repeat or run past t = T - 1 (flow times are continuous).
        T = self.objective.num_train_timesteps
        if self.objective.is_flow:
            return self
        used = {"sample": self.sample.every_steps > 0, "draftp": self.objective.method == "draftp"}
        for key, steps in (("sample", self.sample.num_steps), ("draftp", self.draftp.num_steps)):
            if used[key] and steps >= T:
                raise ValueError(
                    f"{key}.num_steps: a sampler visits fewer timesteps than "
                    f"objective.num_train_timesteps ({T}), got {steps}; lower it"
                )
        return self

    @model_validator(mode="after")
    def _draftp_trains_the_denoiser(self) -> Config:
        trained = self.parts.training_text_encoders()
        if self.objective.method == "draftp" and trained:
            raise ValueError(
                "objective.method draftp fine-tunes the denoiser (its KL leash compares it with "
                f"the base at the same text encoding); set {_parts(trained)}: frozen"
            )
        return self

    @model_validator(mode="after")
    def _cache_fits_the_parts(self) -> Config:
        trained = self.parts.training_text_encoders()
        if self.cache.text_embeddings != "none" and trained:
            raise ValueError(
                f"cache.text_embeddings: {self.cache.text_embeddings!r} reuses embeddings of "
                f"frozen text encoders; set it to none when {_parts(trained)} trains"
            )
        return self

    @model_validator(mode="after")
    def _cache_fits_the_data(self) -> Config:
        if self.cache.latents == "memory" and (self.data.crop != "center" or self.data.random_flip):
            raise ValueError(
                "cache.latents: 'memory' needs the same pixels every epoch (data.crop: center, "
                "data.random_flip: false); set cache.latents: none for random crops or flips"
            )
        if self.cache.latents == "disk" and self.data.crop != "center":
            raise ValueError(
                "cache.latents: 'disk' holds each image's center crop (and its mirror with "
                "random_flip); set data.crop: center, or cache.latents: none for random crops"
            )
        return self


def _parts(names: list[str]) -> str:
    """``parts.a``, ``parts.a and parts.b``."""
    return " and ".join(f"parts.{name}" for name in names)
