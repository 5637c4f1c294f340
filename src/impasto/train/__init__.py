"""Training: the loop, the step, optimizers, LR schedules, precision and state.

The loop is imported lazily, so that importing a registry of this package (``impasto.train.optim``
for :mod:`impasto.train.checks`) does not pull in the whole trainer.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from impasto.config import Config
    from impasto.train.trainer import TrainResult


def train(
    config: Config, resume: bool = True, run_summary: Callable[[Path], list[str]] | None = None
) -> TrainResult:
    """Train (or resume) the run of ``config``; its registry names are checked first, since
    :func:`impasto.config.build_config` checks structure only. ``run_summary(run_dir)``: the
    lines rank 0 prints at the end or after a stop (the CLI passes ``impasto.runs``')."""
    from impasto.train.checks import check_config

    check_config(config)
    from impasto.train.trainer import train as _train

    return _train(config, resume=resume, run_summary=run_summary)


class _CallableModule(types.ModuleType):
    """``impasto.train(config)`` (DESIGN §2) keeps working once this subpackage is imported:
    importing ``impasto.train.<anything>`` rebinds the name ``impasto.train`` from the root
    package's function to this module, so the module calls :func:`train` itself."""

    def __call__(self, config: Config, resume: bool = True) -> TrainResult:
        return train(config, resume=resume)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["train"]
