"""How well a video VAE reconstructs demo clips: PSNR, the video demo's judge, latent statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan
from torch import Tensor

from impasto.demo_score_video import VideoDemoScore, score_demo_clips
from impasto.vae.metrics import psnr
from impasto.vae.video_data import ClipSet

EVAL_BATCH_PIXELS = 4 * 17 * 64 * 64  # frames x height x width per no-grad forward


@torch.no_grad()
def reconstruct_clips(vae: AutoencoderKLWan, frames: Tensor) -> Tensor:
    """``decode(encode(x).mode())`` of clips ``[N, 3, T, S, S]`` in [-1, 1], in [-1, 1].

    Runs a few clips at a time on the VAE's device and dtype; returns float32 on the input's
    device.
    """
    num_frames, side = frames.shape[2], frames.shape[-1]
    batch_size = max(1, EVAL_BATCH_PIXELS // (num_frames * side * side))
    outputs = []
    for chunk in frames.split(batch_size):
        chunk = chunk.to(vae.device, vae.dtype)
        decoded = vae.decode(vae.encode(chunk).latent_dist.mode()).sample
        outputs.append(decoded.clamp(-1.0, 1.0).to(frames.device, torch.float32))
    return torch.cat(outputs)


def _to_unit(frames: Tensor) -> Tensor:
    return (frames + 1.0) / 2.0


def clip_psnrs(reference: Tensor, reconstruction: Tensor) -> list[float]:
    """PSNR (dB, frames in [0, 1]) of each clip of ``[N, 3, T, S, S]`` in [-1, 1], over all its
    frames."""
    return [
        psnr(_to_unit(clip), _to_unit(decoded))
        for clip, decoded in zip(reference, reconstruction, strict=True)
    ]


def judge_clips(clips: Sequence[Tensor], captions: Sequence[str]) -> VideoDemoScore:
    """:func:`score_demo_clips` of clips, each ``[3, T, S, S]`` in [-1, 1] (a tensor
    ``[N, 3, T, S, S]`` is a sequence of them)."""
    frames = [_to_unit(clip).clamp(0, 1).permute(1, 2, 3, 0).numpy() for clip in clips]
    return score_demo_clips(frames, list(captions))  # frames [T, S, S, 3] in [0, 1]


@dataclass(frozen=True)
class VideoVaeEvaluation:
    """Reconstruction quality on held-out clips and images (posterior modes, no sampling)."""

    clip_psnr: float  # mean over clips of the per-clip PSNR, dB
    image_psnr: float  # mean over images, dB
    judge: VideoDemoScore  # the video demo's judge on the reconstructed clips
    psnr_by_geometry: dict[str, float]  # "17x64" (frames x side) → mean PSNR, dB

    def as_dict(self) -> dict:
        judge = self.judge.as_dict()
        return {
            "clip_psnr_db": round(self.clip_psnr, 3),
            "image_psnr_db": round(self.image_psnr, 3),
            "psnr_db_by_geometry": {k: round(v, 3) for k, v in self.psnr_by_geometry.items()},
            "judge": {k: v for k, v in judge.items() if v or k.endswith("accuracy")},
        }

    def summary(self) -> str:
        return (
            f"clips {self.clip_psnr:.2f} dB, images {self.image_psnr:.2f} dB, judge colour "
            f"{self.judge.color_accuracy:.3f} shape {self.judge.shape_accuracy:.3f} direction "
            f"{self.judge.direction_accuracy:.3f} ({self.judge.num_clips} clips)"
        )


def evaluate_video_vae(
    vae: AutoencoderKLWan, clips: Sequence[ClipSet], images: Sequence[ClipSet]
) -> VideoVaeEvaluation:
    """PSNR of ``clips`` and ``images`` reconstructed by ``vae``, and the judge on the clips."""
    was_training = vae.training
    vae.eval()
    clip_values, by_geometry, reconstructions, captions = [], {}, [], []
    for clip_set in clips:
        decoded = reconstruct_clips(vae, clip_set.frames)
        values = clip_psnrs(clip_set.frames, decoded)
        by_geometry["{}x{}".format(*clip_set.geometry)] = sum(values) / len(values)
        clip_values += values
        reconstructions += list(decoded)
        captions += clip_set.captions
    image_values = [
        value for image_set in images
        for value in clip_psnrs(image_set.frames, reconstruct_clips(vae, image_set.frames))
    ]  # fmt: skip
    vae.train(was_training)
    return VideoVaeEvaluation(
        clip_psnr=sum(clip_values) / len(clip_values),
        image_psnr=sum(image_values) / len(image_values),
        judge=judge_clips(reconstructions, captions),
        psnr_by_geometry=by_geometry,
    )


@torch.no_grad()
def latent_channel_stats(
    vae: AutoencoderKLWan, sets: Sequence[ClipSet]
) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of the posterior modes of every item of
    ``sets``, over all latent frames and positions: Wan's ``latents_mean`` and ``latents_std``
    (WanPipeline maps latents to ``(z − mean) / std``)."""
    was_training = vae.training
    vae.eval()
    values = []
    for clip_set in sets:
        num_frames, side = clip_set.geometry
        batch_size = max(1, EVAL_BATCH_PIXELS // (num_frames * side * side))
        for chunk in clip_set.frames.split(batch_size):
            latents = vae.encode(chunk.to(vae.device, vae.dtype)).latent_dist.mode()
            values.append(latents.float().transpose(0, 1).flatten(1).cpu())  # [z, N·t·h·w]
    vae.train(was_training)
    channels = torch.cat(values, dim=1).double()
    return channels.mean(dim=1).tolist(), channels.std(dim=1).tolist()
