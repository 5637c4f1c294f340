"""Train the demo video VAE on the video demo's clips and save it as a diffusers folder (issue #32).

The recipe is the image demo VAE's (:mod:`impasto.vae.train`): MSE + a tiny KL term, the
decoder fed posterior samples, AdamW with warmup and cosine decay, no checkpoints. The clips
are generated in memory (:mod:`impasto.vae.video_data`). The init comes from ``seed`` and every
random draw of step ``s`` (which clips, their crops, posterior noise) from a generator seeded with
``derive_seed(seed, s)``, so a run replays exactly on the same machine and thread count.
With ``init`` a run fine-tunes a saved video VAE's weights instead (the shipped one is a
fine-tune of a 2000-step run).

After the last step the weights are rounded to the saved dtype, Wan's ``latents_mean`` and
``latents_std`` are measured per channel on training clips (so that WanPipeline's latent map
``(z − mean) / std`` gives zero-mean, unit-variance latents), and the VAE is evaluated on
held-out clips as it is saved.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import save_file

from impasto.data import derive_seed
from impasto.models.vae_files import SIDECAR_TRAINING_KEY
from impasto.models.video_autoencoder import CONFIG_NAME, WEIGHTS_NAME, load_video_vae
from impasto.vae.objective import get_pixel_loss
from impasto.vae.settings import VideoVaeTrainSettings
from impasto.vae.train import INITIAL_LOGVAR, optimizer_step
from impasto.vae.video_architecture import build_tiny_video_vae
from impasto.vae.video_data import clip_sets, image_sets, training_batch
from impasto.vae.video_metrics import VideoVaeEvaluation, evaluate_video_vae, latent_channel_stats

WEIGHT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
EVAL_SEED = 12345  # dataset seed of the held-out clips and images (training uses `seed`)
NUM_EVAL_PER_GEOMETRY = 18  # 18 clips cover the 18 held-out combinations once
NUM_EVAL_IMAGES_PER_SIDE = 32
NUM_CALIBRATION_PER_GEOMETRY = 36


@dataclass(frozen=True)
class VideoVaeReport:
    """What a :func:`train_video_vae` run produced and how well it reconstructs held-out clips."""

    out_dir: Path
    command: str  # the equivalent `python -m impasto.vae.video ...` command line
    steps: int
    train_seconds: float  # the optimisation loop only
    total_seconds: float  # training, calibration, evaluation and saving
    losses: tuple[float, ...]  # mean training loss of each logging interval
    evaluation: VideoVaeEvaluation  # of the saved (dtype-rounded) weights
    latents_mean: tuple[float, ...]
    latents_std: tuple[float, ...]
    dtype: str

    def summary(self) -> str:
        return (
            f"impasto: wrote {self.out_dir}; held-out {self.evaluation.summary()}; "
            f"{self.steps} steps in {self.train_seconds:.0f} s"
        )


def validate_video_settings(settings: VideoVaeTrainSettings) -> None:
    """Raise ``ValueError`` with a one-line message for an invalid setting."""
    get_pixel_loss(settings.loss)
    for name in ("steps", "batch_pixels"):
        if getattr(settings, name) <= 0:
            raise ValueError(f"video vae: {name} must be positive, got {getattr(settings, name)}")
    if settings.crop < 0 or settings.crop % 8:
        raise ValueError(f"video vae: crop must be 0 or a multiple of 8, got {settings.crop}")
    if not 0 <= settings.image_steps < settings.steps:
        raise ValueError(f"video vae: image_steps must be in [0, steps), got "
                         f"{settings.image_steps} of {settings.steps}")  # fmt: skip
    if settings.lr <= 0:
        raise ValueError(f"video vae: lr must be positive, got {settings.lr}")
    if settings.warmup_steps < 0 or settings.kl_weight < 0:
        raise ValueError("video vae: warmup_steps and kl_weight must be >= 0")


def train_video_vae_command(out_dir: Path, settings: VideoVaeTrainSettings, dtype: str) -> str:
    """The ``python -m impasto.vae.video`` command line that runs ``settings``."""
    words = ["python", "-m", "impasto.vae.video", "--out", str(out_dir)]
    for name, value in asdict(settings).items():
        if value != "":  # no --init: a fresh init
            words += ["--" + name.replace("_", "-"), str(value)]
    return shlex.join([*words, "--dtype", dtype])


def starting_video_vae(settings: VideoVaeTrainSettings) -> tuple[AutoencoderKLWan, dict]:
    """The VAE a run starts from and the training record of its ``settings.init`` folder
    (``{}`` for a fresh init): a fresh :func:`build_tiny_video_vae` of ``settings.seed`` with a
    :func:`near_deterministic_posterior`, or the weights of ``settings.init``, trainable."""
    if not settings.init:
        vae = build_tiny_video_vae(settings.seed)
        near_deterministic_posterior(vae)
        return vae, {}
    vae = load_video_vae(settings.init, setting="--init").requires_grad_(True)
    record = json.loads((Path(settings.init) / CONFIG_NAME).read_text(encoding="utf-8"))
    return vae.train(), record.get(SIDECAR_TRAINING_KEY, {})


def near_deterministic_posterior(vae: AutoencoderKLWan) -> None:
    """Start the posterior's std at ``exp(INITIAL_LOGVAR / 2)`` ~ 0.05, as the image VAE does,
    so the decoder does not first learn from noise larger than the latents."""
    with torch.no_grad():
        vae.quant_conv.bias[vae.config.z_dim :] += INITIAL_LOGVAR


def fit_video_vae(
    vae: AutoencoderKLWan,
    settings: VideoVaeTrainSettings,
    log_every: int = 100,
    log: Callable[[str], None] | None = None,
) -> tuple[float, ...]:
    """Optimise ``vae`` in place for ``settings.steps`` steps; return per-interval mean losses."""
    log = log or _silent
    pixel_loss = get_pixel_loss(settings.loss)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=settings.lr, weight_decay=0.0)
    vae.train()
    losses: list[float] = []
    running, num_running = torch.zeros((), device=vae.device), 0
    for step in range(settings.steps):
        generator = torch.Generator().manual_seed(derive_seed(settings.seed, step))
        batch = training_batch(step, settings.seed, settings.batch_pixels, settings.image_steps,
                               settings.crop, generator).to(vae.device)  # fmt: skip
        # diffusers' Wan decode clamps to [-1, 1]: a pixel past its target's bound (a white or
        # black background) gets no gradient, and is right already.
        running += optimizer_step(vae, batch, generator, optimizer, pixel_loss, settings, step)
        num_running += 1
        if (step + 1) % log_every == 0 or step + 1 == settings.steps:
            losses.append(running.item() / num_running)  # the only host sync
            running, num_running = torch.zeros_like(running), 0
            log(f"video vae: step {step + 1}/{settings.steps} loss {losses[-1]:.5f}")
    vae.eval()
    return tuple(losses)


def round_weights(vae: AutoencoderKLWan, dtype: torch.dtype) -> None:
    """Round every weight to ``dtype`` and back, in place: the model then computes what the
    saved file will (evaluation and calibration measure the shipped weights)."""
    with torch.no_grad():
        for tensor in vae.state_dict().values():
            tensor.copy_(tensor.to(dtype))


def calibrate_latents(vae: AutoencoderKLWan, seed: int) -> tuple[list[float], list[float]]:
    """Measure ``latents_mean`` / ``latents_std`` per channel on training clips and images of
    dataset ``seed`` (:data:`NUM_CALIBRATION_PER_GEOMETRY` per geometry) and write them into
    ``vae.config``; return them (rounded to 6 digits)."""
    sets = clip_sets(seed, NUM_CALIBRATION_PER_GEOMETRY) + image_sets(
        seed, NUM_CALIBRATION_PER_GEOMETRY
    )
    mean, std = latent_channel_stats(vae, sets)
    mean, std = [round(v, 6) for v in mean], [round(v, 6) for v in std]
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return mean, std


def save_video_vae_folder(
    vae: AutoencoderKLWan, out_dir: Path, training: dict, dtype: torch.dtype
) -> Path:
    """Write ``out_dir/config.json`` (diffusers config + ``_impasto_training``) and
    ``out_dir/diffusion_pytorch_model.safetensors`` (weights in ``dtype``): a folder that
    :func:`~impasto.models.video_autoencoder.load_video_vae` and
    ``AutoencoderKLWan.from_pretrained`` read. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in vae.state_dict().items()}
    save_file(state, out_dir / WEIGHTS_NAME, metadata={"format": "pt"})
    config = {**json.loads(vae.to_json_string()), SIDECAR_TRAINING_KEY: training}
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


def train_video_vae(
    out_dir: Path,
    *,
    steps: int = VideoVaeTrainSettings.steps,
    batch_pixels: int = VideoVaeTrainSettings.batch_pixels,
    image_steps: int = VideoVaeTrainSettings.image_steps,
    crop: int = VideoVaeTrainSettings.crop,
    lr: float = VideoVaeTrainSettings.lr,
    warmup_steps: int = VideoVaeTrainSettings.warmup_steps,
    loss: str = VideoVaeTrainSettings.loss,
    kl_weight: float = VideoVaeTrainSettings.kl_weight,
    max_grad_norm: float = VideoVaeTrainSettings.max_grad_norm,
    seed: int = VideoVaeTrainSettings.seed,
    init: str | Path = VideoVaeTrainSettings.init,
    dtype: str = "float16",
    device: str = "cpu",
    log_every: int = 100,
    log: Callable[[str], None] | None = None,
) -> VideoVaeReport:
    """Train the demo video VAE on the video demo's clips and save it to the folder ``out_dir``.

    Args:
        out_dir: folder to write ``config.json`` and ``diffusion_pytorch_model.safetensors`` in
            (created; existing files of those names are replaced).
        steps, lr, warmup_steps: AdamW steps and schedule (cosine to 0).
        batch_pixels: frames x height x width per step (see :func:`training_batch`).
        image_steps: the first steps train on images only (an image warm-up), then on the
            mix of clips and images.
        crop: train on random ``crop`` px squares of the items (a multiple of 8; 0: whole).
        loss: pixel loss, a name in :data:`impasto.vae.objective.PIXEL_LOSSES`.
        kl_weight: KL weight on SD's per-item-sum scale (SD: 1e-6).
        max_grad_norm: gradient clipping.
        seed: init, the training clips (dataset seed), batch order and posterior noise.
        init: a video VAE folder (e.g. the shipped one) to fine-tune instead of a fresh init
            from ``seed``; its training record is kept in the new one's under ``"init"``.
        dtype: saved weights, "float16" or "float32"; evaluation measures the saved weights.
        device: where to train ("cpu", "cuda", ...).
        log_every: steps between loss logs (and host syncs).
        log: receives progress lines, e.g. ``print``; ``None`` is silent.
    """
    start = time.perf_counter()
    log = log or _silent
    settings = VideoVaeTrainSettings(
        steps, batch_pixels, image_steps, crop, lr, warmup_steps, loss, kl_weight, max_grad_norm,
        seed, str(init),
    )  # fmt: skip
    validate_video_settings(settings)
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"video vae: unknown dtype {dtype!r}; valid: {sorted(WEIGHT_DTYPES)}")
    if log_every <= 0:
        raise ValueError(f"video vae: log_every must be positive, got {log_every}")
    command = train_video_vae_command(Path(out_dir), settings, dtype)

    vae, init_record = starting_video_vae(settings)
    vae = vae.to(device)
    train_start = time.perf_counter()
    losses = fit_video_vae(vae, settings, log_every, log)
    train_seconds = time.perf_counter() - train_start

    round_weights(vae, WEIGHT_DTYPES[dtype])
    latents_mean, latents_std = calibrate_latents(vae, seed)
    log("video vae: evaluating on held-out clips and images")
    evaluation = evaluate_video_vae(
        vae,
        clip_sets(EVAL_SEED, NUM_EVAL_PER_GEOMETRY, held_out=True),
        image_sets(EVAL_SEED, NUM_EVAL_IMAGES_PER_SIDE),
    )
    training = {
        "command": command,
        "settings": asdict(settings),
        "dtype": dtype,
        "held_out": {
            "dataset_seed": EVAL_SEED,
            "clips_per_geometry": NUM_EVAL_PER_GEOMETRY,
            "images_per_side": NUM_EVAL_IMAGES_PER_SIDE,
            **evaluation.as_dict(),
        },
        "train_seconds": round(train_seconds, 1),
        **({"init": init_record} if settings.init else {}),
        "torch_num_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__},
    }
    save_video_vae_folder(vae.cpu(), Path(out_dir), training, WEIGHT_DTYPES[dtype])
    return VideoVaeReport(
        out_dir=Path(out_dir),
        command=command,
        steps=steps,
        train_seconds=train_seconds,
        total_seconds=time.perf_counter() - start,
        losses=losses,
        evaluation=evaluation,
        latents_mean=tuple(latents_mean),
        latents_std=tuple(latents_std),
        dtype=dtype,
    )


def _silent(message: str) -> None:
    pass
