"""Export formats a model family writes itself (``FamilySpec.exports``, e.g. the diffusion
transformer's folder): the run's model rebuilt from its checkpoint, its adapters merged, cast
to the export dtype, and handed to the family's writer with the record of how it samples
(:mod:`impasto.models.exported`). Nothing here knows a family."""

from __future__ import annotations

from pathlib import Path

from impasto.checkpoint.trained import load_trained, read_checkpoint_config, resolve_checkpoint
from impasto.export.base import DTYPES, Exporter, ExportOptions
from impasto.export.lora import lora_metadata, read_adapters
from impasto.models.backbone import FAMILIES
from impasto.models.parts import merge_adapters


def family_formats(family: str) -> tuple[str, ...]:
    """The formats ``family`` writes itself: of the whole model, then of a LoRA run's
    adapters."""
    spec = FAMILIES.get(family)
    return (*spec.exports, *spec.lora_exports) if spec is not None else ()


def family_exporter(family: str, fmt: str) -> Exporter:
    """The exporter of ``family``'s own format ``fmt`` (one of :func:`family_formats`)."""
    if fmt in FAMILIES[family].lora_exports:
        return family_lora_exporter(family, fmt)
    writer = FAMILIES[family].exports[fmt]

    def export(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
        path = resolve_checkpoint(checkpoint)
        config = read_checkpoint_config(path)
        if options.merge_lora:
            raise ValueError(
                f"export: --merge-lora adds a kohya SDXL LoRA; a {family} model takes none"
            )
        adapters = [name for name in FAMILIES[family].parts if config.parts.mode(name) == "lora"]
        if adapters and not options.merge:
            raise ValueError(
                f"export: this run trained {config.lora.kind} adapters ({', '.join(adapters)}); "
                f"add --merge to bake them into the {fmt}"
            )
        config, backbone = load_trained(path, ema=options.ema)
        dtype = DTYPES[options.dtype]
        for module in backbone.modules().values():
            merge_adapters(module)
            module.to(dtype)
        record = {
            "family": family,
            "objective": config.objective.model_dump(mode="json"),
            "resolution": config.sample.resolution or config.data.resolution,
        }
        return writer(backbone, Path(out), record, dtype)

    return export


def family_lora_exporter(family: str, fmt: str) -> Exporter:
    """The exporter of ``family``'s LoRA format ``fmt``: the adapters of the checkpoint read
    from its files (the EMA's with ``--ema``; no model is built), handed un-merged to the
    family's writer with the header every LoRA export carries (kohya's ``ss_*``, SAI
    model-spec, ``impasto.*``; :func:`impasto.export.lora.lora_metadata`)."""
    spec = FAMILIES[family]
    writer = spec.lora_exports[fmt]

    def export(checkpoint: str | Path, out: str | Path, options: ExportOptions) -> Path:
        if options.merge or options.merge_lora:
            raise ValueError(f"export: --merge and --merge-lora make full models, not {fmt}")
        adapters = read_adapters(checkpoint, ("lora",), fmt, options.ema, spec.parts)
        out = Path(out)
        name = out.stem if out.suffix == ".safetensors" else out.name
        metadata = lora_metadata(adapters, name, name)
        states = {
            part: {key: tensor.float() for key, tensor in state.items()}
            for part, state in adapters.states.items()
        }
        return writer(adapters.config, states, out, DTYPES[options.dtype], metadata)

    return export
