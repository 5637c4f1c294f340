"""The baseline of ``impasto bench``: the plain diffusers training step (what the diffusers SDXL
training script does per step) on a fresh UNet, and the FLOP count of its forward + backward
with ``torch.utils.flop_counter``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from torch.utils.flop_counter import FlopCounterMode

from impasto.checkpoint.trained import build_starting_backbone
from impasto.config import Config
from impasto.data import Batch
from impasto.models import add_time_ids
from impasto.precision import autocast_factory, resolve_precision


class DiffusersStep:
    """The plain diffusers training step on a fresh UNet."""

    def __init__(self, config: Config, device: torch.device) -> None:
        self.device = device
        self.unet = build_starting_backbone(config).denoiser().to(device).train()
        self.optimizer = torch.optim.AdamW(self.unet.parameters(), lr=config.optim.lr)
        self.scheduler = DDPMScheduler(
            beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012
        )
        precision = resolve_precision(config.train.mixed_precision, device)
        self.autocast = autocast_factory(device, precision)

    def prepare(self, batch: Batch) -> None:
        device = self.device
        self.latents = batch.latent_mean.to(device)
        self.embeds = batch.prompt_embeds.to(device)
        time_ids = add_time_ids(
            batch.original_sizes, batch.crop_top_lefts, batch.target_sizes, dtype=torch.float32
        )
        self.added = {
            "text_embeds": batch.pooled_prompt_embeds.to(device),
            "time_ids": time_ids.to(device),
        }

    def forward_backward(self) -> None:
        noise = torch.randn_like(self.latents)
        timesteps = torch.randint(0, 1000, (self.latents.shape[0],), device=self.device)
        noisy = self.scheduler.add_noise(self.latents, noise, timesteps)
        with self.autocast():
            prediction = self.unet(noisy, timesteps, self.embeds, added_cond_kwargs=self.added)
        F.mse_loss(prediction.sample.float(), noise.float()).backward()

    def __call__(self) -> None:
        self.forward_backward()
        torch.nn.utils.clip_grad_norm_(self.unet.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def count_flops(step: DiffusersStep) -> int:
    """FLOPs of one forward + backward of the plain step (counted, not timed)."""
    with FlopCounterMode(display=False) as counter:
        step.forward_backward()
    step.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()
