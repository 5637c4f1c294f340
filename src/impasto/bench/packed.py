"""``impasto bench --model FAMILY-PRESET``: the trainer's step on a model that packs tokens
(``data.pack_tokens``), packed against padded, per image token; ``FAMILY-NAME`` of a family's
video models (:class:`~impasto.models.backbone.ClipBenchModel`), per clip token.

The step trains on one micro-batch of images of three bucket shapes, the demo's aspect ratios
(64x64, 48x80, 80x48) scaled to the resolution, as a cache delivers them (random latents and
text embeddings: no autoencoder or text encoder runs). Both layouts run the trainer's packed
step (``packed_denoising_loss``: every image its own noise, time, text and positions; attention
within each image) on the same images:

- ``packed``: the images end to end in one sequence of ``data.pack_tokens`` = their tokens
  rounded up to a multiple of 128;
- ``padded`` (the baseline, NeMo's): every image padded to the largest image's token count,
  ``images × max tokens`` (rounded up alike). The padding sits at the sequence's end rather
  than after each image: the token-wise layers (projections and MLP: nearly all FLOPs) compute
  on it all the same, and attention skips it in both layouts (the grouped and varlen kernels;
  a fused kernel with a padding mask does the same).

FLOPs, parameters and the memory of weights, gradients, optimizer state and EMA come from the
same step on the meta device (:mod:`impasto.bench.meta`): nothing large is built to count
them, so ``--estimate`` reports them for any size without timing. TFLOP/s and MFU count the
images' FLOPs (the packed count less its padding) in both rows. The layouts run interleaved,
A B A B, for ``rounds``; each round's ratio (padded time / packed time) gives a median and a
spread.

A video model's step trains on square clips of several frame counts instead (``--frames``; an
image is a one-frame clip), through the family's video autoencoder, as a video run's cache
delivers them: each clip's tokens count its latent frames. With one shape only (the 7B video
model's one 8k-token clip) nothing is padded and the packed layout runs alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from impasto.bench.meta import MetaStep, count_meta_flops, measure_meta_step, meta_backbone
from impasto.bench.mix import PACK_MULTIPLE, ImageMix, clip_mix, image_mix, synthetic_pack
from impasto.bench.report import count
from impasto.bench.step import VARIANTS, ImpastoStep, bench_config, free_memory, time_steps
from impasto.config import Config
from impasto.config.schema import ModelConfig
from impasto.data import Batch
from impasto.logging.flops import peak_tflops
from impasto.models.backbone import FAMILIES, Backbone, ClipBenchModel, reusing_builds
from impasto.precision import resolve_device
from impasto.train.checks import check_config

DEFAULT_RESOLUTION = 256  # NeMo's first pretraining stage
CPU_MAX_PARAMETERS = 100_000_000  # larger: a CPU step takes minutes; estimate instead
LAYOUTS = ("padded", "packed")  # the baseline first
FLOPS_METHOD = (
    "counted on the meta device: one forward + backward of the trainer's packed step, "
    "torch.utils.flop_counter's formulas, attention at its math cost"
)


def family_preset(model: str) -> tuple[str, str] | None:
    """``(family, name)`` of ``--model FAMILY-NAME`` for a family other than the default one
    (whose presets are named alone: ``tiny``, ``sdxl``), ``name`` a preset or one of the
    family's video models (``clip_bench``); None for those."""
    import impasto.models  # noqa: F401  (registers the families)

    default = ModelConfig.model_fields["family"].default
    for family, spec in FAMILIES.items():
        name = model.removeprefix(f"{family}-")
        if (
            family != default
            and name != model
            and (name in spec.presets or name in spec.clip_bench)
        ):
            return family, name
    return None


def model_names() -> list[str]:
    """Every ``--model`` name: the default family's presets, then FAMILY-PRESET, then each
    family's video models."""
    import impasto.models  # noqa: F401

    default = ModelConfig.model_fields["family"].default
    names = list(FAMILIES[default].presets)
    for family, spec in FAMILIES.items():
        if family != default:
            names += [f"{family}-{name}" for name in (*spec.presets, *spec.clip_bench)]
    return names


def clip_model_names() -> list[str]:
    """The ``--model`` names of video models (the ones ``--frames`` applies to)."""
    import impasto.models  # noqa: F401

    return [f"{family}-{name}" for family, spec in FAMILIES.items() for name in spec.clip_bench]


@dataclass(frozen=True)
class PackedRow:
    variant: str
    layout: str
    sequence_tokens: int
    fill: float  # image tokens / sequence tokens
    step_ms: float | None  # None: it did not run (``error`` says why)
    tokens_per_s: float | None  # image tokens
    tflops: float | None
    mfu: float | None
    peak_memory_gib: float | None
    vs_padded: float | None  # the median of the rounds' padded / this step time
    error: str | None = None
    rounds_ms: list[float] | None = None


@dataclass(frozen=True)
class Flops:
    """Forward + backward FLOPs of one step: of the images alone (the model's work, what
    TFLOP/s and MFU count), and of each layout's sequence with its padding."""

    images: int  # the samples' (images or clips)
    packed: int
    padded: int


def layout_flops(count: Callable[[int], int], mix: ImageMix) -> Flops:
    """:class:`Flops` from ``count(sequence tokens)``. Attention skips padding and the other
    matmuls are per token (or per image), so each padding token costs the same: the count at
    a longer sequence gives that cost, and the images' FLOPs are the packed count less its
    padding."""
    packed_length, padded_length = mix.capacity("packed"), mix.capacity("padded")
    longer = max(padded_length, packed_length + PACK_MULTIPLE)
    packed, at_longer = count(packed_length), count(longer)
    per_token = (at_longer - packed) // (longer - packed_length)
    return Flops(
        images=packed - (packed_length - mix.image_tokens) * per_token,
        packed=packed,
        padded=packed + (padded_length - packed_length) * per_token,
    )


@dataclass(frozen=True)
class BenchPlan:
    """What the timed runs share: the user's settings, the samples, their FLOPs, the meta
    step of the packed layout (the default variant's: FLOPs, parameters) and of each
    variant (its memory), and the config of each (variant, layout)."""

    model: str
    resolution: int
    precision: str
    device: str  # train.device of the config (--device, or --set train.device)
    mix: ImageMix
    data: Batch
    meta: MetaStep  # the packed step's
    flops: Flops
    configs: dict[tuple[str, str], Config]
    states: dict[str, MetaStep | None]  # each variant's packed meta step (its memory)


def variant_state(config: Config, data: Batch) -> MetaStep | None:
    """The meta step of a variant's config; None where its optimizer cannot step on the meta
    device (stochastic rounding draws from a device generator: pure_bf16, low_memory)."""
    try:
        return measure_meta_step(config, data)
    except RuntimeError as error:
        if "meta" not in str(error).lower():
            raise
        return None


def clip_options(family: str, clips: ClipBenchModel | None) -> tuple[str, ...]:
    """The ``model.<family>`` overrides that make a video model (before the user's ``--set``,
    which may change them: ``--set model.<family>.attention=spatiotemporal``)."""
    if clips is None:
        return ()
    return tuple(f"model.{family}.{key}={value}" for key, value in clips.options.items())


def bench_mix(
    probe: Backbone, clips: ClipBenchModel | None, resolution: int, frames: tuple[int, ...] | None,
    batch: int | None, model: str,
) -> ImageMix:  # fmt: skip
    """The step's samples: a video model's clips, or the images of an image model."""
    if clips is None:
        if frames is not None:
            raise ValueError(
                f"bench: --frames is for the video models ({', '.join(clip_model_names())}); "
                f"{model} trains on images, leave --frames out"
            )
        return image_mix(probe, resolution, batch)
    samples = clips.samples if batch is None else batch
    return clip_mix(probe, resolution, frames or clips.frames, samples)


def plan_bench(
    family: str, preset: str, resolution: int | None, batch: int | None, precision: str,
    variants: tuple[str, ...], device: str, overrides: tuple[str, ...],
    frames: tuple[int, ...] | None = None,
) -> BenchPlan:  # fmt: skip
    """Configs, samples and the meta step of each layout (nothing large is built here)."""
    name, clips = preset, FAMILIES[family].clip_bench.get(preset)
    if clips is not None:
        preset = clips.preset
    resolution = resolution or (clips.resolution if clips is not None else DEFAULT_RESOLUTION)
    user = (f"model.family={family}", *clip_options(family, clips), *overrides)

    def config(variant: str, tokens: int | None) -> Config:
        extra = {} if tokens is None else {"data.pack_tokens": tokens}
        return bench_config(
            preset, resolution, 1, precision, device, user, VARIANTS[variant] | extra
        )

    base = config("default", None)
    check_config(base)  # the user's --model and --set names
    probe = meta_backbone(base)
    mix = bench_mix(probe, clips, resolution, frames, batch, f"{family}-{name}")
    data = synthetic_pack(probe, mix)
    meta = measure_meta_step(config("default", mix.capacity("packed")), data)

    def flops_at(tokens: int) -> int:
        if tokens == mix.capacity("packed"):
            return meta.flops
        return count_meta_flops(config("default", tokens), data)

    flops = layout_flops(flops_at, mix)
    configs = {
        (v, layout): config(v, mix.capacity(layout)) for v in variants for layout in mix.layouts()
    }
    states = {v: meta if v == "default" else variant_state(configs[v, "packed"], data)
              for v in variants}  # fmt: skip
    return BenchPlan(f"{family}-{name}", resolution, precision, base.train.device, mix, data,
                     meta, flops, configs, states)  # fmt: skip


def check_fits(plan: BenchPlan, target: torch.device) -> dict[tuple[str, str], str]:
    """Refuse a model too large for the device in one line, before building it; on a GPU,
    the variants whose weights, gradients, optimizer state and EMA alone exceed its memory
    are not built: (variant, layout) → why (a one-line error when no variant fits)."""
    packed = plan.meta
    if target.type == "cpu" and packed.trained_parameters > CPU_MAX_PARAMETERS:
        raise ValueError(
            f"bench: {plan.model} trains {count(packed.trained_parameters)} parameters, too "
            f"many to time on the CPU (at most {count(CPU_MAX_PARAMETERS)}); time it "
            "on a GPU, or add --estimate for its FLOPs per token and memory only"
        )
    if target.type != "cuda":
        return {}
    total = torch.cuda.get_device_properties(target).total_memory
    too_large = {v: state for v, state in plan.states.items()
                 if state is not None and state.state_bytes > total}  # fmt: skip
    if len(too_large) == len(plan.states):
        state = min(too_large.values(), key=lambda each: each.state_bytes)
        raise ValueError(
            f"bench: {plan.model}'s weights, gradients, optimizer state and EMA take "
            f"{state.state_bytes / 2**30:.1f} GiB before activations, more than the "
            f"{total / 2**30:.1f} GiB of {torch.cuda.get_device_name(target)}; see "
            "--estimate, try --variants low_memory, or shard it over several GPUs"
        )
    return {
        key: f"does not fit: {too_large[key[0]].state_bytes / 2**30:.1f} GiB before activations"
        for key in plan.configs
        if key[0] in too_large
    }


def time_layouts(
    plan: BenchPlan, target: torch.device, steps: int, warmup: int, rounds: int,
    skipped: dict[tuple[str, str], str] | None = None,
) -> tuple[dict[tuple[str, str], list[float]], dict, dict[tuple[str, str], str]]:  # fmt: skip
    """(seconds per round, peak GiB, errors) of each (variant, layout), interleaved: each
    round times every one once, a fresh model each time (copies of one build); ``skipped``
    ones (they do not fit) are reported with their reason, not built."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in plan.configs}
    peaks: dict[tuple[str, str], float | None] = {}
    errors: dict[tuple[str, str], str] = dict(skipped or {})
    builds = rounds * sum(key not in errors for key in plan.configs)
    # one build is timed as it is: a kept original beside its copy would double the host
    # memory (a 12 B transformer and its 4.7 B T5, random, in fp32: 67 GB)
    with reusing_builds() if builds > 1 else nullcontext():
        for _ in range(rounds):
            for key, config in plan.configs.items():
                if key in errors:
                    continue
                try:
                    step = ImpastoStep(config, target)
                    step.prepare(plan.data)
                    seconds, peaks[key] = time_steps(step, target, warmup, steps)
                    times[key].append(seconds)
                except torch.OutOfMemoryError:
                    errors[key] = "out of memory"
                step = None  # drop the model (also after an error) before the next one
                free_memory(target)
    return times, peaks, errors


def run_packed_bench(
    family: str, preset: str, resolution: int | None = None, batch: int | None = None,
    steps: int = 2, warmup: int = 1, rounds: int = 3, precision: str = "auto",
    variants: tuple[str, ...] = ("default",), device: str = "auto",
    overrides: tuple[str, ...] = (), estimate: bool = False,
    frames: tuple[int, ...] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Time the packed and the padded step of ``family``'s ``preset`` or video model (or,
    with ``estimate``, only count its FLOPs and memory); returns a JSON-able report."""
    plan = plan_bench(family, preset, resolution, batch, precision, tuple(variants), device,
                      tuple(overrides), frames)  # fmt: skip
    target = resolve_device(plan.device)
    report = describe(plan, target, steps, rounds, estimate)
    if estimate:
        return report
    skipped = check_fits(plan, target)
    times, peaks, errors = time_layouts(plan, target, steps, warmup, rounds, skipped)
    report["ratios"] = ratios(times, tuple(variants), errors)
    speedups = {ratio["variant"]: ratio["median"] for ratio in report["ratios"]}
    rows = packed_rows(plan, target, times, peaks, errors, speedups)
    report["rows"] = [asdict(row) for row in rows]
    return report


def describe(
    plan: BenchPlan, target: torch.device, steps: int, rounds: int, estimate: bool
) -> dict[str, Any]:
    """The report without timings: the samples, the FLOPs and the memory (of the first
    variant: ``memory_variant``)."""
    mix, packed = plan.mix, plan.meta
    memory_variant, state = next(
        ((v, state) for v, state in plan.states.items() if state is not None), ("default", packed)
    )
    by_variant = {variant: config for (variant, _), config in plan.configs.items()}
    first = next(iter(plan.configs.values()))
    return {
        "model": plan.model,
        "resolution": plan.resolution,
        "precision": plan.precision,
        "device": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu",
        "estimate": estimate,
        "steps": steps,
        "rounds": rounds,
        "images": mix.num_images,
        "clips": mix.clips,  # a video model: images and clips as clips (frames below)
        "shapes": [
            {"frames": f, "height": h, "width": w, "images": count, "tokens": tokens}
            for (h, w), f, count, tokens in zip(
                mix.shapes, mix.frame_counts(), mix.counts, mix.tokens, strict=True
            )
        ],
        "image_tokens": mix.image_tokens,  # the samples' tokens, images' and clips'
        "sequence_tokens": {layout: mix.capacity(layout) for layout in LAYOUTS},
        "layouts": list(mix.layouts()),
        "flops_method": FLOPS_METHOD,
        "flops_per_step": plan.flops.images,  # the images' (what TFLOP/s and MFU count)
        "flops_per_token": plan.flops.images / mix.image_tokens,
        "packed_flops_per_step": plan.flops.packed,  # with the packed sequence's padding
        "padded_flops_per_step": plan.flops.padded,
        "trained_parameters": packed.trained_parameters,
        "frozen_parameters": packed.frozen_parameters,
        "memory_variant": memory_variant,
        "memory_gib": {
            "weights": state.weights_bytes / 2**30,
            "gradients": state.gradients_bytes / 2**30,
            "optimizer": state.optimizer_bytes / 2**30,
            "ema": state.ema_bytes / 2**30,
            "trained_total": state.state_bytes / 2**30,
            "frozen": state.frozen_bytes / 2**30,
        },
        "frozen_gib": {name: size / 2**30 for name, size in state.frozen_by_network.items()},
        "released_gib": {name: size / 2**30 for name, size in state.released_by_network.items()},
        "frozen_dtype": by_variant.get(memory_variant, first).memory.frozen_dtype,
        "rows": [],
        "ratios": [],
    }


def packed_rows(
    plan: BenchPlan, target: torch.device, times: dict, peaks: dict, errors: dict,
    speedups: dict[str, float],
) -> list[PackedRow]:  # fmt: skip
    """A row per (variant, layout): medians over the rounds; TFLOP/s of the images' FLOPs;
    ``speedups``: each variant's median of the rounds' padded / packed time."""
    flops, peak = plan.flops.images, peak_tflops(target)
    rows = []
    for (variant, layout), measured in times.items():
        length = plan.mix.capacity(layout)
        fill = plan.mix.image_tokens / length
        if (variant, layout) in errors:
            rows.append(PackedRow(variant, layout, length, fill, None, None, None, None, None,
                                  None, errors[variant, layout]))  # fmt: skip
            continue
        seconds = statistics.median(measured)
        tflops = flops / seconds / 1e12  # on a CPU too; MFU needs a known peak
        rows.append(PackedRow(
            variant=variant, layout=layout, sequence_tokens=length, fill=fill,
            step_ms=seconds * 1e3, tokens_per_s=plan.mix.image_tokens / seconds, tflops=tflops,
            mfu=None if tflops is None or peak is None else tflops / peak,
            peak_memory_gib=peaks.get((variant, layout)),
            vs_padded=1.0 if layout == "padded" else speedups.get(variant),
            rounds_ms=[value * 1e3 for value in measured],
        ))  # fmt: skip
    return rows


def ratios(times: dict, variants: tuple[str, ...], errors: dict) -> list[dict[str, Any]]:
    """Per variant, each round's padded time / packed time: the median and the spread."""
    out = []
    for variant in variants:
        keys = ((variant, "padded"), (variant, "packed"))
        if any(key in errors or key not in times for key in keys):
            continue
        pairs = zip(times[variant, "padded"], times[variant, "packed"], strict=True)
        each = [padded / packed for padded, packed in pairs]
        out.append({"variant": variant, "median": statistics.median(each), "min": min(each),
                    "max": max(each), "rounds": each})  # fmt: skip
    return out
