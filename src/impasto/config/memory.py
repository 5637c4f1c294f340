"""The ``memory`` and ``ema`` sections: how a step trades memory for speed, and the moving
average of the trained weights (docs/speed-memory.md)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from impasto.config.section import MAX_STEPS, Float, Int, Section

BLOCK_NAME = r"^(down\.\d+|mid|up\.\d+)$"


class MemoryConfig(Section):
    """How the UNet step trades memory for speed (docs/speed-memory.md)."""

    gradient_checkpointing: Literal["none", "all"] | list[str] = Field(
        "none",
        description="recompute activations in backward: none, all, or a list of UNet blocks "
        "such as [down.1, mid, up.0]",
    )
    attention: Literal["sdpa", "flash", "efficient", "math"] = Field(
        "sdpa",
        description="scaled-dot-product attention kernel: sdpa lets PyTorch choose; flash / "
        "efficient / math force one (an error where it cannot run)",
    )
    channels_last: bool = Field(False, description="UNet convolutions in NHWC memory format")
    compile: Literal["none", "blocks", "unet"] = Field(
        "none", description="torch.compile each UNet block (regional: fast to compile) or all"
    )
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = Field(
        "default", description="reduce-overhead uses CUDA graphs"
    )
    compile_backend: str = Field("inductor", description="torch.compile backend")
    fused_backward: bool = Field(
        False,
        description="step each parameter in its gradient hook, so full gradients never coexist "
        "(needs grad_accum_steps 1 and optim.max_grad_norm null)",
    )
    offload_blocks: bool = Field(
        False, description="keep UNet blocks in CPU memory, streamed to the GPU when used"
    )
    resident_blocks: Int = Field(
        0, ge=0, le=1024, description="offload: blocks that stay on the GPU"
    )
    vae_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="the VAE's weights (fp16 overflows in SDXL's VAE; not offered)"
    )
    frozen_dtype: Literal["fp32", "bf16", "float8", "int8"] = Field(
        "fp32",
        description="weights nothing trains: frozen text encoders and the base weights under "
        "LoRA adapters (bf16 halves them: SDXL's UNet 10.3 → 5.1 GB; needs "
        "train.mixed_precision: bf16); float8 or int8: the linear base weights under LoRA in "
        "one byte each, torchao weight-only (a 12 B transformer's 44 → 11 GiB; "
        'pip install "impasto[quant]")',
    )

    @field_validator("gradient_checkpointing")
    @classmethod
    def _block_names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            bad = [name for name in value if not re.match(BLOCK_NAME, name)]
            if bad:
                raise ValueError(f"unknown UNet block {bad[0]!r}; name blocks down.N, mid or up.N")
        return value


class EmaConfig(Section):
    """An exponential moving average of the trained weights (docs/speed-memory.md)."""

    enabled: bool = False
    decay: Float = Field(0.9999, ge=0, lt=1)
    warmup: Literal["none", "power"] = Field(
        "none", description="power: decay min(decay, 1 - (1 + t/inv_gamma)^-power) (k-diffusion)"
    )
    inv_gamma: Float = Field(1.0, gt=0)
    power: Float = Field(2 / 3, gt=0)
    update_every: Int = Field(
        1, ge=1, le=MAX_STEPS, description="update every N steps (with decay^N)"
    )
    device: Literal["cpu", "same"] = Field(
        "same",
        description="where the fp32 shadow weights live: same (beside the weights: fast) or "
        "cpu (saves GPU memory; each update copies the weights over PCIe, so raise "
        "update_every)",
    )
    sample_with_ema: bool = Field(True, description="validation samples use the EMA weights")
