"""The DiT family: our own diffusion transformer (``model.family: dit``), its sizes, token
layout and packing, and its backbone (docs/dit.md). Importing it registers the family."""

from impasto.models.dit import build  # noqa: F401  (registers the "dit" family)
