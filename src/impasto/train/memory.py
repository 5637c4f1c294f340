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

from impasto.config.schema import MemoryConfig

ContextFactory = Callable[[], AbstractContextManager]

SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def unet_blocks(unet: nn.Module) -> dict[str, nn.Module]:
    """The UNet's blocks by config name: ``down.0`` .. ``down.N``, ``mid``, ``up.0`` .. ``up.N``."""
    blocks = {f"down.{i}": block for i, block in enumerate(unet.down_blocks)}
    if unet.mid_block is not None:
        blocks["mid"] = unet.mid_block
    blocks.update({f"up.{i}": block for i, block in enumerate(unet.up_blocks)})
    return blocks


def select_blocks(unet: nn.Module, names: str | list[str]) -> dict[str, nn.Module]:
    """``all``, ``none`` or a list of block names → those blocks (one-line error if unknown)."""
    blocks = unet_blocks(unet)
    if names == "all":
        return blocks
    if names == "none":
        return {}
    unknown = [name for name in names if name not in blocks]
    if unknown:
        raise ValueError(
            f"memory: this UNet has no block {unknown[0]!r}; its blocks: {', '.join(blocks)}"
        )
    return {name: blocks[name] for name in names}


def set_gradient_checkpointing(unet: nn.Module, names: str | list[str]) -> list[str]:
    """Recompute the activations of the chosen blocks in backward (diffusers' own checkpointing,
    enabled for the whole UNet, then switched off in the other blocks). Returns the names."""
    chosen = select_blocks(unet, names)
    if not chosen:
        return []
    unet.enable_gradient_checkpointing()
    for name, block in unet_blocks(unet).items():
        if name not in chosen:
            for module in block.modules():
                if hasattr(module, "gradient_checkpointing"):
                    module.gradient_checkpointing = False
    return list(chosen)


def compile_unet(unet: nn.Module, how: str, mode: str, backend: str) -> None:
    """``torch.compile`` in place (state-dict keys unchanged): each block, or the whole UNet."""
    if how == "none":
        return
    options = {"backend": backend, "mode": None if mode == "default" else mode}
    if how == "unet":
        unet.compile(**options)
        return
    for block in unet_blocks(unet).values():
        block.compile(**options)


def set_weight_dtypes(models, mixed_precision: str, vae_dtype: str) -> None:
    """``pure_bf16``: the UNet and text encoders hold bf16 weights; the VAE as ``vae_dtype``."""
    if mixed_precision == "pure_bf16":
        for module in (models.unet, models.text_encoder, models.text_encoder_2):
            module.to(torch.bfloat16)
    models.vae.to(torch.bfloat16 if vae_dtype == "bf16" else torch.float32)


def apply_memory_options(unet: nn.Module, memory: MemoryConfig) -> None:
    """Set up the UNet as ``memory`` asks (call after it is on its device, before training)."""
    set_gradient_checkpointing(unet, memory.gradient_checkpointing)
    if memory.channels_last:
        unet.to(memory_format=torch.channels_last)
    compile_unet(unet, memory.compile, memory.compile_mode, memory.compile_backend)


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
