"""Sampling writes clips (issue #32): ``impasto sample --frames``, ``sample.frames`` and the
validation clips of a run.

No family trains a video model yet, so the model here is a stand-in built for sampling only:
:class:`ClipBackbone`, a Conv3d denoiser over a tiny random Wan 2.1 VAE (diffusers'
``AutoencoderKLWan``: 8x spatial, 4x temporal), behind the backbone's sampling methods. It is
handed to ``impasto sample`` in place of opening a checkpoint (``open_model`` is patched), so
these tests cover the command line, the frame rule, generation with ``frames``, the files and
the validation grid; not loading a video checkpoint nor a trained video DiT.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from PIL import Image
from torch import Tensor, nn
from toy_family import WIDTH, ToyBackbone, ToyCondition, ToyTextEncoder

from impasto.cli import main
from impasto.config import build_config
from impasto.config.schema import ObjectiveConfig, SampleConfig
from impasto.models import autoencoder
from impasto.sample_source import SamplingModel
from impasto.sampling import generate
from impasto.sampling.grid import PADDING, font_size, load_font
from impasto.train.checks import config_problems
from impasto.train.validation import clip_row, write_validation_grid
from impasto.video_files import GRID_PADDING, clip_frames, has_av

Z_DIM, SIDE, FRAMES = 4, 32, 5
PROMPT = "a red circle moving left on a white background"
TINY_WAN = dict(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True],
                latents_mean=[0.3, -0.5, 0.1, 0.9], latents_std=[1.5, 0.5, 2.0, 0.8])  # fmt: skip


class ClipDenoiser(nn.Module):
    """Conv3d over the latent clip, FiLM-modulated by the text and the time."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(Z_DIM, Z_DIM, 3, padding=1)
        self.film = nn.Linear(WIDTH + 1, 2 * Z_DIM)

    def forward(self, x: Tensor, t: Tensor, text: Tensor) -> Tensor:
        scale, shift = self.film(torch.cat([text, t.float()[:, None]], 1)).chunk(2, dim=1)
        return self.conv(x) * (1 + scale[..., None, None, None]) + shift[..., None, None, None]


class ClipBackbone:
    """A video model's sampling methods: latents ``[B, 4, 1 + (N - 1)/4, H/8, W/8]`` decoded
    by a real (tiny, random) Wan VAE into clips ``[B, 3, N, H, W]``."""

    family = "toy-clips"

    def __init__(self, seed: int = 0) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.nets = {"transformer": ClipDenoiser(), "text_encoder": ToyTextEncoder()}
            self.vae = AutoencoderKLWan(**TINY_WAN).eval()

    def parts(self) -> dict[str, nn.Module]:
        return dict(self.nets)

    def frozen(self) -> dict[str, nn.Module]:
        return {"vae": self.vae}

    def modules(self) -> dict[str, nn.Module]:
        return self.parts() | self.frozen()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int, int]:
        return Z_DIM, autoencoder.latent_frames(self.vae, frames), height // 8, width // 8

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> ToyCondition:
        return ToyCondition(self.nets["text_encoder"](prompts))

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: ToyCondition) -> Tensor:
        times = timesteps.reshape(-1).expand(x_t.shape[0])
        return self.nets["transformer"](x_t, times / 1000.0, condition.vector)

    def decode_latents(self, latents: Tensor) -> Tensor:
        return autoencoder.decode_latents(self.vae, latents)


class NoVaeBackbone(ClipBackbone):
    """A video model whose VAE is out of reach, saying its frame rule itself (8x in time)."""

    def frozen(self) -> dict[str, nn.Module]:
        return {}

    def temporal_compression(self) -> int:
        return 8


@pytest.fixture(scope="module")
def backbone() -> ClipBackbone:
    return ClipBackbone()


def _model(backbone, **sample) -> SamplingModel:
    sample = SampleConfig(num_steps=2, guidance_scale=3.0, **sample)
    return SamplingModel(Path("video-model"), backbone, ObjectiveConfig(), sample, SIDE, SIDE)


@pytest.fixture
def open_as(monkeypatch):
    """``impasto sample`` opens the given stand-in model, whatever path it is given."""

    def patch(backbone, **sample) -> None:
        model = _model(backbone, **sample)
        monkeypatch.setattr("impasto.inference.open_model", lambda path, ema=False: model)

    return patch


def _webp_frames(path: Path) -> np.ndarray:
    with Image.open(path) as preview:
        frames = []
        for index in range(preview.n_frames):
            preview.seek(index)
            frames.append(np.asarray(preview.convert("RGB")))
    return np.stack(frames)


def test_sample_frames_writes_an_mp4_a_webp_and_a_frame_grid_per_clip(
    backbone, open_as, tmp_path, capsys
):
    pytest.importorskip("av", reason="the clips' .mp4 files need PyAV: pip install -e '.[video]'")
    from impasto.data.video import decode_frames, probe_clip

    open_as(backbone)
    out = tmp_path / "out"
    assert main(["sample", "model", "--prompt", PROMPT, "--frames", "5", "--num", "2",
                 "--seed", "3", "--out", str(out)]) == 0  # fmt: skip
    digest = hashlib.sha256(PROMPT.encode()).hexdigest()[:8]
    stems = [f"0000{i}-a-red-circle-moving-left-on-a-white-background-{digest}-seed{3 + i}"
             for i in range(2)]  # fmt: skip
    expected = [
        str(out / f"{stem}.{suffix}") for stem in stems for suffix in ("mp4", "webp", "png")
    ]
    assert capsys.readouterr().out.split() == expected
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(p).name for p in expected)
    # The clips are generate's with frames=5, seeds 3 and 4 (the run's steps and guidance).
    clips = generate(backbone, [PROMPT], num_images_per_prompt=2, frames=FRAMES, seed=3,
                     num_steps=2, guidance_scale=3.0, height=SIDE, width=SIDE)  # fmt: skip
    assert clips.shape == (2, 3, FRAMES, SIDE, SIDE)
    for stem, clip in zip(stems, clips, strict=True):
        frames = clip_frames(clip)
        assert np.abs(np.diff(frames.astype(np.int16), axis=0)).max() > 0  # frames differ
        assert np.array_equal(_webp_frames(out / f"{stem}.webp"), frames)  # lossless
        with Image.open(out / f"{stem}.png") as grid:
            assert grid.size == (FRAMES * (SIDE + GRID_PADDING) + GRID_PADDING,
                                 SIDE + 2 * GRID_PADDING)  # fmt: skip
            pixels, parameters = np.asarray(grid.convert("RGB")), grid.text["parameters"]
        for index, frame in enumerate(frames):
            left = GRID_PADDING + index * (SIDE + GRID_PADDING)
            assert np.array_equal(pixels[GRID_PADDING : GRID_PADDING + SIDE, left : left + SIDE],
                                  frame)  # fmt: skip
        assert parameters.endswith("Size: 32x32, Frames: 5, FPS: 16")
        info = probe_clip(out / f"{stem}.mp4")
        assert (info.num_frames, info.height, info.width) == (FRAMES, SIDE, SIDE)
        assert info.fps == pytest.approx(16)
        decoded = decode_frames(out / f"{stem}.mp4", range(FRAMES)).numpy().astype(np.int16)
        # A random VAE's noise at 32 px is H.264's worst case (measured: 4.6 levels off on
        # average, frames 12-18 apart); each decoded frame is still nearest its own.
        distances = np.abs(decoded[:, None] - frames[None].astype(np.int16)).mean(axis=(2, 3, 4))
        assert distances.diagonal().max() < 7
        assert distances.argmin(axis=1).tolist() == list(range(FRAMES))


def test_the_runs_sample_frames_and_other_formats(backbone, open_as, tmp_path, capsys):
    open_as(backbone, frames=FRAMES)  # a run whose config sets sample.frames: 5
    assert main(["sample", "run", "--prompt", PROMPT, "--format", "gif", "--out",
                 str(tmp_path)]) == 0  # fmt: skip
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert [path.suffix for path in written] == [".gif", ".png"]
    with Image.open(written[0]) as gif:
        assert gif.n_frames == FRAMES and gif.size == (SIDE, SIDE)


def _error(capsys, *args: str) -> str:
    assert main(["sample", "model", "--prompt", PROMPT, "--out", "unused", *args]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0].removeprefix("impasto: error: ")


def test_frame_count_mistakes_are_one_line(backbone, open_as, capsys, monkeypatch):
    open_as(backbone)
    assert _error(capsys, "--frames", "6") == (
        "--frames must be k·4+1 (the autoencoder's frame rule), got 6; use 5 or 9"
    )
    assert _error(capsys, "--frames", "0") == "--frames must be >= 1, got 0"
    assert _error(capsys, "--frames", "5", "--format", "webm") == (
        "--format: unknown clip format 'webm'; valid: mp4, webp, gif"
    )
    assert _error(capsys, "--format", "gif") == (
        "--format sets how clips are written; add --frames N"
    )
    open_as(backbone, frames=FRAMES)
    assert _error(capsys, "--frames", "4") == (  # --frames overrides sample.frames
        "--frames must be k·4+1 (the autoencoder's frame rule), got 4; use 1 or 5"
    )
    open_as(NoVaeBackbone())  # the backbone's own rule: 8x
    assert _error(capsys, "--frames", "5") == (
        "--frames must be k·8+1 (the autoencoder's frame rule), got 5; use 1 or 9"
    )
    open_as(ToyBackbone(0))  # an image model: its VAE is no video VAE
    assert _error(capsys, "--frames", "5") == (
        "--frames 5: this model's VAE encodes images; --frames needs a video model"
    )
    open_as(backbone)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    assert _error(capsys, "--frames", "5") == (
        "--format (default: mp4, webp): an .mp4 clip needs PyAV: pip install 'impasto[video]' "
        "(in a checkout: pip install -e '.[video]')"
    )


def test_an_image_models_one_frame_clip_is_its_image(open_as, tmp_path, capsys):
    toy = ToyBackbone(0)
    open_as(toy)
    assert main(["sample", "m", "--prompt", PROMPT, "--frames", "1", "--format", "webp",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    webp, png = (Path(line) for line in capsys.readouterr().out.split())
    image = generate(toy, [PROMPT], num_steps=2, guidance_scale=3.0, height=SIDE, width=SIDE)
    assert np.array_equal(_webp_frames(webp), clip_frames(image[:, :, None][0]))
    assert png.suffix == ".png"


def test_validation_clips_write_a_grid_of_frame_rows_and_previews(tiny_raw, backbone, tmp_path):
    tiny_raw["sample"] = {"every_steps": 1, "prompts": [PROMPT, "a blue square moving up"],
                          "num_steps": 2, "resolution": SIDE, "frames": FRAMES}  # fmt: skip
    config = build_config(tiny_raw)
    validation = write_validation_grid(config, backbone, tmp_path, step=3)
    assert validation.path == tmp_path / "samples" / "step-00000003.png"
    assert validation.images.shape == (2, 3, FRAMES, SIDE, SIDE)
    folder = tmp_path / "samples" / "step-00000003"
    stems = ["000-a-red-circle-moving-left-on-a-white-background", "001-a-blue-square-moving-up"]
    suffixes = [".webp", ".mp4"] if has_av() else [".webp"]  # .mp4 with PyAV only
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        stem + suffix for stem in stems for suffix in suffixes
    )
    for stem, clip in zip(stems, validation.images, strict=True):
        assert np.array_equal(_webp_frames(folder / f"{stem}.webp"), clip_frames(clip))
    # One row per clip: its 5 frames enlarged 4x to 128 px, labelled in 16 px text.
    row = clip_row(validation.images[1])
    assert row.shape == (3, 4 * SIDE + 2 * GRID_PADDING, FRAMES * (4 * SIDE + GRID_PADDING) + 2)
    row_pixels = (row * 255).round().byte().permute(1, 2, 0).numpy()
    for index, frame in enumerate(clip_frames(validation.images[1])):
        left = GRID_PADDING + index * (4 * SIDE + GRID_PADDING)
        square = row_pixels[GRID_PADDING + 3 : GRID_PADDING + 4 * SIDE : 4, left + 1 :: 4]
        assert np.array_equal(square[:, :SIDE], frame)  # every pixel a 4x4 square
    with Image.open(validation.path) as png:
        pixels = np.asarray(png)
    header_font = load_font(font_size(128) * 3 // 2)
    header_height = sum(header_font.getmetrics()) + 2 * PADDING
    line_height = sum(load_font(font_size(128)).getmetrics()) + 2
    slot_height = row.shape[1] + 3 * line_height + PADDING + PADDING
    assert pixels.shape == (header_height + 2 * slot_height + PADDING,
                            row.shape[2] + 2 * PADDING, 3)  # fmt: skip
    top = header_height + PADDING + slot_height  # the second clip's row
    drawn = pixels[top : top + row.shape[1], PADDING : PADDING + row.shape[2]]
    assert np.array_equal(drawn, row_pixels)
    tensorboard = (validation.grid * 255).round().byte().permute(1, 2, 0).numpy()
    assert np.array_equal(tensorboard, pixels)  # TensorBoard logs the PNG's grid


def test_sample_frames_config_rules(tiny_raw):
    tiny_raw["sample"] = {"frames": 16}
    with pytest.raises(ValueError) as error:
        build_config(tiny_raw)
    assert str(error.value) == (
        "config: sample.frames must be k·4+1 (the autoencoder's frame rule), got 16; use 13 or 17"
    )
    tiny_raw["sample"] = {"frames": 0}
    with pytest.raises(ValueError, match="sample.frames: input should be greater than or equal"):
        build_config(tiny_raw)
    # data.video's temporal compression sets the rule.
    tiny_raw["data"]["video"] = {"temporal_compression": 8, "num_frames": 9}
    tiny_raw["sample"] = {"frames": 9}
    assert build_config(tiny_raw).sample.frames == 9
    tiny_raw["sample"] = {"frames": 5}
    with pytest.raises(ValueError, match=r"got 5; use 1 or 9$"):
        build_config(tiny_raw)
    # An image family samples images; one frame is an image.
    del tiny_raw["data"]["video"]
    tiny_raw["sample"] = {"frames": 5}
    assert config_problems(build_config(tiny_raw)) == [
        "sample.frames: the sdxl family samples images, not clips; remove sample.frames"
    ]
    tiny_raw["sample"] = {"frames": 1}
    assert config_problems(build_config(tiny_raw)) == []
