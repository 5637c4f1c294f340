"""The training loop: build, restore, then step / log / sample / save (torchtitan-style).

The loop knows no model family and no training method: the backbone (``model.family``) and
the method (``objective.method``) come from registries through :func:`build_step_setup`, the
data from :func:`~impasto.data.pipeline.prepare_run_data`, and the whole run state is one dict
of Stateful objects that the checkpointer saves and restores.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from impasto.checkpoint.stateful import Stateful
from impasto.config import Config
from impasto.data import derive_seed
from impasto.data.pipeline import prepare_run_data
from impasto.distributed import rank_and_world
from impasto.logging import MetricsLogger
from impasto.precision import resolve_device, resolve_precision
from impasto.train.methods import DataNeeds
from impasto.train.nonfinite import NonFiniteGuard
from impasto.train.optim import LRSchedule
from impasto.train.setup import build_step_setup
from impasto.train.signals import StopRequest
from impasto.train.state import (
    RNGStreams,
    TrainState,
    ema_states,
    part_state,
    prepare_run_dir,
    restore_run,
    run_info,
    save_run,
)
from impasto.train.validation import write_validation_grid


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    state: TrainState
    last_checkpoint: Path | None
    interrupted: bool


def train(config: Config, resume: bool = True) -> TrainResult:
    """Train (or continue training) the run described by ``config``."""
    if rank_and_world()[1] > 1:
        raise ValueError(
            "impasto train runs in one process for now (DDP/FSDP are not built yet); under "
            "torchrun every rank would train its own copy into the same run directory. Use "
            "`torchrun ... -m impasto cache CONFIG` to fill the cache on all GPUs, then train"
        )
    return Trainer(config, resume).run()


class Trainer:
    """One run: built from a config, resumed from its newest checkpoint, then stepped."""

    def __init__(self, config: Config, resume: bool) -> None:
        self.started = time.perf_counter()
        self.config = config
        self.run_dir = prepare_run_dir(config, resume)
        device = resolve_device(config.train.device)
        precision = resolve_precision(config.train.mixed_precision, device)
        self.rng = RNGStreams(config.train.seed)
        self.setup = setup = build_step_setup(config, device, precision)
        images = setup.method.needs is DataNeeds.IMAGES_AND_CAPTIONS
        self.data = prepare_run_data(
            config, setup.backbone, self.run_dir, images, setup.autocast, str(precision)
        )
        self.state = TrainState()
        self.lr = LRSchedule(setup.optimizer, config.optim, self.data.total_steps)
        how = "zeroed" if setup.fused is not None else "kept out of the weights"
        self.guard = NonFiniteGuard(self.state, config.train.max_nonfinite_steps, how)
        self.last_checkpoint = restore_run(self.run_dir, config, self.states()) if resume else None
        if self.last_checkpoint is not None:
            print(f"impasto: resumed from {self.last_checkpoint} (step {self.state.step})")

    def states(self) -> dict[str, Stateful]:
        """Everything a checkpoint holds, by name; the RNG streams last (restoring the data
        position may draw from them)."""
        setup = self.setup
        states = {name: part_state(part) for name, part in setup.trainable.items()}
        states |= {"optimizer": setup.optimizer, "lr_schedule": self.lr, "train": self.state}
        states |= {"data": self.data.stream, "run": run_info(self.config, setup.optimizer)}
        if setup.ema is not None:
            states |= ema_states(setup.ema)
        return states | {"rng": self.rng}

    def run(self) -> TrainResult:
        config, state, total = self.config, self.state, self.data.total_steps
        metrics = MetricsLogger(self.run_dir, config.log.jsonl, config.log.tensorboard, state.step)
        progress = tqdm(total=total, initial=state.step, unit="step", dynamic_ncols=True,
                        disable=not config.log.progress_bar)  # fmt: skip
        interrupted = False
        with StopRequest() as stop:
            while state.step < total and not interrupted:
                values = self.step()
                progress.update(1)
                if values is not None:
                    metrics.log(state.step, values)
                    progress.set_postfix(loss=f"{values['loss']:.4f}", lr=f"{values['lr']:.2e}")
                if self.should_sample():
                    with self.sampling_weights():
                        path, grid = write_validation_grid(
                            config, self.setup.backbone, self.run_dir, state.step
                        )
                    metrics.log_image("samples", grid, state.step)
                    progress.write(f"impasto: samples at step {state.step}: {path}")
                interrupted = stop.requested
                if self.should_save() or interrupted:
                    self.guard.settle()
                    header = self.setup.backbone.checkpoint_metadata()
                    self.last_checkpoint = save_run(
                        self.run_dir, config, state.step, self.states(), header
                    )
        progress.close()
        metrics.close()
        self.guard.settle()
        report(state, time.perf_counter() - self.started, interrupted, self.last_checkpoint)
        if state.images_bad:
            print(f"impasto: the skipped images and why: {self.data.bad_data.path}")
        return TrainResult(self.run_dir, state, self.last_checkpoint, interrupted)

    def step(self) -> dict[str, float] | None:
        """One optimizer step; returns the metrics on logging steps (the only host syncs)."""
        config, state = self.config, self.state
        step_start = time.perf_counter()
        lr = self.lr.apply(state.step)
        loss, metrics, num_samples = self.accumulate_gradients()
        grad_norm, finite = self.setup.update(config.optim.max_grad_norm)
        self.guard.observe(finite)
        state.step += 1
        if self.setup.ema is not None:
            self.setup.ema.update(state.step)
        state.samples_seen += num_samples
        if state.step % config.log.every_steps and state.step != self.data.total_steps:
            return None
        self.guard.settle()
        step_time = time.perf_counter() - step_start
        values = {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item()}
        values |= {name: value.item() for name, value in metrics.items()}
        return values | {
            "step_time": step_time,
            "samples_per_s": num_samples / step_time,
            "epoch": self.data.stream.epoch,
            "images_bad": state.images_bad,
        }

    def accumulate_gradients(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Forward and backward ``grad_accum_steps`` micro-batches; returns the mean loss and
        metrics (device tensors) and the number of samples."""
        config, state = self.config, self.state
        accum = config.train.grad_accum_steps
        # Summed on the device: .item() happens only on logging steps (no per-step host sync).
        total_loss = torch.zeros((), device=self.setup.backbone.device)
        metrics: dict[str, torch.Tensor] = {}
        num_samples = 0
        for micro in range(accum):
            batch = next(self.data.stream)
            state.images_attempted += config.data.batch_size
            state.images_bad += batch.num_bad
            self.data.bad_data.record(batch.skipped)
            self.check_bad_fraction()
            if batch.size == 0:
                continue
            # (seed, rank, step, micro) with rank 0 on every rank: methods draw for the global
            # batch and keep their rows, so the draws do not depend on the number of ranks.
            seed = derive_seed(config.train.seed, 0, state.step, micro)
            out = self.setup.micro_step(batch, torch.Generator().manual_seed(seed), 1 / accum)
            total_loss += out.loss
            for name, value in out.metrics.items():
                metrics[name] = metrics.get(name, 0) + value.detach() / accum
            num_samples += len(batch.captions)
        return total_loss / accum, metrics, num_samples

    def check_bad_fraction(self) -> None:
        """After a full epoch's worth of images, stop if too many were unusable."""
        state, limit = self.state, self.config.data.max_bad_fraction
        fraction = state.images_bad / max(1, state.images_attempted)
        if state.images_attempted >= len(self.data.records) and fraction > limit:
            raise ValueError(
                f"data: {state.images_bad} of {state.images_attempted} images were unusable "
                f"({fraction:.0%} > data.max_bad_fraction {limit}); see "
                f"{self.data.bad_data.path}, then remove or fix the broken files"
            )

    def sampling_weights(self) -> AbstractContextManager:
        """The weights validation samples use: the EMA's (``ema.sample_with_ema``) or live."""
        if self.setup.ema is not None and self.config.ema.sample_with_ema:
            return self.setup.ema.swapped()
        return contextlib.nullcontext()

    def should_sample(self) -> bool:
        every, step = self.config.sample.every_steps, self.state.step
        return every > 0 and (step % every == 0 or step == self.data.total_steps)

    def should_save(self) -> bool:
        final = self.state.step == self.data.total_steps and self.config.checkpoint.save_final
        return final or self.state.step % self.config.checkpoint.every_steps == 0


def report(state: TrainState, elapsed: float, interrupted: bool, checkpoint: Path | None) -> None:
    how = "stopped on request" if interrupted else "finished"
    print(f"impasto: {how} at step {state.step} in {elapsed:.1f} s; checkpoint: {checkpoint}")
    if state.images_bad:
        print(f"impasto: skipped {state.images_bad} unusable images")
    if state.steps_skipped:
        print(f"impasto: skipped {state.steps_skipped} non-finite steps")
