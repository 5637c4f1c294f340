"""Loading a config as the CLI does: its structure first (fast, no torch), then its names.

:func:`impasto.config.load_config` and :func:`impasto.config.build_config` check structure only;
these add :func:`impasto.train.checks.check_config`, which imports the registries (and torch) only
once the structure is right. Re-exported as ``impasto.load_config`` and ``impasto.build_config``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from impasto import config as structure
from impasto.config import Config
from impasto.train.checks import check_config


def build_config(raw: dict[str, Any], base: str | Path | None = None) -> Config:
    """The validated :class:`Config` of a raw mapping; a :class:`ConfigError` lists every
    problem, the structural ones first (the registry names are checked once those pass).
    Relative paths are made absolute against ``base`` (default: the working directory)."""
    config = structure.build_config(raw, base)
    check_config(config)
    return config


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """The validated :class:`Config` of a YAML file with ``a.b=c`` overrides applied; its
    relative paths are relative to the file's folder, those of the overrides to the working
    directory."""
    config = structure.load_config(path, overrides)
    check_config(config)
    return config


__all__ = ["build_config", "check_config", "load_config"]
