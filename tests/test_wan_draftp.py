"""DRaFT+ on the Wan 2.1 family (issue #33) on the tiny preset: it samples images (one-frame
clips) on WanPipeline's ladder (the backbone's ``sampling_ladder``) with classifier-free
guidance, its no-gradient prefix is ``impasto sample``'s Euler trajectory on that ladder, and
the transformer's adapters learn through the last K steps (docs/wan.md)."""

from __future__ import annotations

import pytest
import torch
from test_draftp import PROMPTS, _prompt_batch, _raw, _setup, brightness, prompt_file  # noqa: F401

from impasto.inference import model_sampling_options
from impasto.sampling import generate_latents
from impasto.sampling.flow import flow_timesteps
from impasto.sampling.generate import draw_noise, image_generators
from impasto.train.methods.draftp import truncated_sample

TEXT_LENGTH = 16


def _wan_setup(prompt_file, tmp_path, checkpoint_decoder: bool = False):  # noqa: F811
    raw = _raw(
        prompt_file, tmp_path / "run",
        objective={"prediction_type": "flow", "timestep_sampling": "logit_normal",
                   "flow_shift": 3.0},
        model={"family": "wan", "preset": "tiny", "wan": {"text_length": TEXT_LENGTH}},
    )  # fmt: skip
    raw["parts"] = {"transformer": "lora"}
    raw["data"]["resolution"] = 32
    raw["draftp"] |= {"num_steps": 4, "truncation_steps": 2, "guidance_scale": 3.0,
                      "checkpoint_decoder": checkpoint_decoder}  # fmt: skip
    return _setup(raw)


def test_draftp_samples_on_wans_ladder_as_impasto_sample(prompt_file, tmp_path):  # noqa: F811
    config, setup = _wan_setup(prompt_file, tmp_path)
    method, backbone = setup.method, setup.backbone
    backbone.denoiser().eval()
    timesteps, ts = backbone.sampling_ladder(4, 32, 32)
    assert torch.equal(method.plan.timesteps, timesteps) and torch.equal(method.plan.sigmas, ts)
    assert not torch.allclose(flow_timesteps(4, 3.0)[0].float(), timesteps, atol=1e-3)
    assert method.shape == (16, 4, 4)  # images: one-frame clips of the transformer

    prompts = PROMPTS[:2]
    expected: list[torch.Tensor] = []
    generate_latents(
        backbone, prompts, num_steps=4, guidance_scale=3.0, seed=11, height=32, width=32,
        sampler="euler", callback=lambda i, x, d: expected.append(x),
        **model_sampling_options(config),
    )  # fmt: skip
    tuned, base = method.denoisers(prompts)
    x = draw_noise(image_generators(2, 11), method.shape) * method.plan.noise_scale
    seen: list[torch.Tensor] = []
    end = truncated_sample(method.plan, tuned, base, x, 2, True, lambda i, s, d: seen.append(s))
    assert len(seen) == 2
    for mine, theirs in zip(seen, expected[:2], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert float(end.kl.detach()) == 0.0  # zero-initialised adapters: the tuned model is the base


def test_draftp_step_tunes_wans_adapters(prompt_file, tmp_path):  # noqa: F811
    # diffusers' Wan VAE has no decoder checkpointing: draftp.checkpoint_decoder (default true)
    # stops with one line naming the setting
    _, setup = _wan_setup(prompt_file, tmp_path / "checkpointed", checkpoint_decoder=True)
    with pytest.raises(ValueError, match=r"^draftp.checkpoint_decoder: .*; set it to false$"):
        setup.method.step(_prompt_batch(PROMPTS[:2]), torch.Generator().manual_seed(1))

    _, setup = _wan_setup(prompt_file, tmp_path)
    method, transformer = setup.method, setup.backbone.denoiser()
    with torch.no_grad():  # trained-looking adapters: lora_B starts at zero
        generator = torch.Generator().manual_seed(0)
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    out = method.step(_prompt_batch(PROMPTS[:2]), torch.Generator().manual_seed(1))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}
    assert grads and all("lora_" in n for n in grads)
    assert all(g is not None for g in grads.values())
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0
    # every block's adapters learn (the reward reaches through the whole transformer)
    assert {n.split(".")[1] for n, g in grads.items() if g.abs().sum() > 0} == {"0", "1"}
