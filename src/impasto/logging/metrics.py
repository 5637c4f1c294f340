"""Metrics sinks: a JSONL file and TensorBoard scalars (rank 0 only).

On resume, records past the checkpoint's step are dropped from both sinks (the JSONL file is
rewritten; TensorBoard gets ``purge_step``), so the log of a resumed run equals the log of an
uninterrupted one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import Tensor

METRICS_FILE = "metrics.jsonl"


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
    def __init__(self, run_dir: Path, jsonl: bool, tensorboard: bool, resume_step: int) -> None:
        self._jsonl = None
        self._writer = None
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
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):  # "val/reward" keeps its own group
                    self._writer.add_scalar(key if "/" in key else f"train/{key}", value, step)

    def log_image(self, tag: str, image: Tensor, step: int) -> None:
        """A ``[3, H, W]`` image in [0, 1] to TensorBoard (the PNG file is the caller's)."""
        if self._writer is not None:
            self._writer.add_image(tag, image, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
