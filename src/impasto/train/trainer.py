"""The training loop: build, restore, then step / log / sample / save (torchtitan-style).

The loop knows no model family and no training method: the backbone (``model.family``) and
the method (``objective.method``) come from registries through :func:`build_step_setup`, the
data from :func:`~impasto.data.pipeline.prepare_run_data`, and the whole run state is one dict
of Stateful objects that the checkpointer saves and restores.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from impasto.checkpoint.sharded import ShardedCheckpointer, is_sharded, load_sharded
from impasto.checkpoint.space import DeferredDiskFull, disk_full_is_one_line
from impasto.checkpoint.stateful import Stateful, load_states
from impasto.checkpoint.trained import model_metadata
from impasto.config import Config, config_hash, config_to_dict
from impasto.data import derive_seed
from impasto.data.census import DATASET_FILE
from impasto.data.dataset import Batch, Skipped
from impasto.data.pipeline import prepare_run_data
from impasto.data.records import bad_fraction_text
from impasto.data.skips import Reencoded
from impasto.distributed import RunGroup, run_group
from impasto.faults import fault_point, writing
from impasto.logging import MetricsLogger
from impasto.logging.flops import FlopMeter, peak_tflops, tflops_and_mfu
from impasto.logging.profiler import StepProfiler
from impasto.logging.progress import RunProgress
from impasto.logging.system import peak_memory
from impasto.precision import resolve_device, resolve_precision
from impasto.train.evaluation import build_evaluator, release_gathered
from impasto.train.memo import share_encodings
from impasto.train.methods import DataNeeds, Rows
from impasto.train.nonfinite import NonFiniteGuard
from impasto.train.optim import LRSchedule
from impasto.train.run_lock import RunLock, lock_run_dir
from impasto.train.setup import build_step_setup
from impasto.train.signals import StopRequest
from impasto.train.state import (
    CHECKPOINTS,
    RNGStreams,
    TrainState,
    check_resumable,
    config_text,
    ema_states,
    optimizer_by_name,
    part_state,
    prepare_run_dir,
    restore_newest,
    run_info,
    save_run,
)
from impasto.train.step_metrics import (
    IntervalMeter,
    TrainingClock,
    group_lrs,
    subset_means,
)
from impasto.train.summary import dataset_facts, report, run_clock, summary_lines
from impasto.train.validation import ValidationGrid, render_validation_grid, validation_prompts


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    state: TrainState
    last_checkpoint: Path | None
    interrupted: bool


RunSummary = Callable[[Path], Sequence[str]]
"""The run summary printed at the end: the run directory → lines (the CLI passes
``impasto.runs.summarize_run(run_dir).lines()``, which ``impasto runs summary`` prints again;
``train/`` cannot import ``impasto.runs``, which imports ``train/``)."""


def train(
    config: Config, resume: bool = True, run_summary: RunSummary | None = None
) -> TrainResult:
    """Train (or continue training) the run described by ``config``: in this process, or as
    one rank of a ``torchrun`` job (``parallel.strategy``). ``run_summary``: what rank 0 prints
    once the run stopped (finished or by a signal) and its files are closed.

    A disk that fills up between two checkpoints fails some other write of the run (metrics,
    a grid, a report, the lock file): that stops the run with one line naming the file and
    the newest checkpoint, from which the same command resumes once there is room (issue #29;
    :mod:`impasto.checkpoint.space`)."""
    parallel = config.parallel
    run_dir = Path(config.train.output_dir)
    with (
        StopRequest(),
        run_group(parallel, config.train.device) as group,  # a signal meanwhile stops at once
        disk_full_is_one_line(run_dir, run_dir / CHECKPOINTS),
    ):
        return Trainer(config, resume, group, run_summary).run()


class Trainer:
    """One run: built from a config, resumed from its newest checkpoint, then stepped.

    In a parallel run every rank runs this same loop in lockstep: the collectives (gradient
    reduction, the stop flag, metrics on logging steps, checkpoints) happen at the same steps
    on all of them, and rank 0 alone writes logs, samples and reports."""

    wall_clock: Callable[[], float] = staticmethod(time.monotonic)  # checkpoint.every_minutes

    def __init__(
        self,
        config: Config,
        resume: bool,
        group: RunGroup | None = None,
        run_summary: RunSummary | None = None,
    ) -> None:
        self.started = time.perf_counter()
        self.clock = TrainingClock()  # the run's training time, continued by a resume
        self.run_summary = run_summary
        # FLOPs counted once per batch shape (a compiled model would run eagerly while counted).
        self.flop_meter = FlopMeter() if config.memory.compile == "none" else None
        self.step_flops = 0
        self.profiler: StepProfiler | None = None
        # A signal from here on stops at once (start-up), later after the step (run).
        self.stop = StopRequest().install()
        self.lock: RunLock | None = None
        # Rank 0's writes that find the disk full: kept until the ranks agree to stop.
        self.writes = DeferredDiskFull()
        try:
            self.build(config, resume, group)
        except BaseException:
            self.close()
            raise

    def build(self, config: Config, resume: bool, group: RunGroup | None) -> None:
        self.config = config
        self.group = group = group or RunGroup(device=resolve_device(config.train.device))
        output_dir = Path(config.train.output_dir)
        self.lock = lock_run_dir(output_dir, group, self.writes)
        self.writes.check(group, output_dir, output_dir / CHECKPOINTS)
        with self.writes.deferred(), writing(output_dir / "config.yaml"):
            self.run_dir = prepare_run_dir(config, resume, group.is_main)
        group.barrier()
        self.writes.check(group, output_dir, output_dir / CHECKPOINTS)
        group.agree(
            "the config", config_hash(config),
            "start every rank with the same config file and overrides",
        )  # fmt: skip
        self.precision = precision = resolve_precision(config.train.mixed_precision, group.device)
        self.peak_tflops = peak_tflops(group.device)  # for MFU (None: not a GPU we know)
        self.rng = RNGStreams(config.train.seed)
        self.setup = setup = build_step_setup(config, group.device, precision, group)
        images = setup.method.needs is DataNeeds.IMAGES_AND_CAPTIONS
        self.data = prepare_run_data(
            config, setup.backbone, self.run_dir, images, setup.autocast, str(precision), group
        )
        group.agree(
            "the data", (len(self.data.records), self.data.total_steps),
            "every node must read the same dataset (a shared filesystem or identical copies)",
        )  # fmt: skip
        self.facts = dataset_facts(config, self.data, group.data_world)  # for dataset.json
        self.evaluator = build_evaluator(
            setup.method, setup.backbone, self.data.eval_sets, config, group
        )
        self.meter = IntervalMeter()
        # Read once: a prompt file edited mid-run changes neither the grids nor the ranks' lockstep.
        self.prompts = validation_prompts(config.sample) if config.sample.every_steps else []
        share_encodings(setup, config, self.data, self.prompts)  # cache: issues #33, #32
        self.state = TrainState()
        self.unsynced = UnsyncedCounts()
        self.lr = LRSchedule(setup.optimizer, config.optim, self.data.total_steps)
        how = "zeroed" if setup.fused is not None else "kept out of the weights"
        self.guard = NonFiniteGuard(self.state, config.train.max_nonfinite_steps, how)
        self.sharded = None
        if group.parallel:
            self.sharded = ShardedCheckpointer(
                self.run_dir / CHECKPOINTS, group, config.checkpoint.keep_last,
                config.checkpoint.async_save,
            )  # fmt: skip
        self.last_checkpoint = self.restore() if resume else None
        if self.last_checkpoint is not None:
            print(f"impasto: resumed from {self.last_checkpoint} (step {self.state.step})")
        else:  # the items left out while the sources were read (a resumed run counted them)
            scanned = self.data.scan_skipped
            self.state.images_attempted += len(scanned)
            self.state.count_bad(item.name for item in scanned)

    def close(self) -> None:
        """Hand back the signal handlers and the run lock (also after a failed start)."""
        self.stop.restore()
        if self.profiler is not None:
            self.profiler.stop()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def restore(self) -> Path | None:
        """Load the newest complete checkpoint: a sharded one into any strategy and number of
        ranks, a one-process one into a one-process or ``ddp`` run; a damaged one is set aside
        and the one before it loaded (:func:`~impasto.train.state.restore_newest`)."""
        return restore_newest(self.run_dir / CHECKPOINTS, self.group, self.load)

    def load(self, path: Path) -> None:
        check_resumable(path, self.config)
        if is_sharded(path):
            load_sharded(path, self.states(sharded=True))
        elif self.config.parallel.strategy in ("fsdp", "hsdp"):
            raise ValueError(
                f"checkpoint {path} was written by a one-process run; resume it with "
                "parallel.strategy none or ddp (the next checkpoint is sharded and loads "
                "anywhere), or start over with --no-resume"
            )
        else:
            load_states(path, self.states())

    def states(self, sharded: bool = False) -> dict[str, Stateful]:
        """Everything a checkpoint holds, by name; the RNG streams last (restoring the data
        position may draw from them). ``sharded``: the optimizer by parameter name."""
        setup = self.setup
        states = {name: part_state(part) for name, part in setup.trainable.items()}
        optimizer = setup.optimizer
        if sharded:
            optimizer = optimizer_by_name(setup.optimizer, setup.trainable)
        states |= {"optimizer": optimizer, "lr_schedule": self.lr, "train": self.state}
        run = run_info(self.config, setup.optimizer, self.clock)
        states |= {"data": self.data.stream, "run": run}
        if setup.ema is not None:
            states |= ema_states(setup.ema)
        return states | {"rng": self.rng}

    def run(self) -> TrainResult:
        try:
            result = self.train_steps()
        finally:
            self.close()
        # After the lock is handed back: the summary reads the run as finished or stopped.
        if self.group.is_main and self.run_summary is not None:
            print("\n".join(self.run_summary(self.run_dir)))
        return result

    def train_steps(self) -> TrainResult:
        state, group, main = self.state, self.group, self.group.is_main
        if main:
            summary = summary_lines(
                self.config, self.data, self.setup.trainable, group.device, self.precision,
                group.data_world, state.step,
            )  # fmt: skip
            print("\n".join(summary))
        with self.metrics_logger() as metrics:  # closed (quietly, after an error) at the end
            interrupted = self.train_loop(metrics)
        self.guard.settle()
        report(state, time.perf_counter() - self.started, interrupted, self.last_checkpoint)
        summarize = getattr(self.setup.method, "summarize", None)
        if main and summarize is not None:
            summarize(self.run_dir)
        if state.images_bad:
            print(f"impasto: the skipped images and why: {self.data.bad_data.path}")
        return TrainResult(self.run_dir, state, self.last_checkpoint, interrupted)

    def metrics_logger(self) -> contextlib.AbstractContextManager[MetricsLogger | None]:
        """The metrics sinks (rank 0; None on the other ranks, and when a full disk kept them
        from opening: the run then stops at the end of the first step)."""
        if not self.group.is_main:
            return contextlib.nullcontext()
        log, step = self.config.log, self.state.step
        with self.writes.deferred():
            return MetricsLogger(
                self.run_dir, log.jsonl, log.tensorboard, step,
                wandb=log.wandb, config=config_to_dict(self.config),
            )  # fmt: skip
        return contextlib.nullcontext()

    def train_loop(self, metrics: MetricsLogger | None) -> bool:
        """Step until the last step or a signal, logging, validating and saving as due;
        returns whether a signal stopped it."""
        config, state, total, log = self.config, self.state, self.data.total_steps, self.config.log
        stop, main = self.stop, self.group.is_main
        self.profiler = profiler = StepProfiler(log.profile, self.run_dir, main)
        progress = RunProgress(
            run_clock(config, total), state.step, main, log.progress_bar, log.every_steps
        )
        interrupted = False
        self.last_save = self.wall_clock()  # checkpoint.every_minutes counts from here
        if state.step == 0:  # the baselines: what the method measures, the validation loss
            self.log(metrics, self.check(metrics, progress, baseline=True))
        stop.defer()  # from the first step on, a signal saves after the step
        while state.step < total and not interrupted:
            progress.start_step(state.step)
            values = self.step()
            profiler.step()
            if values is not None and main:
                progress.log(state.step, values)
            # One record per step: the training values (logging steps) and the validation's.
            self.log(metrics, (values or {}) | self.check(metrics, progress))
            # The ranks stop together: a signal seen by any of them stops all at this step
            # (saving), a write that found the disk full too (without: no room to save);
            # rank 0's clock decides a checkpoint by time (checkpoint.every_minutes).
            interrupted, timely, full = self.group.any(
                stop.requested, self.save_is_due_by_time(), self.writes.failed
            )
            if full:
                raise self.writes.stop(self.group, self.run_dir, self.run_dir / CHECKPOINTS)
            if self.sharded is not None:
                self.last_checkpoint = self.sharded.poll() or self.last_checkpoint
            if self.should_save() or timely or interrupted:
                with progress.timing("save"):
                    self.save()
                self.last_save = self.wall_clock()
            progress.advance(state.step)
        if self.sharded is not None:
            self.last_checkpoint = self.sharded.wait() or self.last_checkpoint
        self.sync_counts()
        self.writes.check(self.group, self.run_dir, self.run_dir / CHECKPOINTS)
        progress.close()
        profiler.close()
        return interrupted

    def log(self, metrics: MetricsLogger | None, values: dict[str, float]) -> None:
        """Write one record of this step (rank 0), with the run's training time so far."""
        if metrics is not None and values:
            with self.writes.deferred():
                metrics.log(self.state.step, values | {"elapsed_s": self.clock.elapsed()})

    def check(
        self, metrics: MetricsLogger | None, progress: RunProgress, baseline: bool = False
    ) -> dict[str, float]:
        """The validation due at this step (every rank): the sample grid with what the method
        measures on it, and the validation loss; returns their values. ``baseline`` (step 0,
        before training): the grid only when the method measures it."""
        values: dict[str, float] = {}
        if self.should_sample() and (not baseline or self.measures_validation()):
            with progress.timing("validation"):
                values |= self.validate(metrics, progress)
        if self.should_evaluate():
            with progress.timing("validation"):
                values |= self.evaluate(progress)
        return values

    def evaluate(self, progress: RunProgress) -> dict[str, float]:
        """The validation loss of the live weights (and the EMA's) on the held-out sets."""
        values = self.evaluator.evaluate(self.setup.ema)
        if self.group.is_main:
            losses = ", ".join(f"{k} {v:.4g}" for k, v in values.items() if k.endswith("/loss"))
            progress.write(f"impasto: validation loss at step {self.state.step}: {losses}")
        return values

    def save(self) -> None:
        """Checkpoint the run: sharded through DCP in a parallel run (maybe in the background),
        else the one-process files. Every weights file (or the sharded checkpoint's state)
        records what model it is: the backbone's header and how the run trained it; beside
        them, ``dataset.json`` (images, epochs, tag frequency: kohya's LoRA metadata)."""
        self.guard.settle()
        self.sync_counts()
        config, step = self.config, self.state.step
        dataset = {DATASET_FILE: self.facts.json(self.data.stream.epoch)}
        if self.sharded is None:
            header = self.setup.backbone.checkpoint_metadata()
            states = self.states()
            self.last_checkpoint = save_run(self.run_dir, config, step, states, header, dataset)
            return
        header = self.setup.backbone.checkpoint_metadata() | model_metadata(config)
        saved = self.sharded.save(
            step, self.states(sharded=True), {"config.yaml": config_text(config)} | dataset,
            {name: header for name in self.setup.trainable} | {"ema": header},
        )  # fmt: skip
        self.last_checkpoint = saved or self.last_checkpoint

    def sync_counts(self) -> None:
        """Add every rank's samples and unusable images since the last sync to the run's
        counters, and (rank 0) the unusable ones and the re-encoded text embeddings to the
        bad-data report: collective, on logging and saving steps and at the end."""
        unsynced, self.unsynced = self.unsynced, UnsyncedCounts()
        attempted, bad, reencoded, samples = self.group.data_sum(
            unsynced.attempted, unsynced.bad, len(unsynced.reencoded), unsynced.samples
        )
        self.state.samples_seen += samples
        self.state.images_attempted += attempted
        skipped, notes = unsynced.skipped, unsynced.reencoded
        if bad and self.group.world > 1:  # (bad is the sum: every rank gathers, or none)
            skipped = [item for part in self.group.data_gather(skipped) for item in part]
        if reencoded and self.group.world > 1:
            notes = [item for part in self.group.data_gather(notes) for item in part]
        # Each bad item counts once, whichever rank met it and however often: the counted
        # names are part of the checkpointed counters, so a resumed run counts alike. A
        # re-encoded text embedding is reported, not counted: its image was trained on.
        self.state.count_bad(item.name for item in skipped)
        if self.group.is_main and (skipped or notes):
            path = self.data.bad_data.path or self.run_dir
            with self.writes.deferred(), writing(path, "bad_data.write"):
                self.data.bad_data.record([*skipped, *notes])

    def step(self) -> dict[str, float] | None:
        """One optimizer step; returns the metrics on logging steps (the only host syncs)."""
        config, state, meter = self.config, self.state, self.meter
        step_start = time.perf_counter()
        lr = self.lr.apply(state.step)
        loss, metrics, num_samples = self.accumulate_gradients()
        grad_norm, finite = self.setup.update(config.optim.max_grad_norm)
        self.guard.observe(finite)
        state.step += 1
        if self.setup.ema is not None:
            self.setup.ema.update(state.step)
        fault_point("step")
        self.unsynced.samples += num_samples
        meter.add_subsets({name: value for name, value in metrics.items() if value.ndim})
        if state.step % config.log.every_steps and state.step != self.data.total_steps:
            meter.step_s += time.perf_counter() - step_start
            return None
        self.guard.settle()
        self.sync_counts()
        # One all-reduce of the loss, the metrics and the interval's (sum, count) pairs (means
        # over the ranks: a pair's ratio is the same), then the host reads.
        names = [name for name, value in metrics.items() if not value.ndim]
        subsets = list(meter.subsets)
        flat = [loss.reshape(1), *(metrics[name].reshape(1) for name in names)]
        flat += [meter.subsets[name].to(loss) for name in subsets]
        means = self.group.mean(torch.cat(flat)).tolist()
        (num_samples,) = self.group.data_sum(num_samples)  # this step's, over the ranks
        step_time = time.perf_counter() - step_start
        meter.step_s += step_time
        values = {"loss": means[0], "lr": lr} | group_lrs(self.setup.optimizer)
        values["grad_norm"] = grad_norm.item()
        values |= dict(zip(names, means[1 : 1 + len(names)], strict=True))
        values |= subset_means(subsets, means[1 + len(names) :])
        values |= {
            "step_time": step_time,
            "samples_per_s": num_samples / step_time,
            "data_wait": meter.data_wait(),
            "epoch": self.data.stream.epoch,
            "images_bad": state.images_bad,
            "steps_skipped": state.steps_skipped,
        }
        if self.flop_meter is not None:  # this rank's FLOPs against one device's peak
            values |= tflops_and_mfu(self.step_flops, step_time, self.peak_tflops)
        meter.reset()
        return values | peak_memory(self.group.device)

    def accumulate_gradients(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Forward and backward ``grad_accum_steps`` micro-batches; returns the mean loss and
        metrics (device tensors) and the number of samples."""
        config, state, group = self.config, self.state, self.group
        accum = config.train.grad_accum_steps
        # Summed on the device: .item() happens only on logging steps (no per-step host sync).
        total_loss = torch.zeros((), device=self.setup.backbone.device)
        metrics: dict[str, torch.Tensor] = {}
        step_seed = derive_seed(config.train.seed, 0, state.step, 0)  # the method's draws
        outputs, pipelined, num_samples, self.step_flops = [], [], 0, 0
        for micro in range(accum):
            with self.meter.waiting():
                batch = next(self.data.stream)
            self.unsynced.add(config.data.batch_size, batch.num_bad, batch.skipped, batch.reencoded)
            self.check_bad_fraction()
            # This micro-batch is slot micro × world + rank of the step's global batch (the
            # order the data stream hands them out in). The method draws for the whole global
            # batch from one generator per step and keeps its rows; other randomness (dropout)
            # comes from the global generators, seeded per slot. So the numbers a sample meets
            # depend on (seed, step, slot) only: not on how many ranks or micro-steps share it.
            if batch.size == 0:
                if group.parallel:  # the other ranks' backward would wait for this one's
                    raise ValueError(
                        f"data: every image of a batch on rank {group.rank} was unusable (see "
                        f"{self.data.bad_data.path}); remove or fix the broken files"
                    )
                continue
            slot = micro * group.data_world + group.data_rank
            rows = Rows(slot, accum * group.data_world, config.data.batch_size)
            torch.manual_seed(seed := derive_seed(config.train.seed, state.step, slot, 1))
            generator = torch.Generator().manual_seed(step_seed)
            num_samples += len(batch.captions)
            if self.setup.pipeline is not None:
                pipelined.append((batch, generator, rows, seed, batch_shapes(batch)))
                continue
            key = batch_shapes(batch)
            with self.flop_meter.measure(key) if self.flop_meter else contextlib.nullcontext():
                out = self.setup.micro_step(batch, generator, 1 / accum, rows, micro == accum - 1)
            if self.flop_meter is not None:
                self.step_flops += self.flop_meter.flops(key) or 0
            outputs.append(out)
        if pipelined:  # parallel.pp runs them at once (and counts this stage's FLOPs)
            outputs, self.step_flops = self.setup.pipeline.run(pipelined, self.flop_meter)
        for out in outputs:
            total_loss += out.loss
            for name, value in out.metrics.items():  # means: averaged; (sum, count): summed
                value = value.detach() if value.ndim else value.detach() / accum
                metrics[name] = metrics.get(name, 0) + value
        return total_loss / accum, metrics, num_samples

    def check_bad_fraction(self) -> None:
        """After an epoch's worth of images (this rank's share), stop if too many were unusable."""
        state, limit, shares = self.state, self.config.data.max_bad_fraction, self.group.data_world
        bad = state.images_bad + self.unsynced.bad * shares  # an estimate between syncs
        attempted = state.images_attempted + self.unsynced.attempted * shares
        fraction = bad / max(1, attempted)
        if attempted >= len(self.data.records) + len(self.data.scan_skipped) and fraction > limit:
            raise ValueError(
                f"data: {bad} of {attempted} images unusable; allowed: "
                f"{bad_fraction_text(limit)}; see {self.data.bad_data.path}, then remove or "
                "fix the broken files"
            )

    def validate(self, metrics: MetricsLogger | None, progress: RunProgress) -> dict[str, float]:
        """Render the validation grid (every rank: FSDP gathers weights) and log it (rank 0);
        returns what the method measures on it (rank 0; nothing elsewhere)."""
        step = self.state.step
        with self.sampling_weights():
            validation = render_validation_grid(
                self.config, self.setup.backbone, self.run_dir, step, self.prompts
            )
        if metrics is None:
            return {}
        with self.writes.deferred():
            validation.save()
            metrics.log_image("samples", validation.grid, step)
            progress.write(f"impasto: samples at step {step}: {validation.path}")
        return self.validation_metrics(validation)

    def measures_validation(self) -> bool:
        return hasattr(self.setup.method, "validation_metrics")

    def validation_metrics(self, validation: ValidationGrid) -> dict[str, float]:
        """What the method measures on the validation images (``val/NAME``), if anything:
        e.g. draftp's reward on held-out prompts and the images' diversity."""
        measure = getattr(self.setup.method, "validation_metrics", None)
        if measure is None:
            return {}
        per_prompt = self.config.sample.images_per_prompt
        values = measure(validation.images, validation.prompts, per_prompt)
        return {f"val/{name}": value for name, value in values.items()}

    @contextlib.contextmanager
    def sampling_weights(self) -> Iterator[None]:
        """The weights validation samples use: the EMA's (``ema.sample_with_ema``) or live.
        FSDP's gathered weights are dropped around the swap, so that neither the sampling nor
        the next training step sees the other's (:func:`release_gathered`)."""
        if self.setup.ema is None or not self.config.ema.sample_with_ema:
            yield
            return
        modules = list(self.setup.backbone.modules().values())
        release_gathered(modules)
        with self.setup.ema.swapped():
            try:
                yield
            finally:
                release_gathered(modules)

    def should_sample(self) -> bool:
        every, step = self.config.sample.every_steps, self.state.step
        return every > 0 and (step % every == 0 or step == self.data.total_steps)

    def should_evaluate(self) -> bool:
        """The validation loss is due: every ``eval.every_steps`` steps (step 0: the starting
        weights) and at the last step."""
        every, step = self.config.eval.every_steps, self.state.step
        if self.evaluator is None:
            return False
        return step % every == 0 or step == self.data.total_steps

    def should_save(self) -> bool:
        final = self.state.step == self.data.total_steps and self.config.checkpoint.save_final
        return final or self.state.step % self.config.checkpoint.every_steps == 0

    def save_is_due_by_time(self) -> bool:
        """``checkpoint.every_minutes`` passed on this process's clock since the last save (or
        the start). Rank 0's answer counts: the others say no, and ``group.any`` agrees."""
        minutes = self.config.checkpoint.every_minutes
        if minutes is None or not self.group.is_main:
            return False
        return self.wall_clock() - self.last_save >= minutes * 60


@dataclass
class UnsyncedCounts:
    """This rank's images since the counters were last summed over the ranks."""

    attempted: int = 0
    bad: int = 0
    samples: int = 0  # trained on
    skipped: list[Skipped] = field(default_factory=list)
    reencoded: list[Reencoded] = field(default_factory=list)  # damaged cached text embeddings

    def add(
        self, attempted: int, bad: int, skipped: Sequence[Skipped], reencoded: Sequence[Reencoded]
    ) -> None:
        self.attempted += attempted
        self.bad += bad
        self.skipped.extend(skipped)
        self.reencoded.extend(reencoded)


def batch_shapes(batch: Batch) -> tuple:
    """What decides a step's FLOPs: the shapes of the batch's tensors (the bucket, cached or
    encoded on the fly, the caption length)."""
    if batch.groups is not None:  # a pack: the shapes of each of its groups
        return tuple(batch_shapes(group) for group in batch.groups)
    tensors = (batch.pixel_values, batch.latent_mean, batch.prompt_embeds, batch.loss_masks)
    return tuple(None if t is None else tuple(t.shape) for t in tensors) + (len(batch.captions),)
