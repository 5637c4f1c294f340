"""The tiny demo video VAE: Wan 2.1's causal 3-D ``AutoencoderKLWan`` at widths a CPU trains.

Same structure as Wan 2.1's VAE (four stages of causal 3x3x3 convolutions with RMS norms, three
spatial downsamplings, the last two also temporal: 8x spatial and 4x temporal; a mid block with
per-frame self-attention; a diagonal Gaussian posterior) with 8-32 channels instead of 96-384,
one residual block per stage instead of two, and 8 latent channels instead of 16 (issue #32).

Frames ``[B, 3, 4n + 1, H, W]`` in [-1, 1] become latents ``[B, 8, n + 1, H/8, W/8]``: latent
frame 0 encodes frame 0 alone (so a single image is a 1-frame clip), each later one 4 frames.

Why the image demo VAE's norm problem does not arise here: Wan's ``WanRMS_norm`` normalises each
pixel's channel vector on its own (``F.normalize`` over channels, no statistics over the
image), so a flat background's colour survives as the direction of that vector; it is the
GroupNorm over a whole image with one channel per group that loses it (see
:mod:`impasto.vae.architecture`). The narrowest norm here has 8 channels.

Those per-pixel norms make the init matter instead: see :func:`init_conv_weights`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKLWan
from torch import Tensor, nn

TINY_VIDEO_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 8,
    "z_dim": 8,
    "dim_mult": [1, 2, 4, 4],  # widths 8, 16, 32, 32
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],  # (sic, diffusers' spelling): 4x temporal
    "dropout": 0.0,
}
"""Architecture of the demo video VAE (``AutoencoderKLWan`` keyword arguments)."""

TINY_VIDEO_VAE_Z_DIM: int = TINY_VIDEO_VAE_CONFIG["z_dim"]


def init_conv_weights(vae: AutoencoderKLWan) -> None:
    """Initialise ``vae`` as an image autoencoder inflated to video, in place, from the global
    torch RNG: Kaiming-normal spatial weights (He et al. 2015, fan-in, ReLU gain), zero biases,
    zero weights on the earlier frames of every causal 3x3x3 convolution, and temporal
    resamplers that copy frames.

    At this init every frame goes through the same 2-D network; the encoder's temporal
    downsamplings keep the last frame of each group of 4 and the decoder's upsamplings repeat
    each latent frame 4 times. A clip then decodes to its frames 0, 4, 4, 4, 4, 8, ... and the
    earlier-frame weights, trained on clips, learn the motion in between: the inflation of an
    image VAE into a causal video VAE (the Wan 2.1 report trains a 2-D image VAE first and
    inflates it).

    Why not PyTorch's defaults: they shrink each convolution's output to ~0.6x its input, so
    the latents' part of the decoder's activations is ~1-5 % at init (the rest is the same at
    every pixel), and Wan's per-pixel RMS norms pass that constant part at full scale. Adam
    then fits the mean colour and the decoder collapses to a constant output (demo images at
    32 px, batch 16: loss 0.65 from step 150 on at lr 5e-4; with Kaiming weights, 0.05 at step
    400 at lr 2e-3). Why copy frames: with random temporal resamplers the frames' errors grew
    with time (MSE 0.02 on frame 0 to 0.14 on frame 16 after 500 clip steps), the decoder
    redrawing the first frame's content instead of the motion.
    """
    for name, module in vae.named_modules():
        if not isinstance(module, (nn.Conv2d, nn.Conv3d)):  # WanCausalConv3d is an nn.Conv3d
            continue
        nn.init.zeros_(module.bias)
        if name.endswith("time_conv"):
            _init_frame_copy(module.weight)
        elif isinstance(module, nn.Conv3d) and module.weight.shape[2] > 1:
            spatial = torch.empty(module.weight.shape[:2] + module.weight.shape[3:])
            nn.init.kaiming_normal_(spatial, nonlinearity="relu")
            with torch.no_grad():
                module.weight.zero_()
                module.weight[:, :, -1] = spatial  # the current frame (causal: the last tap)
        else:
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")


def _init_frame_copy(weight: Tensor) -> None:
    """A temporal ``(3, 1, 1)`` convolution ``[out, in, 3, 1, 1]`` that outputs its last input
    frame: ``out == in`` (a downsampling: stride 2 keeps every second frame) or ``out == 2 in``
    (an upsampling: both output frames copy the input frame)."""
    out_channels, in_channels = weight.shape[:2]
    with torch.no_grad():
        weight.zero_()
        for start in range(0, out_channels, in_channels):
            weight[start : start + in_channels, :, -1, 0, 0] = torch.eye(in_channels)


def build_tiny_video_vae(seed: int) -> AutoencoderKLWan:
    """A randomly initialised demo video VAE (:func:`init_conv_weights`); the init depends only
    on ``seed``.

    The global torch RNG is left as it was. ``latents_mean`` (zeros) and ``latents_std`` (ones)
    are placeholders until training measures them.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            **TINY_VIDEO_VAE_CONFIG,
            latents_mean=[0.0] * TINY_VIDEO_VAE_Z_DIM,
            latents_std=[1.0] * TINY_VIDEO_VAE_Z_DIM,
        )
        init_conv_weights(vae)
    return vae
