"""SD3's preconditioned loss form (``objective.precondition_outputs``, issue #33) against
diffusers' train_dreambooth_lora_sd3.py: ``model_pred * (-sigmas) + noisy_model_input``
regressed on the clean latents, weighted by ``compute_loss_weighting_for_sd3``."""

from __future__ import annotations

import pytest
import torch
from diffusers.training_utils import compute_loss_weighting_for_sd3

from impasto.config.objective import ObjectiveConfig
from impasto.objectives.objective import Objective


def script_loss(model_pred, latents, noise, sigmas, scheme: str) -> torch.Tensor:
    """train_dreambooth_lora_sd3.py's loss per sample, --precondition_outputs 1."""
    sigmas = sigmas.view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * latents + sigmas * noise
    model_pred = model_pred * (-sigmas) + noisy_model_input
    target = latents
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=scheme, sigmas=sigmas)
    return torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2)
                      .reshape(target.shape[0], -1), 1)  # fmt: skip


@pytest.mark.parametrize(("weighting", "scheme"), [
    ("none", "logit_normal"), ("sigma_sqrt", "sigma_sqrt"), ("cosmap", "cosmap"),
])  # fmt: skip
def test_preconditioned_loss_equals_the_sd3_script(weighting, scheme):
    generator = torch.Generator().manual_seed(0)
    latents, noise, pred = (torch.randn(3, 16, 4, 4, generator=generator) for _ in range(3))
    config = ObjectiveConfig(
        prediction_type="flow", precondition_outputs=True, loss_weighting=weighting
    )
    objective = Objective.from_config(config)
    times = torch.tensor([0.2, 0.5, 0.9])
    x_t, target, _ = objective.noised(latents, noise, noise, times)
    torch.testing.assert_close(x_t, (1 - times.view(-1, 1, 1, 1)) * latents
                               + times.view(-1, 1, 1, 1) * noise)  # fmt: skip
    ours = objective.per_sample_loss(pred, target, times)
    torch.testing.assert_close(ours, script_loss(pred, latents, noise, times, scheme))
    # the velocity form differs by σ² per sample (and is what precondition_outputs: false gives)
    plain = Objective.from_config(config.model_copy(update={"precondition_outputs": False}))
    velocity = plain.per_sample_loss(pred, target, times)
    torch.testing.assert_close(ours, velocity * times**2)
    assert not torch.allclose(ours, velocity)


def test_precondition_outputs_is_a_flow_option():
    with pytest.raises(ValueError, match="precondition_outputs applies to flow only"):
        ObjectiveConfig(prediction_type="epsilon", precondition_outputs=True)
