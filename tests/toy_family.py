"""A second model family and two more training methods, registered from outside the package:
the walkthrough of docs/architecture.md and the proof that the seams hold (tests/test_seams.py).

``ToyBackbone``: a three-block conv net conditioned on a bag-of-words text embedding (FiLM),
over a fixed 8× average-pooling "autoencoder". ``X0Method``: plain x0-MSE denoising.
``PromptMethod``: a prompts-only method (it never needs an image).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from impasto.train.methods import DataNeeds, MethodContext, StepOutput

VOCAB, WIDTH, FACTOR = 97, 16, 8


@dataclass(frozen=True)
class ToyText:
    embedding: Tensor  # [B, WIDTH]


@dataclass(frozen=True)
class ToyCondition:
    vector: Tensor  # [B, WIDTH]

    def cat(self, other: ToyCondition) -> ToyCondition:
        return ToyCondition(torch.cat([self.vector, other.vector]))


class ToyTextEncoder(nn.Module):
    """Mean of word embeddings; words are hashed into ``VOCAB`` buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, captions: list[str]) -> Tensor:
        rows = []
        for caption in captions:
            ids = [zlib.crc32(word.encode()) % VOCAB for word in caption.split()] or [0]
            rows.append(self.embed(torch.tensor(ids, device=self.embed.weight.device)).mean(0))
        return torch.stack(rows)


class ToyDenoiser(nn.Module):
    """conv → FiLM(text, t) → conv → conv, as three named blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, WIDTH, 3, padding=1)
        self.mid = nn.Conv2d(WIDTH, WIDTH, 3, padding=1)
        self.up = nn.Conv2d(WIDTH, 3, 3, padding=1)
        self.film = nn.Linear(WIDTH + 1, 2 * WIDTH)

    def forward(self, x: Tensor, t: Tensor, text: Tensor) -> Tensor:
        scale, shift = self.film(torch.cat([text, t.float()[:, None]], 1)).chunk(2, dim=1)
        h = F.silu(self.down(x)) * (1 + scale[..., None, None]) + shift[..., None, None]
        return self.up(F.silu(self.mid(h)))


class AveragePool(nn.Module):
    """The toy autoencoder: 8× average pooling (no weights)."""

    def forward(self, pixels: Tensor) -> Tensor:
        return F.avg_pool2d(pixels, FACTOR)


class ToyBackbone:
    family = "toy"

    def __init__(self, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.nets = {"unet": ToyDenoiser(), "text_encoder": ToyTextEncoder()}
        self.vae = AveragePool()

    def parts(self) -> dict[str, nn.Module]:
        return dict(self.nets)

    def frozen(self) -> dict[str, nn.Module]:
        return {"vae": self.vae}

    def modules(self) -> dict[str, nn.Module]:
        return self.parts() | self.frozen()

    def denoiser(self) -> nn.Module:
        return self.nets["unet"]

    def with_denoiser(self, denoiser: nn.Module) -> ToyBackbone:
        other = copy.copy(self)
        other.nets = {**self.nets, "unet": denoiser}
        return other

    @property
    def device(self) -> torch.device:
        return self.nets["unet"].up.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.nets["unet"].up.weight.dtype

    def to(self, device: Any) -> ToyBackbone:
        for module in self.modules().values():
            module.to(device)
        return self

    def blocks(self) -> dict[str, nn.Module]:
        net = self.nets["unet"]
        return {"down.0": net.down, "mid": net.mid, "up.0": net.up}

    def unused_parameters(self, part: str) -> tuple[str, ...]:
        return ()

    def adapter_targets(self, part: str, preset: str) -> list[str]:
        kinds = nn.Conv2d | nn.Linear
        return [name for name, m in self.nets[part].named_modules() if isinstance(m, kinds)]

    def latent_posterior(self, pixels: Tensor) -> tuple[Tensor, Tensor]:
        mean = self.vae(pixels.to(self.device))
        return mean, torch.full_like(mean, 0.01)

    def encode_latents(self, sample: Tensor) -> Tensor:
        return sample * 2.0

    def decode_latents(self, latents: Tensor) -> Tensor:
        with torch.no_grad():
            return self.decode_images(latents).cpu()

    def decode_images(self, latents: Tensor, checkpointing: bool = False) -> Tensor:
        pixels = F.interpolate(latents.float() / 2.0, scale_factor=FACTOR)
        return (pixels / 2 + 0.5).clamp(0, 1)

    def latent_format(self) -> tuple[int, int]:
        return 3, FACTOR

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return 3, height // FACTOR, width // FACTOR

    def encode_text(self, captions: list[str]) -> ToyText:
        return ToyText(self.nets["text_encoder"](captions))

    def text_from_cache(self, batch: Any) -> None:
        return None

    def condition(self, text: ToyText, batch: Any) -> ToyCondition:
        return ToyCondition(text.embedding)

    def sampling_condition(self, prompts: list[str], height: int, width: int) -> ToyCondition:
        return ToyCondition(self.encode_text(prompts).embedding)

    def forward(self, x_t: Tensor, timesteps: Tensor, condition: ToyCondition) -> Tensor:
        times = timesteps.reshape(-1).expand(x_t.shape[0])  # samplers pass one t for all rows
        return self.nets["unet"](x_t, times / 1000.0, condition.vector)

    def cache_identity(self, kind: str) -> tuple[object, ...]:
        return (self.nets["text_encoder"],) if kind == "text" else ("avg-pool", FACTOR)

    def checkpoint_metadata(self) -> dict[str, str]:
        return {"impasto.family": self.family}


def build_toy(config: Any) -> ToyBackbone:
    return ToyBackbone(config.model.init_seed)


class X0Method:
    """Predict the clean latents from x_t = x0 + t·ε with t ~ U(0, 1): the x0-MSE."""

    needs = DataNeeds.IMAGES_AND_CAPTIONS

    def __init__(self, context: MethodContext) -> None:
        self.backbone, self.autocast = context.backbone, context.autocast

    def step(self, batch: Any, generator: torch.Generator, rows: Any = None) -> StepOutput:
        backbone = self.backbone
        with torch.no_grad():
            mean, _ = backbone.latent_posterior(batch.pixel_values)
            x0 = backbone.encode_latents(mean)
        t = torch.rand(x0.shape[0], generator=generator).to(x0.device)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device)
        condition = backbone.condition(backbone.encode_text(batch.captions), batch)
        with self.autocast():
            prediction = backbone.forward(x0 + t[:, None, None, None] * noise, t * 1000, condition)
        loss = F.mse_loss(prediction.float(), x0)
        return StepOutput(loss, {"mean_t": t.mean()})


class PromptMethod:
    """A prompts-only method: pull the text embedding of each prompt towards a target."""

    needs = DataNeeds.PROMPTS

    def __init__(self, context: MethodContext) -> None:
        self.backbone = context.backbone

    def step(self, batch: Any, generator: torch.Generator, rows: Any = None) -> StepOutput:
        assert batch.pixel_values is None  # a prompts-only stream never loads an image
        embedding = self.backbone.encode_text(batch.captions).embedding
        return StepOutput(embedding.square().mean())
