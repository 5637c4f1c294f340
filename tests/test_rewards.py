"""Rewards (impasto.rewards): CLIP preprocessing, clip_score, aesthetic, weighted, and the two
ways to register a reward. Tiny random CLIPModels are built in code and saved to tmp folders
with the bundled OpenAI CLIP tokenizer files; nothing is downloaded."""

from __future__ import annotations

import json
import sys
import textwrap
from importlib.resources import as_file, files
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPTokenizer, CLIPVisionConfig

import impasto.rewards
import impasto.rewards.clip  # noqa: F401  (registers clip_score and aesthetic)
import impasto.rewards.weighted  # noqa: F401  (registers weighted)
from impasto.config.draftp import RewardConfig
from impasto.rewards import REWARDS, Reward, build_reward, register_reward, reward_kinds
from impasto.rewards.clip import aesthetic_mlp
from impasto.rewards.preprocess import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ClipPreprocess,
    clip_preprocess,
    normalize,
    read_clip_preprocess,
    resized_size,
)

IMAGE_SIZE = 32  # the tiny vision tower's input
PROJECTION_DIM = 16
PROMPTS = ["a photo of a cat", "a red cube on a table", "a photo of a cat"]
LEVEL = 1 / 255 / min(OPENAI_CLIP_STD)  # one uint8 level in normalised units (0.0150)


def tiny_clip_model() -> CLIPModel:
    """A random CLIP with the real 49408-token vocabulary and 77 positions (seed 0)."""
    text = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    config = CLIPConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=PROJECTION_DIM
    )
    torch.manual_seed(0)
    return CLIPModel(config).eval()


def bundled_tokenizer() -> CLIPTokenizer:
    with as_file(files("impasto") / "assets" / "clip") as clip_dir:
        tokenizer = CLIPTokenizer(str(clip_dir / "vocab.json"), str(clip_dir / "merges.txt"))
    # The OpenAI ids: guards against a constructor that ignores its files.
    assert tokenizer("a photo of a cat")["input_ids"] == [49406, 320, 1125, 539, 320, 2368, 49407]
    return tokenizer


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CLIPModel folder as on the Hub: weights, config, tokenizer, preprocessor config."""
    folder = tmp_path_factory.mktemp("clip") / "tiny-clip"
    tiny_clip_model().save_pretrained(folder)
    bundled_tokenizer().save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                "size": {"shortest_edge": IMAGE_SIZE},
                "image_mean": list(OPENAI_CLIP_MEAN),
                "image_std": list(OPENAI_CLIP_STD),
            }
        )
    )
    return folder


def random_head(input_size: int, seed: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    return aesthetic_mlp(input_size)


@pytest.fixture(scope="module")
def head_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random 16-d aesthetic head saved four ways, and a 768-d one (the real size)."""
    folder = tmp_path_factory.mktemp("heads")
    state = random_head(PROJECTION_DIM).state_dict()
    prefixed = {f"layers.{key}": value for key, value in state.items()}
    paths = {name: folder / name for name in ["bare.pth", "layers.pth", "bare.safetensors"]}
    torch.save(state, paths["bare.pth"])
    torch.save(prefixed, paths["layers.pth"])
    save_file(state, str(paths["bare.safetensors"]))
    paths["layers.safetensors"] = folder / "layers.safetensors"
    save_file(prefixed, str(paths["layers.safetensors"]))
    paths["vit_l14.pth"] = folder / "vit_l14.pth"
    torch.save(
        {f"layers.{k}": v for k, v in random_head(768).state_dict().items()}, paths["vit_l14.pth"]
    )
    return paths


def smooth_images(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """``[B, 3, H, W]`` in [0.1, 0.9]: bilinear upsampling of a coarse random grid."""
    generator = torch.Generator().manual_seed(seed)
    coarse = 0.1 + 0.8 * torch.rand(
        batch, 3, max(height // 4, 2), max(width // 4, 2), generator=generator
    )
    return F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)


def hf_image_embeds(model: CLIPModel, pixels: torch.Tensor) -> torch.Tensor:
    pooled = model.vision_model(pixel_values=pixels).pooler_output
    return F.normalize(model.visual_projection(pooled), dim=-1)


# -- preprocessing --------------------------------------------------------------------------


def test_preprocess_of_a_224_image_is_only_normalisation() -> None:
    images = torch.rand(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    expected = (images - mean) / std
    torch.testing.assert_close(clip_preprocess(images, ClipPreprocess(224, 224)), expected)


@pytest.mark.parametrize(("height", "top"), [(300, 38), (227, 2), (229, 2)])
def test_preprocess_crops_the_centre_as_torchvision(height: int, top: int) -> None:
    # Short side already 224: no resize. torchvision's CenterCrop offset is Python's
    # round((H - 224) / 2), which rounds halves to even (transformers' PIL processor floors).
    images = torch.rand(1, 3, height, 224, generator=torch.Generator().manual_seed(0))
    expected = normalize(images[:, :, top : top + 224, :], OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    torch.testing.assert_close(clip_preprocess(images, ClipPreprocess(224, 224)), expected)


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (1024, 768, (298, 224)),
        (768, 1024, (224, 298)),
        (500, 333, (336, 224)),
        (64, 64, (224, 224)),
    ],
)
def test_resized_size_keeps_the_aspect_ratio(height: int, width: int, expected: tuple) -> None:
    assert resized_size(height, width, 224) == expected


@pytest.mark.parametrize(("height", "width"), [(1024, 768), (512, 640), (200, 160)])
def test_preprocess_agrees_with_clip_image_processor(height: int, width: int) -> None:
    """Within 1.5 uint8 levels (max) and 0.5 level (mean) of transformers' PIL processor.

    Measured on these three images: max 0.0134-0.0155 (0.89-1.03 levels of 0.0150), mean
    0.0039-0.0043 (0.27 level). The kernels are the same (torch's antialiased bicubic uses
    PIL's a = -0.5 cubic); PIL resamples uint8 in two separable passes and rounds each to a
    level (0.5 + 0.5 at most), which is the whole gap. The images stay in [0.1, 0.9], where
    PIL's per-pass clipping never acts. Wrong kernels miss by far more: bicubic without
    antialias mean 0.011-0.089, antialiased bilinear 0.014-0.065, area 0.037-0.052.
    """
    try:
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:  # transformers 4.x
        from transformers import CLIPImageProcessor as Processor
    uint8 = (smooth_images(1, height, width) * 255).round().to(torch.uint8)
    images = uint8.float() / 255
    hf_pixels = Processor()(images=[uint8[0].permute(1, 2, 0).numpy()], return_tensors="np")
    expected = torch.from_numpy(np.asarray(hf_pixels["pixel_values"]))
    ours = clip_preprocess(images, ClipPreprocess(224, 224))
    assert ours.shape == expected.shape == (1, 3, 224, 224)
    assert (ours - expected).abs().max() <= 1.5 * LEVEL
    assert (ours - expected).abs().mean() <= 0.5 * LEVEL
    size = resized_size(height, width, 224)
    aliased = F.interpolate(images, size=size, mode="bicubic", align_corners=False)
    wrong = clip_preprocess(aliased, ClipPreprocess(224, 224))
    assert (wrong - expected).abs().mean() > 0.5 * LEVEL  # the bounds can tell kernels apart


def test_preprocess_reads_the_folder_config(tmp_path: Path) -> None:
    assert read_clip_preprocess(tmp_path, 224) == ClipPreprocess(224, 224)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"crop_size": 336, "size": {"shortest_edge": 350}, "image_mean": [0.5] * 3})
    )
    assert read_clip_preprocess(tmp_path, 336) == ClipPreprocess(
        350, 336, (0.5, 0.5, 0.5), OPENAI_CLIP_STD
    )
    with pytest.raises(ValueError, match="crop_size 336 but the vision model takes 224"):
        read_clip_preprocess(tmp_path, 224)


def test_preprocess_gradients_reach_the_pixels() -> None:
    images = smooth_images(2, 96, 80).requires_grad_(True)
    clip_preprocess(images, ClipPreprocess(32, 32)).square().sum().backward()
    assert images.grad is not None and torch.isfinite(images.grad).all()
    assert images.grad.abs().sum() > 0


# -- clip_score -----------------------------------------------------------------------------


def clip_score_config(clip_dir: Path, **overrides: object) -> RewardConfig:
    return RewardConfig(kind="clip_score", path=str(clip_dir), **overrides)


@pytest.fixture(scope="module")
def clip_score(clip_dir: Path) -> Reward:
    """The fp32 clip_score of the tiny CLIP, shared (loading its tokenizer takes 0.6 s)."""
    return build_reward(clip_score_config(clip_dir))


@pytest.fixture(scope="module")
def aesthetic(clip_dir: Path, head_files: dict[str, Path]) -> Reward:
    """The aesthetic reward of the tiny CLIP and the 16-d head, shared."""
    return build_reward(aesthetic_config(clip_dir, head_files["bare.pth"]))


def aesthetic_config(clip_dir: Path, head: Path, **overrides: object) -> RewardConfig:
    return RewardConfig(kind="aesthetic", path=str(clip_dir), head=str(head), **overrides)


def test_clip_score_equals_transformers_logits(clip_dir: Path, clip_score: Reward) -> None:
    reward = clip_score
    assert isinstance(reward, Reward)
    images = smooth_images(3, 48, 40)
    model = CLIPModel.from_pretrained(str(clip_dir), local_files_only=True).eval()
    pixels = clip_preprocess(images, ClipPreprocess(IMAGE_SIZE, IMAGE_SIZE))
    # PickScore's README tokenises with padding=True; CLIP's causal text tower pools the first
    # end token, so padding to the maximum length (what the reward does) gives the same.
    tokens = bundled_tokenizer()(PROMPTS, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        output = model(**tokens, pixel_values=pixels)
        scores = reward(images, PROMPTS)
        embeddings = reward.embed(images)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, output.logits_per_image.diag())
    torch.testing.assert_close(embeddings, output.image_embeds)
    torch.testing.assert_close(embeddings.norm(dim=-1), torch.ones(3))


def test_clip_score_text_cache_keeps_values_and_gradients(clip_dir: Path) -> None:
    reward = build_reward(clip_score_config(clip_dir, options={"text_cache_size": 2}))
    images = smooth_images(3, 40, 40)
    with torch.inference_mode():
        first = reward(images, PROMPTS)
    assert len(reward._text_cache) == 0  # inference tensors could not join a later graph
    grads = []
    for _ in range(2):  # the second call reads the text embeddings from the cache
        pixels = images.clone().requires_grad_(True)
        scores = reward(pixels, PROMPTS)
        torch.testing.assert_close(scores.detach(), first)
        scores.sum().backward()
        grads.append(pixels.grad)
    assert set(reward._text_cache) == set(PROMPTS)
    torch.testing.assert_close(grads[0], grads[1])
    reward(images, ["a", "b", "c"])
    assert list(reward._text_cache) == ["b", "c"]  # bounded, oldest out


def test_clip_score_bf16_weights_give_float32_scores(clip_dir: Path, clip_score: Reward) -> None:
    images = smooth_images(3, 40, 40)
    reward = build_reward(clip_score_config(clip_dir, dtype="bf16"))
    assert {p.dtype for p in reward.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        scores = reward(images, PROMPTS)
        reference = clip_score(images, PROMPTS)
    assert scores.dtype == torch.float32
    assert not torch.equal(scores, reference)  # the weights really are bf16
    # 14.3 · cos; bf16 rounds to 2^-8 relative, so cos moves by ~0.002: measured 0.027 here.
    torch.testing.assert_close(scores, reference, atol=0.1, rtol=0.0)


# -- aesthetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "head_name", ["bare.pth", "layers.pth", "bare.safetensors", "layers.safetensors"]
)
def test_aesthetic_is_the_mlp_on_normalised_embeddings(
    clip_dir: Path, head_files: dict[str, Path], head_name: str
) -> None:
    reward = build_reward(aesthetic_config(clip_dir, head_files[head_name]))
    images = smooth_images(2, 64, 48)
    model = CLIPModel.from_pretrained(str(clip_dir), local_files_only=True).eval()
    weights = random_head(PROJECTION_DIM).state_dict()
    with torch.no_grad():
        x = hf_image_embeds(model, clip_preprocess(images, ClipPreprocess(IMAGE_SIZE, IMAGE_SIZE)))
        for index in (0, 2, 4, 6, 7):  # Linear layers, no activations (simple_inference.py)
            x = x @ weights[f"{index}.weight"].T + weights[f"{index}.bias"]
        scores = reward(images, ["ignored", "prompts"])
        assert torch.equal(scores, reward(images, ["other", "text"]))
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    torch.testing.assert_close(scores, x.squeeze(-1))
    torch.testing.assert_close(reward.embed(images).norm(dim=-1), torch.ones(2))


@pytest.mark.parametrize("kind", ["clip_score", "aesthetic"])
def test_gradients_reach_the_images_and_the_reward_stays_frozen(
    request: pytest.FixtureRequest, kind: str
) -> None:
    reward = request.getfixturevalue(kind)
    images = smooth_images(3, 48, 64).requires_grad_(True)
    reward(images, PROMPTS).sum().backward()
    assert images.grad is not None and torch.isfinite(images.grad).all()
    assert (images.grad.flatten(1).abs().sum(dim=1) > 0).all()  # every image gets a gradient
    parameters = list(reward.parameters())
    assert parameters and not any(p.requires_grad or p.grad is not None for p in parameters)
    assert not any(module.training for module in reward.modules())


# -- weighted -------------------------------------------------------------------------------


def test_weighted_is_the_weighted_sum_of_its_terms(
    clip_dir: Path, head_files: dict[str, Path], clip_score: Reward, aesthetic: Reward
) -> None:
    clip_term = clip_score_config(clip_dir, weight=0.5)
    aesthetic_term = aesthetic_config(clip_dir, head_files["bare.pth"], weight=-2.0)
    reward = build_reward(RewardConfig(kind="weighted", terms=[clip_term, aesthetic_term]))
    images = smooth_images(3, 40, 56)
    with torch.no_grad():
        scores = reward(images, PROMPTS)
        clip_scores = clip_score(images, PROMPTS)
        aesthetic_scores = aesthetic(images, PROMPTS)
        torch.testing.assert_close(reward.embed(images), clip_score.embed(images))
    assert not torch.allclose(clip_scores, aesthetic_scores)
    torch.testing.assert_close(scores, 0.5 * clip_scores - 2.0 * aesthetic_scores)


# -- errors ---------------------------------------------------------------------------------


def write_config(folder: Path, content: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(content)
    return folder


ERROR_CASES = {
    "path unset": (lambda tmp, clip, heads: {"kind": "clip_score"}, "reward.path is unset"),
    "aesthetic path unset": (
        lambda tmp, clip, heads: {"kind": "aesthetic", "head": str(heads["bare.pth"])},
        "reward.path is unset",
    ),
    "folder missing": (
        lambda tmp, clip, heads: {"kind": "clip_score", "path": str(tmp / "absent")},
        "absent does not exist; download PickScore",
    ),
    "no config.json": (
        lambda tmp, clip, heads: {"kind": "clip_score", "path": str(tmp)},
        "is not a CLIPModel folder (no config.json); download PickScore with "
        "`huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir DIR`",
    ),
    "not a CLIP model": (
        lambda tmp, clip, heads: {
            "kind": "clip_score",
            "path": str(write_config(tmp / "bert", '{"model_type": "bert"}')),
        },
        "holds a 'bert' model, not a CLIPModel",
    ),
    "config.json broken": (
        lambda tmp, clip, heads: {
            "kind": "aesthetic",
            "path": str(write_config(tmp / "x", "{oops")),
        },
        "config.json is unreadable",
    ),
    "no tokenizer": (
        lambda tmp, clip, heads: {
            "kind": "clip_score",
            "path": str(write_config(tmp / "clip", '{"model_type": "clip"}')),
        },
        "has no tokenizer",
    ),
    "unknown option": (
        lambda tmp, clip, heads: {"kind": "clip_score", "path": str(clip), "options": {"n": 3}},
        "reward.options: unknown ['n'] for kind clip_score; valid: text_cache_size",
    ),
}
HEAD_ERROR_CASES = {
    "head unset": (lambda tmp, heads: None, "reward.head is unset; download sac+logos"),
    "head missing": (lambda tmp, heads: tmp / "absent.pth", "absent.pth does not exist"),
    "head unreadable pth": (
        lambda tmp, heads: write_bytes(tmp / "junk.pth", b"not a checkpoint"),
        "junk.pth is unreadable",
    ),
    "head unreadable safetensors": (
        lambda tmp, heads: write_bytes(tmp / "junk.safetensors", b"\x00" * 16),
        "junk.safetensors is unreadable",
    ),
    "head not a state dict": (
        lambda tmp, heads: save_object(tmp / "list.pth", [torch.zeros(2)]),
        "holds no state dict of tensors",
    ),
    "head wrong shape": (
        lambda tmp, heads: save_object(
            tmp / "wide.pth", {**random_head(PROJECTION_DIM).state_dict(), "7.bias": torch.zeros(2)}
        ),
        "is not the improved-aesthetic-predictor MLP (mismatched ['7.bias'])",
    ),
    "head for another CLIP": (
        lambda tmp, heads: heads["vit_l14.pth"],
        "its MLP takes 768-d embeddings but the CLIP at reward.path projects to 16",
    ),
}


def write_bytes(file: Path, content: bytes) -> Path:
    file.write_bytes(content)
    return file


def save_object(file: Path, value: object) -> Path:
    torch.save(value, file)
    return file


def assert_one_line_error(config: RewardConfig, expected: str) -> None:
    with pytest.raises(ValueError) as error:
        build_reward(config)
    message = str(error.value)
    assert "\n" not in message
    assert expected in message, message


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_config_errors_are_one_line(
    case: str, tmp_path: Path, clip_dir: Path, head_files: dict[str, Path]
) -> None:
    make_fields, expected = ERROR_CASES[case]
    assert_one_line_error(RewardConfig(**make_fields(tmp_path, clip_dir, head_files)), expected)


@pytest.mark.parametrize("case", sorted(HEAD_ERROR_CASES))
def test_head_errors_are_one_line(
    case: str, tmp_path: Path, clip_dir: Path, head_files: dict[str, Path]
) -> None:
    make_head, expected = HEAD_ERROR_CASES[case]
    head = make_head(tmp_path, head_files)
    config = RewardConfig(kind="aesthetic", path=str(clip_dir), head=head and str(head))
    assert_one_line_error(config, expected)


def test_missing_weights_and_mismatched_crop_are_one_line(clip_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for file in clip_dir.iterdir():
        if file.suffix != ".safetensors" and file.name != "preprocessor_config.json":
            (folder / file.name).write_bytes(file.read_bytes())
    assert_one_line_error(RewardConfig(kind="clip_score", path=str(folder)), "no readable weights")
    (folder / "model.safetensors").write_bytes((clip_dir / "model.safetensors").read_bytes())
    (folder / "preprocessor_config.json").write_text('{"crop_size": 224}')
    assert_one_line_error(
        RewardConfig(kind="clip_score", path=str(folder)),
        "reward.path: " + str(folder / "preprocessor_config.json") + ": crop_size 224",
    )


# -- registration ---------------------------------------------------------------------------


class Brightness:
    """A test reward: ``scale`` times each image's mean pixel."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return self.scale * images.mean(dim=(1, 2, 3))

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        return images.flatten(1)


def forget_on_teardown(monkeypatch: pytest.MonkeyPatch, mapping: dict, key: str) -> None:
    """Make ``monkeypatch`` delete ``mapping[key]`` at teardown (its undo of a new key)."""
    monkeypatch.setitem(mapping, key, None)
    del mapping[key]


def test_register_reward_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_on_teardown(monkeypatch, REWARDS, "test_brightness")

    @register_reward("test_brightness")
    def build(config: RewardConfig, device: torch.device) -> Brightness:
        return Brightness(config.options["scale"])

    images = smooth_images(2, 8, 8)
    reward = build_reward(RewardConfig(kind="test_brightness", options={"scale": 3.0}))
    torch.testing.assert_close(reward(images, ["a", "b"]), 3.0 * images.mean(dim=(1, 2, 3)))
    weighted = RewardConfig(
        kind="weighted", terms=[RewardConfig(kind="test_brightness", options={"scale": 1.0})]
    )
    torch.testing.assert_close(build_reward(weighted)(images, ["a", "b"]), reward(images, []) / 3)
    with pytest.raises(ValueError, match="reward 'test_brightness' is registered twice"):
        register_reward("test_brightness")(build)
    with pytest.raises(ValueError, match="valid: aesthetic, clip_score, .*test_brightness"):
        build_reward(RewardConfig(kind="no_such_reward"))


def fake_distribution(site: Path, entry_point: str) -> None:
    """An installed distribution ``fake_plugin`` 0.1 in ``site`` with one reward entry point."""
    dist_info = site / "fake_plugin-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake_plugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[impasto.rewards]\n{entry_point}\n")


def test_entry_point_reward_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_distribution(tmp_path, "fake_plugin_reward = fake_plugin_rewards:build")
    (tmp_path / "fake_plugin_rewards.py").write_text(
        textwrap.dedent(
            """
            import torch

            class Dark:
                def __call__(self, images, prompts):
                    return 1.0 - images.mean(dim=(1, 2, 3))

                def embed(self, images):
                    return images.flatten(1)

            def build(config, device):
                return Dark()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(impasto.rewards, "_entry_points_loaded", False)
    forget_on_teardown(monkeypatch, REWARDS, "fake_plugin_reward")
    forget_on_teardown(monkeypatch, sys.modules, "fake_plugin_rewards")
    assert "fake_plugin_reward" in reward_kinds()
    reward = build_reward(RewardConfig(kind="fake_plugin_reward"))
    images = smooth_images(2, 8, 8)
    torch.testing.assert_close(reward(images, ["a", "b"]), 1.0 - images.mean(dim=(1, 2, 3)))
    assert isinstance(reward, Reward)


def test_broken_entry_point_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_distribution(tmp_path, "fake_broken_reward = fake_plugin_missing_module:build")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(impasto.rewards, "_entry_points_loaded", False)
    forget_on_teardown(monkeypatch, REWARDS, "fake_broken_reward")
    with pytest.raises(ValueError, match="reward entry point 'fake_broken_reward'.*failed to load"):
        build_reward(RewardConfig(kind="clip_score"))
