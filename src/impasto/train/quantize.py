"""``memory.frozen_dtype: float8 | int8``: the frozen base weights under LoRA adapters held in one
byte per weight with torchao's weight-only quantization (issue #33: a LoRA of a 12 B
transformer on one 24 GB card).

Every ``nn.Linear`` of a part that trains as an adapter (LoRA, DoRA, LoHa, LoKr) whose weight
does not train is quantized in place by ``torchao.quantization.quantize_``: the base layer inside
each peft wrapper and the part's other linear layers (time embedders, modulation projections).
``float8``: e4m3 with one scale per output row (``Float8WeightOnlyConfig``); ``int8``: symmetric
int8 with one scale per row (``Int8WeightOnlyConfig``). A forward dequantizes the weight for its
matmul; the adapters keep their dtype and train, and the input's gradient flows through the
quantized layer (dL/dx = dL/dy · W with W dequantized), so adapters before it train too.
Convolutions, norms and embeddings keep their dtype (torchao quantizes linear layers).

The base is quantized from the starting weights by a deterministic function, so a resumed run
rebuilds it bit for bit; checkpoints hold only the adapters (``Part.state_dict``), and exports
load them onto a fresh full-precision base (``load_trained``), which never sees quantization.
peft wraps the base layer before it is quantized (peft's ``TorchaoLoraLinear`` is for a base
quantized first; its merge re-quantizes, which training never does).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from impasto.config import Config
    from impasto.models.parts import Part

INSTALL = 'pip install "impasto[quant]"'


def _float8() -> object:
    from torchao.quantization import Float8WeightOnlyConfig

    return Float8WeightOnlyConfig()


def _int8() -> object:
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()


QUANTIZERS: dict[str, Callable[[], object]] = {"float8": _float8, "int8": _int8}
"""``memory.frozen_dtype`` → its torchao weight-only config."""


def is_quantized(frozen_dtype: str) -> bool:
    """Whether ``memory.frozen_dtype`` quantizes the base under adapters."""
    return frozen_dtype in QUANTIZERS


def check_quantized_base(config: Config, device: torch.device) -> None:
    """One-line ``ValueError`` where ``memory.frozen_dtype`` float8/int8 cannot apply on
    ``device``, known before the model is built: torchao missing, a parallel strategy,
    ``torch.compile``, block offload on a GPU. (No part training as an adapter is known once
    the parts are built: :func:`quantize_frozen_base`; a missing kernel:
    :func:`check_device_kernel`.)"""
    frozen_dtype = config.memory.frozen_dtype
    if not is_quantized(frozen_dtype):
        return
    option = f"memory.frozen_dtype: {frozen_dtype}"
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"{option} quantizes with torchao, which is not installed; {INSTALL}")
    strategy = config.parallel.strategy
    if strategy != "none":
        raise ValueError(
            f"{option}: parallel.strategy {strategy} would broadcast or shard torchao's "
            "quantized weights, which it cannot; train on one device, or set "
            "memory.frozen_dtype: bf16"
        )
    if config.memory.compile != "none":
        raise ValueError(
            f"{option}: memory.compile {config.memory.compile} fails in training on torchao's "
            "quantized weights (AOT autograd refuses their tensor-subclass outputs); set "
            "memory.compile: none"
        )
    if config.memory.offload_blocks and device.type not in ("cpu", "meta"):
        raise ValueError(
            f"{option}: memory.offload_blocks streams weights through pinned buffers "
            f"(empty_like, copy_) that torchao's quantized tensors do not implement on "
            f"{device.type}; set memory.offload_blocks: false (a float8 base already holds "
            "a 12 B transformer in 11 GiB)"
        )


def quantize_frozen_base(
    parts: dict[str, Part], frozen_dtype: str, dtype: torch.dtype | None = None
) -> int:
    """Quantize the frozen linear layers of the adapter-trained ``parts`` in place (after the
    adapters are injected, before the optimizer); returns how many. ``dtype``: the compute
    dtype (bf16 under autocast): the layer is cast to it first, so each matmul dequantizes to
    what autocast computes in, at half the transient memory of fp32."""
    from torchao.quantization import quantize_

    if not any(part.is_adapter for part in parts.values()):
        full = ", ".join(f"parts.{name}" for name in parts) or "no part"
        raise ValueError(
            f"memory.frozen_dtype: {frozen_dtype} quantizes the frozen base weights under LoRA "
            f"adapters, but {full} trains in full; set parts.<part>: lora, or "
            "memory.frozen_dtype: bf16"
        )
    config = QUANTIZERS[frozen_dtype]()
    count = 0
    for part in parts.values():
        if not part.is_adapter:
            continue
        layers = [
            module
            for module in part.module.modules()
            if type(module) is nn.Linear
            and not module.weight.requires_grad
            and not (frozen_dtype == "float8" and _has_zero_row(module.weight))
        ]
        for layer in layers:
            if dtype is not None and layer.weight.is_floating_point():
                layer.to(dtype)
            quantize_(layer, config, filter_fn=None)
        count += len(layers)
    return count


def _has_zero_row(weight: Tensor) -> bool:
    """Whether a row of ``weight`` is all zeros: float8's scale, the row's max |w| / 448, is
    then 0 and the row 0/0 = NaN (torchao clamps no lower bound). Such a layer (a zero-
    initialised output or modulation projection of a model trained from scratch) keeps its
    dtype; released models have none. On the meta device (an estimate) every layer counts as
    quantized. One host sync per layer, at setup only."""
    if weight.is_meta or weight.numel() == 0:
        return False
    return bool(weight.abs().amax(dim=1).eq(0).any())


def check_device_kernel(frozen_dtype: str, device: torch.device, dtype: torch.dtype | None) -> None:
    """Run one quantized linear layer forward and backward on ``device``; a one-line
    ``ValueError`` where torchao has no kernel for it there."""
    from torchao.quantization import quantize_

    layer = nn.Linear(32, 16, device=device, dtype=dtype or torch.float32).requires_grad_(False)
    try:
        quantize_(layer, QUANTIZERS[frozen_dtype]())
        inputs = torch.ones(2, 32, device=device, dtype=layer.bias.dtype, requires_grad=True)
        layer(inputs).sum().backward()
    except (RuntimeError, NotImplementedError, TypeError, AssertionError) as error:
        other = "int8" if frozen_dtype == "float8" else "bf16"
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(
            f"memory.frozen_dtype: {frozen_dtype} has no torchao kernel on {device.type} "
            f"({reason}); set memory.frozen_dtype: {other}"
        ) from None


def tensor_bytes(tensor: Tensor) -> int:
    """Bytes ``tensor`` holds: a tensor subclass (a torchao quantized weight) counts its inner
    tensors (1-byte data, scales), not its element count × the dtype it computes in."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(tensor_bytes(getattr(tensor, name)) for name in names)
