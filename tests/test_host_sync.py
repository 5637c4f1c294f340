"""No host sync in the training step outside logging steps (issue #13, item 8).

A GPU step that calls ``.item()``, ``float(t)``, ``bool(t)`` or ``int(t)`` on a device tensor
waits for the device to finish: the CPU stops queueing work. On CPU there is no device to wait
for, so this test counts the calls themselves: ``Tensor.item`` and the conversions are patched
to record every call made from impasto's own code (outside ``impasto.data``, whose tensors are
host-side by design) while the loop runs a step that neither logs, samples nor saves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import impasto
from impasto.config import build_config
from impasto.train import trainer as trainer_module
from impasto.train.setup import clip_and_step

SOURCE = Path(impasto.__file__).parent
HOST_DATA = SOURCE / "data"
CONVERSIONS = ("item", "__bool__", "__float__", "__int__")


def _impasto_caller() -> str | None:
    """``file:line`` of the call, when impasto's own code (outside impasto/data) made it.

    Calls inside torch (e.g. a CPU optimizer reading its CPU step counter) are torch's own
    business: only the direct caller counts."""
    frame = sys._getframe(2)
    path = Path(frame.f_code.co_filename)
    if path.is_relative_to(SOURCE) and not path.is_relative_to(HOST_DATA):
        return f"{path.relative_to(SOURCE)}:{frame.f_lineno}"
    return None


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"parts": {"unet": "lora", "text_encoder": "lora"}, "ema": {"enabled": True}},
        {"objective": {"prediction_type": "flow"}, "train": {"grad_accum_steps": 2}},
        {"memory": {"fused_backward": True}, "optim": {"max_grad_norm": None}},
    ],
    ids=["full", "lora_ema", "flow_accum", "fused"],
)
def test_non_logging_steps_make_no_host_sync(tiny_raw, monkeypatch, sections):
    tiny_raw["train"]["max_steps"] = 4
    tiny_raw["log"]["every_steps"] = 4
    tiny_raw["checkpoint"]["every_steps"] = 4
    for name, values in sections.items():
        tiny_raw[name] = {**tiny_raw.get(name, {}), **values}
    trainer = trainer_module.Trainer(build_config(tiny_raw), resume=False)
    calls: list[tuple[int, str]] = []
    current = {"step": 0}

    def recording(name: str):
        original = getattr(torch.Tensor, name)

        def record(self, *args, **kwargs):
            caller = _impasto_caller()
            if caller is not None:
                calls.append((current["step"], f"{name} at {caller}"))
            return original(self, *args, **kwargs)

        return record

    for name in CONVERSIONS:
        monkeypatch.setattr(torch.Tensor, name, recording(name))
    real_step = trainer.step

    def step():
        current["step"] = trainer.state.step + 1  # the step being computed
        return real_step()

    monkeypatch.setattr(trainer, "step", step)
    result = trainer.run()
    assert result.state.step == 4
    quiet_steps = [call for step, call in calls if step < 4]
    assert quiet_steps == []
    assert any(step == 4 for step, _ in calls)  # the logging step does read (the test sees it)


def _model_and_grads(nonfinite: bool) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model(torch.randn(4, 8)).square().mean().backward()
    params = list(model.parameters())
    if nonfinite:
        params[1].grad[0] = float("nan")
    return model, params


@pytest.mark.parametrize("fused", [True, False], ids=["found_inf", "zeroed"])
@pytest.mark.parametrize("max_grad_norm", [0.01, None])
def test_clip_and_step_equals_plain_clipping_and_keeps_nonfinite_gradients_out(
    fused, max_grad_norm
):
    def optimizer(params):
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.0, fused=fused, foreach=not fused)

    model, params = _model_and_grads(nonfinite=False)
    reference, reference_params = _model_and_grads(nonfinite=False)
    norm, finite = clip_and_step(optimizer(params), params, max_grad_norm)
    torch.nn.utils.clip_grad_norm_(reference_params, max_grad_norm or float("inf"))
    optimizer(reference_params).step()
    assert bool(finite) and norm > 0
    for mine, theirs in zip(params, reference_params, strict=True):
        assert torch.equal(mine, theirs)  # bit for bit the plain clip + step

    model, params = _model_and_grads(nonfinite=True)
    before = [param.detach().clone() for param in params]
    adamw = optimizer(params)
    _, finite = clip_and_step(adamw, params, max_grad_norm)
    assert not bool(finite)
    # Weight decay 0: a skipped step (fused) and a step on zero gradients (Adam's first step
    # moves by m / (sqrt(v) + eps) = 0) both leave every weight as it was.
    for param, old in zip(params, before, strict=True):
        assert torch.equal(param, old)
    if fused:  # the kernel skipped: not even the step counters moved
        assert all(float(state["step"]) == 0 for state in adamw.state.values())
