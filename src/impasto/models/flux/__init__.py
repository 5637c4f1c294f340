"""The FLUX.1 family (``model.family: flux``): Black Forest Labs' FLUX.1 transformer over
diffusers' ``FluxTransformer2DModel``, its 16-channel VAE, CLIP-L and T5, trained with
rectified flow as the FLUX authors' and diffusers' scripts train it (docs/flux.md). Importing
it registers the family."""

from impasto.models.flux import build  # noqa: F401  (registers the "flux" family)
