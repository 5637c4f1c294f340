"""Wan 2.1's video VAE (diffusers ``AutoencoderKLWan``): loading, the latent map, and encoding
and decoding long clips a chunk at a time (issue #32).

Frames are ``[B, C, T, H, W]`` in [-1, 1] with ``T = 4n + 1`` and sides multiples of 8;
latents are ``[B, z, 1 + (T − 1)/4, H/8, W/8]``. The latent map is WanPipeline's, per channel:
``(x − latents_mean) / latents_std``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from importlib.resources import as_file, files
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from safetensors.torch import load_file
from torch import Tensor

from impasto.models.single_file.file_errors import check_folder, check_safetensors
from impasto.models.video_vae_stream import ENCODE_STEP_FRAMES, CausalStream

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "AutoencoderKLWan"
TEMPORAL_FACTOR = 4  # Wan 2.1: latent frame 0 is frame 0, each later one 4 frames
FOLDER = "a diffusers AutoencoderKLWan folder (Wan 2.1's vae/, or a Wan pipeline folder)"
DEMO_VIDEO_VAE_ASSET = ("assets", "demo_video_vae")

FrameReader = Callable[[int, int], Tensor]  # (start, stop) → frames [B, C, stop − start, H, W]


def load_video_vae(path: str | Path, setting: str = "model.vae") -> AutoencoderKLWan:
    """The ``AutoencoderKLWan`` in the folder ``path`` (or its ``vae/``): ``config.json`` and
    ``diffusion_pytorch_model.safetensors``, read offline; float32, eval mode, frozen. Every
    problem is a one-line ``ValueError`` naming ``setting``."""
    path = Path(path)
    check_folder(path, setting, FOLDER)
    folder = path / "vae" if (path / "vae" / CONFIG_NAME).is_file() else path
    where = f"{setting} {path}"
    config = _wan_config(folder, where, setting)
    weights = folder / WEIGHTS_NAME
    label = f"{where}: {weights.relative_to(path)}"
    if not weights.is_file():
        raise ValueError(f"{where}: no {weights.relative_to(path)}; copy the VAE's safetensors "
                         "weights there (pickled .bin weights are not read)")  # fmt: skip
    check_safetensors(weights, setting, label)  # unreadable, not safetensors, truncated, corrupt
    try:
        with torch.random.fork_rng(devices=[]):  # the throwaway init draws from the global RNG
            vae = AutoencoderKLWan.from_config(config)
    except Exception as error:  # a value of the wrong type or size
        problem = f"its {CONFIG_NAME} does not build an {CLASS_NAME} ({_first_line(error)})"
        raise ValueError(f"{where}: {problem}; re-download or re-copy it") from None
    _load_state(vae, load_file(str(weights)), label)
    return vae.float().eval().requires_grad_(False)


def load_demo_video_vae() -> AutoencoderKLWan:
    """The demo video VAE shipped in the package: a tiny ``AutoencoderKLWan`` trained on the
    video demo's moving shapes (``impasto.vae.video_train``; docs/video.md), loaded by
    :func:`load_video_vae` (float32, eval mode, frozen)."""
    with as_file(files("impasto").joinpath(*DEMO_VIDEO_VAE_ASSET)) as path:
        return load_video_vae(path, setting="the demo video VAE")


def _wan_config(folder: Path, where: str, setting: str) -> dict:
    """``folder/config.json``, checked to be Wan 2.1's ``AutoencoderKLWan``."""
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"{where}: no {CONFIG_NAME} there or in vae/; point {setting} at {FOLDER}")
    try:
        config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: cannot read {CONFIG_NAME} ({_first_line(error)}); "
                         "re-download or re-copy it") from None  # fmt: skip
    found = config.get("_class_name") if isinstance(config, dict) else None
    if found != CLASS_NAME:
        raise ValueError(f"{where}: its {CONFIG_NAME} is {found or 'no diffusers model'}'s, not "
                         f"a video VAE's; point {setting} at {FOLDER}")  # fmt: skip
    if config.get("patch_size") is not None:
        raise ValueError(f"{where}: a Wan 2.2 VAE (patch_size {config['patch_size']}) is not "
                         "supported yet; use Wan 2.1's 16-channel VAE")  # fmt: skip
    return config


def _load_state(vae: AutoencoderKLWan, state: dict[str, Tensor], label: str) -> None:
    expected = vae.state_dict()
    for names, problem in ((set(expected) - set(state), "missing"),
                           (set(state) - set(expected), "not in this VAE")):  # fmt: skip
        if names:
            raise ValueError(f"{label}: {len(names)} tensors {problem} (e.g. {min(names)}); are "
                             f"it and {CONFIG_NAME} the same VAE's?")  # fmt: skip
    for key, tensor in expected.items():
        if state[key].shape != tensor.shape:
            raise ValueError(f"{label}: {key} has shape {tuple(state[key].shape)}, "
                             f"{CONFIG_NAME} makes it {tuple(tensor.shape)}; are they the same "
                             "VAE's?")  # fmt: skip
    vae.load_state_dict({key: state[key].float() for key in expected}, strict=True)


def clip_latent_shape(vae: AutoencoderKLWan, frames_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[B, C, T, H, W]`` → the latent shape ``[B, z, 1 + (T − 1)/4, H/8, W/8]``; a clip whose
    frame count or sides do not fit is a one-line ``ValueError``."""
    if len(frames_shape) != 5:
        raise ValueError(f"video VAE: frames must be [B, C, T, H, W], got {list(frames_shape)}")
    batch, _, num_frames, height, width = frames_shape
    check_num_frames(num_frames)
    factor = vae.spatial_compression_ratio
    if height % factor or width % factor:
        raise ValueError(f"video VAE: frames of {height}x{width}; both sides must be multiples "
                         f"of {factor}, the VAE's spatial factor")  # fmt: skip
    latent_frames = 1 + (num_frames - 1) // TEMPORAL_FACTOR
    return (batch, vae.config.z_dim, latent_frames, height // factor, width // factor)


def check_num_frames(num_frames: int) -> None:
    """A clip has 4n + 1 frames (Wan's causal VAE: frame 0 alone, then groups of 4)."""
    if num_frames < 1 or (num_frames - 1) % TEMPORAL_FACTOR:
        below = max(1, (num_frames - 1) // TEMPORAL_FACTOR * TEMPORAL_FACTOR + 1)
        raise ValueError(f"video VAE: a clip of {num_frames} frames; it needs 4n + 1 frames "
                         f"(1, 5, 9, ...), e.g. {below} or {below + TEMPORAL_FACTOR}")  # fmt: skip


def clip_posterior(vae: AutoencoderKLWan, frames: Tensor) -> tuple[Tensor, Tensor]:
    """The posterior (mean, std) ``[B, z, t, h, w]`` of a whole clip ``[B, C, T, H, W]`` in
    [-1, 1] (diffusers' ``vae.encode``, tiled where ``vae.enable_tiling()`` is on)."""
    clip_latent_shape(vae, tuple(frames.shape))
    posterior = vae.encode(frames.to(vae.device, vae.dtype)).latent_dist
    return posterior.mean, posterior.std


def _latent_stats(vae: AutoencoderKLWan, like: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel ``(latents_mean, 1 / latents_std)`` ``[1, z, 1, 1, 1]``, as WanPipeline
    builds them (the reciprocal in float32, then cast)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape)
    return mean, inv_std.to(like.device, like.dtype)


def encode_clip_latents(vae: AutoencoderKLWan, sample: Tensor) -> Tensor:
    """A posterior sample (or mean) → the denoiser's latents: ``(x − mean) / std`` per channel
    (WanPipeline's map; Wan's VAE has no scaling factor)."""
    mean, inv_std = _latent_stats(vae, sample)
    return (sample - mean) * inv_std


def raw_clip_latents(vae: AutoencoderKLWan, latents: Tensor) -> Tensor:
    """The inverse of :func:`encode_clip_latents`: ``x · std + mean``, as WanPipeline decodes."""
    mean, inv_std = _latent_stats(vae, latents)
    return latents / inv_std + mean


def decode_clip_latents(vae: AutoencoderKLWan, latents: Tensor) -> Tensor:
    """The denoiser's latents ``[B, z, t, h, w]`` → frames ``[B, C, 1 + 4(t − 1), 8h, 8w]`` in
    [0, 1], without gradients, one clip at a time, float32 on the CPU (diffusers'
    ``vae.decode``, tiled where ``vae.enable_tiling()`` is on)."""
    clips = []
    with torch.no_grad():
        for clip in latents.split(1):
            raw = raw_clip_latents(vae, clip.to(vae.device, vae.dtype))
            clips.append(_to_unit(vae.decode(raw).sample))
    return torch.cat(clips)


def _to_unit(frames: Tensor) -> Tensor:
    return (frames.float().cpu() / 2 + 0.5).clamp(0, 1)


def encode_clip_chunked(
    vae: AutoencoderKLWan, read_frames: FrameReader, num_frames: int, chunk_frames: int = 16
) -> tuple[Tensor, Tensor]:
    """The posterior (mean, std) of a clip read ``chunk_frames`` frames at a time, without
    gradients: equal to :func:`clip_posterior` of the whole clip, while at most
    ``chunk_frames`` frames (and the encoder's cache of 2 frames per causal convolution) are
    held at once.

    Args:
        read_frames: ``(start, stop)`` → frames ``[B, C, stop − start, H, W]`` in [-1, 1]; it
            is called for ``(0, 1)``, then ``(1, 1 + chunk_frames)``, ``(1 + chunk_frames,
            1 + 2·chunk_frames)``, ... up to ``num_frames``, each range once, in order.
        num_frames: the clip's frame count, 4n + 1.
        chunk_frames: frames per read after the first, a multiple of 4.

    Returns:
        (mean, std), each ``[B, z, 1 + (num_frames − 1)/4, H/8, W/8]``, on the VAE's device.
    """
    check_num_frames(num_frames)
    if chunk_frames < ENCODE_STEP_FRAMES or chunk_frames % ENCODE_STEP_FRAMES:
        raise ValueError(f"video VAE: chunk_frames is {chunk_frames}; it must be a positive "
                         f"multiple of {ENCODE_STEP_FRAMES}")  # fmt: skip
    moments, stream, shape = [], None, None
    with torch.no_grad():
        for start in [0, *range(1, num_frames, chunk_frames)]:
            stop = min(start + chunk_frames, num_frames) if start else 1
            frames = read_frames(start, stop)
            shape = _check_read(vae, frames, start, stop, shape)
            frames = frames.to(vae.device, vae.dtype)
            if stream is None:
                stream = CausalStream.encoder(vae, *frames.shape[-2:])
            for step in frames.split(ENCODE_STEP_FRAMES, dim=2):
                moments.append(stream(step))
            del frames, step  # drop this chunk before reading the next
    posterior = DiagonalGaussianDistribution(torch.cat(moments, dim=2))
    return posterior.mean, posterior.std


def _check_read(
    vae: AutoencoderKLWan, frames: Tensor, start: int, stop: int, shape: tuple | None
) -> tuple[int, ...]:
    """The read's shape without its frame count; a read that does not fit raises."""
    if not isinstance(frames, Tensor) or frames.dim() != 5 or frames.shape[2] != stop - start:
        got = list(frames.shape) if isinstance(frames, Tensor) else type(frames).__name__
        raise ValueError(f"video VAE: read_frames({start}, {stop}) returned {got}; expected "
                         f"[B, C, {stop - start}, H, W]")  # fmt: skip
    found = (frames.shape[0], frames.shape[1], *frames.shape[3:])
    if shape is None:
        clip_latent_shape(vae, tuple(frames.shape[:2]) + (1,) + tuple(frames.shape[3:]))
    elif found != shape:
        raise ValueError(f"video VAE: read_frames({start}, {stop}) returned {list(frames.shape)}; "
                         f"earlier reads had [B, C, H, W] = {list(shape)}")  # fmt: skip
    return found


def decode_clip_chunked(
    vae: AutoencoderKLWan, latents: Tensor, chunk_latents: int = 4
) -> Iterator[Tensor]:
    """:func:`decode_clip_latents` for one clip ``[1, z, t, h, w]`` (or a batch), yielded in
    chunks of frames in [0, 1], float32 on the CPU: 1 frame from latent frame 0, then
    ``4 · chunk_latents`` frames at a time. Only one chunk of frames is held at once; the
    concatenated chunks equal :func:`decode_clip_latents`."""
    if chunk_latents < 1:
        raise ValueError(f"video VAE: chunk_latents is {chunk_latents}; it must be at least 1")
    return _decoded_chunks(vae, latents, chunk_latents)


@torch.no_grad()  # as a decorator, it leaves the caller's grad mode alone between yields
def _decoded_chunks(vae: AutoencoderKLWan, latents: Tensor, chunk_latents: int) -> Iterator[Tensor]:
    raw = raw_clip_latents(vae, latents.to(vae.device, vae.dtype))
    stream = CausalStream.decoder(vae, *raw.shape[-2:])
    yield _to_unit(stream(raw[:, :, :1]))
    for start in range(1, raw.shape[2], chunk_latents):
        chunk = raw[:, :, start : start + chunk_latents].split(1, dim=2)
        yield _to_unit(torch.cat([stream(step) for step in chunk], dim=2))


def _first_line(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
