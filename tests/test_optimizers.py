"""Optimizers: bf16 stochastic rounding, AdamWBF16 against torch's AdamW, the registry."""

from __future__ import annotations

import io
import math
import sys
import types

import pytest
import torch

from impasto.config.schema import OptimConfig
from impasto.train.optim import OPTIMIZERS
from impasto.train.sr_adamw import (
    AdamWBF16,
    adamw_update_,
    rounding_seed,
    stochastic_round_to_bf16,
)

BF16_ULP_AT_1 = 2.0**-7  # bf16 keeps 7 explicit mantissa bits


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above |x| (with x's sign), as fp32."""
    bits = x.view(torch.int32) & -65536
    return bits.view(torch.float32), (bits + 65536).view(torch.float32)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- stochastic rounding -------------------------------------------------------------------


def test_sr_lands_on_a_bf16_neighbour():
    scales = torch.tensor([1e-38, 1e-20, 1e-3, 1.0, 1e3, 1e30])  # 1e-38: fp32 subnormal range
    x = (torch.randn(6, 2000, generator=generator(0)) * scales[:, None]).flatten()
    x = torch.cat([x, torch.tensor([1.99999988, -1.99999988])])  # carries into the exponent
    rounded = stochastic_round_to_bf16(x, generator(1))
    assert rounded.dtype == torch.bfloat16
    as_fp32 = rounded.float()
    assert torch.equal(as_fp32.to(torch.bfloat16).float(), as_fp32)  # exact in bf16
    lower, upper = neighbours(x)
    assert bool(((as_fp32 == lower) | (as_fp32 == upper)).all())
    assert as_fp32[-2].item() in (1.9921875, 2.0) and as_fp32[-1].item() in (-1.9921875, -2.0)


def test_sr_leaves_bf16_values_alone():
    x = (torch.randn(5000, generator=generator(0)) * 10).to(torch.bfloat16).float()
    for seed in range(5):
        assert torch.equal(stochastic_round_to_bf16(x, generator(seed)).float(), x)


@pytest.mark.parametrize(
    "value",
    [1 + 0.3 * BF16_ULP_AT_1, -(3 + 0.7 * 2 * BF16_ULP_AT_1), 5e-39, 123.456e20],
)
def test_sr_is_unbiased_with_the_right_frequencies(value: float):
    num_draws = 200_000
    x = torch.full((num_draws,), value, dtype=torch.float32)
    lower, upper = (v[0].double().item() for v in neighbours(x[:1]))
    exact = x[0].double().item()
    p_away = (exact - lower) / (upper - lower)  # probability of rounding away from zero
    assert 0.05 < p_away < 0.95  # a value strictly between two neighbours
    rounded = stochastic_round_to_bf16(x, generator(0)).double()
    assert set(rounded.unique().tolist()) == {lower, upper}
    num_away = int((rounded == upper).sum())
    count_sigma = math.sqrt(num_draws * p_away * (1 - p_away))
    assert abs(num_away - num_draws * p_away) < 5 * count_sigma
    mean_sigma = abs(upper - lower) * count_sigma / num_draws
    assert abs(rounded.mean().item() - exact) < 5 * mean_sigma
    # round-to-nearest, for contrast, is biased by a sizeable fraction of the gap
    nearest = x[:1].to(torch.bfloat16).double().item()
    assert abs(nearest - exact) > 50 * mean_sigma


def test_sr_passes_inf_and_nan_through():
    nan_low_bits = torch.tensor([0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    x = torch.cat([torch.tensor([math.inf, -math.inf, math.nan]), nan_low_bits])
    for seed in range(20):
        rounded = stochastic_round_to_bf16(x, generator(seed)).float()
        assert rounded[0] == math.inf and rounded[1] == -math.inf
        assert bool(rounded[2:].isnan().all())


def test_sr_is_reproducible_from_its_generator():
    x = torch.randn(1000, generator=generator(0))
    first = stochastic_round_to_bf16(x, generator(7))
    assert torch.equal(first, stochastic_round_to_bf16(x, generator(7)))
    assert not torch.equal(first, stochastic_round_to_bf16(x, generator(8)))


def test_sr_refuses_other_dtypes():
    with pytest.raises(ValueError, match="fp32"):
        stochastic_round_to_bf16(torch.zeros(2, dtype=torch.bfloat16))


# --- AdamWBF16 -------------------------------------------------------------------------------


def test_first_step_moments_are_the_textbook_ones():
    # Powers of two keep every product exact, so the check does not depend on the op order.
    # The peers' swapped add_stochastic_ would give exp_avg = g and exp_avg_sq = g² here.
    beta1, beta2 = 0.8, 0.99
    grad = torch.tensor([0.5, -2.0, 4.0, -0.125, 1.0, 8.0])
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(torch.ones(6, dtype=dtype))
        optimizer = AdamWBF16([param], lr=1e-2, betas=(beta1, beta2), weight_decay=0.1)
        param.grad = grad.to(dtype)
        optimizer.step()
        state = optimizer.state[param]
        assert state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["exp_avg"], (1 - beta1) * grad)
        assert torch.equal(state["exp_avg_sq"], (1 - beta2) * grad * grad)


def test_moments_follow_the_recurrence_over_steps():
    beta1, beta2 = 0.9, 0.95
    param = torch.nn.Parameter(torch.randn(50, generator=generator(0)).to(torch.bfloat16))
    optimizer = AdamWBF16([param], lr=1e-3, betas=(beta1, beta2))
    exp_avg = torch.zeros(50, dtype=torch.float64)
    exp_avg_sq = torch.zeros(50, dtype=torch.float64)
    for step in range(4):
        grad = torch.randn(50, generator=generator(10 + step))
        param.grad = grad.to(torch.bfloat16)
        optimizer.step()
        grad = param.grad.double()
        exp_avg = beta1 * exp_avg + (1 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad**2
    state = optimizer.state[param]
    torch.testing.assert_close(state["exp_avg"].double(), exp_avg, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"].double(), exp_avg_sq, rtol=1e-5, atol=1e-7)


def test_fp32_params_match_torch_adamw_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ours = [p.detach().clone().requires_grad_() for p in model.parameters()]
    hyper = {"betas": (0.85, 0.98), "eps": 1e-7, "weight_decay": 0.05}
    torch_adamw = torch.optim.AdamW(
        [{"params": reference[:2], "lr": 3e-3}, {"params": reference[2:], "lr": 1e-2}],
        foreach=False,
        **hyper,
    )
    adamw_bf16 = AdamWBF16(
        [{"params": ours[:2], "lr": 3e-3}, {"params": ours[2:], "lr": 1e-2}], **hyper
    )
    for step in range(6):
        grads = [
            torch.randn(p.shape, generator=generator(step * 10 + i)) for i, p in enumerate(ours)
        ]
        for p_ref, p_ours, grad in zip(reference, ours, grads, strict=True):
            p_ref.grad, p_ours.grad = grad.clone(), grad.clone()
        torch_adamw.step()
        adamw_bf16.step()
    for p_ref, p_ours in zip(reference, ours, strict=True):
        assert torch.equal(p_ref, p_ours)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch_adamw.state[p_ref][key], adamw_bf16.state[p_ours][key])


def test_bf16_updates_below_half_an_ulp_survive_in_expectation():
    # Weights at 1.0 (ulp below: 2⁻⁸ ≈ 0.0039); Adam's first step moves each by about lr =
    # 1e-3, which round-to-nearest always cancels. SR moves a quarter of them a whole ulp.
    num_weights, num_seeds, lr = 4096, 8, 1e-3
    grad = torch.rand(num_weights, generator=generator(0)) + 0.5
    exact = torch.nn.Parameter(torch.ones(num_weights))
    fp32_step = AdamWBF16([exact], lr=lr, weight_decay=0.0)
    exact.grad = grad.clone()
    fp32_step.step()
    assert (exact.detach() - 1).abs().max() < 0.5 * 2.0**-8  # nearest would never move them

    errors = []
    for seed in range(num_seeds):
        param = torch.nn.Parameter(torch.ones(num_weights, dtype=torch.bfloat16))
        optimizer = AdamWBF16([param], lr=lr, weight_decay=0.0, seed=seed)
        param.grad = grad.to(torch.bfloat16)
        optimizer.step()
        assert set(param.detach().float().unique().tolist()) <= {1.0, 1.0 - 2.0**-8}
        errors.append(param.detach().double() - exact.detach().double())
    errors = torch.cat(errors)
    moved = (errors < -(2.0**-9)).double().mean().item()
    assert 0.2 < moved < 0.3  # ≈ lr / 2⁻⁸ = 0.256
    sigma = 2.0**-8 * math.sqrt(0.256 * 0.744 / errors.numel())
    assert abs(errors.mean().item()) < 5 * sigma  # E[SR(p)] = fp32 result
    # grads are bf16 in the SR run; with the same grads the fp32 update is the same within 1e-6
    assert abs((exact.detach() - 1).mean().item() + lr) < 1e-5


def test_bf16_state_dtype_rounds_moments_stochastically():
    param = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    optimizer = AdamWBF16([param], lr=1e-3, betas=(0.9, 0.999), state_dtype=torch.bfloat16)
    grad = torch.randn(1000, generator=generator(0))
    param.grad = grad.to(torch.bfloat16)
    optimizer.step()
    exp_avg = optimizer.state[param]["exp_avg"]
    assert exp_avg.dtype == torch.bfloat16
    lower, upper = neighbours(0.1 * param.grad.float())
    assert bool(((exp_avg.float() == lower) | (exp_avg.float() == upper)).all())


def test_same_seed_same_weights_other_seed_other_weights():
    def train(seed: int) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
        optimizer = AdamWBF16([param], lr=1e-3, seed=seed)
        for step in range(3):
            param.grad = torch.randn(256, generator=generator(step)).to(torch.bfloat16)
            optimizer.step()
        return param.detach().clone()

    assert torch.equal(train(0), train(0))
    assert not torch.equal(train(0), train(1))


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_exactly(state_dtype: torch.dtype):
    def make() -> tuple[list[torch.nn.Parameter], AdamWBF16]:
        params = [
            torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16)),
            torch.nn.Parameter(torch.ones(8, 8)),
        ]
        groups = [{"params": params[:1], "lr": 2e-3}, {"params": params[1:], "lr": 1e-3}]
        return params, AdamWBF16(groups, weight_decay=0.1, seed=3, state_dtype=state_dtype)

    def run(params: list[torch.nn.Parameter], optimizer: AdamWBF16, steps: range) -> None:
        for step in steps:
            for i, param in enumerate(params):
                grad = torch.randn(param.shape, generator=generator(100 * step + i))
                param.grad = grad.to(param.dtype)
            optimizer.step()

    params, optimizer = make()
    run(params, optimizer, range(6))

    params_b, optimizer_b = make()
    run(params_b, optimizer_b, range(3))
    buffer = io.BytesIO()  # as a checkpoint: torch.save, read back with weights_only=True
    torch.save({"optimizer": optimizer_b.state_dict(), "params": params_b}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    params_c, optimizer_c = make()
    with torch.no_grad():
        for param, value in zip(params_c, saved["params"], strict=True):
            param.copy_(value)
    optimizer_c.load_state_dict(saved["optimizer"])
    assert optimizer_c.state[params_c[0]]["exp_avg"].dtype == state_dtype  # not cast to bf16
    run(params_c, optimizer_c, range(3, 6))
    for param, resumed in zip(params, params_c, strict=True):
        assert torch.equal(param, resumed)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], optimizer_c.state[resumed][key])


def test_unsupported_parameter_dtype_is_refused():
    with pytest.raises(ValueError, match="fp32 or bf16"):
        AdamWBF16([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])


# --- registry --------------------------------------------------------------------------------


def small_model_groups() -> tuple[torch.nn.Module, list[dict]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    groups = [
        {"params": list(model[0].parameters()), "lr": 1e-2, "name": "unet"},
        {"params": list(model[1].parameters()), "lr": 1e-3, "name": "text_encoder"},
    ]
    return model, groups


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 4, generator=generator(0))).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("name", ["adamw", "adamw_bf16_sr"])
def test_adam_registry_names_step_each_group_by_its_lr(name: str):
    model, groups = small_model_groups()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = OPTIMIZERS[name](groups, OptimConfig(name=name, lr=5e-3, weight_decay=0.0))
    one_step(model, optimizer)
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2, 1e-3]
    # Adam's first step moves every weight by lr·g/(|g| + eps) ≈ lr
    for param, old, lr in zip(model.parameters(), before, [1e-2, 1e-2, 1e-3, 1e-3], strict=True):
        moved = (param.detach() - old).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, lr), rtol=1e-3, atol=0)


def test_adamw_is_foreach_on_cpu():
    _, groups = small_model_groups()
    optimizer = OPTIMIZERS["adamw"](groups, OptimConfig(name="adamw"))
    assert optimizer.defaults["foreach"] is True and optimizer.defaults["fused"] is False


def test_adafactor_steps_by_lr_with_groups():
    model, groups = small_model_groups()
    bias_before = model[0].bias.detach().clone()
    optimizer = OPTIMIZERS["adafactor"](groups, OptimConfig(name="adafactor", weight_decay=0.0))
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2, 1e-3]
    assert optimizer.defaults["relative_step"] is False
    one_step(model, optimizer)
    # first step of a vector: v = g², update g/|g| = ±1 (RMS 1, not clipped), times lr
    grad_sign = torch.sign(model[0].bias.grad)
    torch.testing.assert_close(model[0].bias.detach(), bias_before - 1e-2 * grad_sign)


def test_adamw_8bit_without_bitsandbytes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes the import fail
    _, groups = small_model_groups()
    with pytest.raises(ValueError, match=r"pip install bitsandbytes .* pip install -e '\.\[bnb\]'"):
        OPTIMIZERS["adamw_8bit"](groups, OptimConfig(name="adamw_8bit"))


def test_adamw_8bit_on_cpu_params(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    _, groups = small_model_groups()
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        OPTIMIZERS["adamw_8bit"](groups, OptimConfig(name="adamw_8bit"))


def test_prodigy_without_its_package(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "prodigyopt", None)
    model = torch.nn.Linear(4, 2)
    with pytest.raises(
        ValueError, match=r"pip install prodigyopt .* pip install -e '\.\[prodigy\]'"
    ):
        OPTIMIZERS["prodigy"](model.parameters(), OptimConfig(name="prodigy", lr=1.0))


def test_prodigy_refuses_per_part_lrs():
    _, groups = small_model_groups()
    with pytest.raises(ValueError, match="one lr for all parts"):
        OPTIMIZERS["prodigy"](groups, OptimConfig(name="prodigy", lr=1.0))


def test_prodigy_steps_when_installed():
    pytest.importorskip("prodigyopt")
    model, groups = small_model_groups()
    for group in groups:
        group["lr"] = 1.0
    before = model[0].weight.detach().clone()
    optimizer = OPTIMIZERS["prodigy"](groups, OptimConfig(name="prodigy", lr=1.0))
    one_step(model, optimizer)
    # the first step is d0 = 1e-6 times an Adam-like unit step
    moved = (model[0].weight.detach() - before).abs()
    assert 1e-7 < moved.max().item() < 1e-5


def test_multi_tensor_update_equals_the_per_tensor_definition_on_bf16() -> None:
    """AdamWBF16 updates a group with foreach kernels; each weight must still come out as
    adamw_update_ then stochastic rounding with its own seed rounding_seed(seed, i, t)."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(4, 5), (7,), (2, 3)]
    weights = [torch.randn(shape, generator=generator).bfloat16() for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(3)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3}]
    optimizer = AdamWBF16(groups, weight_decay=0.1, seed=11)
    reference = [w.float() for w in weights]
    moments = [(torch.zeros(s), torch.zeros(s)) for s in shapes]
    for t, step_grads in enumerate(grads, start=1):
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.bfloat16()
        optimizer.step()
        for i, (grad, (m, v)) in enumerate(zip(step_grads, moments, strict=True)):
            lr = 1e-2 if i < 2 else 3e-3
            p32 = reference[i].clone()
            adamw_update_(p32, grad.bfloat16().float(), m, v, t, lr=lr, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.1)  # fmt: skip
            noise = torch.Generator().manual_seed(rounding_seed(11, i, t))
            reference[i] = stochastic_round_to_bf16(p32, noise).float()
    for param, expected in zip(params, reference, strict=True):
        assert torch.equal(param.detach().float(), expected)
