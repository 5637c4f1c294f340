"""The validation loss on held-out images (issue #18): the method's own loss at fixed,
stratified times with fixed noise, so that it compares across steps, resumes and runs.

What is fixed: the images (:mod:`impasto.data.holdout`: the split of
``data.validation_split`` and the sets of ``eval.sets``, the first ``eval.max_images`` of each
in a fixed order), their crops and captions (center crop, no flip, no caption randomness), the
times (``eval.timesteps`` strata of the method's time range, the midpoint of each: the
method's ``eval_times``) and the noise: image ``i`` of a set draws its ``[S, C, h, w]`` noise
from a generator seeded with ``(eval.seed, set, i)``, the same at every evaluation. The
latents are the autoencoder's posterior means, encoded once (the autoencoder never trains).

Nothing here touches the training's random streams: the batches are read in this process
without a ``DataLoader`` (whose iterator would draw a seed from torch's generator), every draw
comes from the generators above, the networks run in eval mode without gradients, and the
global generators are forked around it all besides. So a run with evaluation trains exactly
as one without (``tests/test_evaluation.py``).

In a parallel run every rank evaluates a share of the batches, the same number on each (a
rank with fewer repeats one and leaves it out of the sums, so the sharded forwards of FSDP stay
in lockstep), and the sums are gathered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from impasto.config import Config
from impasto.data import Batch, derive_seed
from impasto.data.holdout import HeldOutSet, holdout_hash
from impasto.distributed import RunGroup
from impasto.models.backbone import Backbone
from impasto.sampling.generate import eval_mode
from impasto.train.ema import EMA
from impasto.train.methods import EvalLoss

NOISE_STREAM = 18_019  # separates the evaluation's noise seeds from other (seed, ...) ones


@dataclass(frozen=True)
class EvalJob:
    """One batch of one set: ``set_index`` into the evaluator's sets, ``batch`` its number."""

    set_index: int
    batch: int


def share(jobs: list[EvalJob], rank: int, world: int) -> list[tuple[EvalJob, bool]]:
    """Rank ``rank``'s jobs, ``(job, counted)``: every ``world``-th from the ``rank``-th, then
    repeats of a job (not counted) until every rank has the same number (at least one each)."""
    mine = [(job, True) for job in jobs[rank::world]]
    length = max(1, -(-len(jobs) // world))
    filler = (jobs[rank % len(jobs)], False)
    return mine + [filler] * (length - len(mine))


def metric_prefix(name: str | None, ema: bool) -> str:
    """``val`` (the split), ``val/NAME`` (a set), ``val/ema`` and ``val/ema/NAME`` (EMA)."""
    parts = ["val", "ema" if ema else None, name]
    return "/".join(part for part in parts if part)


class Evaluator:
    """Measures the validation loss of the current weights (and the EMA's) on every held-out
    set; every rank calls :meth:`evaluate` at the same steps."""

    def __init__(
        self,
        method: EvalLoss,
        backbone: Backbone,
        sets: list[HeldOutSet],
        num_strata: int,
        seed: int,
        group: RunGroup,
    ) -> None:
        self.method, self.backbone, self.sets, self.group = method, backbone, sets, group
        self.seed = seed
        self.times = method.eval_times(num_strata)
        jobs = [
            EvalJob(index, number)
            for index, held_out in enumerate(sets)
            for number in range(len(held_out.batches))
        ]
        self.jobs = share(jobs, group.data_rank, group.data_world) if jobs else []
        self.encoded: dict[EvalJob, Batch] = {}  # this rank's batches, latents encoded once

    def evaluate(self, ema: EMA | None = None) -> dict[str, float]:
        """``val/loss``, ``val/loss_t{s}`` (each stratum) and ``val/NAME/...`` for each set;
        with ``ema``, also ``val/ema/loss`` (and ``val/ema/NAME/loss``) with its weights.
        Collective: every rank calls it, every rank gets the numbers."""
        values = self.losses(ema=False)
        if ema is not None:
            with ema.swapped():
                values |= self.losses(ema=True)
        return values

    def losses(self, ema: bool) -> dict[str, float]:
        """One pass over this rank's batches with the weights in place; the sums gathered."""
        num_strata = len(self.times)
        sums = torch.zeros(len(self.sets), num_strata, dtype=torch.float64)
        counts = [0] * len(self.sets)
        with self.isolated():
            for job, counted in self.jobs:
                batch = self.batch(job)
                if batch.size == 0:  # every image of it unreadable
                    continue
                losses = self.method.eval_loss(batch, self.times, self.noise(job, batch))
                if counted:
                    sums[job.set_index] += losses.double().sum(dim=1).cpu()
                    counts[job.set_index] += batch.size
        gathered = self.group.data_gather((sums, counts))  # (a host read: not a training step)
        total_sums = sum(part[0] for part in gathered)
        total_counts = [sum(part[1][i] for part in gathered) for i in range(len(self.sets))]
        values = {}
        for index, held_out in enumerate(self.sets):
            if not total_counts[index]:
                continue
            prefix = metric_prefix(held_out.name, ema)
            per_stratum = (total_sums[index] / total_counts[index]).tolist()
            values[f"{prefix}/loss"] = sum(per_stratum) / num_strata
            if not ema:
                values |= {f"{prefix}/loss_t{s}": v for s, v in enumerate(per_stratum)}
        return values

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """No gradients, eval mode, the global generators forked (belt and braces: nothing
        here draws from them); FSDP's gathered weights dropped after (:func:`release_gathered`)."""
        device = self.backbone.device
        devices = [device] if device.type == "cuda" else []
        modules = list(self.backbone.modules().values())
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), eval_mode(*modules):
                yield
        finally:
            release_gathered(modules)

    def batch(self, job: EvalJob) -> Batch:
        """The job's batch with its latents' posterior encoded (once; kept on the CPU)."""
        if job not in self.encoded:
            batch = self.sets[job.set_index].batch(job.batch)
            if batch.size and batch.latent_mean is None and batch.pixel_values is not None:
                pixels = batch.pixel_values.to(self.backbone.device)
                mean, std = self.backbone.latent_posterior(pixels)
                batch = replace(
                    batch, pixel_values=None, latent_mean=mean.cpu(), latent_std=std.cpu()
                )
            self.encoded[job] = batch
        return self.encoded[job]

    def noise(self, job: EvalJob, batch: Batch) -> Tensor:
        """``[S, B, C, h, w]``: image ``i`` of its set draws ``[S, C, h, w]`` from a generator of
        ``(eval.seed, the set, i)``: the same noise at every evaluation, on any rank."""
        held_out = self.sets[job.set_index]
        set_key = holdout_hash(held_out.name or "", 0)
        height, width = batch.target_sizes[0].tolist()
        shape = (len(self.times), *self.backbone.latent_shape(height, width))
        rows = []
        for index in batch.indices.tolist():
            seed = derive_seed(self.seed, NOISE_STREAM, set_key, index)
            rows.append(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
        return torch.stack(rows, dim=1)


def release_gathered(modules: Iterable[nn.Module]) -> None:
    """Free the weights FSDP2 gathered (unsharded) for a forward, so the next forward gathers
    the sharded ones again. A part's root keeps its gathered weights after forward
    (``reshard_after_forward=False``) until a backward reshards them; after a forward without
    one (evaluation, sampling) they would hide weights swapped into the shards since (the
    EMA's, or the live ones swapped back). No-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def build_evaluator(
    method: object, backbone: Backbone, sets: list[HeldOutSet], config: Config, group: RunGroup
) -> Evaluator | None:
    """The run's :class:`Evaluator` (``eval.every_steps``), or None: evaluation is off, or the
    method has no validation loss (said once, on rank 0)."""
    evaluation = config.eval
    if not evaluation.every_steps:
        return None
    if not (hasattr(method, "eval_loss") and hasattr(method, "eval_times")):
        if group.is_main:
            print(
                f"impasto: objective.method {config.objective.method} has no validation "
                "loss; eval.every_steps does nothing"
            )
        return None
    return Evaluator(method, backbone, sets, evaluation.timesteps, evaluation.seed, group)
