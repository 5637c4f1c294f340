"""Training: the loop, the step, optimizers, LR schedules, precision and state.

The loop is imported lazily: the config schema validates names against registries in this
package (``impasto.train.optim``) and must not pull in the whole trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from impasto.config import Config
    from impasto.train.trainer import TrainResult


def train(config: Config, resume: bool = True) -> TrainResult:
    from impasto.train.trainer import train as _train

    return _train(config, resume=resume)


__all__ = ["train"]
