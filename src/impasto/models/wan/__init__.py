"""The Wan 2.1 family (``model.family: wan``): Wan-AI's Wan 2.1 text-to-video (1.3B and 14B)
over diffusers' ``WanTransformer3DModel``, its video VAE ``AutoencoderKLWan`` and umT5, trained
with rectified flow as musubi-tuner and diffusion-pipe train it and sampled as ``WanPipeline``
samples (docs/wan.md). Importing it registers the family."""

from impasto.models.wan import build  # noqa: F401  (registers the "wan" family)
