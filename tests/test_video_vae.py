"""The video VAE (issue #32): Wan 2.1's ``AutoencoderKLWan`` from a folder, its latent map,
and chunked (and tiled) encoding and decoding equal to diffusers' whole-clip calls, on a tiny
random config built here."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from torch.testing import assert_close

from impasto.models.video_autoencoder import (
    clip_latent_shape,
    clip_posterior,
    decode_clip_chunked,
    decode_clip_latents,
    encode_clip_chunked,
    encode_clip_latents,
    load_video_vae,
    raw_clip_latents,
)

Z_DIM = 4
SIDE = 32  # 4x4 latents
# Wan 2.1's layout (4 levels: 8x spatial; 2 temporal downsamplings: 4x) at the smallest width.
TINY_WAN = dict(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True],
                latents_mean=[0.3, -0.5, 0.1, 0.9], latents_std=[1.5, 0.5, 2.0, 0.8])  # fmt: skip


def tiny_wan_vae(seed: int = 0) -> AutoencoderKLWan:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(**TINY_WAN).eval()


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    return tiny_wan_vae()


def frame_at(index: int, side: int = SIDE) -> torch.Tensor:
    """Frame ``index`` of a synthetic clip ``[1, 3, 1, side, side]`` in [-1, 1], made on demand."""
    generator = torch.Generator().manual_seed(index)
    return torch.rand(1, 3, 1, side, side, generator=generator) * 2 - 1


def clip(num_frames: int, side: int = SIDE) -> torch.Tensor:
    return torch.cat([frame_at(i, side) for i in range(num_frames)], dim=2)


class CountingReader:
    """``read_frames`` that makes frames on demand and tracks, through weak references, how many
    of the frames it handed out are still alive (held by the caller, or by a view of them)."""

    def __init__(self, side: int = SIDE) -> None:
        self.side, self.ranges, self.max_live = side, [], 0
        self.handed: list[tuple[weakref.ref, int]] = []

    def live_frames(self) -> int:
        return sum(count for ref, count in self.handed if ref() is not None)

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        self.ranges.append((start, stop))
        frames = torch.cat([frame_at(i, self.side) for i in range(start, stop)], dim=2)
        self.handed.append((weakref.ref(frames), stop - start))
        self.max_live = max(self.max_live, self.live_frames())
        return frames


@pytest.mark.parametrize("num_frames", [1, 5, 9])
def test_encode_decode_shapes_and_frame_counts(vae, num_frames: int):
    frames = clip(num_frames)
    with torch.no_grad():
        mean, std = clip_posterior(vae, frames)
    latent_frames = 1 + (num_frames - 1) // 4
    assert mean.shape == std.shape == (1, Z_DIM, latent_frames, SIDE // 8, SIDE // 8)
    assert clip_latent_shape(vae, tuple(frames.shape)) == tuple(mean.shape)
    decoded = decode_clip_latents(vae, encode_clip_latents(vae, mean))
    assert decoded.shape == (1, 3, num_frames, SIDE, SIDE)
    assert decoded.dtype == torch.float32 and 0 <= decoded.min() and decoded.max() <= 1
    assert decoded.std() > 0.01  # not a constant clamp


def test_latent_map_is_wans_and_inverts(vae):
    raw = torch.randn(2, Z_DIM, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor(TINY_WAN["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(TINY_WAN["latents_std"]).view(1, -1, 1, 1, 1)
    latents = encode_clip_latents(vae, raw)
    assert_close(latents, (raw - mean) / std)
    assert_close(raw_clip_latents(vae, latents), raw)


def test_decode_reads_the_denoisers_latents(vae):
    """decode_clip_latents undoes the map before the decoder: WanPipeline's decode exactly."""
    with torch.no_grad():
        raw, _ = clip_posterior(vae, clip(5))
        expected = (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1)
    assert_close(decode_clip_latents(vae, encode_clip_latents(vae, raw)), expected)


@pytest.mark.parametrize(
    ("shape", "match"),
    [((1, 3, 4, 32, 32), r"4 frames; it needs 4n \+ 1 frames \(1, 5, 9, ...\), e.g. 1 or 5"),
     ((1, 3, 5, 30, 32), "30x32; both sides must be multiples of 8"),
     ((3, 5, 32, 32), r"frames must be \[B, C, T, H, W\]")],
)  # fmt: skip
def test_a_clip_that_does_not_fit_is_one_line(vae, shape, match):
    with pytest.raises(ValueError, match=match) as error:
        clip_posterior(vae, torch.zeros(shape))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("chunk_frames", [4, 8])
def test_chunked_encode_equals_the_whole_clip(vae, chunk_frames: int):
    reader = CountingReader()
    mean, std = encode_clip_chunked(vae, reader, 17, chunk_frames)
    with torch.no_grad():
        expected_mean, expected_std = clip_posterior(vae, clip(17))
    assert_close(mean, expected_mean, rtol=1e-5, atol=1e-6)
    assert_close(std, expected_std, rtol=1e-5, atol=1e-6)
    step = chunk_frames
    assert reader.ranges == [(0, 1)] + [(s, min(s + step, 17)) for s in range(1, 17, step)]


def test_chunked_encode_with_tiles_equals_diffusers_tiled_encode():
    vae = tiny_wan_vae()
    frames = clip(9, side=64)
    with torch.no_grad():
        untiled, _ = clip_posterior(vae, frames)
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                          tile_sample_stride_height=16, tile_sample_stride_width=16)  # fmt: skip
        tiled, _ = clip_posterior(vae, frames)
    mean, _ = encode_clip_chunked(vae, CountingReader(side=64), 9, chunk_frames=4)
    assert_close(mean, tiled, rtol=1e-5, atol=1e-6)
    # the tiles were used: the blended seams differ from the untiled encode
    assert (tiled - untiled).abs().max() > 1e-3


@pytest.mark.parametrize("tiling", [False, True])
def test_chunked_decode_equals_the_whole_clip(tiling: bool):
    vae = tiny_wan_vae()
    if tiling:  # latents 8x8, tiles of 4x4 latents every 2
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                          tile_sample_stride_height=16, tile_sample_stride_width=16)  # fmt: skip
    latents = torch.randn(1, Z_DIM, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    chunks = []
    for chunk in decode_clip_chunked(vae, latents, chunk_latents=2):
        assert torch.is_grad_enabled() and not chunk.requires_grad  # no_grad stays inside
        chunks.append(chunk)
    assert [chunk.shape[2] for chunk in chunks] == [1, 8, 4]
    assert_close(torch.cat(chunks, dim=2), decode_clip_latents(vae, latents), rtol=1e-5, atol=1e-6)


def test_the_counting_reader_sees_a_frame_held_through_a_view():
    """The memory bound below would catch a leak: a kept view keeps its frames alive."""
    reader = CountingReader()
    kept = reader(0, 4)[:, :, -1:]
    reader(4, 8)
    assert reader.live_frames() == 4 and reader.max_live == 8
    del kept
    assert reader.live_frames() == 0


def test_caching_a_257_frame_clip_holds_one_chunk_of_frames(vae):
    """Issue #32: caching a long clip never holds more than one chunk of frames; its latents
    equal the whole-clip encode (checked on the first 33 frames: the encoder is causal)."""
    reader = CountingReader()
    mean, std = encode_clip_chunked(vae, reader, 257, chunk_frames=16)
    assert mean.shape == std.shape == (1, Z_DIM, 65, 4, 4)
    assert reader.max_live <= 16  # frames alive at once, the new chunk included
    assert reader.ranges[0] == (0, 1) and reader.ranges[-1] == (241, 257)
    assert sum(stop - start for start, stop in reader.ranges) == 257
    with torch.no_grad():
        expected_mean, expected_std = clip_posterior(vae, clip(33))
    assert_close(mean[:, :, :9], expected_mean, rtol=1e-5, atol=1e-6)
    assert_close(std[:, :, :9], expected_std, rtol=1e-5, atol=1e-6)


def test_chunk_and_read_errors_are_one_line(vae):
    with pytest.raises(ValueError, match="chunk_frames is 6; it must be a positive multiple of 4"):
        encode_clip_chunked(vae, CountingReader(), 9, chunk_frames=6)
    with pytest.raises(ValueError, match=r"read_frames\(1, 5\) returned \[1, 3, 3, 32, 32\]"):
        encode_clip_chunked(
            vae, lambda start, stop: clip(stop - start)[:, :, : max(1, stop - start - 1)], 9, 4
        )


def test_load_a_vae_folder_or_a_pipeline_folder(vae, tmp_path: Path):
    vae.save_pretrained(tmp_path / "wan_vae")
    vae.save_pretrained(tmp_path / "wan_pipeline" / "vae")
    for folder in ("wan_vae", "wan_pipeline"):
        loaded = load_video_vae(tmp_path / folder)
        assert not loaded.training and loaded.dtype == torch.float32
        assert not any(parameter.requires_grad for parameter in loaded.parameters())
        for key, tensor in vae.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), key
        assert loaded.config.latents_std == TINY_WAN["latents_std"]


def _image_vae_folder(root: Path) -> Path:
    AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4).save_pretrained(
        root
    )
    return root


def _wan22_folder(root: Path) -> Path:
    root.mkdir()
    (root / "config.json").write_text(
        json.dumps({"_class_name": "AutoencoderKLWan", "patch_size": 2})
    )
    return root


def _weightless_folder(vae: AutoencoderKLWan, root: Path) -> Path:
    vae.save_pretrained(root / "vae", safe_serialization=False)  # a pickled .bin only
    return root


def _other_config_folder(vae: AutoencoderKLWan, root: Path) -> Path:
    vae.save_pretrained(root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "base_dim": 16}))
    return root


def _corrupt_weights_folder(vae: AutoencoderKLWan, root: Path) -> Path:
    vae.save_pretrained(root)
    weights = root / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return root


@pytest.mark.parametrize(
    ("make", "match"),
    [(lambda vae, tmp: tmp / "nowhere", "does not exist; put the folder back there"),
     (lambda vae, tmp: (tmp / "f.safetensors").write_bytes(b"x") and tmp / "f.safetensors",
      "is a file, not a folder; point model.video_vae at a diffusers AutoencoderKLWan folder"),
     (lambda vae, tmp: (tmp / "empty").mkdir() or tmp / "empty",
      "no config.json there or in vae/; point model.video_vae at a diffusers AutoencoderKLWan"),
     (lambda vae, tmp: _image_vae_folder(tmp / "sdxl_vae"),
      "its config.json is AutoencoderKL's, not a video VAE's; point model.video_vae at"),
     (lambda vae, tmp: _wan22_folder(tmp / "wan22"),
      r"a Wan 2.2 VAE \(patch_size 2\) is not supported yet; use Wan 2.1's"),
     (lambda vae, tmp: _weightless_folder(vae, tmp / "pipeline"),
      r"no vae/diffusion_pytorch_model.safetensors; copy the VAE's safetensors weights there"),
     (lambda vae, tmp: _other_config_folder(vae, tmp / "wider"),
      r"diffusion_pytorch_model.safetensors: encoder.conv_in.weight has shape \(8, 3, 3, 3, 3\), "
      r"config.json makes it \(16, 3, 3, 3, 3\); are they the same VAE's\?"),
     (lambda vae, tmp: _corrupt_weights_folder(vae, tmp / "cut"),
      "diffusion_pytorch_model.safetensors: .*re-download or re-copy it")],
)  # fmt: skip
def test_a_folder_that_is_not_a_wan_vae_is_one_line(vae, tmp_path: Path, make, match):
    path = make(vae, tmp_path)
    with pytest.raises(ValueError, match=match) as error:
        load_video_vae(path, setting="model.video_vae")
    message = str(error.value)
    assert message.startswith(f"model.video_vae {path}") and "\n" not in message
