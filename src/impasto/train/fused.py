"""Fused backward: each parameter's optimizer step runs in its gradient hook.

A plain step keeps every gradient until ``optimizer.step()``: for a full SDXL fine-tune that is
2.6 B fp32 numbers (10 GB) at once. Here each parameter has its own optimizer, stepped by a
``register_post_accumulate_grad_hook`` as soon as backward has produced its gradient, which is
then freed; at most a few gradients exist at a time (PyTorch's tutorial "How to save memory by
fusing the optimizer step into the backward pass"; kohya's ``fused_backward_pass``).

What changes: the step happens inside ``backward()``, so gradients cannot be accumulated over
micro-batches nor clipped by their global norm (the config refuses both). A non-finite gradient
cannot skip the whole step either (earlier parameters have already stepped): it is replaced by
zeros for that parameter (no host sync), counted, and the step counts as non-finite for
``train.max_nonfinite_steps``. With finite gradients the result equals the unfused step exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import Tensor
from torch.optim import Optimizer


class FusedBackwardOptimizer:
    """One optimizer per parameter, stepped in backward; quacks like the optimizer it replaces
    for the trainer (``param_groups`` for the LR schedule, ``state_dict``, ``zero_grad``).

    Args:
        groups: parameter groups (``[{"params": [...], "lr": ...}, ...]``).
        build: makes an optimizer from a list of groups (a registry builder bound to its config).
    """

    def __init__(
        self, groups: Iterable[dict], build: Callable[[list[dict]], torch.optim.Optimizer]
    ):
        self.optimizers: list[Optimizer] = []
        self.handles = []
        self._squared_norm: Tensor | None = None
        self._nonfinite: Tensor | None = None
        for group in groups:
            options = {key: value for key, value in group.items() if key != "params"}
            for param in group["params"]:
                # "seed": optimizers that round stochastically (adamw_bf16_sr) draw each
                # parameter's stream from it, as they would from its index unfused.
                index = len(self.optimizers)
                optimizer = build([{**options, "params": [param], "seed": index}])
                self.optimizers.append(optimizer)
                hook = partial(self._step, optimizer)
                self.handles.append(param.register_post_accumulate_grad_hook(hook))

    def _step(self, optimizer: Optimizer, param: Tensor) -> None:
        grad = param.grad
        squared = grad.detach().float().square().sum()
        finite = torch.isfinite(squared)
        grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a no-op on finite gradients
        if self._squared_norm is None:
            self._squared_norm = torch.zeros((), device=grad.device)
            self._nonfinite = torch.zeros((), dtype=torch.long, device=grad.device)
        self._squared_norm += torch.where(finite, squared, 0.0).to(self._squared_norm.device)
        self._nonfinite += (~finite).to(self._nonfinite.device)
        optimizer.step()
        param.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def finish_step(self) -> tuple[Tensor, Tensor]:
        """After backward: the step's gradient norm (of the finite gradients) and the number of
        parameters whose gradient was not finite, as device tensors (no host sync)."""
        if self._squared_norm is None:
            return torch.zeros(()), torch.zeros((), dtype=torch.long)
        norm, nonfinite = self._squared_norm.sqrt(), self._nonfinite
        self._squared_norm = self._nonfinite = None
        return norm, nonfinite

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: every gradient was freed by its hook."""

    def state_dict(self) -> dict:
        return {"fused_backward": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("fused_backward")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(
                "checkpoint: the optimizer state was saved without memory.fused_backward (or for "
                "other parameters); resume with the same memory.fused_backward setting"
            )
        for optimizer, optimizer_state in zip(self.optimizers, saved, strict=True):
            optimizer.load_state_dict(optimizer_state)

    def remove(self) -> None:
        """Detach the hooks (the parameters train with a normal optimizer again)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
