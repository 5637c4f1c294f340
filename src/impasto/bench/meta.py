"""A training step on the meta device: its FLOPs and the memory of its weights, gradients,
optimizer state and EMA, for a model of any size, with nothing allocated.

The trainer's own setup (:func:`~impasto.train.setup.build_step_setup`: parts, dtypes, memory
options, optimizer, EMA) is built with every tensor on ``meta`` (shapes and dtypes only), then
one micro-step runs under the trainer's own :class:`~impasto.logging.flops.FlopMeter`
(``torch.utils.flop_counter``'s formulas) and one update fills the optimizer state. The count
is the model's, not a device's: the same on a CPU, an H100 or here (on ``meta`` attention runs
as its math, two batched matmuls, ``4·S_q·S_k·d`` per forward; elementwise ops count 0).
Activations are not estimated.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from impasto.checkpoint.trained import build_starting_backbone
from impasto.config import Config
from impasto.data import Batch
from impasto.logging.flops import FlopMeter
from impasto.models.backbone import Backbone
from impasto.train.quantize import tensor_bytes
from impasto.train.setup import StepSetup, build_step_setup
from impasto.train.text_release import ReleasableText, releasable_encoders

META = torch.device("meta")


@dataclass(frozen=True)
class MetaStep:
    """One step of a config on the meta device: FLOPs of the micro-batch's forward + backward,
    parameters, and bytes of what a step keeps between steps."""

    flops: int
    trained_parameters: int
    frozen_parameters: int
    weights_bytes: int  # the trained parameters
    gradients_bytes: int
    optimizer_bytes: int
    ema_bytes: int
    frozen_bytes: int  # the networks that do not train (text encoders, autoencoder)
    # and the frozen weights under adapters, by network (a quantized base counts its bytes)
    frozen_by_network: dict[str, int] = field(default_factory=dict)
    # the frozen text encoders a run with cached text releases (not in frozen_bytes)
    released_by_network: dict[str, int] = field(default_factory=dict)

    @property
    def state_bytes(self) -> int:
        """What the trained parts hold on the device between steps (before activations)."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.ema_bytes


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build on the meta device; weight files a build reads (the demo VAE) load as no-ops."""
    with warnings.catch_warnings(), META:
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        yield


def meta_backbone(config: Config) -> Backbone:
    """``config``'s starting model with every tensor on the meta device."""
    with on_meta():
        return build_starting_backbone(config)


def _bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes held: a quantized frozen weight (``memory.frozen_dtype`` float8/int8) counts its
    1-byte data and scales (:func:`~impasto.train.quantize.tensor_bytes`)."""
    return sum(tensor_bytes(t) for t in tensors if isinstance(t, Tensor))


def _counted_micro_step(config: Config, batch: Batch) -> tuple[StepSetup, int]:
    """The trainer's step of ``config`` built on the meta device, after one micro-step on
    ``batch``, and that micro-step's FLOPs."""
    with on_meta():
        setup = build_step_setup(config, META, None)
    meter = FlopMeter()
    with meter.measure("step"):
        setup.micro_step(batch, torch.Generator().manual_seed(0))
    return setup, meter.flops("step")


def count_meta_flops(config: Config, batch: Batch) -> int:
    """FLOPs of the forward + backward of ``config``'s step on ``batch`` (meta device)."""
    return _counted_micro_step(config, batch)[1]


def measure_meta_step(config: Config, batch: Batch) -> MetaStep:
    """Build the trainer's step of ``config`` on the meta device and run it once on ``batch``."""
    setup, flops = _counted_micro_step(config, batch)
    gradients = _bytes(param.grad for param in setup.params)
    setup.update(config.optim.max_grad_norm)
    optimizer = setup.fused.optimizers if setup.fused is not None else [setup.optimizer]
    state = [
        value
        for each in optimizer
        for per_param in each.state.values()
        for value in per_param.values()
    ]
    trained = {id(param) for param in setup.params}
    released = released_text_encoders(setup)
    frozen_by_network = {
        name: [param for param in module.parameters() if id(param) not in trained]
        for name, module in setup.backbone.modules().items()
        if name not in released
    }
    frozen = [param for params in frozen_by_network.values() for param in params]
    return MetaStep(
        flops=flops,
        trained_parameters=sum(param.numel() for param in setup.params),
        frozen_parameters=sum(param.numel() for param in frozen)  # the model's, released too
        + sum(param.numel() for module in released.values() for param in module.parameters()),
        weights_bytes=_bytes(setup.params),
        gradients_bytes=gradients,
        optimizer_bytes=_bytes(state),
        ema_bytes=_bytes(setup.ema.shadows) if setup.ema is not None else 0,
        frozen_bytes=_bytes(frozen),
        frozen_by_network={name: _bytes(params) for name, params in frozen_by_network.items()},
        released_by_network={name: _bytes(m.parameters()) for name, m in released.items()},
    )


def released_text_encoders(setup: StepSetup) -> dict[str, torch.nn.Module]:
    """The text encoders a run with cached text embeddings releases after caching them
    (:mod:`impasto.train.text_release`). The bench's batches carry their text encodings as the
    cache delivers them, so every frozen one is, unless a text encoder trains (a run that
    trains one caches no text)."""
    backbone = setup.backbone
    encoders = backbone.text_encoders() if isinstance(backbone, ReleasableText) else {}
    cached = not any(name in encoders for name in setup.trainable)
    return releasable_encoders(backbone, setup.trainable, cached)
