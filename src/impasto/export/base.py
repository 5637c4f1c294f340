"""What every exporter shares: the export options and dtypes, and the registry of exporters,
one table of formats per model family (a family's module registers its own with
:func:`register_exporter`, as :mod:`impasto.export.sdxl` does SDXL's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from impasto.registry import registrar

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp16"  # a key of DTYPES
    merge: bool = False  # bake a LoRA run's adapters into the full model
    merge_lora: str | None = None  # a kohya LoRA file to add to the full model
    lora_scale: float = 1.0  # its strength
    ema: bool = False  # export the EMA weights (ema.safetensors) instead of the live ones
    verbose: bool = False  # print the export's time and peak memory


Exporter = Callable[[str | Path, str | Path, ExportOptions], Path]
"""``(checkpoint, out, options) -> the path written``."""

EXPORTERS: dict[str, dict[str, Exporter]] = {}
"""``model.family`` → format name (``impasto export --format``) → that format's exporter."""


def register_exporter(family: str, fmt: str) -> Callable[[Exporter], Exporter]:
    """Decorator: ``@register_exporter("sdxl", "diffusers")`` on an exporter
    ``(checkpoint, out, options) -> Path`` of the runs of ``model.family`` ``family``."""
    return registrar(EXPORTERS.setdefault(family, {}), f"{family} export format")(fmt)
