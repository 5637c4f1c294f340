"""The SD3.5 family (issue #33) on the tiny random preset: its text encoding against
``StableDiffusion3Pipeline.encode_prompt``, its training step against a reference computed with
diffusers' classes directly (the way diffusers' train_dreambooth_lora_sd3.py computes it), its
sampler against ``StableDiffusion3Pipeline`` (classifier-free and skip-layer guidance), loading
a diffusers folder, and the presets' sizes (docs/sd3.md)."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)
from tiny_inputs import tiny_batch

from impasto.config.schema import ObjectiveConfig
from impasto.models.sd3.backbone import Sd3Backbone
from impasto.models.sd3.components import build_tiny
from impasto.models.sd3.files import load_sd3_folder, save_sd3_folder, sd3_pipeline
from impasto.models.sd3.options import Sd3Options
from impasto.models.sd3.sampling import generate_sd3, generate_sd3_latents
from impasto.objectives.objective import Objective
from impasto.sampling.generate import generate_latents
from impasto.train.methods.denoise import denoising_loss

TEXT_LENGTH = 16  # T5 tokens: short, so each test runs in a second
SHIFT = 3.0  # SD3.5's scheduler shift


@pytest.fixture(scope="module")
def sd3() -> Sd3Backbone:
    return Sd3Backbone(build_tiny(0, TEXT_LENGTH), Sd3Options(text_length=TEXT_LENGTH))


def sd3_objective() -> Objective:
    return Objective.from_config(
        ObjectiveConfig(prediction_type="flow", timestep_sampling="logit_normal", flow_shift=SHIFT)
    )


def test_text_encoding_is_the_pipelines(sd3):
    prompts = ["a red cube", "a blue ball on a much longer caption than the other one"]
    ours = sd3.encode_text(prompts)
    embeds, _, pooled, _ = sd3_pipeline(sd3.components).encode_prompt(
        prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH
    )
    torch.testing.assert_close(ours.prompt_embeds, embeds, rtol=0, atol=0)
    torch.testing.assert_close(ours.pooled_prompt_embeds, pooled, rtol=0, atol=0)
    # 77 CLIP tokens then the T5 tokens; CLIP-L 8 + CLIP-G 16 features zero-padded to T5's 32
    assert ours.prompt_embeds.shape == (2, 77 + TEXT_LENGTH, 32)
    assert ours.pooled_prompt_embeds.shape == (2, 8 + 16)
    assert torch.all(ours.prompt_embeds[:, :77, 24:] == 0)
    assert ours.prompt_embeds[:, 77:, 24:].abs().sum() > 0


def reference_step_loss(backbone: Sd3Backbone, batch, seed: int):
    """One step's loss as diffusers' train_dreambooth_lora_sd3.py computes it with
    ``--weighting_scheme logit_normal --precondition_outputs 0``, with diffusers' classes and
    functions only, its random draws from ``seed`` in impasto's order (posterior sample, noise,
    logit-normal u). The script indexes its scheduler's 1000 shifted times with u; here u
    itself is shifted, by the scheduler's own formula (impasto keeps t continuous)."""
    parts = backbone.components
    pipe = sd3_pipeline(parts)
    generator = torch.Generator().manual_seed(seed)
    vae = parts.vae
    model_input = vae.encode(batch.pixel_values).latent_dist.sample(generator=generator)
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn(model_input.shape, generator=generator)
    bsz = model_input.shape[0]
    u = compute_density_for_timestep_sampling(
        "logit_normal", bsz, logit_mean=0.0, logit_std=1.0, generator=generator
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT)
    scheduler.set_timesteps(sigmas=u.numpy())  # shifts them: 3u/(1 + 2u)
    sigmas = scheduler.sigmas[:-1].float()
    timesteps = sigmas * scheduler.config.num_train_timesteps
    sigmas = sigmas.view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    prompt_embeds, _, pooled_prompt_embeds, _ = pipe.encode_prompt(
        batch.captions, None, None, do_classifier_free_guidance=False,
        max_sequence_length=TEXT_LENGTH,
    )  # fmt: skip
    model_pred = parts.transformer(
        hidden_states=noisy_model_input,
        timestep=timesteps,
        encoder_hidden_states=prompt_embeds,
        pooled_projections=pooled_prompt_embeds,
        return_dict=False,
    )[0]
    weighting = compute_loss_weighting_for_sd3("logit_normal", sigmas)
    target = noise - model_input
    loss = torch.mean((weighting * (model_pred - target) ** 2).reshape(bsz, -1), 1)
    return loss.mean()


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


def test_training_step_equals_diffusers_reference(sd3):
    backbone = Sd3Backbone(copy.deepcopy(sd3.components), sd3.options)
    transformer = backbone.components.transformer
    batch = tiny_batch()
    objective = sd3_objective()
    out = denoising_loss(backbone, objective, batch, torch.Generator().manual_seed(3), nullcontext)
    out.loss.backward()
    ours = gradients(transformer)
    reference = reference_step_loss(backbone, batch, seed=3)
    reference.backward()
    theirs = gradients(transformer)
    torch.testing.assert_close(out.loss, reference)
    # every weight gets a gradient: the dual attention (attn2) and the q/k norms included
    assert ours.keys() == theirs.keys() and len(ours) == len(list(transformer.parameters()))
    assert any(".attn2." in name for name in ours) and any("norm_q" in name for name in ours)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], msg=name)
    # the shift reaches the times: another shift, another loss
    other = Objective.from_config(
        ObjectiveConfig(prediction_type="flow", timestep_sampling="logit_normal")
    )
    with torch.no_grad():
        moved = denoising_loss(
            backbone, other, batch, torch.Generator().manual_seed(3), nullcontext
        )
    assert not torch.allclose(moved.loss, out.loss.detach())


def test_sampling_matches_the_pipeline_with_guidance(sd3):
    prompts = ["a red cube", "a blue ball"]
    ours = generate_sd3_latents(
        sd3, prompts, num_steps=4, guidance_scale=4.5, negative_prompt="blurry", seed=7
    )
    theirs = sd3_pipeline(sd3.components)(
        prompts, negative_prompt="blurry", height=64, width=64, num_inference_steps=4,
        guidance_scale=4.5, max_sequence_length=TEXT_LENGTH, output_type="latent",
        generator=[torch.Generator().manual_seed(7 + i) for i in range(2)],
    ).images  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert ours.std() > 0.1  # not a collapse to a constant both sides share
    # impasto's generic flow sampler (impasto sample, validation grids) at the objective's
    # shift 3 walks the same ladder: the pipeline's output too
    generic = generate_latents(
        sd3, prompts, negative_prompt="blurry", num_steps=4, guidance_scale=4.5, seed=7,
        prediction_type="flow", flow_shift=SHIFT, sampler="euler",
    )  # fmt: skip
    torch.testing.assert_close(generic, theirs, rtol=1e-4, atol=1e-5)
    unguided = generate_sd3_latents(sd3, prompts, num_steps=4, guidance_scale=1.0, seed=7)
    assert (unguided - ours).abs().max() > 1e-3


def test_skip_layer_guidance_and_decoded_images_match_the_pipeline(sd3):
    call = {"num_steps": 5, "guidance_scale": 3.0, "seed": 1, "skip_start": 0.0}
    ours = generate_sd3(sd3, ["a red cube"], skip_layers=[1], skip_stop=0.6, **call)
    theirs = sd3_pipeline(sd3.components)(
        "a red cube", height=64, width=64, num_inference_steps=5, guidance_scale=3.0,
        skip_guidance_layers=[1], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=0.6,
        max_sequence_length=TEXT_LENGTH, output_type="pt",
        generator=[torch.Generator().manual_seed(1)],
    ).images  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    plain = generate_sd3(sd3, ["a red cube"], **call)
    assert (plain - ours).abs().max() > 1e-4  # the skipped layer changed the image


def test_diffusers_folder_loads_the_same_networks(sd3, tmp_path):
    save_sd3_folder(sd3.components, tmp_path / "sd3")
    loaded = load_sd3_folder(tmp_path / "sd3", TEXT_LENGTH)
    for name, module in sd3.components.networks().items():
        theirs = getattr(loaded, name).state_dict()
        assert module.state_dict().keys() == theirs.keys(), name
        for key, tensor in module.state_dict().items():
            assert torch.equal(tensor, theirs[key]), f"{name}.{key}"
    assert loaded.scheduler_config["shift"] == SHIFT
    assert loaded.tokenizer_2.pad_token == "!" and loaded.tokenizer.pad_token == "<|endoftext|>"
    embeds = Sd3Backbone(loaded, sd3.options).encode_text(["a red cube"])
    torch.testing.assert_close(embeds.prompt_embeds, sd3.encode_text(["a red cube"]).prompt_embeds)


def test_gradient_checkpointing_gives_the_same_gradients(sd3):
    from impasto.train.memory import set_gradient_checkpointing

    backbone = Sd3Backbone(copy.deepcopy(sd3.components), sd3.options)
    transformer = backbone.components.transformer.train()
    objective = sd3_objective()

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(4)
        out = denoising_loss(backbone, objective, tiny_batch(), generator, nullcontext)
        out.loss.backward()
        return out.loss.detach(), gradients(transformer)

    plain_loss, plain = step()
    assert set_gradient_checkpointing(transformer, backbone.blocks(), "all") == [
        "transformer_blocks.0", "transformer_blocks.1",
    ]  # fmt: skip
    assert transformer.gradient_checkpointing
    loss, checkpointed = step()
    torch.testing.assert_close(loss, plain_loss)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_the_medium_and_large_presets_have_the_releases_sizes():
    """SD3.5's published sizes: Large's 8.1 B transformer, Medium's 2.5 B (each counted as its
    file holds it: parameters and the position table, a persistent buffer of 384² × 1536 in
    Medium); CLIP-L 124 M and CLIP-G 695 M with projections, T5-XXL's encoder 4.76 B. Built on
    the meta device (nothing is allocated)."""
    from impasto.models.sd3.components import build_large, build_medium

    with torch.device("meta"):
        medium, large = build_medium(0, 256), build_large(0, 256)

    def count(module: torch.nn.Module) -> int:
        return sum(tensor.numel() for tensor in module.state_dict().values())

    assert round(count(large.transformer) / 1e9, 1) == 8.1
    assert round(count(medium.transformer) / 1e9, 1) == 2.5
    assert medium.transformer.pos_embed.pos_embed.shape == (1, 384 * 384, 1536)
    blocks = medium.transformer.transformer_blocks
    assert [i for i, block in enumerate(blocks) if block.attn2] == list(range(13))
    assert not any(block.attn2 for block in large.transformer.transformer_blocks)
    assert count(large.text_encoder) == 123_650_304
    assert round(count(large.text_encoder_2) / 1e6) == 695
    assert sum(p.numel() for p in large.text_encoder_3.parameters()) == 4_762_310_656
    assert large.vae.config.scaling_factor == 1.5305 and large.vae.config.shift_factor == 0.0609


def test_image_sizes_fit_the_patches_and_the_position_table(sd3):
    assert sd3.latent_shape(64, 96) == (16, 8, 12)
    assert sd3.sequence_length(64, 96) == 4 * 6  # 2×2 patches of the 8×12 latent
    with pytest.raises(ValueError, match=r"multiples of 16 \(the VAE's downsampling 8 × SD3's"):
        sd3.latent_shape(72, 64)
    # the tiny transformer's position table: 16 patches a side, 256 pixels
    assert sd3.latent_shape(256, 256) == (16, 32, 32)
    with pytest.raises(ValueError, match=r"at most 256 \(the transformer's position table of 16"):
        sd3.latent_shape(272, 64)
    with pytest.raises(ValueError, match="data.video: the sd3 family trains on images"):
        sd3.latent_shape(64, 64, frames=5)
