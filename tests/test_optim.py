"""LR schedules: warmup and decay values by hand."""

from __future__ import annotations

import math

import pytest
import torch

from impasto.train.optim import lr_multiplier, set_lr


def test_warmup_then_constant():
    values = [lr_multiplier(s, "constant", 3, 10) for s in range(5)]
    assert values == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_linear_decay_to_floor():
    assert lr_multiplier(0, "linear", 0, 10) == 1.0
    assert lr_multiplier(5, "linear", 0, 10) == pytest.approx(0.5)
    assert lr_multiplier(10, "linear", 0, 10) == 0.0
    assert lr_multiplier(10, "linear", 0, 10, min_ratio=0.1) == pytest.approx(0.1)


def test_cosine_after_warmup():
    # warmup 2, total 12: decay runs over 10 steps; halfway (step 7) the cosine is at 0.5.
    assert lr_multiplier(2, "cosine", 2, 12) == 1.0
    assert lr_multiplier(7, "cosine", 2, 12) == pytest.approx(0.5)
    assert lr_multiplier(4, "cosine", 2, 12) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))
    assert lr_multiplier(12, "cosine", 2, 12) == pytest.approx(0.0)


def test_set_lr_scales_each_group_from_its_base():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([{"params": [param], "lr": 1.0}, {"params": [], "lr": 0.1}])
    set_lr(optimizer, 0.5)
    assert set_lr(optimizer, 0.5) == 0.5  # from the base, not compounding
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.05)
