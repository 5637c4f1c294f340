"""The Wan 2.1 family (issue #33) on the tiny random preset: its training step on clips against
a reference computed with diffusers' classes directly (the way musubi-tuner's and
diffusion-pipe's Wan training computes it: logit-normal t shifted by 3, target ε − x0), its
sampler against ``WanPipeline``, a diffusers folder round trip, the full-size presets' sizes,
and config errors (docs/wan.md)."""

from __future__ import annotations

import copy
import re
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from diffusers.training_utils import compute_density_for_timestep_sampling

from impasto.config.schema import ObjectiveConfig
from impasto.data import Batch
from impasto.models.wan.backbone import WanBackbone
from impasto.models.wan.components import build_tiny
from impasto.models.wan.files import load_wan_folder, save_wan_folder, wan_pipeline
from impasto.models.wan.options import WanOptions
from impasto.models.wan.sampling import generate_wan, generate_wan_latents, wan_ladder
from impasto.objectives.objective import Objective
from impasto.sampling.generate import generate_latents
from impasto.sampling.process import SamplingRequest, family_plan, sampling_plan
from impasto.train.methods.denoise import denoising_loss

TEXT_LENGTH = 16  # umT5 tokens: short, so each test runs in a second
SHIFT = 3.0  # Wan 2.1's flow shift (480p), musubi-tuner's --discrete_flow_shift for T2V


@pytest.fixture(scope="module")
def wan() -> WanBackbone:
    return WanBackbone(build_tiny(0, TEXT_LENGTH), WanOptions(text_length=TEXT_LENGTH))


def clip_batch() -> Batch:
    """Two random clips of 5 frames of 32×32 (2 latent frames of 4×4), with captions."""
    generator = torch.Generator().manual_seed(0)
    return Batch(
        pixel_values=torch.rand(2, 3, 5, 32, 32, generator=generator) * 2 - 1,
        captions=["a red circle", "a blue square moving"],
        original_sizes=torch.tensor([[32, 32]] * 2),
        crop_top_lefts=torch.zeros(2, 2, dtype=torch.long),
        target_sizes=torch.tensor([[32, 32]] * 2),
        indices=torch.arange(2),
    )


def reference_step_loss(backbone: WanBackbone, batch: Batch, seed: int) -> torch.Tensor:
    """One step's loss with diffusers' classes and functions only, its random draws from
    ``seed`` in impasto's order (posterior sample, noise, t): WanPipeline's latent map and
    prompt encoding, musubi-tuner's ``shift`` time sampling (sigmoid of a normal draw, then
    t' = s·t / (1 + (s − 1)·t)), the transformer called as WanPipeline calls it."""
    parts = backbone.components
    pipe = wan_pipeline(parts)
    generator = torch.Generator().manual_seed(seed)
    vae = parts.vae
    sample = vae.encode(batch.pixel_values).latent_dist.sample(generator=generator)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents = (sample - mean) * inv_std
    noise = torch.randn(latents.shape, generator=generator)
    bsz = latents.shape[0]
    t = compute_density_for_timestep_sampling(
        "logit_normal", bsz, logit_mean=0.0, logit_std=1.0, generator=generator
    )
    t = SHIFT * t / (1 + (SHIFT - 1) * t)
    sigmas = t.view(-1, 1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    prompt_embeds, _ = pipe.encode_prompt(
        batch.captions, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH
    )
    prediction = parts.transformer(
        hidden_states=noisy, timestep=t * 1000, encoder_hidden_states=prompt_embeds,
        return_dict=False,
    )[0]  # fmt: skip
    target = noise - latents
    return torch.mean(((prediction - target) ** 2).reshape(bsz, -1), 1).mean()


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return grads


def test_training_step_on_clips_equals_diffusers_reference(wan):
    backbone = WanBackbone(copy.deepcopy(wan.components), wan.options)
    transformer = backbone.components.transformer
    batch = clip_batch()
    objective = Objective.from_config(
        ObjectiveConfig(prediction_type="flow", timestep_sampling="logit_normal", flow_shift=SHIFT)
    )
    out = denoising_loss(backbone, objective, batch, torch.Generator().manual_seed(3), nullcontext)
    out.loss.backward()
    ours = gradients(transformer)
    reference = reference_step_loss(backbone, batch, seed=3)
    reference.backward()
    theirs = gradients(transformer)
    torch.testing.assert_close(out.loss, reference)
    assert ours.keys() == theirs.keys() and len(ours) == len(list(transformer.parameters()))
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], msg=name)


def test_an_image_is_a_one_frame_clip(wan):
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    condition = wan.sampling_condition(["a", "b"], 32, 32)
    with torch.no_grad():
        image = wan.forward(latents, torch.tensor([500.0]), condition)
        clip = wan.forward(latents[:, :, None], torch.tensor([500.0]), condition)
    assert image.shape == latents.shape
    torch.testing.assert_close(image, clip[:, :, 0], rtol=0, atol=0)
    assert wan.latent_shape(32, 48) == (16, 4, 6)
    assert wan.latent_shape(32, 48, frames=9) == (16, 3, 4, 6)
    assert wan.sequence_length(32, 48, frames=9) == 18  # 3 latent frames of 2x3 patches
    with pytest.raises(ValueError, match=r"needs 4n \+ 1 frames .* e\.g\. 5 or 9"):
        wan.latent_shape(32, 32, frames=8)
    with pytest.raises(ValueError, match=r"multiples of 16 .* got 40x32"):
        wan.latent_shape(40, 32)


def test_text_is_the_pipelines_with_zeros_past_each_prompt(wan):
    pipe = wan_pipeline(wan.components)
    prompts = ["a red circle", "  a <b>  blue &amp; square "]
    theirs, _ = pipe.encode_prompt(
        prompts, do_classifier_free_guidance=False, max_sequence_length=TEXT_LENGTH
    )
    with torch.no_grad():
        ours = wan.encode_text(prompts)
    torch.testing.assert_close(ours.prompt_embeds, theirs)
    length = len(wan.components.tokenizer("a red circle").input_ids)  # with </s>
    assert 1 < length < TEXT_LENGTH
    assert ours.prompt_embeds[0, length:].abs().max() == 0
    assert ours.prompt_embeds[0, length - 1].abs().min() > 0
    assert ours.pooled_prompt_embeds.shape == (2, 0)


def test_sampling_with_negative_prompt_matches_wan_pipeline(wan):
    call = {"height": 32, "width": 48, "num_inference_steps": 4, "guidance_scale": 4.0}
    ours = generate_wan_latents(
        wan, ["a red circle", "a dog"], negative_prompt="blurry, static", num_steps=4,
        guidance_scale=4.0, seed=2, height=32, width=48, frames=9,
    )  # fmt: skip
    pipe = wan_pipeline(wan.components)
    theirs = pipe(
        ["a red circle", "a dog"], negative_prompt="blurry, static", num_frames=9,
        generator=[torch.Generator().manual_seed(2 + j) for j in range(2)],
        output_type="latent", max_sequence_length=TEXT_LENGTH, **call,
    ).frames  # fmt: skip
    assert ours.shape == (2, 16, 3, 4, 6)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # decoded: the pipeline's frames ([B, T, H, W, 3] in [0, 1])
    clips = generate_wan(
        wan, ["a dog"], negative_prompt="blurry, static", num_steps=2, guidance_scale=4.0,
        seed=5, height=32, width=32, frames=5,
    )  # fmt: skip
    frames = pipe(
        "a dog", negative_prompt="blurry, static", num_frames=5, height=32, width=32,
        num_inference_steps=2, guidance_scale=4.0, generator=[torch.Generator().manual_seed(5)],
        output_type="pt", max_sequence_length=TEXT_LENGTH,
    ).frames  # fmt: skip
    assert clips.shape == (1, 3, 5, 32, 32)
    torch.testing.assert_close(clips, frames.permute(0, 2, 1, 3, 4), rtol=1e-4, atol=1e-4)


def test_the_ladder_is_unipcs_with_flow_shift(wan):
    timesteps, ts = wan_ladder(wan, 4)
    # UniPC's flow sigmas: linspace(1, 1/T, n) shifted by 3, then 0 (Wan2.1's config)
    base = torch.linspace(1.0, 1 / 1000, 5)[:-1].double()
    shifted = SHIFT * base / (1 + (SHIFT - 1) * base)
    torch.testing.assert_close(ts, torch.cat([shifted, torch.zeros(1)]).float())
    torch.testing.assert_close(timesteps, (shifted * 1000).floor().float(), rtol=0, atol=1.0)
    # impasto sample's generic plan (Euler, shift 1 asked) walks this ladder, not its own
    request = SamplingRequest(
        sampler="euler", num_steps=4, prediction_type="flow", alphas_cumprod=torch.ones(1000)
    )
    generic = sampling_plan(request)
    plan = family_plan(generic, wan, "flow", 4, 32, 32)
    assert not torch.allclose(generic.sigmas.float(), ts)
    torch.testing.assert_close(plan.sigmas, ts, rtol=0, atol=0)
    torch.testing.assert_close(plan.timesteps, timesteps, rtol=0, atol=0)


def test_unipc_is_the_familys_sampler_and_euler_stays_available_by_name(wan):
    """No sampler asked: UniPC, the pipeline's (test above); ``euler`` asked: Euler on the
    same ladder, another result; a scheduler config of another UniPC: one line."""
    options = {"num_steps": 3, "guidance_scale": 3.0, "seed": 1, "height": 32, "width": 32}
    pipe = wan_pipeline(wan.components)
    theirs = pipe(
        "a dog", num_frames=5, num_inference_steps=3, guidance_scale=3.0, height=32, width=32,
        generator=[torch.Generator().manual_seed(1)], output_type="latent",
        max_sequence_length=TEXT_LENGTH,
    ).frames  # fmt: skip
    assert wan.own_sampler == "unipc"
    unipc = generate_latents(wan, ["a dog"], frames=5, prediction_type="flow", **options)
    torch.testing.assert_close(unipc, theirs, rtol=1e-5, atol=1e-6)
    euler = generate_wan_latents(wan, ["a dog"], frames=5, sampler="euler", **options)
    assert (euler - theirs).abs().max() > 1e-3
    other = copy.copy(wan.components)
    other.scheduler_config = {**wan.components.scheduler_config, "solver_order": 3}
    with pytest.raises(ValueError, match=r"solver_order=3; .*--sampler euler"):
        generate_latents(WanBackbone(other, wan.options), ["a dog"], frames=5,
                         prediction_type="flow", **options)  # fmt: skip


def test_diffusers_folder_round_trips(wan, tmp_path):
    save_wan_folder(wan.components, tmp_path / "wan")
    loaded = load_wan_folder(tmp_path / "wan", TEXT_LENGTH)
    for name in ("transformer", "vae", "text_encoder"):
        want = getattr(wan.components, name).state_dict()
        got = getattr(loaded, name).state_dict()
        assert want and want.keys() == got.keys()  # a network with tensors, all of them back
        assert all(torch.equal(want[k], got[k]) for k in want), name
    assert loaded.scheduler_config["flow_shift"] == SHIFT
    # without model.wan.text_length the folder's own length holds (an exported run's)
    assert load_wan_folder(tmp_path / "wan", None).tokenizer.model_max_length == TEXT_LENGTH
    backbone = WanBackbone(loaded, WanOptions(text_length=TEXT_LENGTH))
    with torch.no_grad():
        torch.testing.assert_close(
            backbone.encode_text(["a red cube"]).prompt_embeds,
            wan.encode_text(["a red cube"]).prompt_embeds,
        )
    (tmp_path / "broken" / "transformer").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"no transformer/config.json; expected a diffusers Wan"):
        load_wan_folder(tmp_path / "broken", TEXT_LENGTH)


def test_the_full_presets_have_the_releases_sizes():
    """Wan2.1-T2V's published sizes: the 1.3B transformer (1.42 B parameters), the 14B one
    (14.29 B), umT5-XXL's encoder (5.68 B), the VAE (127 M); built on the meta device."""
    from impasto.models.wan.components import build_1_3b, build_14b

    with torch.device("meta"):
        small, large = build_1_3b(0, 512), build_14b(0, 512)

    def count(module: torch.nn.Module) -> int:
        return sum(parameter.numel() for parameter in module.parameters())

    assert round(count(small.transformer) / 1e9, 2) == 1.42
    assert round(count(large.transformer) / 1e9, 2) == 14.29
    assert round(count(small.text_encoder) / 1e9, 2) == 5.68
    assert round(count(small.vae) / 1e6) == 127
    assert len(small.transformer.blocks) == 30 and len(large.transformer.blocks) == 40


def test_nothing_outside_the_models_package_names_the_wan_familys_classes():
    """Only src/impasto/models/ knows the family (the DiT family's rule, issue #31); the video
    VAE (Wan 2.1's, issue #32) is named outside it, the family's module and networks are not."""
    import impasto

    root = Path(impasto.__file__).parent
    pattern = re.compile(r"models\.wan\b|WanBackbone|WanTransformer3DModel|UMT5")
    files = sorted(root.rglob("*.py"))
    outside = [path for path in files if "models" not in path.relative_to(root).parts]
    inside = [path for path in files if "wan" in path.relative_to(root).parts]
    lines = {path: path.read_text(encoding="utf-8").splitlines() for path in files}
    # the scan reads the package and its pattern finds the family where it lives
    assert len(outside) > 50 and any(pattern.search(line) for p in inside for line in lines[p])
    named = [
        f"{path.relative_to(root)}:{number}"
        for path in outside
        for number, line in enumerate(lines[path], 1)
        if pattern.search(line)
    ]
    assert named == []
