"""``impasto export``: a trained checkpoint in the formats other tools load (docs/formats.md).

The formats are per model family: :func:`export_checkpoint` reads the checkpoint's
``model.family`` and runs that family's exporter of the format asked for (:data:`EXPORTERS`,
family → format → exporter; a family's module adds its own with :func:`register_exporter`).
SDXL's (:mod:`impasto.export.sdxl`):

- ``diffusers``: a ``StableDiffusionXLPipeline`` folder whose scheduler says how to sample the
  model (v-prediction, zero terminal SNR and trailing spacing, or flow matching with its shift).
- ``single-file``: one ``.safetensors`` in the original SGM layout (A1111, ComfyUI, Forge),
  with ComfyUI's ``v_pred`` / ``ztsnr`` marker keys and SAI model-spec metadata.
- ``lora-diffusers``: the adapters of a LoRA/DoRA run as ``pytorch_lora_weights.safetensors``,
  names that ``pipe.load_lora_weights`` and ComfyUI's LoRA loader both read
  (:mod:`impasto.export.lora`).
- ``lora-kohya``: the adapters of a LoRA run in kohya's layout (``lora_unet_…``, SGM names),
  one ``.safetensors`` that ComfyUI, A1111 and Forge load.

A family may also write formats of its own (``FamilySpec.exports``,
:mod:`impasto.export.family`): the diffusion transformer's ``folder`` (weights, autoencoder,
text encoders and ``impasto-model.json``, which ``model.path`` and ``impasto sample`` read
back).

A LoRA run exports to the full-model formats only with ``merge=True`` (the adapters baked into
the base weights). LoRA files carry kohya's ``ss_*`` training metadata
(:mod:`impasto.export.metadata`).

Memory (issue #17): the LoRA formats read the adapter tensors from the checkpoint and never build
the model. The full-model formats rebuild it one network at a time where the base model is a
file (:mod:`impasto.export.lowmem`), else whole in fp32; each network is cast to the export
dtype in place, parameter by parameter, and files are written one tensor at a time: no second
copy of the model is ever held. ``verbose`` reports the time and the process's peak memory.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

from impasto.checkpoint.trained import read_checkpoint_config, resolve_checkpoint
from impasto.export import sdxl  # registers SDXL's formats
from impasto.export.base import DTYPES, EXPORTERS, Exporter, ExportOptions, register_exporter
from impasto.export.family import family_exporter, family_formats
from impasto.models.backbone import FAMILIES
from impasto.models.parts import merge_adapters
from impasto.permissions import apply_umask


def exporter_for(family: str, fmt: str) -> Exporter:
    """The exporter of format ``fmt`` for a run of ``model.family`` ``family``: one registered
    in ``EXPORTERS`` (SDXL's), or one the family writes itself (``FamilySpec.exports``); a
    one-line ``ValueError`` listing that family's formats when it has no ``fmt``."""
    formats = [*EXPORTERS.get(family, {}), *family_formats(family)]
    if not formats:
        with_formats = sorted({*EXPORTERS, *(name for name in FAMILIES if family_formats(name))})
        raise ValueError(
            f"export: this run trained model.family {family!r}, which has no export formats; "
            f"families with formats: {', '.join(with_formats)}"
        )
    if fmt not in formats:
        raise ValueError(
            f"export: unknown format {fmt!r} for model.family {family!r}; "
            f"valid: {', '.join(formats)}"
        )
    if fmt in EXPORTERS.get(family, {}):
        return EXPORTERS[family][fmt]
    return family_exporter(family, fmt)


def export_checkpoint(
    checkpoint: str | Path, fmt: str, out: str | Path, options: ExportOptions | None = None
) -> Path:
    """Write the model of ``checkpoint`` (a checkpoint or run directory) as ``fmt`` to ``out``."""
    options = options or ExportOptions()
    family = read_checkpoint_config(resolve_checkpoint(checkpoint)).model.family
    exporter = exporter_for(family, fmt)
    if options.dtype not in DTYPES:
        raise ValueError(f"export: unknown dtype {options.dtype!r}; valid: {', '.join(DTYPES)}")
    if options.merge_lora and fmt.startswith("lora-"):
        raise ValueError(
            "export: --merge-lora adds a LoRA to a full model (diffusers, single-file)"
        )
    started = time.perf_counter()
    path = apply_umask(exporter(checkpoint, out, options))
    if options.verbose:
        print(export_report(time.perf_counter() - started), file=sys.stderr)
    return path


def peak_memory_gb() -> float:
    """The process's peak resident memory so far (``ru_maxrss``, KiB on Linux), in GiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 30 if sys.platform == "darwin" else 1 << 20)  # macOS counts bytes


def export_report(seconds: float) -> str:
    """One line: how long an export took and the process's peak memory (which includes
    whatever the process did before the export; the CLI runs the export alone)."""
    return f"export: {seconds:.1f} s, peak memory {peak_memory_gb():.2f} GiB (max RSS)"


__all__ = [
    "DTYPES",
    "EXPORTERS",
    "ExportOptions",
    "Exporter",
    "export_checkpoint",
    "export_report",
    "exporter_for",
    "merge_adapters",
    "peak_memory_gb",
    "register_exporter",
    "sdxl",
]
