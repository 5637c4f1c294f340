"""Non-finite steps, counted on the device and read only on logging and checkpoint steps.

``StepSetup.update`` keeps a non-finite gradient out of the weights without a host sync; this
guard counts such steps as 0-dim device tensors and settles them into the train counters when
the loop reads anyway (logging, saving, the end), stopping the run after
``train.max_nonfinite_steps`` in a row (DESIGN §6) before a checkpoint could hold them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from impasto.train.state import TrainState


class NonFiniteGuard:
    def __init__(self, state: TrainState, limit: int, how: str) -> None:
        self.state, self.limit, self.how = state, limit, how
        self.in_row: Tensor | None = None  # non-finite steps in a row, on the device
        self.new: Tensor | None = None  # non-finite steps since the last settle

    def observe(self, finite: Tensor) -> None:
        """Record one step's finite flag (a device tensor; no sync)."""
        if self.in_row is None:
            self.in_row = torch.tensor(self.state.nonfinite_in_row, device=finite.device)
            self.new = torch.zeros((), dtype=torch.long, device=finite.device)
        self.in_row = torch.where(finite, 0, self.in_row + 1)
        self.new = self.new + (~finite).long()

    def settle(self) -> None:
        """Read the counts (a host sync), report new non-finite steps, and raise
        ``FloatingPointError`` after ``limit`` in a row."""
        if self.in_row is None:
            return
        state = self.state
        new = int(self.new.item())
        state.nonfinite_in_row = int(self.in_row.item())
        self.new.zero_()
        if new:
            state.steps_skipped += new
            print(f"impasto: {new} non-finite step(s) by step {state.step}: gradients {self.how}")
        if state.nonfinite_in_row >= self.limit:
            raise FloatingPointError(
                f"{state.nonfinite_in_row} non-finite steps in a row; stopping with the last "
                "checkpoint intact (lower optim.lr or check the data)"
            )
