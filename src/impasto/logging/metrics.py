"""Metrics sinks: a JSONL file, TensorBoard and (``log.wandb``) Weights & Biases; rank 0 only.

On resume, records past the checkpoint's step are dropped from the first two (the JSONL file
is rewritten; TensorBoard gets ``purge_step``), so the log of a resumed run equals the log of
an uninterrupted one; wandb cannot drop steps, so it skips them instead (see
:mod:`impasto.logging.wandb_sink`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from impasto.config.schema import WandbConfig

METRICS_FILE = "metrics.jsonl"


def metric_tag(key: str) -> str:
    """The chart name of a logged value: ``train/KEY``; a key with its own group ("val/reward")
    keeps it."""
    return key if "/" in key else f"train/{key}"


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with ``step <= last_step`` (and drop a torn last line), atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
        if record.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """``wandb``: ``log.wandb`` (None or not enabled: no wandb); ``config``: the resolved run
    config as a plain dict (``config_to_dict``), the wandb run's config."""

    def __init__(
        self,
        run_dir: Path,
        jsonl: bool,
        tensorboard: bool,
        resume_step: int,
        wandb: WandbConfig | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self._jsonl = None
        self._writer = None
        self._wandb = None
        if wandb is not None and wandb.enabled:  # first: a missing wandb fails before any file
            from impasto.logging.wandb_sink import WandbSink

            self._wandb = WandbSink(wandb, run_dir, resume_step, config)
        if jsonl:
            path = run_dir / METRICS_FILE
            truncate_jsonl(path, resume_step)
            self._jsonl = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(run_dir / "tensorboard"), purge_step=resume_step + 1
            )

    def log(self, step: int, values: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()
        scalars = {
            metric_tag(key): value
            for key, value in values.items()
            if isinstance(value, (int, float))
        }
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def log_image(self, tag: str, image: Tensor, step: int) -> None:
        """A ``[3, H, W]`` image in [0, 1] to TensorBoard and wandb (the PNG file is the
        caller's)."""
        if self._writer is not None:
            self._writer.add_image(tag, image, step)
        if self._wandb is not None:
            self._wandb.log_image(tag, image, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.close()
