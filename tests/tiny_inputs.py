"""Fixed inputs for the tiny SDXL preset, shared by tests that compare models' outputs."""

from __future__ import annotations

import torch

from impasto.data import Batch


def tiny_batch() -> Batch:
    """Two random 64×64 images with captions, as the data loader collates them."""
    generator = torch.Generator().manual_seed(0)
    return Batch(
        pixel_values=torch.rand(2, 3, 64, 64, generator=generator) * 2 - 1,
        captions=["a red circle", "a blue square"],
        original_sizes=torch.tensor([[64, 64]] * 2),
        crop_top_lefts=torch.zeros(2, 2, dtype=torch.long),
        target_sizes=torch.tensor([[64, 64]] * 2),
        indices=torch.arange(2),
    )


def tiny_unet_output(unet) -> torch.Tensor:
    """The tiny UNet's output on one fixed input (t = 500): equal outputs, equal functions."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    context = torch.randn(1, 77, 64, generator=generator)
    added = {"text_embeds": torch.randn(1, 32, generator=generator), "time_ids": torch.ones(1, 6)}
    with torch.no_grad():
        return unet(x, torch.tensor([500]), context, added_cond_kwargs=added).sample
