"""A step's randomness does not depend on how many ranks share it (groundwork of issue #14).

The denoising method draws posterior noise, noise, times and the noise shaping (offset,
pyramid, input perturbation) for the step's global batch and keeps its own rows, so two ranks
with batch 2 draw exactly what one process with batch 4 draws; one process draws as it always
did (the golden trace is unchanged)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

from impasto.config.schema import ObjectiveConfig
from impasto.data import Batch
from impasto.models.presets import build_tiny
from impasto.models.sdxl import SDXLBackbone
from impasto.objectives.objective import Objective
from impasto.train.methods.denoise import Rows, denoising_loss

OBJECTIVES = {
    "eps": {},
    "v_ztsnr_min_snr": {
        "prediction_type": "v_prediction",
        "zero_terminal_snr": True,
        "loss_weighting": "min_snr",
    },
    "flow_shifted": {
        "prediction_type": "flow",
        "timestep_sampling": "logit_normal",
        "flow_shift": 3,
    },
    "noise_shaping": {
        "noise_offset": 0.1,
        "multires_noise_iterations": 2,
        "input_perturbation": 0.1,
        "timestep_sampling": "timestep_bias",
        "timestep_bias": {"strategy": "later", "multiplier": 2.0},
    },
}


def _batch(size: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    sizes = torch.tensor([[64, 64]] * size)
    return Batch(
        pixel_values=torch.rand(size, 3, 64, 64, generator=generator) * 2 - 1,
        captions=[f"a shape number {i}" for i in range(size)],
        original_sizes=sizes,
        crop_top_lefts=torch.zeros(size, 2, dtype=torch.long),
        target_sizes=sizes,
        indices=torch.arange(size),
    )


def _rows_of(batch: Batch, start: int, stop: int) -> Batch:
    take = slice(start, stop)
    return replace(
        batch,
        pixel_values=batch.pixel_values[take],
        captions=batch.captions[take],
        original_sizes=batch.original_sizes[take],
        crop_top_lefts=batch.crop_top_lefts[take],
        target_sizes=batch.target_sizes[take],
        indices=batch.indices[take],
    )


@pytest.fixture(scope="module")
def backbone() -> SDXLBackbone:
    return SDXLBackbone(build_tiny(0))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_two_ranks_draw_what_one_process_draws(backbone, name):
    objective = Objective.from_config(ObjectiveConfig(**OBJECTIVES[name]))
    batch = _batch(4)

    def loss(part: Batch, rows: Rows):
        generator = torch.Generator().manual_seed(11)  # every rank derives the step's seed
        with torch.no_grad():
            return denoising_loss(backbone, objective, part, generator, nullcontext, rows=rows)

    whole = loss(batch, Rows())
    halves = [loss(_rows_of(batch, 2 * r, 2 * r + 2), Rows(r, 2, 2)) for r in (0, 1)]
    assert torch.equal(torch.cat([half.timesteps for half in halves]), whole.timesteps)
    per_sample = torch.cat([half.per_sample_loss for half in halves])
    torch.testing.assert_close(per_sample, whole.per_sample_loss, rtol=1e-5, atol=1e-6)
    # Rank 1 alone, drawing only its own rows, would see other times: the slicing matters.
    alone = loss(_rows_of(batch, 2, 4), Rows())
    assert not torch.equal(alone.timesteps, whole.timesteps[2:])


def test_rows_span():
    assert Rows().span(3) == (slice(0, 3), 3)  # one process: exactly its rows
    assert Rows(1, 4, 2).span(2) == (slice(2, 4), 8)
    assert Rows(3, 4, 2).span(1) == (slice(6, 7), 8)  # an image was dropped on rank 3
