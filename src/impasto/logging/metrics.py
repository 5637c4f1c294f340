"""Metrics sinks: a JSONL file, TensorBoard and (``log.wandb``) Weights & Biases; rank 0 only.

On resume, records past the checkpoint's step are dropped from the first two (the JSONL file
is rewritten; TensorBoard gets ``purge_step``), so the log of a resumed run equals the log of
an uninterrupted one; wandb cannot drop steps, so it skips them instead (see
:mod:`impasto.logging.wandb_sink`).

A full disk fails these writes between two checkpoints: each names its file
(:func:`~impasto.faults.writing`; TensorBoard's writer thread keeps its error for the next
call to raise, so that thread prints nothing), and the trainer stops with one line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch import Tensor

from impasto.faults import is_disk_full_error, writing

if TYPE_CHECKING:
    from impasto.config.schema import WandbConfig

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


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
    with writing(tmp):
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """``wandb``: ``log.wandb`` (None or not enabled: no wandb); ``config``: the resolved run
    config as a plain dict (``config_to_dict``), the wandb run's config. As a context manager
    it closes the sinks at the end, quietly when the block failed."""

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
        self._hook: Callable[[threading.ExceptHookArgs], object] | None = None
        self.run_dir = run_dir
        self.jsonl_path = run_dir / METRICS_FILE
        self.tensorboard_dir = run_dir / TENSORBOARD_DIR
        try:
            self._open(jsonl, tensorboard, resume_step, wandb, config)
        except BaseException:
            self.close(quiet=True)
            raise

    def _open(
        self,
        jsonl: bool,
        tensorboard: bool,
        resume_step: int,
        wandb: WandbConfig | None,
        config: dict[str, Any] | None,
    ) -> None:
        if wandb is not None and wandb.enabled:  # first: a missing wandb fails before any file
            from impasto.logging.wandb_sink import WandbSink

            self._wandb = WandbSink(wandb, self.run_dir, resume_step, config)
        if jsonl:
            truncate_jsonl(self.jsonl_path, resume_step)
            with writing(self.jsonl_path):
                self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._hook = threading.excepthook
            threading.excepthook = _quiet_kept_disk_full(self._hook)
            with writing(self.tensorboard_dir):
                self._writer = SummaryWriter(
                    log_dir=str(self.tensorboard_dir), purge_step=resume_step + 1
                )

    def log(self, step: int, values: dict[str, Any]) -> None:
        if self._jsonl is not None:
            with writing(self.jsonl_path, "metrics.write"):
                self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
                self._jsonl.flush()
        scalars = {
            metric_tag(key): value
            for key, value in values.items()
            if isinstance(value, (int, float))
        }
        if self._writer is not None:
            with writing(self.tensorboard_dir, "tensorboard.write"):
                for tag, value in scalars.items():
                    self._writer.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def log_image(self, tag: str, image: Tensor, step: int) -> None:
        """A ``[3, H, W]`` image in [0, 1] to TensorBoard and wandb (the PNG file is the
        caller's)."""
        if self._writer is not None:
            with writing(self.tensorboard_dir, "tensorboard.write"):
                self._writer.add_image(tag, image, step)
        if self._wandb is not None:
            self._wandb.log_image(tag, image, step)

    def close(self, quiet: bool = False) -> None:
        """Flush and close every sink, then raise the first sink's error (a full disk fails
        the last flush); ``quiet``: raise nothing (the run already stops with its error)."""
        errors = []
        sinks = [(self._jsonl, self.jsonl_path), (self._writer, self.tensorboard_dir)]
        for sink, path in [*sinks, (self._wandb, self.run_dir / "wandb")]:
            try:
                with writing(path):
                    if sink is not None:
                        sink.close()
            except Exception as error:  # the other sinks still close
                errors.append(error)
        self._jsonl = self._writer = self._wandb = None
        if self._hook is not None:
            threading.excepthook, self._hook = self._hook, None
        if errors and not quiet:
            raise errors[0]

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(quiet=error is not None)


def _quiet_kept_disk_full(
    previous: Callable[[threading.ExceptHookArgs], object],
) -> Callable[[threading.ExceptHookArgs], object]:
    """A ``threading.excepthook`` that prints nothing for a disk-full error a thread keeps for
    its owner to raise (TensorBoard's writer thread stores it as ``exception`` and the next
    ``add_scalar``, ``flush`` or ``close`` raises it): the run stops with one line then."""

    def hook(args: threading.ExceptHookArgs) -> object:
        kept = getattr(args.thread, "exception", None) is args.exc_value
        if kept and args.exc_value is not None and is_disk_full_error(args.exc_value):
            return None
        return previous(args)

    return hook
