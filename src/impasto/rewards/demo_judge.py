"""The ``demo`` reward: a small CNN that judges the colour and shape of a demo image.

The reward of an image ``[3, H, W]`` in [0, 1] for "a red circle on a white background" is
``log p(red | image) + log p(circle | image)`` under :class:`DemoJudge`: at most 0, a certain
match. The shipped judge (``assets/demo_judge/``, docs/draftp.md) is trained by
``python -m impasto.rewards.demo_judge --out FILE`` on demo images rendered in memory, most of
them through the shipped demo VAE: a generator can only draw what that decoder outputs.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from importlib.resources import as_file, files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from impasto.data import render_demo_image
from impasto.data.demo import DEMO_BACKGROUNDS, DEMO_COLORS, DEMO_SHAPES, demo_spec
from impasto.data.demo_eval import parse_demo_caption
from impasto.data.seeding import derive_seed
from impasto.models.vae_files import load_demo_vae
from impasto.rewards import register_reward
from impasto.vae.train import lr_at

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

    from impasto.config.draftp import RewardConfig

JUDGE_SIZE = 64
COLOR_NAMES: tuple[str, ...] = tuple(DEMO_COLORS)
SHAPE_NAMES: tuple[str, ...] = DEMO_SHAPES
CHANNELS, STRIDES = (16, 32, 48, 64, 64), (2, 2, 1, 2, 2)  # 64 → 32 → 16 → 16 → 8 → 4 px
JUDGE_ASSET = ("assets", "demo_judge", "judge.safetensors")
LABELS_KEY, TRAINING_KEY = "labels", "impasto_training"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEMO_PROMPT = re.compile(
    f"an? ({'|'.join(DEMO_COLORS)}) ({'|'.join(DEMO_SHAPES)}) "
    f"on a ({'|'.join(DEMO_BACKGROUNDS)}) background"
)
TRAIN_HINT = "train one with `python -m impasto.rewards.demo_judge --out FILE`"


def resize_for_judge(images: Tensor) -> Tensor:
    """``[B, 3, H, W]`` → ``[B, 3, 64, 64]``: bilinear with antialiasing (in fp32: CPU torch has
    none for bf16), differentiable."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"reward demo: images must be [B, 3, H, W], got {tuple(images.shape)}")
    if images.shape[-2:] == (JUDGE_SIZE, JUDGE_SIZE):
        return images
    return F.interpolate(images.float(), JUDGE_SIZE, mode="bilinear", antialias=True).to(images)


class DemoJudge(nn.Module):
    """Five conv 3x3 + SiLU stages, a global average pool (:meth:`features`), two linear heads.

    Images ``[B, 3, H, W]`` in [0, 1] → ``(colour logits [B, 6], shape logits [B, 3])``, in the
    order of ``DEMO_COLORS`` and ``DEMO_SHAPES``."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for width_in, width, stride in zip((3, *CHANNELS[:-1]), CHANNELS, STRIDES, strict=True):
            layers += [nn.Conv2d(width_in, width, 3, stride=stride, padding=1), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        self.color_head = nn.Linear(CHANNELS[-1], len(COLOR_NAMES))
        self.shape_head = nn.Linear(CHANNELS[-1], len(SHAPE_NAMES))

    def features(self, images: Tensor) -> Tensor:
        """The pooled penultimate features ``[B, 64]`` of images in [0, 1]."""
        return self.body(resize_for_judge(images) * 2 - 1).mean(dim=(2, 3))

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        pooled = self.features(images)
        return self.color_head(pooled), self.shape_head(pooled)


def demo_labels(prompts: Sequence[str]) -> tuple[list[int], list[int]]:
    """Colour and shape indices of demo prompts ("a red circle on a white background")."""
    for prompt in prompts:
        if not DEMO_PROMPT.fullmatch(prompt):
            raise ValueError(
                f"reward demo: prompt {prompt!r} is not a demo caption; write e.g. 'a red circle "
                f"on a white background' (colours {', '.join(COLOR_NAMES)}; shapes "
                f"{', '.join(SHAPE_NAMES)}; backgrounds {', '.join(DEMO_BACKGROUNDS)})"
            )
    pairs = [parse_demo_caption(prompt) for prompt in prompts]
    return [COLOR_NAMES.index(c) for c, _ in pairs], [SHAPE_NAMES.index(s) for _, s in pairs]


def demo_log_likelihood(
    color_logits: Tensor, shape_logits: Tensor, colors: Tensor, shapes: Tensor
) -> Tensor:
    """``log p(colour) + log p(shape)`` ``[B]`` from logits ``[B, 6]``, ``[B, 3]`` and indices."""
    color = F.log_softmax(color_logits.float(), dim=-1).gather(1, colors[:, None])
    shape = F.log_softmax(shape_logits.float(), dim=-1).gather(1, shapes[:, None])
    return (color + shape)[:, 0]


class DemoReward:
    """The ``demo`` reward around a frozen :class:`DemoJudge` (see the module docstring)."""

    def __init__(self, judge: DemoJudge) -> None:
        self.judge = judge
        self.dtype, self.device = judge.color_head.weight.dtype, judge.color_head.weight.device

    def __call__(self, images: Tensor, prompts: list[str]) -> Tensor:
        if len(prompts) != len(images):
            raise ValueError(f"reward demo: {len(images)} images but {len(prompts)} prompts")
        colors, shapes = (torch.tensor(x, device=self.device) for x in demo_labels(prompts))
        return demo_log_likelihood(*self.judge(images.to(self.dtype)), colors, shapes)

    def embed(self, images: Tensor) -> Tensor:
        """The judge's pooled penultimate features ``[B, 64]``, float32."""
        return self.judge.features(images.to(self.dtype)).float()


def save_judge_file(judge: DemoJudge, out_file: Path, training: dict[str, Any]) -> None:
    """Write ``judge``'s fp32 weights to ``out_file`` (.safetensors), with its label names and
    ``training`` record (JSON) in the metadata."""
    out_file = Path(out_file)
    if out_file.suffix != ".safetensors":
        raise ValueError(f"reward demo: the judge file must end in .safetensors, got {out_file}")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        LABELS_KEY: json.dumps({"colors": COLOR_NAMES, "shapes": SHAPE_NAMES}),
        TRAINING_KEY: json.dumps(training),
    }
    state = {name: value.detach().float() for name, value in judge.state_dict().items()}
    save_file(state, out_file, metadata=metadata)


def load_judge_file(path: Path) -> tuple[DemoJudge, dict[str, Any]]:
    """``(judge in eval mode, training record)`` from a file :func:`save_judge_file` wrote."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"reward demo: cannot read {path} ({error}); {TRAIN_HINT}") from None
    if LABELS_KEY not in metadata:
        raise ValueError(f"reward demo: {path} has no judge metadata; {TRAIN_HINT}")
    labels = json.loads(metadata[LABELS_KEY])
    if (tuple(labels["colors"]), tuple(labels["shapes"])) != (COLOR_NAMES, SHAPE_NAMES):
        raise ValueError(f"reward demo: {path} judges other labels ({labels}); {TRAIN_HINT}")
    judge = DemoJudge()
    judge.load_state_dict(load_file(str(path)), strict=True)
    return judge.eval(), json.loads(metadata.get(TRAINING_KEY, "{}"))


def load_demo_judge(path: Path | str | None = None) -> DemoJudge:
    """The judge in ``path``, or the one shipped in the package; eval mode, fp32, CPU."""
    if path is not None:
        return load_judge_file(Path(path))[0]
    with as_file(files("impasto").joinpath(*JUDGE_ASSET)) as shipped:
        return load_judge_file(shipped)[0]


def build_demo_reward(config: RewardConfig, device: torch.device) -> DemoReward:
    """The ``demo`` reward: the judge in ``config.path`` (or the shipped one), frozen, eval."""
    if config.options or config.head:
        raise ValueError("reward demo takes no reward.options nor reward.head; remove them")
    judge = load_demo_judge(config.path).to(device=device, dtype=DTYPES[config.dtype])
    return DemoReward(judge.requires_grad_(False).eval())


# --- training -----------------------------------------------------------------------------------

MAX_LATENT_NOISE = 0.3  # in latent stds: at 0.25 the VAE already draws wobbly, generated shapes
LABEL_SMOOTHING = 0.05  # bounds the logits, so the reward stays smooth near a match
WARMUP_STEPS = 50  # or a tenth of the steps, if fewer
HELD_OUT_LATENT_NOISE = {"rendered": None, "vae_round_trip": 0.0, "vae_latent_noise_0.2": 0.2}


@dataclass(frozen=True)
class JudgeTrainSettings:
    """What :func:`train_demo_judge` does; each field is also a ``--flag`` of :func:`main`."""

    num_images: int = 4096  # demo images of dataset ``seed``, 3 in 4 through the VAE
    seed: int = 11  # dataset, init and batches; the demo run's dataset is seed 0
    held_out_seed: int = 12
    num_held_out: int = 252  # every (colour, shape, background) triple 4 times
    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3


@dataclass(frozen=True)
class JudgeData:
    """Demo images, uint8 ``[N, 3, 64, 64]``, with their labels."""

    images: Tensor
    colors: Tensor  # [N] int64, indices into COLOR_NAMES
    shapes: Tensor  # [N] int64, indices into SHAPE_NAMES


def render_judge_data(num_images: int, seed: int) -> JudgeData:
    """Images ``0 .. num_images - 1`` of the demo dataset ``seed`` at 64 px, rendered in memory."""
    specs = [demo_spec(index, seed, JUDGE_SIZE) for index in range(num_images)]
    pixels = np.stack([np.asarray(render_demo_image(spec, JUDGE_SIZE)) for spec in specs])
    return JudgeData(
        images=torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(),
        colors=torch.tensor([COLOR_NAMES.index(s.color) for s in specs]),
        shapes=torch.tensor([SHAPE_NAMES.index(s.shape) for s in specs]),
    )


@torch.no_grad()
def vae_round_trip(
    vae: AutoencoderKL, images: Tensor, latent_noise: Tensor, generator: torch.Generator
) -> Tensor:
    """``decode(encode(x).mean + noise)``, uint8 ``[N, 3, H, W]`` from uint8 ``images``, with
    noise std ``latent_noise`` ``[N]`` in latent stds (0.2-0.3 wobbles edges and corners)."""
    outputs = []
    for chunk, noise_std in zip(images.split(256), latent_noise.split(256), strict=True):
        latents = vae.encode(chunk.float() / 127.5 - 1).latent_dist.mean
        noise = torch.randn(latents.shape, generator=generator) / vae.config.scaling_factor
        decoded = vae.decode(latents + noise_std[:, None, None, None] * noise).sample
        outputs.append(((decoded.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8))
    return torch.cat(outputs) if outputs else images.clone()


def blur(images: Tensor) -> Tensor:
    """``images`` ``[B, C, H, W]`` through a 3x3 binomial filter (a Gaussian of sigma ~0.7 px)."""
    taps = torch.tensor([0.25, 0.5, 0.25], dtype=images.dtype, device=images.device)
    kernel = (taps[:, None] * taps).expand(images.shape[1], 1, 3, 3)
    padded = F.pad(images, (1, 1, 1, 1), mode="replicate")
    return F.conv2d(padded, kernel, groups=images.shape[1])


def augment(images: Tensor, generator: torch.Generator) -> Tensor:
    """Per image, what a generator's pictures vary in: a faint shape (blended toward the
    background, weight 0.6-1, a quarter of images), blur (sigma ~0.7 px for a quarter, ~1 px
    for a quarter), colour jitter (gain +-8 %, offset +-0.04 per channel), pixel noise (std up
    to 0.03), a horizontal flip (half). ``images`` ``[B, 3, H, W]`` in [0, 1]."""
    batch = len(images)

    def uniform(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=generator)

    edges = torch.cat([images[:, :, 0], images[:, :, -1]], -1)  # a shape spans <= 70 % of a row
    background = edges.median(-1).values[..., None, None]
    weight = torch.where(uniform(batch) < 0.25, 0.6 + 0.4 * uniform(batch), 1.0)
    images = background + weight[:, None, None, None] * (images - background)
    blurs = uniform(batch)[:, None, None, None]
    images = torch.where(blurs < 0.5, blur(images), images)
    images = torch.where(blurs < 0.25, blur(images), images)
    gain = 1 + 0.08 * (2 * uniform(batch, 3, 1, 1) - 1)
    offset = 0.04 * (2 * uniform(batch, 3, 1, 1) - 1)
    noise = 0.03 * uniform(batch, 1, 1, 1) * torch.randn(images.shape, generator=generator)
    flip = (uniform(batch) < 0.5)[:, None, None, None]
    images = images * gain + offset + noise
    return torch.where(flip, images.flip(-1), images).clamp(0, 1)


@torch.no_grad()
def judge_accuracy(judge: DemoJudge, data: JudgeData) -> dict[str, float]:
    """``{"color": accuracy, "shape": accuracy}`` of ``judge``'s argmax on ``data``."""
    colors, shapes = (logits.argmax(-1) for logits in judge(data.images.float() / 255))
    accuracy = lambda hits: round(hits.float().mean().item(), 4)  # noqa: E731
    return {"color": accuracy(colors == data.colors), "shape": accuracy(shapes == data.shapes)}


def _training_data(vae: AutoencoderKL, settings: JudgeTrainSettings) -> JudgeData:
    """The training images: a quarter as rendered, a quarter through the VAE, half through the
    VAE with latent noise up to :data:`MAX_LATENT_NOISE`."""
    data = render_judge_data(settings.num_images, settings.seed)
    generator = torch.Generator().manual_seed(derive_seed(settings.seed, -1))
    kind = torch.rand(settings.num_images, generator=generator)
    noise_std = MAX_LATENT_NOISE * torch.rand(settings.num_images, generator=generator)
    noise_std, through_vae = torch.where(kind < 0.5, noise_std, 0.0), kind < 0.75
    decoded = vae_round_trip(vae, data.images[through_vae], noise_std[through_vae], generator)
    data.images[through_vae] = decoded
    return data


def _held_out_sets(vae: AutoencoderKL, settings: JudgeTrainSettings) -> dict[str, JudgeData]:
    """The held-out images as rendered and after the VAE, per :data:`HELD_OUT_LATENT_NOISE`."""
    data = render_judge_data(settings.num_held_out, settings.held_out_seed)
    generator = torch.Generator().manual_seed(derive_seed(settings.held_out_seed, -1))
    sets = {}
    for name, std in HELD_OUT_LATENT_NOISE.items():
        noise = torch.full((settings.num_held_out,), std or 0.0)
        images = data.images if std is None else vae_round_trip(vae, data.images, noise, generator)
        sets[name] = replace(data, images=images)
    return sets


def _train_loop(
    judge: DemoJudge, data: JudgeData, settings: JudgeTrainSettings, log: Callable[[str], None]
) -> None:
    """Optimise ``judge`` in place on ``data``: AdamW, warmup then cosine, two cross-entropies."""
    steps, batch_size, smoothing = settings.steps, settings.batch_size, LABEL_SMOOTHING
    optimizer = torch.optim.AdamW(judge.parameters(), lr=settings.lr, weight_decay=0.0)
    judge.train()
    for step in range(steps):
        generator = torch.Generator().manual_seed(derive_seed(settings.seed, step))
        index = torch.randint(len(data.images), (batch_size,), generator=generator)
        images = augment(data.images[index].float() / 255, generator)
        color_logits, shape_logits = judge(images)
        loss = F.cross_entropy(color_logits, data.colors[index], label_smoothing=smoothing)
        loss = loss + F.cross_entropy(shape_logits, data.shapes[index], label_smoothing=smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings.lr, min(WARMUP_STEPS, steps // 10), steps)
        optimizer.step()
        if (step + 1) % 200 == 0 or step + 1 == steps:
            log(f"reward demo: step {step + 1}/{steps} loss {loss.item():.4f}")  # the only sync
    judge.eval()


def train_demo_judge(
    out_file: Path,
    num_images: int = JudgeTrainSettings.num_images,
    seed: int = JudgeTrainSettings.seed,
    steps: int = JudgeTrainSettings.steps,
    *,
    held_out_seed: int = JudgeTrainSettings.held_out_seed,
    num_held_out: int = JudgeTrainSettings.num_held_out,
    batch_size: int = JudgeTrainSettings.batch_size,
    lr: float = JudgeTrainSettings.lr,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train a :class:`DemoJudge` and save it to ``out_file`` (.safetensors). The arguments are
    :class:`JudgeTrainSettings`' fields; ``log`` gets progress lines (``None``: silent). Returns
    the training record stored in the file: command, settings, held-out accuracies, timings."""
    settings = JudgeTrainSettings(
        num_images, seed, held_out_seed, num_held_out, steps, batch_size, lr
    )
    if min(num_images, num_held_out, steps, batch_size) <= 0 or lr <= 0:
        raise ValueError(f"reward demo: counts and lr must be positive, got {settings}")
    if seed == held_out_seed:
        raise ValueError(f"reward demo: held_out_seed must differ from seed {seed}; pick another")
    log, start = log or (lambda message: None), time.perf_counter()
    command = ["python", "-m", "impasto.rewards.demo_judge", f"--out={out_file}"]
    command += [f"--{name.replace('_', '-')}={value}" for name, value in asdict(settings).items()]
    vae = load_demo_vae()
    data, held_out = _training_data(vae, settings), _held_out_sets(vae, settings)
    log(f"reward demo: {len(data.images)} training images in {time.perf_counter() - start:.0f} s")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        judge = DemoJudge()
    train_start = time.perf_counter()
    _train_loop(judge, data, settings, log)
    record = {
        "command": shlex.join(command),  # the equivalent command line
        "settings": asdict(settings),
        "num_parameters": sum(p.numel() for p in judge.parameters()),
        "held_out_accuracy": {name: judge_accuracy(judge, d) for name, d in held_out.items()},
        "train_seconds": round(time.perf_counter() - train_start, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "torch_num_threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__},
    }
    save_judge_file(judge, Path(out_file), record)
    log(f"reward demo: wrote {out_file}; held out: {json.dumps(record['held_out_accuracy'])}")
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m impasto.rewards.demo_judge --out FILE [--steps N ...]``; the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m impasto.rewards.demo_judge", description="Train the demo reward's judge."
    )
    parser.add_argument("--out", type=Path, required=True, help=".safetensors file to write")
    for field in fields(JudgeTrainSettings):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    args = vars(parser.parse_args(argv))
    torch.set_num_threads(args.pop("threads"))
    try:
        train_demo_judge(args.pop("out"), **args, log=print)
    except ValueError as error:
        print(f"impasto: error: {error}", file=sys.stderr)
        return 2
    return 0


# Under `python -m impasto.rewards.demo_judge` this file runs a second time as __main__, after the
# package has imported (and registered) it: registering it again would be an error.
if __name__ == "__main__":
    raise SystemExit(main())
else:
    register_reward("demo")(build_demo_reward)
