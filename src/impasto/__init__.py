"""impasto: train and fine-tune Stable Diffusion XL and diffusion transformers with PyTorch.

``import impasto`` imports no torch: the entry points below load their modules when called or
first looked up, so the CLI reports config mistakes in well under a second (issue #13).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from impasto.api import build_config, load_config
    from impasto.config import Config
    from impasto.train.trainer import TrainResult

from impasto.quiet import quiet_dependency_noise
from impasto.version import __version__

quiet_dependency_noise()  # before any dependency logs at import (impasto.quiet)

_API = ("build_config", "load_config")


def train(config: Config, resume: bool = True) -> TrainResult:
    """Train the run described by ``config`` (a :class:`impasto.config.Config`)."""
    from impasto.train import train as _train

    return _train(config, resume=resume)


def __getattr__(name: str) -> Any:
    # PEP 562: impasto.api imports pydantic and the schema; only pay for it when it is used.
    if name in _API:
        from impasto import api

        return getattr(api, name)
    raise AttributeError(f"module 'impasto' has no attribute {name!r}")


__all__ = ["__version__", "build_config", "load_config", "train"]
