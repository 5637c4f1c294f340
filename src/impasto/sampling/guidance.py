"""Classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598) with optional rescale.

Guidance combines two predictions of the same network at the same input: one conditioned on
the prompt, one on the negative prompt (the "unconditional" branch; impasto trains it through
caption dropout as the empty-prompt embedding). Both are computed in one batched forward of
``[uncond; cond]``, as diffusers' SDXL pipeline does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

Conditioning = TypeVar("Conditioning")


def cfg(uncond: Tensor, cond: Tensor, scale: float) -> Tensor:
    """uncond + scale·(cond − uncond): scale 1 is ``cond``, 0 is ``uncond`` (eq. 6)."""
    return uncond + scale * (cond - uncond)


def rescale_cfg(guided: Tensor, cond: Tensor, rescale: float) -> Tensor:
    """Guidance rescale φ (Lin et al. 2023, arXiv:2305.08891, §3.4 and Algorithm 2).

    x_resc = guided·std(cond)/std(guided), std per sample over (C, H, W); returns
    φ·x_resc + (1 − φ)·guided. Counters the over-exposure of large guidance scales, needed
    with zero terminal SNR (the paper uses φ = 0.7). Applied to the model output (ε or v) as in
    diffusers' ``rescale_noise_cfg``.
    """
    dims = list(range(1, cond.ndim))
    std_cond = cond.std(dim=dims, keepdim=True)
    std_guided = guided.std(dim=dims, keepdim=True)
    rescaled = guided * (std_cond / std_guided)
    return rescale * rescaled + (1 - rescale) * guided


def guided_output(
    model: Callable[[Tensor, Tensor, Conditioning], Tensor],
    x: Tensor,
    timestep: Tensor,
    cond: Conditioning,
    uncond_and_cond: Conditioning | None,
    scale: float,
    rescale: float = 0.0,
) -> Tensor:
    """The guided model output at ``x`` ``[B, ...]``, from one network forward.

    ``model(x, timestep, conditioning)`` is the network call. ``cond`` conditions B rows on the
    prompts; ``uncond_and_cond`` is the same batched as ``[uncond; cond]`` (2B rows), built
    once by the caller. With ``scale == 1`` or no ``uncond_and_cond`` only the conditional
    branch runs (half the compute); otherwise the network sees ``[x; x]`` and the halves are
    combined by ``cfg`` (then ``rescale_cfg`` if ``rescale > 0``).
    """
    if uncond_and_cond is None or scale == 1.0:
        return model(x, timestep, cond)
    output_uncond, output_cond = model(torch.cat([x, x]), timestep, uncond_and_cond).chunk(2)
    guided = cfg(output_uncond, output_cond, scale)
    if rescale > 0.0:
        guided = rescale_cfg(guided, output_cond, rescale)
    return guided
