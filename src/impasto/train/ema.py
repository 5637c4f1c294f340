"""Exponential moving average (EMA) of the trainable weights.

After optimizer step ``t`` the shadow weights move towards the live ones::

    shadow ← d·shadow + (1 − d)·param        (one ``lerp_`` with weight 1 − d)

The shadows are fp32 whatever the parameters' dtype: with d = 0.9999 the change per update is
1e-4 of the gap, well below bf16's resolution (2^-8 relative), so a bf16 shadow would stop
moving. The EMA tracks the parameters it was built from (the full UNet or only LoRA adapters)
and holds its own update counter, so ``update(step)`` needs only the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

DEVICES = ("same", "cpu")

# The foreach path casts a chunk of parameters to fp32 at once (bf16 → fp32 copies); bounding
# the chunk bounds that temporary memory (2^26 elements = 256 MiB) for a full SDXL UNet.
_MAX_CHUNK_NUMEL = 2**26


def power_warmup_decay(t: int, decay: float, inv_gamma: float = 1.0, power: float = 2 / 3) -> float:
    """The EMA decay of the ``t``-th step (0-based) since the EMA started: the inverse-power ramp.

    ``min(decay, 1 − (1 + t / inv_gamma) ** −power)``: 0 at t = 0 (the shadow starts as a copy
    of the weights), 0.999 near t = 31.6K and 0.9999 near t = 1M with the defaults
    inv_gamma = 1, power = 2/3. This is k-diffusion's ``EMAWarmup`` (Katherine Crowson), which
    diffusers' ``EMAModel.get_decay`` uses with ``use_ema_warmup=True``, where
    ``t = optimization_step − 1`` and ``update_after_step = 0``.
    """
    return min(decay, 1.0 - (1.0 + t / inv_gamma) ** -power)


def _no_warmup(first: int, num_steps: int, decay: float, inv_gamma: float, power: float) -> float:
    return decay**num_steps


def _power_warmup(
    first: int, num_steps: int, decay: float, inv_gamma: float, power: float
) -> float:
    steps = range(first, first + num_steps)
    return math.prod(power_warmup_decay(t, decay, inv_gamma, power) for t in steps)


# name → decay of one update covering steps [first, first + num_steps) since the EMA started,
# given (first, num_steps, decay, inv_gamma, power). It is the product of the per-step decays,
# so an update every N steps equals N single updates while the weights stay constant, and the
# EMA's time constant (in optimizer steps) does not depend on ``update_every``.
WARMUPS: dict[str, Callable[[int, int, float, float, float], float]] = {
    "none": _no_warmup,
    "power": _power_warmup,
}


class EMA:
    """fp32 shadow copies of named parameters, updated every ``update_every`` optimizer steps.

    Args:
        named_parameters: (name, parameter) pairs, e.g. ``unet.named_parameters()`` filtered to
            ``requires_grad``; the EMA keeps references to them.
        decay: the per-optimizer-step decay d (the time constant is about 1 / (1 − d) steps).
        warmup: a key of ``WARMUPS``: ``"none"`` (constant d) or ``"power"``
            (``power_warmup_decay``, capped at d).
        inv_gamma, power: the ``"power"`` ramp's parameters (diffusers' defaults).
        update_every: update on optimizer steps that are multiples of N, with the product of
            the N per-step decays (``decay ** N`` without warmup). Fewer updates cost less (a
            CPU shadow means a device→host copy per update) at the price of lag: the shadow
            sees only every N-th weight.
        device: ``"same"`` keeps each shadow beside its parameter; ``"cpu"`` keeps them on the
            host (pinned when CUDA is available), saving accelerator memory.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        decay: float = 0.9999,
        warmup: str = "none",
        inv_gamma: float = 1.0,
        power: float = 2 / 3,
        update_every: int = 1,
        device: str = "same",
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if warmup not in WARMUPS:
            raise ValueError(f"unknown EMA warmup {warmup!r}; valid: {', '.join(WARMUPS)}")
        if inv_gamma <= 0.0 or power <= 0.0:
            raise ValueError(f"EMA inv_gamma and power must be > 0, got {inv_gamma}, {power}")
        if update_every < 1:
            raise ValueError(f"EMA update_every must be >= 1, got {update_every}")
        if device not in DEVICES:
            raise ValueError(f"unknown EMA device {device!r}; valid: {', '.join(DEVICES)}")
        pairs = list(named_parameters)
        if not pairs:
            raise ValueError("EMA got no parameters to track")
        self.names = [name for name, _ in pairs]
        if len(set(self.names)) != len(self.names):
            raise ValueError("EMA got duplicate parameter names")
        self.decay = decay
        self.warmup = warmup
        self.inv_gamma = inv_gamma
        self.power = power
        self.update_every = update_every
        self.device = device
        self.num_updates = 0
        self._params = [param for _, param in pairs]
        with torch.no_grad():
            self.shadows = [self._new_buffer(p, torch.float32).copy_(p) for p in self._params]

    def _new_buffer(self, like: Tensor, dtype: torch.dtype) -> Tensor:
        if self.device == "cpu":
            pin = torch.cuda.is_available()
            return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pin)
        # empty_like: a sharded (FSDP) weight gets a shadow sharded alike
        return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)

    def next_decay(self) -> float:
        """The decay the next update will apply (covering ``update_every`` optimizer steps)."""
        first = self.num_updates * self.update_every
        window = WARMUPS[self.warmup]
        return window(first, self.update_every, self.decay, self.inv_gamma, self.power)

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Update the shadows after optimizer step ``step`` (1-based) if it is an update step.

        Returns whether an update happened.
        """
        if step < 1:
            raise ValueError(f"EMA.update takes the 1-based optimizer step, got {step}")
        if step % self.update_every != 0:
            return False
        weight = 1.0 - self.next_decay()
        devices = {t.device for t in self.shadows} | {p.device for p in self._params}
        if len(devices) == 1:
            _lerp_foreach(self.shadows, self._params, weight)
        else:
            _lerp_per_tensor(self.shadows, self._params, weight)
        self.num_updates += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        """Shadows by name (references, as ``nn.Module.state_dict``), options and update count."""
        options = {
            "decay": self.decay,
            "warmup": self.warmup,
            "inv_gamma": self.inv_gamma,
            "power": self.power,
            "update_every": self.update_every,
        }
        shadows = dict(zip(self.names, self.shadows, strict=True))
        return {"shadows": shadows, "options": options, "num_updates": self.num_updates}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore shadows and update count; the options stay those this EMA was built with.

        The options are the run config's (a changed config is reported on resume), and those
        in ``state`` are a record; with the same options a resumed run continues bitwise.
        """
        shadows = state["shadows"]
        missing = [name for name in self.names if name not in shadows]
        tracked = set(self.names)
        extra = [name for name in shadows if name not in tracked]
        if missing or extra:
            raise ValueError(
                f"EMA state does not match the tracked parameters: {len(missing)} missing "
                f"(e.g. {missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})"
            )
        for name, shadow in zip(self.names, self.shadows, strict=True):
            if tuple(shadows[name].shape) != tuple(shadow.shape):
                raise ValueError(
                    f"EMA state shape mismatch for {name!r}: "
                    f"{tuple(shadows[name].shape)} saved, {tuple(shadow.shape)} tracked"
                )
        for name, shadow in zip(self.names, self.shadows, strict=True):
            shadow.copy_(shadows[name])
        self.num_updates = int(state["num_updates"])

    @torch.no_grad()
    def copy_to(self, named_parameters: Iterable[tuple[str, Tensor]] | None = None) -> None:
        """Write the EMA weights into ``named_parameters`` (default: the tracked ones).

        Targets are matched by name and cast to their own dtype; extra target names (e.g. the
        frozen base weights around LoRA adapters) are left alone, missing ones raise.
        """
        for target, shadow in zip(self._targets(named_parameters), self.shadows, strict=True):
            target.copy_(shadow)

    @contextmanager
    def swapped(
        self, named_parameters: Iterable[tuple[str, Tensor]] | None = None
    ) -> Iterator[None]:
        """Hold the EMA weights in ``named_parameters`` (default: the tracked ones) for a block.

        The training weights are backed up (in their own dtype, on the shadows' device) and
        copied back on exit, exception or not, so they come back bit for bit, e.g.::

            with ema.swapped():
                images = sample_validation(unet, ...)
        """
        targets = self._targets(named_parameters)
        with torch.no_grad():
            backups = [self._new_buffer(t, t.dtype).copy_(t) for t in targets]
        try:
            with torch.no_grad():
                for target, shadow in zip(targets, self.shadows, strict=True):
                    target.copy_(shadow)
            yield
        finally:
            with torch.no_grad():
                for target, backup in zip(targets, backups, strict=True):
                    target.copy_(backup)

    def _targets(self, named_parameters: Iterable[tuple[str, Tensor]] | None) -> list[Tensor]:
        if named_parameters is None:
            return self._params
        by_name = dict(named_parameters)
        missing = [name for name in self.names if name not in by_name]
        if missing:
            raise ValueError(
                f"{len(missing)} EMA parameters are missing from the target, e.g. {missing[0]!r}"
            )
        targets = [by_name[name] for name in self.names]
        for name, target, shadow in zip(self.names, targets, self.shadows, strict=True):
            if target.shape != shadow.shape:
                raise ValueError(
                    f"EMA target shape mismatch for {name!r}: "
                    f"{tuple(target.shape)} given, {tuple(shadow.shape)} tracked"
                )
        return targets


def _lerp_foreach(shadows: list[Tensor], params: list[Tensor], weight: float) -> None:
    """shadow += weight·(param − shadow), batched; every tensor on one device. A chunk ends
    where the parameters' mesh changes too (one ``foreach`` kernel takes one mesh)."""
    start, numel = 0, 0
    for i, param in enumerate(params):
        numel += param.numel()
        last = i == len(params) - 1
        mesh_changes = not last and _mesh(params[i + 1]) != _mesh(param)
        if numel >= _MAX_CHUNK_NUMEL or last or mesh_changes:
            chunk = [p.to(torch.float32) for p in params[start : i + 1]]
            torch._foreach_lerp_(shadows[start : i + 1], chunk, weight)
            start, numel = i + 1, 0


def _mesh(tensor: Tensor) -> object:
    return getattr(tensor, "device_mesh", None)


def _lerp_per_tensor(shadows: list[Tensor], params: list[Tensor], weight: float) -> None:
    """The same update one tensor at a time, bringing each parameter to its shadow's device."""
    for shadow, param in zip(shadows, params, strict=True):
        shadow.lerp_(param.to(device=shadow.device, dtype=torch.float32), weight)
