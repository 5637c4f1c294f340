"""Memory and speed options of the UNet step (config section ``memory``).

Each option changes how the step runs, never what it computes (up to floating-point order):
gradient checkpointing per UNet block, the scaled-dot-product attention kernel, channels-last
convolutions, and regional ``torch.compile`` (each down/mid/up block compiled on its own, so the
first step compiles a few small graphs instead of one huge one: PyTorch's "regional
compilation" recipe).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from impasto.config.memory import MemoryConfig
from impasto.models.backbone import Backbone

ContextFactory = Callable[[], AbstractContextManager]

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def select_blocks(blocks: dict[str, nn.Module], names: str | list[str]) -> dict[str, nn.Module]:
    """``all``, ``none`` or a list of block names → those blocks (one-line error if unknown)."""
    if names == "all":
        return blocks
    if names == "none":
        return {}
    unknown = [name for name in names if name not in blocks]
    if unknown:
        raise ValueError(
            f"memory: this model has no block {unknown[0]!r}; its blocks: {', '.join(blocks)}"
        )
    return {name: blocks[name] for name in names}


def set_gradient_checkpointing(
    denoiser: nn.Module, blocks: dict[str, nn.Module], names: str | list[str]
) -> list[str]:
    """Recompute the activations of the chosen blocks in backward (diffusers' own checkpointing,
    enabled for the whole model, then switched off in the other blocks). Returns the names."""
    chosen = select_blocks(blocks, names)
    if not chosen:
        return []
    denoiser.enable_gradient_checkpointing()
    for name, block in blocks.items():
        if name not in chosen:
            for module in block.modules():
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = False
    return list(chosen)


def compile_denoiser(
    denoiser: nn.Module, blocks: dict[str, nn.Module], how: str, mode: str, backend: str
) -> None:
    """``torch.compile`` in place (state-dict keys unchanged): each block, or the whole model."""
    if how == "none":
        return
    options = {"backend": backend, "mode": None if mode == "default" else mode}
    if how == "unet":
        denoiser.compile(**options)
        return
    for block in blocks.values():
        block.compile(**options)


def set_weight_dtypes(
    backbone: Backbone, mixed_precision: str, vae_dtype: str, frozen_dtype: str = "fp32"
) -> None:
    """``pure_bf16``: the trainable parts hold bf16 weights; the frozen networks (the VAE) as
    ``vae_dtype``. ``frozen_dtype`` bf16: every parameter of the parts that does not train (a
    frozen text encoder, the base weights under adapters) in bf16; what trains keeps fp32.
    Call it once the parts say what trains (``requires_grad``)."""
    if mixed_precision == "pure_bf16":
        for module in backbone.parts().values():
            module.to(torch.bfloat16)
    elif frozen_dtype == "bf16":
        for module in backbone.parts().values():
            for parameter in module.parameters():
                if not parameter.requires_grad:
                    parameter.data = parameter.data.to(torch.bfloat16)
    for module in backbone.frozen().values():
        module.to(torch.bfloat16 if vae_dtype == "bf16" else torch.float32)


def apply_memory_options(backbone: Backbone, memory: MemoryConfig) -> None:
    """Set up the denoiser as ``memory`` asks (after it is on its device, before training)."""
    denoiser, blocks = backbone.denoiser(), backbone.blocks()
    set_gradient_checkpointing(denoiser, blocks, memory.gradient_checkpointing)
    if memory.channels_last:
        denoiser.to(memory_format=torch.channels_last)
    compile_denoiser(denoiser, blocks, memory.compile, memory.compile_mode, memory.compile_backend)


def attention_context(attention: str) -> ContextFactory:
    """A context factory that restricts SDPA to one kernel (``sdpa``: PyTorch chooses)."""
    if attention == "sdpa":
        return contextlib.nullcontext
    backend = SDPA_BACKENDS[attention]
    return lambda: sdpa_kernel(backend)


def combined(
    *factories: Callable[[], AbstractContextManager],
) -> Callable[[], AbstractContextManager]:
    """One context factory entering each of ``factories`` in order."""

    @contextlib.contextmanager
    def enter_all():
        with contextlib.ExitStack() as stack:
            for factory in factories:
                stack.enter_context(factory())
            yield

    return enter_all
