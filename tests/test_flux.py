"""The FLUX.1 family (issue #33) on the tiny random preset: its token layout, its training step
against a reference computed with diffusers' classes directly (the way diffusers'
train_dreambooth_lora_flux.py computes it), its sampler against ``FluxPipeline``, loading a
diffusers folder, LoRA targets and config errors (docs/flux.md)."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from diffusers import FluxPipeline
from diffusers.training_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)
from tiny_inputs import tiny_batch

from impasto.config.schema import ObjectiveConfig
from impasto.models.flux import layout
from impasto.models.flux.backbone import FluxBackbone
from impasto.models.flux.components import build_tiny
from impasto.models.flux.files import load_flux_folder, save_flux_folder
from impasto.models.flux.options import FluxOptions
from impasto.models.flux.sampling import generate_flux, generate_flux_latents
from impasto.objectives.objective import Objective
from impasto.train.methods.denoise import denoising_loss

TEXT_LENGTH = 16  # T5 tokens: short, so each test runs in a second


@pytest.fixture(scope="module")
def flux() -> FluxBackbone:
    return FluxBackbone(build_tiny(0, TEXT_LENGTH), FluxOptions(text_length=TEXT_LENGTH))


def pipeline_of(backbone: FluxBackbone) -> FluxPipeline:
    parts = backbone.components
    return FluxPipeline(
        scheduler=parts.scheduler(), vae=parts.vae, text_encoder=parts.text_encoder,
        tokenizer=parts.tokenizer, text_encoder_2=parts.text_encoder_2,
        tokenizer_2=parts.tokenizer_2, transformer=parts.transformer,
    )  # fmt: skip


def test_packing_and_ids_are_the_pipelines():
    latents = torch.randn(2, 16, 6, 8)
    tokens = layout.pack_latents(latents)
    torch.testing.assert_close(
        tokens, FluxPipeline._pack_latents(latents, 2, 16, 6, 8), rtol=0, atol=0
    )
    # the pipeline unpacks from pixel sizes: 8× the latent's
    unpacked = FluxPipeline._unpack_latents(tokens, 48, 64, 8)
    torch.testing.assert_close(layout.unpack_latents(tokens, 6, 8), unpacked, rtol=0, atol=0)
    torch.testing.assert_close(layout.unpack_latents(tokens, 6, 8), latents, rtol=0, atol=0)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    torch.testing.assert_close(layout.image_ids(6, 8, "cpu", torch.float32), ids, rtol=0, atol=0)


def reference_step_loss(backbone: FluxBackbone, batch, seed: int, guidance: float):
    """One step's loss as diffusers' train_dreambooth_lora_flux.py computes it, with diffusers'
    classes and functions only, its random draws from ``seed`` in impasto's order (posterior
    sample, noise, logit-normal t); the script's ``u`` is used as the time itself (it rounds it
    to its scheduler's 1000 timesteps, impasto does not)."""
    parts = backbone.components
    pipe = pipeline_of(backbone)
    generator = torch.Generator().manual_seed(seed)
    vae = parts.vae
    model_input = vae.encode(batch.pixel_values).latent_dist.sample(generator=generator)
    model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn(model_input.shape, generator=generator)
    bsz, channels, height, width = model_input.shape
    sigmas = compute_density_for_timestep_sampling(
        "logit_normal", bsz, logit_mean=0.0, logit_std=1.0, generator=generator
    )
    timesteps = sigmas * 1000
    sigmas = sigmas.view(-1, 1, 1, 1)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    prompt_embeds, pooled_prompt_embeds, text_ids = pipe.encode_prompt(
        batch.captions, prompt_2=None, max_sequence_length=TEXT_LENGTH
    )
    packed = FluxPipeline._pack_latents(noisy_model_input, bsz, channels, height, width)
    img_ids = FluxPipeline._prepare_latent_image_ids(
        bsz, height // 2, width // 2, "cpu", torch.float32
    )
    model_pred = parts.transformer(
        hidden_states=packed,
        timestep=timesteps / 1000,
        guidance=torch.tensor([guidance]).expand(bsz),
        pooled_projections=pooled_prompt_embeds,
        encoder_hidden_states=prompt_embeds,
        txt_ids=text_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    model_pred = FluxPipeline._unpack_latents(
        model_pred, height * vae_scale_factor, width * vae_scale_factor, vae_scale_factor
    )
    weighting = compute_loss_weighting_for_sd3("none", sigmas)
    target = noise - model_input
    loss = torch.mean((weighting * (model_pred - target) ** 2).reshape(bsz, -1), 1)
    return loss.mean()


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


def test_training_step_equals_diffusers_reference(flux):
    backbone = FluxBackbone(
        copy.deepcopy(flux.components), FluxOptions(text_length=TEXT_LENGTH, guidance=2.5)
    )
    transformer = backbone.components.transformer
    batch = tiny_batch()
    objective = Objective.from_config(
        ObjectiveConfig(prediction_type="flow", timestep_sampling="logit_normal")
    )
    out = denoising_loss(backbone, objective, batch, torch.Generator().manual_seed(3), nullcontext)
    out.loss.backward()
    ours = gradients(transformer)
    reference = reference_step_loss(backbone, batch, seed=3, guidance=2.5)
    reference.backward()
    theirs = gradients(transformer)
    torch.testing.assert_close(out.loss, reference)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(transformer.parameters()))
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], msg=name)
    # the guidance value reaches the transformer: another value, another loss
    other = FluxBackbone(backbone.components, FluxOptions(text_length=TEXT_LENGTH, guidance=1.0))
    with torch.no_grad():
        moved = denoising_loss(
            other, objective, batch, torch.Generator().manual_seed(3), nullcontext
        )
    assert not torch.allclose(moved.loss, out.loss.detach())


def test_sampling_matches_flux_pipeline(flux):
    prompts = ["a red cube", "a blue ball"]
    ours = generate_flux_latents(flux, prompts, num_steps=4, seed=7, height=64, width=64)
    pipe = pipeline_of(flux)
    theirs = pipe(
        prompts, height=64, width=64, num_inference_steps=4, guidance_scale=3.5,
        max_sequence_length=TEXT_LENGTH, output_type="latent",
        generator=[torch.Generator().manual_seed(7 + i) for i in range(2)],
    ).images  # fmt: skip
    torch.testing.assert_close(layout.pack_latents(ours), theirs, rtol=1e-4, atol=1e-5)
    assert ours.std() > 0.1  # not a collapse to a constant both sides share


def test_true_cfg_and_decoded_images_match_flux_pipeline(flux):
    ours = generate_flux(
        flux, ["a red cube"], negative_prompt="blurry", true_cfg_scale=2.0, num_steps=3, seed=1
    )
    theirs = pipeline_of(flux)(
        "a red cube", negative_prompt="blurry", true_cfg_scale=2.0, height=64, width=64,
        num_inference_steps=3, max_sequence_length=TEXT_LENGTH, output_type="pt",
        generator=[torch.Generator().manual_seed(1)],
    ).images  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_diffusers_folder_loads_the_same_networks(flux, tmp_path):
    save_flux_folder(flux.components, tmp_path / "flux")
    loaded = load_flux_folder(tmp_path / "flux", TEXT_LENGTH)
    for name, module in flux.components.networks().items():
        theirs = getattr(loaded, name).state_dict()
        assert module.state_dict().keys() == theirs.keys(), name
        for key, tensor in module.state_dict().items():
            assert torch.equal(tensor, theirs[key]), f"{name}.{key}"
    assert (
        loaded.tokenizer_2("a red cube").input_ids
        == flux.components.tokenizer_2("a red cube").input_ids
    )
    assert loaded.scheduler_config["use_dynamic_shifting"] is True
    embeds = FluxBackbone(loaded, flux.options).encode_text(["a red cube"])
    torch.testing.assert_close(embeds.prompt_embeds, flux.encode_text(["a red cube"]).prompt_embeds)


def test_gradient_checkpointing_gives_the_same_gradients(flux):
    from impasto.train.memory import set_gradient_checkpointing

    backbone = FluxBackbone(copy.deepcopy(flux.components), flux.options)
    transformer = backbone.components.transformer.train()
    objective = Objective.from_config(ObjectiveConfig(prediction_type="flow"))

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(4)
        out = denoising_loss(backbone, objective, tiny_batch(), generator, nullcontext)
        out.loss.backward()
        return out.loss.detach(), gradients(transformer)

    plain_loss, plain = step()
    assert set_gradient_checkpointing(transformer, backbone.blocks(), "all") == [
        "transformer_blocks.0", "single_transformer_blocks.0",
    ]  # fmt: skip
    assert transformer.gradient_checkpointing
    loss, checkpointed = step()
    torch.testing.assert_close(loss, plain_loss)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


SCHNELL_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}


def test_a_schnell_like_model_ignores_guidance_and_samples_as_flux_pipeline(flux):
    """FLUX.1-schnell's kind: no guidance embedding, a fixed-shift scheduler."""
    from dataclasses import replace

    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        config = {**flux.components.transformer.config, "guidance_embeds": False}
        transformer = FluxTransformer2DModel.from_config(config).eval()
    parts = replace(flux.components, transformer=transformer, scheduler_config=SCHNELL_SCHEDULER)
    objective = Objective.from_config(ObjectiveConfig(prediction_type="flow"))
    losses = []
    for guidance in (1.0, 3.5):  # unused: the same loss
        backbone = FluxBackbone(parts, FluxOptions(text_length=TEXT_LENGTH, guidance=guidance))
        with torch.no_grad():
            generator = torch.Generator().manual_seed(2)
            losses.append(denoising_loss(backbone, objective, tiny_batch(), generator, nullcontext))
    assert torch.equal(losses[0].loss, losses[1].loss) and losses[0].loss.isfinite()
    ours = generate_flux_latents(backbone, ["a red cube"], num_steps=4, seed=3)
    theirs = pipeline_of(backbone)(
        "a red cube", height=64, width=64, num_inference_steps=4, output_type="latent",
        max_sequence_length=TEXT_LENGTH, generator=[torch.Generator().manual_seed(3)],
    ).images  # fmt: skip
    torch.testing.assert_close(layout.pack_latents(ours), theirs, rtol=1e-4, atol=1e-5)


def test_the_dev_and_schnell_presets_have_the_releases_sizes():
    """FLUX.1's published sizes: a 12 B transformer (11.9 B), T5-XXL's encoder (4.76 B),
    CLIP-L's text model (123 M); built on the meta device (nothing is allocated)."""
    from impasto.models.flux.components import build_dev, build_schnell

    with torch.device("meta"):
        dev, schnell = build_dev(0, 512), build_schnell(0, 256)

    def count(module: torch.nn.Module) -> int:
        return sum(parameter.numel() for parameter in module.parameters())

    assert round(count(dev.transformer) / 1e9, 2) == 11.90
    assert count(dev.text_encoder_2) == 4_762_310_656
    assert count(dev.text_encoder) == 123_060_480
    assert dev.transformer.config.guidance_embeds and not schnell.transformer.config.guidance_embeds
    guidance = count(dev.transformer) - count(schnell.transformer)
    assert guidance == count(dev.transformer.time_text_embed.guidance_embedder)
    assert schnell.scheduler_config["use_dynamic_shifting"] is False
