"""The Stable Diffusion 3.5 family (``model.family: sd3``): Stability AI's SD3.5 Large and
Medium over diffusers' ``SD3Transformer2DModel``, its 16-channel VAE, CLIP-L, CLIP-G and T5,
trained with rectified flow as diffusers' SD3 scripts train it (docs/sd3.md). Importing it
registers the family."""

from impasto.models.sd3 import build  # noqa: F401  (registers the "sd3" family)
