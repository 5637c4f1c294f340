"""Train the tiny demo VAE on an image folder and save it as one safetensors file.

The loop is plain (no checkpoints, no resume: a run takes minutes on a CPU). Every random draw
of step ``s`` (batch indices, posterior noise) comes from a generator seeded with
``derive_seed(seed, s)``, and the init from ``seed``, so a run replays exactly on the same
machine with the same number of threads.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKL
from torch import Tensor

from impasto.data import derive_seed, scan_image_folder
from impasto.models.vae_files import save_vae_file
from impasto.vae.architecture import TINY_VAE_DOWNSAMPLING, build_tiny_vae
from impasto.vae.metrics import latent_std, load_images, mean_psnr
from impasto.vae.objective import get_pixel_loss, vae_loss
from impasto.vae.settings import VaeTrainSettings

MAX_AUTO_HELD_OUT = 64
INITIAL_LOGVAR = -6.0


@dataclass(frozen=True)
class VaeReport:
    """What a :func:`train_vae` run produced and how well it reconstructs held-out images."""

    out_file: Path
    config_file: Path
    command: str  # the equivalent `impasto train-vae ...` command line
    num_train_images: int
    num_held_out_images: int
    steps: int
    train_seconds: float  # the optimisation loop only
    total_seconds: float  # loading, training, evaluation and saving
    losses: tuple[float, ...]  # mean training loss of each logging interval
    psnr_before: float  # held-out PSNR (dB) of the random init
    psnr: float  # held-out PSNR (dB) of the trained VAE
    scaling_factor: float  # 1 / std of the trained latents on the training images
    latent_shape: tuple[int, int, int]  # (C, H, W) per image

    def summary(self) -> str:
        c, h, w = self.latent_shape
        return (
            f"impasto: wrote {self.out_file} and {self.config_file}; held-out PSNR "
            f"{self.psnr:.2f} dB (random init {self.psnr_before:.2f} dB, held-out images: "
            f"{self.num_held_out_images}); latents {c}x{h}x{w}; scaling_factor "
            f"{self.scaling_factor:.5f}; {self.steps} steps in {self.train_seconds:.0f} s"
        )


def validate_settings(settings: VaeTrainSettings) -> None:
    """Raise ``ValueError`` with a one-line message for an invalid setting."""
    get_pixel_loss(settings.loss)
    if settings.resolution <= 0 or settings.resolution % TINY_VAE_DOWNSAMPLING:
        raise ValueError(
            f"vae: resolution must be a positive multiple of {TINY_VAE_DOWNSAMPLING}, "
            f"got {settings.resolution}"
        )
    for name in ("steps", "batch_size"):
        if getattr(settings, name) <= 0:
            raise ValueError(f"vae: {name} must be positive, got {getattr(settings, name)}")
    if settings.lr <= 0:
        raise ValueError(f"vae: lr must be positive, got {settings.lr}")
    if settings.warmup_steps < 0 or settings.kl_weight < 0:
        raise ValueError("vae: warmup_steps and kl_weight must be >= 0")


def lr_at(step: int, lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to 0."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def train_vae_command(
    data_dir: Path, out_file: Path, held_out: Path | None, settings: VaeTrainSettings
) -> str:
    """The ``impasto train-vae`` command line that runs ``settings`` (every option spelled out)."""
    words = ["impasto", "train-vae", str(data_dir), "--out", str(out_file)]
    if held_out is not None:
        words += ["--held-out", str(held_out)]
    for name, value in asdict(settings).items():
        words += ["--" + name.replace("_", "-"), str(value)]
    return shlex.join(words)


def split_held_out(data_dir: Path, held_out: Path | None) -> tuple[list, list]:
    """``(train_records, held_out_records)``: ``held_out``'s images, or the last 5% (<= 64)."""
    records = scan_image_folder(Path(data_dir))
    if held_out is not None:
        return records, scan_image_folder(Path(held_out))
    if len(records) < 2:
        raise ValueError(f"vae: {data_dir} has 1 image; pass --held-out or add images")
    num_held_out = min(MAX_AUTO_HELD_OUT, max(1, len(records) // 20))
    return records[:-num_held_out], records[-num_held_out:]


def _near_deterministic_posterior(vae: AutoencoderKL) -> None:
    # The posterior's log-variance channels start near 0 (std 1, larger than the latents), and
    # the 1e-6 KL weight barely moves them, so the decoder would first learn from noise. Start
    # them at std exp(-3) ~ 0.05; reconstruction then decides how small they get.
    latent_channels = vae.config.latent_channels
    with torch.no_grad():
        vae.quant_conv.bias[latent_channels:] += INITIAL_LOGVAR


def _train_loop(
    vae: AutoencoderKL,
    images: Tensor,
    settings: VaeTrainSettings,
    log_every: int,
    log: Callable[[str], None],
) -> tuple[float, ...]:
    """Optimise ``vae`` in place on ``images`` ``[N, 3, R, R]``; return per-interval mean losses."""
    pixel_loss = get_pixel_loss(settings.loss)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.lr, weight_decay=0.0)
    vae.train()
    losses: list[float] = []
    running, num_running = torch.zeros((), device=images.device), 0
    for step in range(settings.steps):
        generator = torch.Generator().manual_seed(derive_seed(settings.seed, step))
        indices = torch.randint(len(images), (settings.batch_size,), generator=generator)
        batch = images[indices.to(images.device)]
        running += optimizer_step(vae, batch, generator, optimizer, pixel_loss, settings, step)
        num_running += 1
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            losses.append(running.item() / num_running)  # the only host sync
            running, num_running = torch.zeros_like(running), 0
            log(f"vae: step {step + 1}/{settings.steps} loss {losses[-1]:.5f}")
    vae.eval()
    return tuple(losses)


def optimizer_step(
    vae: torch.nn.Module, batch: Tensor, generator: torch.Generator,
    optimizer: torch.optim.Optimizer, pixel_loss: Callable, settings: Any, step: int,
) -> Tensor:  # fmt: skip
    """One step of a VAE on ``batch`` (images or clips): a posterior sample (its noise from
    ``generator``), the reconstruction and KL loss, clipped gradients, the warmup-cosine lr of
    ``step``. Returns the loss, detached (no host sync)."""
    posterior = vae.encode(batch).latent_dist
    noise = torch.randn(posterior.mean.shape, generator=generator).to(batch.device)
    decoded = vae.decode(posterior.mean + posterior.std * noise).sample
    output = vae_loss(decoded, batch, posterior, pixel_loss, settings.kl_weight)
    optimizer.zero_grad(set_to_none=True)
    output.loss.backward()
    torch.nn.utils.clip_grad_norm_(vae.parameters(), settings.max_grad_norm)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, settings.lr, settings.warmup_steps, settings.steps)
    optimizer.step()
    return output.loss.detach()


def train_vae(
    data_dir: Path,
    out_file: Path,
    *,
    resolution: int = 64,
    steps: int = 4000,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    held_out: Path | None = None,
    warmup_steps: int = 100,
    loss: str = "mse",
    kl_weight: float = 1e-6,
    max_grad_norm: float = 1.0,
    device: str = "cpu",
    log_every: int = 100,
    log: Callable[[str], None] | None = None,
) -> VaeReport:
    """Train the tiny preset's ``AutoencoderKL`` on ``data_dir`` and save it to ``out_file``.

    Args:
        data_dir: image folder (see :func:`impasto.data.scan_image_folder`), centre-cropped.
        out_file: ``.safetensors`` file to write; ``config.json`` is written beside it.
        resolution: training and evaluation side, a multiple of 8.
        steps, batch_size, lr, warmup_steps: AdamW steps and schedule (cosine to 0).
        seed: init, batch order and posterior noise.
        held_out: folder of evaluation images; ``None`` holds out the last 5% (<= 64) of
            ``data_dir``.
        loss: pixel loss, a name in :data:`impasto.vae.objective.PIXEL_LOSSES`.
        kl_weight: KL weight on SD's per-image-sum scale (SD: 1e-6).
        max_grad_norm: gradient clipping.
        device: where to train ("cpu", "cuda", ...).
        log_every: steps between loss logs (and host syncs).
        log: receives progress lines, e.g. ``print``; ``None`` is silent.

    Returns:
        A :class:`VaeReport`. ``scaling_factor`` is set to ``1 / std`` of the trained latents.
    """
    start = time.perf_counter()
    log = log or _silent
    settings = VaeTrainSettings(
        resolution, steps, batch_size, lr, warmup_steps, loss, kl_weight, max_grad_norm, seed
    )  # fmt: skip
    validate_settings(settings)
    if log_every <= 0:
        raise ValueError(f"vae: log_every must be positive, got {log_every}")
    out_file = Path(out_file)
    if out_file.suffix != ".safetensors":
        raise ValueError(f"vae: the output file must end in .safetensors, got {out_file}")
    command = train_vae_command(Path(data_dir), out_file, held_out, settings)
    train_records, held_out_records = split_held_out(Path(data_dir), held_out)
    train_images = load_images(train_records, resolution).to(device)
    held_out_images = load_images(held_out_records, resolution).to(device)
    log(f"vae: {len(train_images)} training and {len(held_out_images)} held-out images")

    vae = build_tiny_vae(seed).to(device)
    _near_deterministic_posterior(vae)
    psnr_before = mean_psnr(vae, held_out_images)
    train_start = time.perf_counter()
    losses = _train_loop(vae, train_images, settings, log_every, log)
    train_seconds = time.perf_counter() - train_start

    scaling_factor, psnr, latent_shape = _calibrate_and_evaluate(vae, train_images, held_out_images)
    training = {
        "command": command,
        "settings": asdict(settings),
        "num_train_images": len(train_images),
        "num_held_out_images": len(held_out_images),
        "psnr_held_out_db": round(psnr, 3),
        "psnr_held_out_db_at_init": round(psnr_before, 3),
        "train_seconds": round(train_seconds, 1),
        "torch_num_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
    }
    config_file = save_vae_file(vae.cpu(), out_file, training)
    return VaeReport(
        out_file=out_file,
        config_file=config_file,
        command=command,
        num_train_images=len(train_images),
        num_held_out_images=len(held_out_images),
        steps=settings.steps,
        train_seconds=train_seconds,
        total_seconds=time.perf_counter() - start,
        losses=losses,
        psnr_before=psnr_before,
        psnr=psnr,
        scaling_factor=scaling_factor,
        latent_shape=latent_shape,
    )


def _silent(message: str) -> None:
    pass


def _calibrate_and_evaluate(
    vae: AutoencoderKL, train_images: Tensor, held_out_images: Tensor
) -> tuple[float, float, tuple[int, int, int]]:
    """Set ``scaling_factor = 1 / latent std`` on the training images (Rombach et al. 2022).

    Returns ``(scaling_factor, held-out PSNR in dB, latent shape (C, H, W) of one image)``.
    """
    scaling_factor = 1.0 / latent_std(vae, train_images)
    vae.register_to_config(scaling_factor=scaling_factor)
    with torch.no_grad():
        channels, height, width = vae.encode(held_out_images[:1]).latent_dist.mode().shape[1:]
    return scaling_factor, mean_psnr(vae, held_out_images), (channels, height, width)
