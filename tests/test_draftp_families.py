"""DRaFT+ on the released-DiT families (issue #33): it samples on the family's own ladder and
guidance (``OwnSampling``: FLUX's size-dependent shift and embedded guidance, SD3.5's
scheduler shift with classifier-free guidance), so its no-gradient prefix is ``impasto
sample``'s trajectory (which tests/test_flux_cli.py and tests/test_sd3_cli.py hold equal to
FluxPipeline and StableDiffusion3Pipeline), and the adapters learn through the last K steps."""

from __future__ import annotations

import pytest
import torch
from test_draftp import PROMPTS, _prompt_batch, _raw, _setup, brightness, prompt_file  # noqa: F401

from impasto.inference import model_sampling_options
from impasto.sampling import generate_latents
from impasto.sampling.flow import flow_timesteps
from impasto.sampling.generate import draw_noise, image_generators
from impasto.train.methods.draftp import truncated_sample

FAMILIES = {
    "flux": {"parts": {"transformer": "lora"}, "objective": {}},
    "sd3": {"parts": {"transformer": "lora"}, "objective": {}},  # the run's flow_shift: 1
}


def _family_setup(family: str, prompt_file, tmp_path):  # noqa: F811
    objective = {"prediction_type": "flow", "timestep_sampling": "logit_normal"}
    raw = _raw(
        prompt_file, tmp_path / "run", objective=objective | FAMILIES[family]["objective"],
        model={"family": family, "preset": "tiny", family: {"text_length": 16}},
    )  # fmt: skip
    raw["parts"] = FAMILIES[family]["parts"]
    raw["draftp"] |= {"num_steps": 4, "truncation_steps": 2, "guidance_scale": 3.0}
    if family != "sd3":
        return _setup(raw)
    with pytest.warns(UserWarning, match=r"SD3\.5 trains and samples at shift 3\.0") as record:
        built = _setup(raw)
    assert "objective.flow_shift: 3.0" in str(record[0].message)
    return built


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draftp_samples_on_the_familys_ladder(family, prompt_file, tmp_path):  # noqa: F811
    config, setup = _family_setup(family, prompt_file, tmp_path)
    method, backbone = setup.method, setup.backbone
    backbone.denoiser().eval()
    timesteps, ts = backbone.sampling_ladder(4, 64, 64)
    assert torch.equal(method.plan.timesteps, timesteps) and torch.equal(method.plan.sigmas, ts)
    # the generic ladder at the run's objective.flow_shift is another one
    generic = flow_timesteps(4, config.objective.flow_shift)[0]
    assert not torch.allclose(generic.float(), timesteps, atol=1e-3)

    prompts = PROMPTS[:2]
    expected: list[torch.Tensor] = []
    generate_latents(
        backbone, prompts, num_steps=4, guidance_scale=3.0, seed=11, height=64, width=64,
        callback=lambda i, x, d: expected.append(x), **model_sampling_options(config),
    )  # fmt: skip
    tuned, base = method.denoisers(prompts)
    x = draw_noise(image_generators(2, 11), method.shape) * method.plan.noise_scale
    seen: list[torch.Tensor] = []
    end = truncated_sample(method.plan, tuned, base, x, 2, True, lambda i, s, d: seen.append(s))
    assert len(seen) == 2
    for mine, theirs in zip(seen, expected[:2], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert float(end.kl) == 0.0  # zero-initialised adapters: the tuned model is the base


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draftp_tunes_the_familys_adapters(family, prompt_file, tmp_path):  # noqa: F811
    _, setup = _family_setup(family, prompt_file, tmp_path)
    method, transformer = setup.method, setup.backbone.denoiser()
    with torch.no_grad():  # trained-looking adapters: lora_B starts at zero
        generator = torch.Generator().manual_seed(0)
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    out = method.step(_prompt_batch(PROMPTS[:2]), torch.Generator().manual_seed(1))
    out.loss.backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0
    assert float(out.metrics["kl"]) > 0  # the adapters moved the step direction
