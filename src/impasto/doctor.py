"""``impasto doctor``: what this environment can run, in one screen."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil

OPTIONAL = ("wandb", "bitsandbytes", "datasets", "s3fs", "gcsfs", "av", "torchao")
REQUIRED = (
    "torch", "diffusers", "transformers", "peft", "safetensors", "pydantic", "tensorboard",
    "pyarrow", "fsspec", "braceexpand",
)  # fmt: skip


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> str:
    import torch

    from impasto import __version__

    lines = [f"impasto {__version__}, Python {platform.python_version()} on {platform.platform()}"]
    lines += [f"  {name}: {_version(name)}" for name in REQUIRED]
    lines.append(
        f"  CUDA available: {torch.cuda.is_available()} (torch built for CUDA {torch.version.cuda})"
    )
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        bf16 = torch.cuda.is_bf16_supported()
        lines.append(
            f"  GPU {index}: {name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, "
            f"bf16 {bf16}"
        )
    lines.append(f"  CPU threads used by torch: {torch.get_num_threads()}")
    disk = shutil.disk_usage(".")
    lines.append(f"  disk free here: {disk.free / 2**30:.1f} GiB")
    lines += [f"  optional {name}: {_version(name)}" for name in OPTIONAL]
    return "\n".join(lines)
