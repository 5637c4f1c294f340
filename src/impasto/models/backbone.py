"""The backbone protocol: what the training loop, the methods, sampling and export need from a
model family, and the registry that maps ``model.family`` to an implementation.

A family (SDXL today, a DiT later) is one module implementing :class:`Backbone` over its own
networks. Nothing outside that module names the family's component classes: the loop, the
training methods, the samplers and the benchmark speak only this protocol (torchtitan keeps
the same split between a model file and what trains it).

Terms:
- *parts*: the networks that may train (``parts.<name>: full | lora | frozen`` in the config);
  *frozen*: networks that never train (an autoencoder);
- *text encoding*: what ``encode_text`` returns for a list of captions; a frozen dataclass of
  ``[B, ...]`` tensors, so caches can split and stack it per caption;
- *conditioning*: everything the denoiser's forward takes besides x_t and t, on its device.

Optional hooks, which a backbone has or lacks as a whole (checked with ``isinstance``):
:class:`OwnSampling` (``sampling_ladder``, ``embedded_guidance``: a model that samples on its
own time ladder and takes its guidance as an input; ``impasto.sampling`` then uses both).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ValidationError
from torch import Tensor, nn

from impasto.models.exported import FolderWriter
from impasto.registry import lookup, registrar
from impasto.sampling.process import OwnSampling  # noqa: F401  (an optional protocol)


class Batch(Protocol):
    """What a backbone reads from a training batch (``impasto.data.Batch`` has it): the size
    micro-conditioning ``[B, 2]`` (height, width) / (top, left), and cached text encodings when
    the batch comes from the disk cache (else None)."""

    captions: list[str]
    original_sizes: Tensor
    crop_top_lefts: Tensor
    target_sizes: Tensor
    prompt_embeds: Tensor | None
    pooled_prompt_embeds: Tensor | None


@runtime_checkable
class Backbone(Protocol):
    """A model family as the trainer sees it (see the module docstring for the terms)."""

    family: str

    def parts(self) -> dict[str, nn.Module]:
        """The networks that may train, by config name, in a fixed order."""

    def frozen(self) -> dict[str, nn.Module]:
        """The networks that never train (e.g. the VAE)."""

    def modules(self) -> dict[str, nn.Module]:
        """Every network: ``parts() | frozen()``."""

    @property
    def device(self) -> torch.device:
        """The denoiser's device (where a step's tensors go)."""

    @property
    def dtype(self) -> torch.dtype:
        """The denoiser's weight dtype."""

    def to(self, device: torch.device | str) -> Backbone:
        """Move every network to ``device`` in place; return self."""

    def blocks(self) -> dict[str, nn.Module]:
        """The denoiser's blocks in execution order, by config name (``down.0``, ``mid`` ...):
        the units of activation checkpointing, compile, offload and (later) FSDP."""

    def denoiser(self) -> nn.Module:
        """The network that predicts from x_t (the module blocks() belong to)."""

    def with_denoiser(self, denoiser: nn.Module) -> Backbone:
        """A backbone whose denoiser is ``denoiser`` and whose other networks are this one's
        (shared, not copied): a frozen copy of the starting model, for reward fine-tuning's
        KL leash and annealed sampling."""

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        """Name prefixes of ``part``'s parameters the family never reads (kept frozen, so
        every trainable parameter gets a gradient, as DDP needs)."""

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        """Full module names of ``part`` that get an adapter under ``lora.targets: preset``."""

    def latent_posterior(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        """The autoencoder's posterior (mean, std) ``[B, C, h, w]`` of images in [-1, 1]."""

    def clip_posterior(
        self, read_frames: Callable[[int, int], Tensor], num_frames: int, chunk_frames: int = 16
    ) -> tuple[Tensor, Tensor]:
        """The posterior (mean, std) ``[1, z, t, h, w]`` of one clip, read ``chunk_frames``
        frames at a time: ``read_frames(start, stop)`` gives frames ``[1, 3, stop − start, H,
        W]`` in [-1, 1], asked for in order, each range once. Equal to ``latent_posterior`` of
        the whole clip while holding one chunk of frames (the disk cache of clips); a family
        whose autoencoder takes no clips raises ``ValueError``."""

    def encode_latents(self, sample: Tensor) -> Tensor:
        """A posterior sample → the denoiser's latent space (scale and shift)."""

    def decode_latents(self, latents: Tensor) -> Tensor:
        """Latents → images ``[B, 3, H, W]`` in [0, 1], float32 on the CPU (the inverse map of
        ``encode_latents``, then the decoder)."""

    def decode_images(self, latents: Tensor, checkpointing: bool = False) -> Tensor:
        """Latents → images ``[B, 3, H, W]`` in [0, 1], float32 on the decoder's device, with
        gradients flowing to ``latents`` through the frozen decoder (reward fine-tuning);
        ``checkpointing``: recompute the decoder's activations in backward."""

    def latent_format(self) -> tuple[int, int]:
        """(latent channels, the autoencoder's downsampling factor)."""

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, h, w) of the latents of an H×W image; ValueError if the size does not fit."""

    def encode_text(self, captions: list[str]) -> Any:
        """The text encoding of ``captions`` (gradients flow unless disabled by the caller)."""

    def text_from_cache(self, batch: Batch) -> Any | None:
        """The batch's cached text encoding on the denoiser's device, or None."""

    def condition(self, text: Any, batch: Batch) -> Any:
        """The training conditioning of a batch from its text encoding."""

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> Any:
        """The conditioning for generating ``prompts`` at H×W (with a ``cat`` for CFG)."""

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: Any) -> Tensor:
        """The denoiser's prediction at (x_t, t)."""

    def forward_packed(
        self, x_ts: list[Tensor], timesteps: list[Tensor], conditions: list[Any],
        capacity: int | None = None,
    ) -> list[Tensor]:  # fmt: skip
        """Predictions for groups of same-shaped samples of different shapes (a pack,
        ``data.pack_tokens``): one sequence of ``capacity`` tokens where the family packs
        (attention stays inside each sample), else one forward per group."""

    def sequence_length(self, height: int, width: int, frames: int = 1) -> int:
        """Tokens (or latent positions) an H×W image, or a clip of ``frames`` H×W frames,
        takes in the denoiser's sequence: what a pack of ``data.pack_tokens`` holds."""

    def tensor_parallel_plan(self) -> TensorParallelPlan | None:
        """How the denoiser's blocks split over a tensor-parallel group (``parallel.tp``), or
        None where the family has no plan."""

    def context_parallel_plan(self) -> ContextParallelPlan | None:
        """How the denoiser splits each sample's sequence over a context-parallel group
        (``parallel.cp``), or None where the family cannot."""

    def pipeline_stage(self, stage: int, num_stages: int) -> PipelineStagePlan | None:
        """The backbone of pipeline stage ``stage`` of ``num_stages`` (``parallel.pp``): its
        denoiser holds that stage's share of the blocks (this backbone's is taken apart), or
        None where the family cannot split."""

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        """What cached encodings of ``kind`` (``latents`` or ``text``) depend on: networks
        (hashed by weights), tokenizers (by vocabulary) and plain values (by ``repr``)."""

    def checkpoint_metadata(self) -> dict[str, str]:
        """Strings for the checkpoint's weight headers that identify the family."""


BackboneBuilder = Callable[[Any], Backbone]  # (Config) -> Backbone

LoraWriter = Callable[[Any, dict[str, dict[str, Tensor]], Path, torch.dtype, dict[str, str]], Path]
"""``(config, adapters, out, dtype, metadata) -> the path written``: a family writes a LoRA
run's adapters (``config``: the run's; ``adapters``: per adapted part, peft's state dict
``<module>.lora_A.weight`` / ``.lora_B.weight``, float32, the scale alpha/rank not applied) to
``out`` in ``dtype``, with ``metadata`` (kohya's ``ss_*``, SAI model-spec and ``impasto.*``
header strings, which the family may amend) in the file's header."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """Megatron-LM's tensor and sequence parallelism of a denoiser's blocks, as names only
    (applied by :mod:`impasto.train.tensor_parallel`, which holds the ``torch.distributed``
    side). Between the blocks' layers the token sequence is split across the group; each
    ``gathers`` module's first input (the sequence) is gathered whole, its ``colwise``
    projections keep a slice of the heads / hidden features, and its ``rowwise`` projection
    sums the slices and hands each rank its part of the sequence again.

    Names are relative to each block (a name a block lacks is skipped): ``head_norms`` are
    norms over the features of each head (QK norm, on the heads' slice), ``sequence_norms``
    norms with weights that run on the sequence's part; ``conditioned`` modules make
    per-sample vectors (adaLN modulation) that each rank applies to its part, so their
    gradients are summed over the group. ``token_index`` names the block's keyword argument
    that indexes per-token rows (a pack's document ids), split with the sequence. The
    sequence enters split at the first block and is gathered whole before ``output`` (a
    module of the denoiser). ``token_multiple`` is the denoiser's attribute that tells it
    sequences must be a multiple of the group size (it packs the ones that are not)."""

    blocks: tuple[nn.Module, ...]
    gathers: tuple[str, ...]
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    head_norms: tuple[str, ...] = ()
    sequence_norms: tuple[str, ...] = ()
    conditioned: tuple[str, ...] = ()
    token_index: str | None = None
    output: str = ""
    token_multiple: str = ""
    divisible: Mapping[str, int] = field(default_factory=dict)  # what the group size must divide


@dataclass(frozen=True)
class ContextParallelPlan:
    """Context parallelism (Ulysses all-to-all) of a denoiser, as names only (applied by
    :mod:`impasto.train.context_parallel`, which holds the ``torch.distributed`` side). ``hook``
    is the denoiser's attribute that takes a
    :class:`~impasto.models.sequence_parallel.SequenceParallel`: through it the denoiser
    splits its sequence after the input layer, runs each attention over the whole sequence for
    a share of the heads, and gathers its output. ``token_multiple`` is the attribute that
    tells it sequences must be a multiple of a number of tokens (multiplied by the group
    size); ``divisible``: counts the group size must divide (the attention heads, each rank's
    share after tensor parallelism)."""

    hook: str
    token_multiple: str = ""
    divisible: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ClipBenchModel:
    """A video model of ``impasto bench --model FAMILY-NAME`` beyond the family's presets: a
    preset trained on clips, the ``model.<family>`` options that make it one (its video
    autoencoder, its attention layout), and the clips of the bench's step: squares of
    ``resolution`` pixels with each of ``frames`` frames (1: an image), ``samples`` in all
    (None: the bench's default count)."""

    preset: str
    options: Mapping[str, Any]
    resolution: int
    frames: tuple[int, ...]
    samples: int | None = None


@dataclass(frozen=True)
class PipelineStagePlan:
    """One stage of a pipeline-parallel denoiser (applied by
    :mod:`impasto.train.pipeline_parallel`, which holds the ``torch.distributed`` side).

    ``backbone``'s denoiser is the stage: its parameters keep the whole denoiser's names, and it
    has ``prepare(*args, **kwargs)``, which turns the arguments of a whole-denoiser call into a
    micro-batch's *call* (with ``tokens``, the first stage's input, ``dtype``, the hidden states'
    dtype, and ``finish(output)``, the last stage's output as the denoiser's prediction);
    ``stage(x, call)`` runs the stage; ``io_meta(call)`` gives its input and output as meta
    tensors (shapes and dtypes). Every stage computes what the call needs besides ``x`` itself,
    so only the hidden states travel between stages; ``shared`` are the name prefixes of the
    parameters every stage holds a copy of (their gradients are summed over the stages)."""

    backbone: Any  # a Backbone
    shared: tuple[str, ...] = ()
    is_first: bool = True
    is_last: bool = True


@dataclass(frozen=True)
class FamilySpec:
    """What the config of a family may name, known without building a model: its parts (in
    the backbone's order), its presets, and the pydantic section of its options
    (``model.<family>``; None: it takes none), whether it reads ``model.text_encoder``, and
    the export formats it writes itself (``impasto export --format``: a writer of the rebuilt
    backbone, or of a LoRA run's adapters; :mod:`impasto.export.family`), whether it splits
    for ``parallel.tp``, ``parallel.cp`` and ``parallel.pp``, whether it trains on clips
    (``data.video``), and its video models of ``impasto bench`` (``--model FAMILY-NAME``)."""

    parts: tuple[str, ...]
    presets: tuple[str, ...]
    options: type[BaseModel] | None = None
    reads_text_encoder: bool = False  # model.text_encoder: text encoders from another folder
    exports: Mapping[str, FolderWriter] = field(default_factory=dict)  # format → its writer
    # format → writer of a LoRA run's adapters, un-merged, read from the checkpoint (no model
    # is built): impasto export --format lora-* (impasto.export.family)
    lora_exports: Mapping[str, LoraWriter] = field(default_factory=dict)
    # diffusers pipeline class (a folder's model_index.json) → the objective fields it was
    # trained with: a downloaded folder of this family opens for impasto sample
    pipelines: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    tensor_parallel: bool = False  # parallel.tp: its backbone has a TensorParallelPlan
    context_parallel: bool = False  # parallel.cp: its backbone has a ContextParallelPlan
    pipeline_parallel: bool = False  # parallel.pp: its backbone splits into pipeline stages
    video: bool = False  # data.video: its denoiser takes clips (a frame axis)
    clip_bench: Mapping[str, ClipBenchModel] = field(default_factory=dict)  # bench --model

    def read_options(self, raw: dict[str, Any], family: str) -> BaseModel | None:
        """The validated ``model.<family>`` section (ValueError naming the key if it is bad)."""
        if self.options is None:
            if raw:
                raise ValueError(f"model.{family}: the {family} family takes no options")
            return None
        try:
            return self.options.model_validate(raw)
        except ValidationError as error:
            first = error.errors()[0]
            key = ".".join(str(part) for part in first["loc"])
            raise ValueError(
                f"model.{family}.{key}: {first['msg']}, got {first.get('input')!r}"
            ) from None


FAMILIES: dict[str, FamilySpec] = {}
"""``model.family`` → what its config may name (registered by the family's module beside its
builder; a family without one, like a test's, is checked by its builder only)."""


def pipeline_family(path: str | Path) -> tuple[str, Mapping[str, Any]] | None:
    """``(family, objective fields)`` of a diffusers folder whose ``model_index.json`` names
    a pipeline a family reads (``FamilySpec.pipelines``); None for any other path."""
    import json

    try:
        index = json.loads((Path(path) / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = index.get("_class_name") if isinstance(index, dict) else None
    for family, spec in FAMILIES.items():
        if name in spec.pipelines:
            return family, spec.pipelines[name]
    return None


register_family = registrar(FAMILIES, "model family")
"""``register_family("name")(FamilySpec(...))``."""

BACKBONES: dict[str, BackboneBuilder] = {}
"""``model.family`` → a builder of that family's backbone from a Config (registered by the
family's module; see ``register_backbone``)."""


register_backbone = registrar(BACKBONES, "model family")
"""Decorator: ``@register_backbone("family")`` on a builder ``(config) -> Backbone``."""


def build_backbone(config: Any) -> Backbone:
    """The backbone ``config.model.family`` names, built from ``config.model``."""
    return lookup(BACKBONES, config.model.family, "model.family", "family")(config)


@contextlib.contextmanager
def reusing_builds() -> Iterator[None]:
    """Within the block, each ``config.model`` section is built once; later builds of the same
    section return deep copies (independent, equal to a fresh build: presets build from
    ``model.init_seed``). ``impasto bench`` builds the same random model for every variant and
    round; a large family's random text encoders and denoiser take a minute of CPU to
    initialise, a copy seconds. ``BACKBONES`` is restored when the block ends."""
    built: dict[str, Backbone] = {}
    builders = dict(BACKBONES)

    def reuse(builder: BackboneBuilder) -> BackboneBuilder:
        def build(config: Any) -> Backbone:
            key = config.model.model_dump_json()
            if key not in built:
                built[key] = builder(config)
            return copy.deepcopy(built[key])

        return build

    BACKBONES.update({family: reuse(builder) for family, builder in builders.items()})
    try:
        yield
    finally:
        BACKBONES.clear()
        BACKBONES.update(builders)


def adapter_layers(
    module: nn.Module, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()
) -> list[str]:
    """Full names of ``module``'s linear and conv layers whose name ends with one of
    ``suffixes`` (a whole name component), except those under a prefix in ``skip``."""
    return [
        name
        for name, child in module.named_modules()
        if isinstance(child, nn.Linear | nn.Conv2d)
        and any(name == s or name.endswith("." + s) for s in suffixes)
        and not name.startswith(skip or ("\0",))
    ]


def split_rows(encoding: Any) -> list[Any]:
    """A dataclass of ``[B, ...]`` tensors → B dataclasses of single rows (on the CPU)."""
    columns = [getattr(encoding, column.name) for column in fields(encoding)]
    size = columns[0].shape[0]
    return [type(encoding)(*(column[row].cpu() for column in columns)) for row in range(size)]


def stack_rows(rows: list[Any], device: torch.device) -> Any:
    """The inverse of :func:`split_rows`: rows stacked into one dataclass on ``device``."""
    names = [column.name for column in fields(rows[0])]
    stacked = [torch.stack([getattr(row, name) for row in rows]).to(device) for name in names]
    return type(rows[0])(*stacked)
