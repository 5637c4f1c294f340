"""``log.wandb``: Weights & Biases as a metrics sink beside JSONL and TensorBoard (issue #18).

The wandb run lives in ``RUN/wandb/`` (offline mode: ``wandb sync RUN/wandb/offline-run-*``
uploads it later). Its id is kept in ``RUN/wandb-run-id``, so a resumed run appends to the same
wandb run; a run that starts from step 0 gets a new one.

wandb's steps only increase: a ``log`` at a step below the run's last is dropped, with a
warning each time. So a resumed session logs only steps after its checkpoint, and (online,
where wandb knows the run's last step) only steps after the last one the interrupted session
logged. With exact resume those are the same values the interrupted session logged.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from impasto.faults import writing

if TYPE_CHECKING:
    from impasto.config.schema import WandbConfig

RUN_ID_FILE = "wandb-run-id"


def import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError as error:
        raise ValueError(
            "log.wandb.enabled is true but wandb is not installed: pip install wandb (in a "
            "checkout: pip install -e '.[wandb]')"
        ) from error
    return wandb


def wandb_run_id(run_dir: Path, resume_step: int) -> str:
    """The wandb run id of ``run_dir``: the stored one when the run resumes from a checkpoint
    (``resume_step`` > 0), else a new random one, stored for later sessions."""
    path = run_dir / RUN_ID_FILE
    if resume_step > 0 and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    new_id = uuid.uuid4().hex[:12]
    with writing(path, "wandb.write"):
        path.write_text(f"{new_id}\n", encoding="utf-8")
    return new_id


def image_array(image: Tensor) -> Any:
    """A ``[3, H, W]`` image in [0, 1] as the ``[H, W, 3]`` uint8 array wandb.Image expects
    (given a float tensor, wandb.Image assumes 0..255)."""
    pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(1, 2, 0).cpu().numpy()


class WandbSink:
    """One wandb run per run directory; ``config``: the resolved run config (a plain dict)."""

    def __init__(
        self,
        settings: WandbConfig,
        run_dir: Path,
        resume_step: int,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.wandb = import_wandb()
        run_id = wandb_run_id(run_dir, resume_step)
        self.run = self.wandb.init(
            project=settings.project,
            entity=settings.entity,
            mode=settings.mode,
            dir=str(run_dir),  # wandb adds wandb/
            id=run_id,
            name=run_dir.name,
            resume="allow",
            config=config,
        )
        # A fresh run logs from step 0 (the baseline validation); a resumed one from the step
        # after its checkpoint, or after the wandb run's last step if that is later.
        self.first_step = resume_step + 1 if resume_step > 0 else 0
        if self.run.starting_step > self.first_step:
            print(
                f"impasto: wandb run {run_id} already has steps up to "
                f"{self.run.starting_step - 1}; this session logs to wandb from step "
                f"{self.run.starting_step} on (wandb steps only increase)"
            )
            self.first_step = self.run.starting_step

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step >= self.first_step:
            self.run.log(scalars, step=step)

    def log_image(self, tag: str, image: Tensor, step: int) -> None:
        """A ``[3, H, W]`` image in [0, 1]."""
        if step >= self.first_step:
            self.run.log({tag: self.wandb.Image(image_array(image))}, step=step)

    def close(self) -> None:
        self.run.finish()
