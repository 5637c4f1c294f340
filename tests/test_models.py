"""Tests for impasto.models: tokenizers, conditioning vs diffusers, presets and folder I/O."""

from __future__ import annotations

import json
import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline

from impasto.models import (
    PromptEmbeds,
    SDXLComponents,
    add_time_ids,
    build_preset,
    build_tiny,
    encode_prompts,
    load_clip_tokenizers,
    load_components,
    load_diffusers,
    save_diffusers,
    to_pipeline,
)

CAT_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]  # "a photo of a cat", OpenAI CLIP BPE
LONG_PROMPT = "a watercolor painting of a lighthouse at dusk, " * 12  # > 77 tokens


@pytest.fixture(scope="module")
def saved_dir(tiny: SDXLComponents, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sdxl") / "tiny"
    save_diffusers(tiny, path)
    return path


def _copy(saved_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_dir, tmp_path / "copy"))


def _unet_output(components: SDXLComponents) -> torch.Tensor:
    """UNet prediction on a fixed input built from its own seeded generator."""
    generator = torch.Generator().manual_seed(123)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    text = torch.randn(2, 77, 64, generator=generator)
    pooled = torch.randn(2, 32, generator=generator)
    time_ids = torch.tensor([[96.0, 64.0, 0.0, 8.0, 64.0, 64.0]] * 2)
    with torch.no_grad():
        return components.unet(
            latents,
            torch.tensor([10, 700]),
            encoder_hidden_states=text,
            added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids},
        ).sample


# --- tokenizers -----------------------------------------------------------------------------


def test_tokenizers_give_published_clip_ids_and_sdxl_pad_tokens() -> None:
    tokenizer, tokenizer_2 = load_clip_tokenizers()
    assert tokenizer("a photo of a cat").input_ids == CAT_IDS
    assert tokenizer_2("a photo of a cat").input_ids == CAT_IDS
    padded = tokenizer("a photo of a cat", padding="max_length", max_length=77).input_ids
    padded_2 = tokenizer_2("a photo of a cat", padding="max_length", max_length=77).input_ids
    assert len(padded) == len(padded_2) == 77
    assert padded[7] == padded[76] == 49407  # "<|endoftext|>"
    assert padded_2[7] == padded_2[76] == 0  # "!"
    assert tokenizer.model_max_length == tokenizer_2.model_max_length == 77


def test_tokenizer_truncates_to_77_ending_with_eos() -> None:
    tokenizer, _ = load_clip_tokenizers()
    ids = tokenizer(LONG_PROMPT, max_length=77, truncation=True, padding="max_length").input_ids
    assert len(ids) == 77 and ids[0] == 49406 and ids[-1] == 49407


def test_bundled_assets_have_clip_layout() -> None:
    clip_dir = files("impasto") / "assets" / "clip"
    vocab = json.loads((clip_dir / "vocab.json").read_text(encoding="utf-8"))
    merges = (clip_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert len(vocab) == 49408
    assert vocab["!"] == 0 and vocab["!</w>"] == 256 and vocab["in"] == 512
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert merges[0] == "#version: 0.2" and merges[1] == "i n" and len(merges) == 48895


# --- conditioning ---------------------------------------------------------------------------


def test_encode_prompts_matches_diffusers_encode_prompt(tiny: SDXLComponents) -> None:
    prompts = ["a photo of a cat", "", LONG_PROMPT]
    with torch.no_grad():
        ours = encode_prompts(tiny, prompts)
        expected, _, expected_pooled, _ = to_pipeline(tiny).encode_prompt(
            prompts, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False
        )
    assert isinstance(ours, PromptEmbeds)
    assert ours.prompt_embeds.shape == (3, 77, 64)
    assert ours.pooled_prompt_embeds.shape == (3, 32)
    torch.testing.assert_close(ours.prompt_embeds, expected)
    torch.testing.assert_close(ours.pooled_prompt_embeds, expected_pooled)
    assert not torch.equal(ours.prompt_embeds[0], ours.prompt_embeds[1])


def test_encode_prompts_rejects_a_bare_string(tiny: SDXLComponents) -> None:
    with pytest.raises(ValueError, match="list of prompt strings"):
        encode_prompts(tiny, "a photo of a cat")  # type: ignore[arg-type]


def test_add_time_ids_matches_diffusers_convention(tiny: SDXLComponents) -> None:
    original = torch.tensor([[1024, 768], [512, 640]])
    crops = torch.tensor([[16, 0], [0, 32]])
    target = torch.tensor([[1024, 1024], [512, 576]])
    ids = add_time_ids(original, crops, target, dtype=torch.float16)
    expected = torch.tensor(
        [[1024, 768, 16, 0, 1024, 1024], [512, 640, 0, 32, 512, 576]], dtype=torch.float16
    )
    assert torch.equal(ids, expected)
    pipeline = to_pipeline(tiny)
    reference = pipeline._get_add_time_ids(
        (512, 640), (0, 32), (512, 576), dtype=torch.float16, text_encoder_projection_dim=32
    )
    assert torch.equal(ids[1:], reference)


def test_add_time_ids_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"crop_top_lefts must have shape \[B, 2\]"):
        add_time_ids(torch.ones(2, 2), torch.ones(2, 3), torch.ones(2, 2))


# --- presets --------------------------------------------------------------------------------


def test_build_tiny_is_seeded_and_leaves_global_rng_alone(tiny: SDXLComponents) -> None:
    rng_state = torch.random.get_rng_state()
    again = build_tiny(0)
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    other = build_tiny(1)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        reference = getattr(tiny, name).state_dict()
        same = getattr(again, name).state_dict()
        assert all(torch.equal(reference[key], same[key]) for key in reference), name
    assert not torch.equal(tiny.unet.conv_in.weight, other.unet.conv_in.weight), (
        "seed 1 must give different weights"
    )


def test_build_preset_lists_valid_names_and_load_components_needs_one_source() -> None:
    assert isinstance(build_preset("tiny", 0), SDXLComponents)
    message = r"unknown model preset 'huge'; valid presets: \['demo', 'sdxl', 'tiny'\]"
    with pytest.raises(ValueError, match=message):
        build_preset("huge")
    with pytest.raises(ValueError, match="exactly one"):
        load_components(None, None)
    with pytest.raises(ValueError, match="exactly one"):
        load_components("tiny", "/some/folder")


def test_demo_preset_is_tiny_with_10x_text_encoder_init(tiny: SDXLComponents) -> None:
    demo = build_preset("demo", 0)
    tiny_unet = tiny.unet.state_dict()
    assert all(torch.equal(value, tiny_unet[key]) for key, value in demo.unet.state_dict().items())
    for name in ("text_encoder", "text_encoder_2"):
        demo_std = getattr(demo, name).get_input_embeddings().weight.detach().std().item()
        tiny_std = getattr(tiny, name).get_input_embeddings().weight.detach().std().item()
        assert demo_std / tiny_std == pytest.approx(10, rel=0.01)


def test_tiny_sdxl_forward_at_64px(tiny: SDXLComponents) -> None:
    assert tiny.vae.config.latent_channels == 4  # the demo VAE (its scale: tests/test_vae.py)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ids = add_time_ids(
        torch.tensor([[64, 64], [80, 96]]), torch.zeros(2, 2), torch.tensor([[64, 64]] * 2)
    )
    with torch.no_grad():
        latents = tiny.vae.encode(images).latent_dist.mode() * tiny.vae_scaling_factor
        text = encode_prompts(tiny, ["a photo of a cat", "a dog"])
        kwargs = {"encoder_hidden_states": text.prompt_embeds, "timestep": torch.tensor([1, 999])}
        cond = {"text_embeds": text.pooled_prompt_embeds, "time_ids": ids}
        noise_pred = tiny.unet(latents, added_cond_kwargs=cond, **kwargs).sample
        other_sizes = {"text_embeds": text.pooled_prompt_embeds, "time_ids": ids * 2}
        noise_pred_2 = tiny.unet(latents, added_cond_kwargs=other_sizes, **kwargs).sample
    assert latents.shape == (2, 4, 8, 8)
    assert noise_pred.shape == (2, 4, 8, 8) and torch.isfinite(noise_pred).all()
    assert not torch.allclose(noise_pred, noise_pred_2), "time_ids must condition the UNet"


# --- diffusers folder I/O -------------------------------------------------------------------


def test_save_load_round_trip_is_exact(tiny: SDXLComponents, saved_dir: Path) -> None:
    loaded = load_diffusers(saved_dir)
    assert torch.equal(_unet_output(loaded), _unet_output(tiny))
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        reference, restored = getattr(tiny, name).state_dict(), getattr(loaded, name).state_dict()
        assert reference.keys() == restored.keys(), name
        assert all(torch.equal(reference[key], restored[key]) for key in reference), name
        assert all(p.dtype == torch.float32 for p in getattr(loaded, name).parameters()), name
        # In memory of their own, aligned as the run's weights are: views into the mapped file
        # sit at the header's offsets, where the CPU kernels round differently.
        tensors = [*getattr(loaded, name).parameters(), *getattr(loaded, name).buffers()]
        assert all(t.data_ptr() % 64 == 0 for t in tensors), name
    assert loaded.tokenizer("a cat", padding="max_length", max_length=77).input_ids[-1] == 49407
    assert loaded.tokenizer_2("a cat", padding="max_length", max_length=77).input_ids[-1] == 0
    assert loaded.tokenizer.model_max_length == 77


def test_saved_folder_is_a_stock_sdxl_pipeline(saved_dir: Path) -> None:
    pipeline = StableDiffusionXLPipeline.from_pretrained(saved_dir, local_files_only=True)
    scheduler = pipeline.scheduler.config
    assert type(pipeline.scheduler).__name__ == "EulerDiscreteScheduler"
    assert (scheduler.beta_schedule, scheduler.beta_start, scheduler.beta_end) == (
        "scaled_linear",
        0.00085,
        0.012,
    )
    assert scheduler.num_train_timesteps == 1000 and scheduler.prediction_type == "epsilon"
    assert scheduler.timestep_spacing == "leading" and scheduler.steps_offset == 1
    assert pipeline.tokenizer_2.pad_token == "!"
    for subfolder in ("unet", "vae"):
        assert (saved_dir / subfolder / "diffusion_pytorch_model.safetensors").is_file()
    assert (saved_dir / "tokenizer" / "merges.txt").is_file()


def test_missing_tokenizer_folders_fall_back_to_bundled(saved_dir: Path, tmp_path: Path) -> None:
    path = _copy(saved_dir, tmp_path)
    shutil.rmtree(path / "tokenizer")
    shutil.rmtree(path / "tokenizer_2")
    loaded = load_diffusers(path)
    assert loaded.tokenizer("a photo of a cat").input_ids == CAT_IDS
    assert loaded.tokenizer.pad_token_id == 49407 and loaded.tokenizer_2.pad_token_id == 0


def _assert_one_line_value_error(path: Path, expected: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        load_diffusers(path)
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert expected in message, message


def test_missing_folder_raises_one_line(tmp_path: Path) -> None:
    _assert_one_line_value_error(tmp_path / "nope", "does not exist")


def test_missing_model_index_raises_one_line(saved_dir: Path, tmp_path: Path) -> None:
    path = _copy(saved_dir, tmp_path)
    (path / "model_index.json").unlink()
    _assert_one_line_value_error(path, "no model_index.json")


def test_missing_unet_folder_raises_one_line(saved_dir: Path, tmp_path: Path) -> None:
    path = _copy(saved_dir, tmp_path)
    shutil.rmtree(path / "unet")
    _assert_one_line_value_error(path, "no unet/ folder; expected a diffusers SDXL folder")


def test_missing_text_encoder_weights_raise_one_line(saved_dir: Path, tmp_path: Path) -> None:
    path = _copy(saved_dir, tmp_path)
    (path / "text_encoder_2" / "model.safetensors").unlink()
    _assert_one_line_value_error(path, "no weights in text_encoder_2/")


def test_truncated_unet_weights_raise_one_line(saved_dir: Path, tmp_path: Path) -> None:
    path = _copy(saved_dir, tmp_path)
    weights = path / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    _assert_one_line_value_error(
        path, f"model.path {path}: unet/diffusion_pytorch_model.safetensors: truncated ("
    )


def test_invalid_component_config_raises_one_line(saved_dir: Path, tmp_path: Path) -> None:
    path = _copy(saved_dir, tmp_path)
    (path / "vae" / "config.json").write_text("{not json", encoding="utf-8")
    _assert_one_line_value_error(path, "vae/config.json is not valid JSON")


def test_pickled_bin_weights_are_refused(tmp_path: Path, tiny: SDXLComponents) -> None:
    save_diffusers(tiny, tmp_path / "model")
    weights = tmp_path / "model" / "unet" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_name("diffusion_pytorch_model.bin"))
    with pytest.raises(ValueError, match="only pickled .bin weights; impasto loads safetensors"):
        load_diffusers(tmp_path / "model")


def test_reusing_preset_builds_builds_once_and_hands_out_independent_copies(monkeypatch) -> None:
    from impasto.models import presets

    calls: list[int] = []

    def counted(seed: int) -> SDXLComponents:
        calls.append(seed)
        return presets.build_tiny(seed)

    monkeypatch.setitem(presets.PRESETS, "tiny", counted)
    with presets.reusing_preset_builds():
        first, second = presets.build_preset("tiny", 1), presets.build_preset("tiny", 1)
        other_seed = presets.build_preset("tiny", 2)
    assert calls == [1, 2]  # the second seed-1 build was a copy
    assert presets.PRESETS["tiny"] is counted  # restored
    fresh = presets.build_tiny(1)
    for copy_ in (first, second):
        for (name, a), b in zip(
            copy_.unet.named_parameters(), fresh.unet.parameters(), strict=True
        ):
            assert torch.equal(a, b), name
    with torch.no_grad():
        first.unet.conv_in.weight.add_(1.0)  # the copies share no storage
    assert torch.equal(second.unet.conv_in.weight, fresh.unet.conv_in.weight)
    assert not torch.equal(other_seed.unet.conv_in.weight, fresh.unet.conv_in.weight)
