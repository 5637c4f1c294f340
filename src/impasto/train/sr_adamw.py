"""AdamW for bf16 weights: fp32 math, stochastic rounding on the write back.

With bf16 weights, round-to-nearest cancels every update smaller than half a bf16 ulp (2⁻⁹
relative), so a small learning rate stops training. Stochastic rounding (SR) rounds up or down
with probabilities that make the stored weight equal the fp32 result in expectation (Zamirai,
Zhang, Aberger, De Sa, "Revisiting BFloat16 Training", arXiv:2010.06192).

The SR kernel is OneTrainer's ``copy_stochastic_``: add 16 uniform random bits to the 16 low
mantissa bits of the fp32 pattern, then truncate. We do not copy its ``add_stochastic_``, whose
arguments are swapped (it returns other + alpha·input); the moments here are updated in fp32 with
the plain torch ops, m = β1·m + (1 − β1)·g and v = β2·v + (1 − β2)·g².
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import groupby
from typing import Any

import torch
from torch import Tensor

_LOW_BITS = 1 << 16  # bf16 is the top 16 bits of fp32; SR randomises the 16 it drops
_HIGH_MASK = -65536  # 0xFFFF0000 as a signed int32
_MASK64 = (1 << 64) - 1
_SUPPORTED = (torch.float32, torch.bfloat16)


def stochastic_round_to_bf16(x: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Round fp32 ``x`` to bf16, up or down at random so that E[result] = x.

    The fp32 bit pattern is s·eeeeeeee·m₂₃…m₀; bf16 keeps the top 16 bits. Adding U{0, …, 2¹⁶−1}
    to the pattern carries into bit 16 with probability low16/2¹⁶, which is the distance to
    the lower bf16 neighbour over the gap between neighbours (spacing is uniform inside a
    binade, and a carry into the exponent lands exactly on the next binade). Masking the low
    16 bits then truncates, so the result is exact in bf16. Both signs work, since the pattern
    is sign-magnitude. Values already in bf16 have low16 = 0 and never move. inf and nan are
    returned as they are (a nan pattern could otherwise carry into inf); finite values within
    half a bf16 ulp of the fp32 maximum may round to inf.

    x: fp32 tensor, any shape; the same shape in bf16 is returned. Randomness comes only from
    ``generator`` (on x's device), or the global RNG when None.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic_round_to_bf16 takes fp32, got {x.dtype}")
    noise = torch.randint(
        0, _LOW_BITS, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    bits = noise.add_(x.view(torch.int32)).bitwise_and_(_HIGH_MASK)
    rounded = torch.where(torch.isfinite(x), bits.view(torch.float32), x)
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero


def adamw_update_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on fp32 tensors, in place (Loshchilov & Hutter, arXiv:1711.05101).

    The ops and their order are those of ``torch.optim.AdamW(foreach=False)``, so an fp32
    parameter comes out bitwise equal:
        p ← p·(1 − lr·wd);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
        p ← p − lr/(1 − β1ᵗ) · m / (sqrt(v)/sqrt(1 − β2ᵗ) + eps)
    ``step`` is t, counted from 1. All tensors share one shape.
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)  # m + (1 − β1)(g − m) = β1·m + (1 − β1)·g
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def rounding_seed(seed: int, param_index: int, step: int) -> int:
    """The seed of the rounding noise for one parameter at one step (SplitMix64 chain).

    Depending only on these three keeps runs replayable without any generator state.
    """
    mixed = seed & _MASK64
    for value in (param_index, step):
        mixed = _splitmix64(mixed ^ (value & _MASK64))
    return mixed >> 1  # 63 bits: a valid manual_seed on every device


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class AdamWBF16(torch.optim.Optimizer):
    """AdamW that keeps bf16 weights unbiased with stochastic rounding; fp32 weights too.

    Per parameter, the step is done in fp32 on a copy (``adamw_update_``) and the result is
    written back to a bf16 weight with ``stochastic_round_to_bf16``: one rounding per step, of
    the whole new value. An fp32 weight is updated in place with the same ops, so it matches
    ``torch.optim.AdamW(foreach=False)`` bitwise and one class serves both dtypes. The
    arithmetic runs as multi-tensor kernels over each group (same ops, same results).

    Moments: fp32 by default (8 bytes per parameter on top of the weight). ``state_dtype=
    torch.bfloat16`` halves that; they are then updated in fp32 and stored with SR as well.

    Randomness: the noise for parameter i (its position across all groups) at step t comes
    from a generator seeded with ``rounding_seed(seed, i, t)``. The seed is a param-group
    value and t is in the per-parameter state, so ``state_dict`` alone resumes a run exactly;
    no generator state is saved. The seed does not depend on the rank, so DDP replicas, which
    see the same gradients, stay identical.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        seed: int = 0,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(
                f"lr, eps and weight_decay must be ≥ 0, got {lr}, {eps}, {weight_decay}"
            )
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"each beta must be in [0, 1), got {list(betas)}")
        if state_dtype not in _SUPPORTED:
            raise ValueError(
                f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}"
            )
        self.state_dtype = state_dtype
        self._generators: dict[torch.device, torch.Generator] = {}
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "seed": seed,
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for param in self.param_groups[-1]["params"]:
            if param.dtype not in _SUPPORTED:
                raise ValueError(f"AdamWBF16 takes fp32 or bf16 parameters, got {param.dtype}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first_index = 0
        for group in self.param_groups:
            batch = []
            for offset, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamWBF16 does not support sparse gradients")
                batch.append((first_index + offset, param, self._advance(param)))
            first_index += len(group["params"])
            # One multi-tensor update per (device, step): kernels per group, not per tensor.
            batch.sort(key=lambda item: (str(item[1].device), item[2]))
            for _, same in groupby(batch, key=lambda item: (str(item[1].device), item[2])):
                self._update(group, list(same))
        return loss

    def _advance(self, param: Tensor) -> int:
        """Count one more step for ``param`` (creating its state); returns t."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # as torch's AdamW
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
        state["step"] += 1
        return int(state["step"].item())  # the step lives on the CPU: no device sync

    def _update(self, group: dict[str, Any], items: list[tuple[int, Tensor, int]]) -> None:
        """AdamW on parameters that share a device and a step t, then the rounding writes.

        The arithmetic is :func:`adamw_update_`'s, op for op, as multi-tensor (``foreach``)
        kernels; ``.float()`` is a no-op on fp32 tensors, so fp32 weights and moments update in
        place. Each parameter's rounding noise still comes from its own seed.
        """
        step = items[0][2]
        params = [param for _, param, _ in items]
        states = [self.state[param] for param in params]
        params32 = [param.float() for param in params]
        grads32 = [param.grad.float() for param in params]
        exp_avgs32 = [state["exp_avg"].float() for state in states]
        exp_avg_sqs32 = [state["exp_avg_sq"].float() for state in states]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if weight_decay != 0:
            torch._foreach_mul_(params32, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs32, grads32, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs32, beta2)
        torch._foreach_addcmul_(exp_avg_sqs32, grads32, grads32, value=1 - beta2)
        denominators = torch._foreach_sqrt(exp_avg_sqs32)
        torch._foreach_div_(denominators, (1 - beta2**step) ** 0.5)
        torch._foreach_add_(denominators, eps)
        step_size = lr / (1 - beta1**step)
        torch._foreach_addcdiv_(params32, exp_avgs32, denominators, value=-step_size)
        if self.state_dtype == torch.float32 and all(p.dtype == torch.float32 for p in params):
            return
        for (index, param, _), state, param32, exp_avg32, exp_avg_sq32 in zip(
            items, states, params32, exp_avgs32, exp_avg_sqs32, strict=True
        ):
            generator = self._generator(param.device, rounding_seed(group["seed"], index, step))
            if self.state_dtype == torch.bfloat16:
                state["exp_avg"].copy_(stochastic_round_to_bf16(exp_avg32, generator))
                state["exp_avg_sq"].copy_(stochastic_round_to_bf16(exp_avg_sq32, generator))
            if param.dtype == torch.bfloat16:
                param.copy_(stochastic_round_to_bf16(param32, generator))

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        """A generator for ``device``, reseeded; reused only to avoid creating one per call."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device].manual_seed(seed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but keep the moments in ``state_dtype``.

        The base class casts every floating state tensor to its parameter's dtype, which
        would round fp32 moments of bf16 weights to bf16; we put back the saved tensors.
        """
        saved_state = state_dict["state"]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        for param_id, param in zip(saved_ids, params, strict=True):
            if param_id not in saved_state:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                saved = saved_state[param_id][key]
                self.state[param][key] = saved.to(device=param.device, dtype=self.state_dtype)
