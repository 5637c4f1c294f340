"""The diffusion denoising objective as a training method (``objective.method: denoise``).

Encode, noise, predict, loss: the objective math lives in :mod:`impasto.objectives` (pure
functions picked by name), the model calls in the backbone; this module only wires them to a
:class:`~impasto.data.Batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from impasto.data import Batch
from impasto.data.seeding import derive_seed
from impasto.models.backbone import Backbone
from impasto.objectives.objective import Objective
from impasto.train.memo import EncodingMemo
from impasto.train.methods import (
    WHOLE_STEP,
    DataNeeds,
    MethodContext,
    Rows,
    StepOutput,
    register_method,
    time_bucket_metrics,
)

TIME_BUCKETS = 4
"""The training loss is also logged per quarter of the time range: ``loss_t0`` (least noise)
to ``loss_t3`` (most), over the samples of each logging interval."""


@dataclass(frozen=True)
class DenoiseOutput:
    loss: Tensor  # scalar, differentiable
    per_sample_loss: Tensor  # [B], detached
    timesteps: Tensor  # [B], the denoiser's time input (flow: t·T)


def denoising_loss(
    backbone: Backbone,
    objective: Objective,
    batch: Batch,
    generator: torch.Generator,
    autocast: Callable[[], AbstractContextManager],
    memo: EncodingMemo | None = None,
    train_text: bool = False,
    rows: Rows = WHOLE_STEP,
) -> DenoiseOutput:
    """The loss of one micro-batch. Randomness (posterior sample, noise, t) comes from
    ``generator``, which lives on the CPU so a run draws the same numbers on any device, and
    is drawn for the step's global batch (``rows``: this rank's place in it).
    ``memo`` (``cache: memory``) reuses earlier encodings of the same images and captions;
    ``train_text``: the prompts are encoded with gradients (a text encoder trains).
    """
    memo = memo or EncodingMemo(latents=False, text_embeddings=False)
    noised, condition = noised_batch(backbone, objective, batch, generator, autocast, memo,
                                     train_text, rows)  # fmt: skip
    with autocast():
        prediction = backbone.forward(noised.x_t, noised.model_times, condition)
    per_sample = objective.per_sample_loss(prediction, noised.target, noised.times, noised.mask)
    return _weighted(per_sample, batch, noised.model_times)


@dataclass
class Noised:
    """A batch of one image size, noised: model input, target, times, latent loss mask."""

    x_t: Tensor
    target: Tensor
    times: Tensor
    model_times: Tensor  # the denoiser's time input (flow: t·T)
    mask: Tensor | None


def noised_batch(
    backbone: Backbone,
    objective: Objective,
    batch: Batch,
    generator: torch.Generator,
    autocast: Callable[[], AbstractContextManager],
    memo: EncodingMemo,
    train_text: bool,
    rows: Rows,
) -> tuple[Noised, object]:
    """(the noised batch, its conditioning): the posterior sample, noise and times drawn for
    the step's global batch (``rows``: this batch's place in it), in that order."""
    device = backbone.device
    with torch.no_grad():
        mean, std = memo.posterior(backbone, batch)
        mine, total = rows.span(mean.shape[0])
        noise_for_posterior = torch.randn((total, *mean.shape[1:]), generator=generator)[mine]
        sample = mean + std * noise_for_posterior.to(device, std.dtype)
        latents = backbone.encode_latents(sample).float()
    text = backbone.text_from_cache(batch)
    if text is None:
        with torch.set_grad_enabled(train_text):
            text = memo.text(backbone, batch.captions, autocast)
    condition = backbone.condition(text, batch)
    noise = torch.randn((total, *latents.shape[1:]), generator=generator).to(device)
    height, width = batch.target_sizes[0].tolist()  # a CPU tensor: no device sync
    frames = latents.shape[2:-2]  # a clip's latent frames: its shift grows with its tokens
    times = objective.sample_times(total, generator, device, (*frames, height, width))
    noise, noise_for_input = objective.shape_noise(noise, generator)
    noise, noise_for_input, times = noise[mine], noise_for_input[mine], times[mine]
    x_t, target, model_times = objective.noised(latents, noise, noise_for_input, times)
    return Noised(x_t, target, times, model_times, latent_mask(batch, latents)), condition


def latent_mask(batch: Batch, latents: Tensor) -> Tensor | None:
    """The batch's pixel loss masks at the latents' resolution (the mean over each cell)."""
    if batch.loss_masks is None:
        return None
    masks = batch.loss_masks.to(latents.device).float()
    return F.interpolate(masks, size=latents.shape[-2:], mode="area")


def _weighted(per_sample: Tensor, batch: Batch, model_times: Tensor) -> DenoiseOutput:
    if batch.loss_weights is not None:
        per_sample = per_sample * batch.loss_weights.to(per_sample)
    return DenoiseOutput(per_sample.mean(), per_sample.detach(), model_times)


def packed_denoising_loss(
    backbone: Backbone,
    objective: Objective,
    batch: Batch,
    generator: torch.Generator,
    autocast: Callable[[], AbstractContextManager],
    capacity: int,
    memo: EncodingMemo | None = None,
    train_text: bool = False,
    rows: Rows = WHOLE_STEP,
) -> DenoiseOutput:
    """The loss of one pack (``data.pack_tokens``): the mean over its images of each image's
    loss, every image with its own posterior sample, noise and time (each shape group's times
    drawn at its own resolution), all predicted in one forward of the pack.

    A pack's images vary in number, so its draws come from a generator of its own, seeded from
    the step's generator and the pack's slot in the step (:class:`Rows`): the same on any
    number of ranks and accumulation steps."""
    memo = memo or EncodingMemo(latents=False, text_embeddings=False)
    step_seed = int(torch.randint(0, 2**62, (1,), generator=generator))  # a CPU draw: no sync
    generator = torch.Generator().manual_seed(derive_seed(step_seed, rows.slot))
    noised, conditions = [], []
    for group in batch.shape_groups():  # each group's draws whole: the pack is its own batch
        group_noised, condition = noised_batch(backbone, objective, group, generator, autocast,
                                               memo, train_text, WHOLE_STEP)  # fmt: skip
        noised.append(group_noised)
        conditions.append(condition)
    with autocast():
        predictions = backbone.forward_packed(
            [n.x_t for n in noised], [n.model_times for n in noised], conditions, capacity
        )
    per_sample = torch.cat([
        objective.per_sample_loss(prediction, n.target, n.times, mask=n.mask)
        for prediction, n in zip(predictions, noised, strict=True)
    ])  # fmt: skip
    return _weighted(per_sample, batch, torch.cat([n.model_times for n in noised]))


class DenoiseMethod:
    """Train the denoiser (and any trained text encoder) on the configured objective."""

    needs = DataNeeds.IMAGES_AND_CAPTIONS

    def __init__(self, context: MethodContext) -> None:
        self.backbone = context.backbone
        self.objective = Objective.from_config(context.config.objective)
        self.memo = EncodingMemo.from_config(context.config)
        self.autocast = context.autocast
        self.pack_tokens = context.config.data.pack_tokens  # batches are packs
        # Encode captions with gradients when a part other than the denoiser (a text encoder)
        # trains.
        parts, denoiser = context.backbone.parts(), context.backbone.denoiser()
        self.train_text = any(parts[name] is not denoiser for name in context.trained_parts)

    def step(self, batch: Batch, generator: torch.Generator, rows: Rows = WHOLE_STEP) -> StepOutput:
        if self.pack_tokens is not None:
            out = packed_denoising_loss(
                self.backbone, self.objective, batch, generator, self.autocast,
                self.pack_tokens, self.memo, train_text=self.train_text, rows=rows,
            )  # fmt: skip
        else:
            out = denoising_loss(
                self.backbone, self.objective, batch, generator, self.autocast, self.memo,
                train_text=self.train_text, rows=rows,
            )  # fmt: skip
        fraction = out.timesteps / self.objective.num_train_timesteps
        return StepOutput(
            out.loss, time_bucket_metrics(out.per_sample_loss, fraction, TIME_BUCKETS)
        )

    def eval_times(self, num_strata: int) -> Tensor:
        """The midpoint of each of ``num_strata`` equal strata of the process's times: VP
        timesteps ⌊(s + ½)·T/S⌋, flow t ≈ (s + ½)/S (unshifted: the same noise levels in
        every run, whatever its ``flow_shift``)."""
        grid = self.objective.process.grid_times()  # every time, in order
        picks = (torch.arange(num_strata, dtype=torch.float64) + 0.5) * len(grid) / num_strata
        times = grid[picks.long()]
        return times.float() if times.is_floating_point() else times

    def eval_loss(self, batch: Batch, times: Tensor, noise: Tensor) -> Tensor:
        """The configured loss (and weighting) of each image at each fixed time: the latents
        are the posterior means, x_t uses ``noise`` as it is (no offset, pyramid or input
        perturbation: the objective itself, not its augmentations)."""
        backbone, objective = self.backbone, self.objective
        device = backbone.device
        with torch.no_grad():
            mean, _ = EncodingMemo(latents=False, text_embeddings=False).posterior(backbone, batch)
            latents = backbone.encode_latents(mean).float()
            text = backbone.text_from_cache(batch)
            if text is None:
                with self.autocast():
                    text = backbone.encode_text(batch.captions)
            condition = backbone.condition(text, batch)
            losses = []
            for time, time_noise in zip(times, noise, strict=True):
                batch_times = time.expand(latents.shape[0]).to(device)
                time_noise = time_noise.to(device)
                noisy, target, model_times = objective.noised(
                    latents, time_noise, time_noise, batch_times
                )
                with self.autocast():
                    prediction = backbone.forward(noisy, model_times, condition)
                losses.append(objective.per_sample_loss(prediction, target, batch_times))
        return torch.stack(losses)


register_method("denoise")(DenoiseMethod)
