"""Names in a config that select code, checked against the registries that hold the code.

:mod:`impasto.config` validates structure only and imports no other impasto package, so a bad
key fails fast, without torch (issue #13). The registries live beside their code (the optimizers
in :mod:`impasto.train.optim`, the objectives in :mod:`impasto.objectives`, ...), so this module
sits above both and imports each registry when it checks it. Every problem is reported at once,
one line each; the lines keep the wording the schema's validators used before the split.
The folders the run writes (``train.output_dir``, ``cache.dir``, ``data.index_dir``) are checked
here too, against the filesystem: a file where a folder must be is one line, not a traceback
from ``mkdir`` once the run has started (issue #16).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from impasto.config.load import ConfigError
from impasto.config.objective import FLOW

if TYPE_CHECKING:
    from impasto.config import Config
    from impasto.config.draftp import RewardConfig
    from impasto.config.schema import (
        MemoryConfig,
        ObjectiveConfig,
        OptimConfig,
        SampleConfig,
    )


def check_config(config: Config) -> None:
    """Raise :class:`ConfigError` listing every unknown name in ``config`` and every folder it
    cannot write to, one per line."""
    _raise_if_any(config_problems(config))


def check_objective(objective: ObjectiveConfig) -> None:
    """:func:`check_config` for a lone objective section (``impasto inspect``, tests)."""
    _raise_if_any(objective_problems(objective))


def config_problems(config: Config) -> list[str]:
    return [
        *model_problems(config),
        *objective_problems(config.objective),
        *optim_problems(config.optim),
        *sample_problems(config.sample, config.objective),
        *method_problems(config),
        *compile_problems(config.memory),
        *video_problems(config),
        *folder_problems(config),
    ]


def video_problems(config: Config) -> list[str]:
    """What a video run (``data.video``) cannot do yet, each with the way out."""
    if config.data.video is None:
        return []
    problems = []
    if config.cache.latents == "disk" and config.data.video.placement != "even":
        problems.append(
            "cache.latents: disk caches each clip's frames once, but data.video.placement: "
            "random draws new ones every epoch; set data.video.placement: even (or "
            "cache.latents: memory)"
        )
    if config.objective.multires_noise_iterations > 0:
        problems.append(
            "objective.multires_noise_iterations: pyramid noise is 2-D and does not take clips "
            "(data.video); set it to 0 (noise_offset works on clips)"
        )
    return problems


def compile_problems(memory: MemoryConfig) -> list[str]:
    """An unknown ``torch.compile`` backend (torch raises it only once the model is built)."""
    if memory.compile == "none":
        return []
    from torch._dynamo import list_backends

    backends = list_backends(exclude_tags=())  # every registered one, plug-ins included
    if memory.compile_backend in backends:
        return []
    valid = ", ".join(list_backends())
    return [
        f"memory.compile_backend: unknown backend {memory.compile_backend!r}; valid: {valid} "
        "(torch._dynamo.list_backends())"
    ]


def folder_problems(config: Config) -> list[str]:
    """Folders the run creates or fills that cannot be folders: an existing file at the path,
    or a file where one of its parents should be (mkdir would raise a traceback mid-run); and
    an output folder the run cannot create or write to (issue #29)."""
    folders = {
        "train.output_dir": config.train.output_dir,
        "cache.dir": config.cache.dir,
        "data.index_dir": config.data.index_dir,
    }
    problems = []
    for key, folder in folders.items():
        problem = folder and _folder_problem(folder)
        if problem:
            problems.append(f"{key}: {problem}, got {folder!r}; choose another folder")
        elif folder and key == "train.output_dir":  # a cache may be shared read-only
            problem = _unwritable(Path(folder))
            if problem:
                problems.append(f"{key}: {problem}; choose a folder you can write to")
    return problems


def _folder_problem(folder: str) -> str | None:
    if "\0" in folder:
        return "a path cannot contain a NUL character"
    path = Path(folder)
    for candidate in (path, *path.parents):  # the nearest existing one must be a folder
        try:
            is_folder = stat.S_ISDIR(candidate.stat().st_mode)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet: the run creates it
        except OSError as error:  # e.g. a name too long for the filesystem
            return f"cannot use this path ({error.strerror})"
        if is_folder:
            return None
        where = "is an existing file" if candidate == path else f"{candidate} is a file"
        return f"{where}, not a folder"
    return None


def _unwritable(path: Path) -> str | None:
    """Why the run could not create ``path`` or write into it (its nearest existing folder
    is read-only or not writable by this user), or None. Known from the filesystem, without
    creating anything: ``--print-config`` writes nothing."""
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    verb = "write to" if existing == path else "create"
    where = "" if existing == path else f" ({existing})"
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return f"cannot {verb} {path}: read-only file system{where}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot {verb} {path}: permission denied{where}"
    return None


def method_problems(config: Config) -> list[str]:
    """What the training method needs from the data, and draftp's sampler and reward."""
    from impasto.train.methods import METHODS, DataNeeds

    method = METHODS.get(config.objective.method)
    problems = []
    needs = getattr(method, "needs", None)
    if needs is DataNeeds.IMAGES_AND_CAPTIONS and config.data.prompts is not None:
        problems.append(
            f"data.prompts: objective.method {config.objective.method} trains on images, and a "
            "prompt file has none; set data.path (or data.sources) instead"
        )
    if config.objective.method == "draftp":
        from impasto.sampling.flow import FLOW_SAMPLERS
        from impasto.train.methods.draftp import DRAFTP_SAMPLERS

        sampler = config.draftp.sampler
        if sampler not in DRAFTP_SAMPLERS:
            problems.append(
                f"draftp.sampler: {sampler!r} cannot be cut into a no-gradient prefix and "
                f"gradient steps; use one of {', '.join(DRAFTP_SAMPLERS)}"
            )
        elif config.objective.is_flow and sampler not in FLOW_SAMPLERS:
            problems.append(
                f"draftp.sampler: {sampler!r} cannot sample a flow model; flow samplers: "
                f"{', '.join(sorted(FLOW_SAMPLERS))}"
            )
        problems.extend(reward_problems(config.reward, "reward"))
    return problems


def reward_problems(reward: RewardConfig, key: str) -> list[str]:
    """Unknown reward kinds in ``reward`` and its terms (entry points included)."""
    from impasto.rewards import reward_kinds

    kinds = reward_kinds()
    problems = []
    if reward.kind not in kinds:
        problems.append(f"{key}.kind: unknown reward {reward.kind!r}; valid: {', '.join(kinds)}")
    for index, term in enumerate(reward.terms):
        problems.extend(reward_problems(term, f"{key}.terms.{index}"))
    return problems


def model_problems(config: Config) -> list[str]:
    """The family, its preset, its options (``model.<family>``) and the part names."""
    from impasto.models import BACKBONES
    from impasto.models.backbone import FAMILIES

    model = config.model
    if model.family not in BACKBONES:
        valid = ", ".join(sorted(BACKBONES))
        return [f"model.family: unknown family {model.family!r}; valid: {valid}"]
    spec = FAMILIES.get(model.family)
    if spec is None:  # a family registered without a spec (a test's) checks itself
        return []
    problems = []
    if model.preset is not None and model.preset not in spec.presets:
        valid = ", ".join(spec.presets)
        problems.append(
            f"model.preset: unknown preset {model.preset!r} of family {model.family}; "
            f"valid: {valid}"
        )
    try:
        spec.read_options(model.options, model.family)
    except ValueError as error:
        problems.append(str(error))
    if model.text_encoder is not None and not spec.reads_text_encoder:
        problems.append(
            f"model.text_encoder: the {model.family} family reads its text encoders from "
            "model.path; remove model.text_encoder"
        )
    if config.parallel.tp > 1 and not spec.tensor_parallel:
        problems.append(
            f"parallel.tp {config.parallel.tp}: the {model.family} family has no "
            "tensor-parallel plan; set parallel.tp: 1 (fsdp shards its weights without it)"
        )
    if config.parallel.cp > 1 and not spec.context_parallel:
        problems.append(
            f"parallel.cp {config.parallel.cp}: the {model.family} family has no "
            "context-parallel plan (no split of its denoiser's sequence over ranks); "
            "set parallel.cp: 1"
        )
    if config.parallel.pp > 1 and not spec.pipeline_parallel:
        problems.append(
            f"parallel.pp {config.parallel.pp}: the {model.family} family cannot split its "
            "denoiser into pipeline stages; set parallel.pp: 1 (fsdp shards its weights)"
        )
    if config.data.video is not None and not spec.video:
        clips = " or ".join(name for name, other in FAMILIES.items() if other.video)
        problems.append(
            f"data.video: the {model.family} family trains on images, not clips; use "
            f"model.family: {clips or 'a family that takes clips'}, or remove data.video"
        )
    if (config.sample.frames or 1) > 1 and not spec.video:
        problems.append(
            f"sample.frames: the {model.family} family samples images, not clips; remove "
            "sample.frames"
        )
    for key in config.parts.model_extra or {}:
        name = key.removesuffix("_lr")
        if name not in spec.parts:
            problems.append(
                f"parts.{key}: the {model.family} family has no part {name!r}; its parts: "
                f"{', '.join(spec.parts)}"
            )
    return problems


def objective_problems(objective: ObjectiveConfig) -> list[str]:
    from impasto.objectives.timesteps import check_mode_scale
    from impasto.train.methods import METHODS

    problems = []
    if objective.method not in METHODS:
        valid = ", ".join(sorted(METHODS))
        problems.append(f"objective.method: unknown method {objective.method!r}; valid: {valid}")
    for field, registry in _objective_registries(objective).items():
        name = getattr(objective, field)
        if name not in registry:
            # The samplers and weightings depend on the family, so name the prediction type.
            family = field in ("timestep_sampling", "loss_weighting")
            kind = f" for prediction_type {objective.prediction_type}" if family else ""
            valid = ", ".join(sorted(registry))
            problems.append(f"objective.{field}: unknown name {name!r}{kind}; valid: {valid}")
    if objective.is_flow and objective.timestep_sampling == "mode":
        try:
            check_mode_scale(objective.mode_scale)
        except ValueError as error:
            problems.append(f"objective.mode_scale: {error}")
    return problems


def _objective_registries(objective: ObjectiveConfig) -> dict[str, Mapping[str, object]]:
    """Each name field of ``objective`` → the registry (a dict) its value must be a key of."""
    from impasto.objectives import (
        FLOW_LOSS_WEIGHTINGS,
        FLOW_TIME_SAMPLERS,
        HUBER_C_SCHEDULES,
        LOSS_WEIGHTINGS,
        LOSSES,
        PREDICTION_TARGETS,
        SCHEDULES,
        TIMESTEP_SAMPLERS,
    )

    flow = objective.is_flow
    return {
        "schedule": SCHEDULES,
        "prediction_type": {**PREDICTION_TARGETS, FLOW: None},
        "timestep_sampling": FLOW_TIME_SAMPLERS if flow else TIMESTEP_SAMPLERS,
        "loss_weighting": {**LOSS_WEIGHTINGS, **FLOW_LOSS_WEIGHTINGS} if flow else LOSS_WEIGHTINGS,
        "loss": LOSSES,
        "huber_schedule": HUBER_C_SCHEDULES,
    }


def optim_problems(optim: OptimConfig) -> list[str]:
    from impasto.train.optim import LR_SCHEDULES, OPTIMIZERS

    problems = []
    if optim.name not in OPTIMIZERS:
        name, valid = optim.name, ", ".join(sorted(OPTIMIZERS))
        problems.append(f"optim.name: unknown optimizer {name!r}; valid: {valid}")
    if optim.lr_schedule not in LR_SCHEDULES:
        name, valid = optim.lr_schedule, ", ".join(sorted(LR_SCHEDULES))
        problems.append(f"optim.lr_schedule: unknown schedule {name!r}; valid: {valid}")
    return problems


def sample_problems(sample: SampleConfig, objective: ObjectiveConfig) -> list[str]:
    from impasto.sampling.flow import FLOW_SAMPLERS
    from impasto.sampling.samplers import SAMPLERS

    if sample.sampler is None:  # the family's own (impasto.sampling.process.default_sampler)
        return prompts_file_problems(sample, objective)
    if sample.sampler not in SAMPLERS:
        valid = ", ".join(sorted(SAMPLERS))
        return [f"sample.sampler: unknown name {sample.sampler!r}; valid: {valid}"]
    if objective.is_flow and sample.sampler not in FLOW_SAMPLERS:
        return [
            f"sample.sampler: {sample.sampler!r} cannot sample a flow model; "
            f"flow samplers: {', '.join(sorted(FLOW_SAMPLERS))}"
        ]
    return prompts_file_problems(sample, objective)


def prompts_file_problems(sample: SampleConfig, objective: ObjectiveConfig) -> list[str]:
    """A ``sample.prompts_file`` that cannot be read, a bad line (``FILE:LINE``), a line's
    steps past the schedule, or prompt sizes that differ when the method measures the
    validation images as one batch (draftp): found now, not at the first validation."""
    if sample.prompts_file is None:
        return []
    from impasto.sampling.prompt_file import read_prompt_file
    from impasto.train.methods import METHODS

    try:
        prompts = read_prompt_file(sample.prompts_file)
    except ValueError as error:
        return [f"sample.prompts_file: {error}"]
    problems = []
    T = objective.num_train_timesteps
    for prompt in prompts:
        steps = prompt.options.num_steps
        if steps is not None and steps >= T and not objective.is_flow:
            problems.append(
                f"sample.prompts_file: {prompt.where}: --s {steps}: a sampler visits fewer "
                f"timesteps than objective.num_train_timesteps ({T}); lower it"
            )
    sized = [p for p in prompts if p.options.width is not None or p.options.height is not None]
    method = METHODS.get(objective.method)
    if sized and hasattr(method, "validation_metrics"):
        problems.append(
            f"sample.prompts_file: {sized[0].where}: objective.method {objective.method} "
            "measures the validation images as one batch of one size; remove --w and --h "
            "(set sample.resolution instead)"
        )
    return problems


def _raise_if_any(problems: list[str]) -> None:
    if problems:
        raise ConfigError("\n".join(problems))
